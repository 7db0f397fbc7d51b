// The recurrence with each step spread over the whole GPU (the plan is recurrence_plan.h's
// PlanGrid): for float32 sizes whose step no block or cluster of recurrence.cu's kernels holds.
//
// One launch runs all T steps of one direction. Block (row tile, unit tile) owns BM batch rows
// x BN hidden units for every step and keeps those units' R in shared memory, entry-major
// (forward: rows j of R; backward: columns j). A step multiplies the previous state (forward:
// h_{k-1} m_k; backward: dz_k) of the block's rows by them: the state streams from a buffer in
// global memory (L2) in chunks of kGridChunk entries, through a ring of kGridStages buffers,
// and the threads split each chunk's entries into KS parts, each part's threads a TM x TN
// register tile of the block's outputs, summed through shared memory at the step's end. Then
// the thread that owns each output applies the step's rule (as recurrence.cu's owners do),
// stores the results, and writes the next state into the other of two state buffers. The
// blocks of a row tile hand over: each counts itself in the row tile's counter, and none reads
// the next state before all have counted.
//
// The step loop is written against a small interface P, so that it also compiles for the host:
// grid_launch.cuh gives the GPU's, tests/cpp/test_grid_steps.cc an emulation that
// runs every GPU thread as a host thread. P has static functions:
//   Sync()                   the block's barrier
//   CopyAsync16(to, from)    copies 16 bytes from global to shared memory, asynchronously
//   InitBarrier(bar, count)  an mbarrier whose phases complete after `count` arrivals
//   ArriveOnCopies(bar)      arrives on bar once this thread's copies so far have landed
//   Release(bar)             arrives on bar after this thread's reads so far
//   WaitPhase(bar, parity)   waits until bar's phase of that parity has completed
//   Arrive(counter)          adds one to a counter after this block's stores (release)
//   WaitFor(counter, value)  waits until the counter reaches value (acquire)
//   WarpMultiplyAdd(acc, a, b)  (tensor-core tiles only) acc += A B for the warp's MT x NT
//                            m16n8k8 tiles, from A's and B's fragments in PTX's tf32 layouts,
//                            each float32 product as SplitTf32's three tf32 ones
//
// GridTile<BM, BN, true> runs the step's products on the tensor cores instead of the FMA
// lanes, as three tf32 products a float32 one ("3xTF32", SplitTf32). The handler does not use
// it: benchmarks/probe_grid_step.cu times it against the FMA lanes, and
// tests/cpp/test_grid_steps.cc checks it against the spec like the FMA tiles.
#ifndef JAX_SGRNN_CUDA_GRID_STEPS_H_
#define JAX_SGRNN_CUDA_GRID_STEPS_H_

#include <bit>
#include <cstdint>

#include "cuda/recurrence_args.h"
#include "cuda/recurrence_plan.h"
#include "sgrnn/core.h"

#if defined(__CUDACC__)
#define SGRNN_DEVICE __device__
#define SGRNN_UNROLL _Pragma("unroll")
#else
#define SGRNN_DEVICE
#define SGRNN_UNROLL
#endif

namespace sgrnn::cuda {

SGRNN_DEVICE inline uint32_t BitsOf(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  return std::bit_cast<uint32_t>(x);
#endif
}
SGRNN_DEVICE inline float FloatOf(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  return std::bit_cast<float>(bits);
#endif
}

// x as big + small for the tensor cores' tf32 products (x y as x_big y_big + x_big y_small +
// x_small y_big). big is x rounded to tf32's 10 fraction bits (half an ulp added to the bits,
// the 13 low bits dropped: 2 integer instructions, where cvt.rna.tf32.f32 compiles to a longer
// sequence on sm_90), and small = x - big exactly, whose own 13 low bits the tensor cores drop
// as they read it; what neither part holds, and the dropped x_small y_small, are under 2^-22
// of x and of x y. An infinite x is all big (x - big would be NaN); a NaN stays in small,
// whatever big becomes; an x within half a tf32 ulp of float32's largest rounds to an
// infinite big and gives NaN.
struct Tf32Split {
  float big, small;
};
SGRNN_DEVICE inline Tf32Split SplitTf32(float x) {
  const float big = FloatOf((BitsOf(x) + 0x1000u) & 0xffffe000u);
  return {big, x == big ? 0.0f : x - big};
}

// The split of a BM x BN tile over a block's kGridThreads threads. Each thread sums a TM x TN
// register tile over its part of a chunk's entries, reading per 4 entries TM 16-byte vectors
// of the state and TN of R. Shared memory returns one register a lane per cycle, a quarter of
// the FMA pipes' rate, so 8 x 8 (a register loaded per 4 FMAs, the loads of a row paired
// across neighbouring lanes) where the tile has a warp's worth of such threads, else 8 x 4.
template <int kRows, int kUnits, bool kOnTensorCores = false>
struct GridTile {
  static constexpr bool kTensorCores = kOnTensorCores;  // false: true is specialized below
  static constexpr int BM = kRows, BN = kUnits, TM = 8;
  static constexpr int TN = (BM / TM) * (BN / 8) % 32 == 0 ? 8 : 4;
  struct Accumulators {
    float v[TM][TN];
  };
  static constexpr int kThreads = kGridThreads, KC = kGridChunk, kStages = kGridStages;
  static constexpr int kStride = kGridChunkStride;
  // A thread's TM rows are BM / TM apart, so that the rows one warp reads lie in different
  // banks (kStride is 4 banks past a multiple of 32); its TN units are TN / 4 vectors of 4,
  // BN / (TN / 4) apart, so that neighbouring lanes read neighbouring vectors.
  static constexpr int kRowGroups = BM / TM, kUnitGroups = BN / TN, kUnitVectors = TN / 4;
  static constexpr int kVectorStride = BN / kUnitVectors;  // units between a thread's vectors
  static constexpr int kPartThreads = kRowGroups * kUnitGroups;
  static constexpr int KS = kThreads / kPartThreads;  // parts of a chunk's entries
  static constexpr int kPartEntries = KC / KS;
  static constexpr int kOutputs = BM * BN / kThreads;  // outputs each thread owns
  static constexpr int kChunkVectors = BM * KC / 4 / kThreads;  // 16-byte copies per chunk
  static_assert(BM % TM == 0 && BN % TN == 0 && TN % 4 == 0);
  static_assert(kPartThreads % 32 == 0 && kThreads % kPartThreads == 0, "warps within a part");
  static_assert(kPartEntries % 4 == 0 && (BM * BN) % kThreads == 0 &&
                (BM * KC / 4) % kThreads == 0);
  static_assert(KS * BN <= kStages * kStride, "the parts' sums fit the chunk buffers");
  // Where entry i of unit u lies in R_units.
  static constexpr int RIndex(int entry, int unit) { return entry * BN + unit; }
  // Unit u (< TN) of a thread's register tile, within the tile.
  static constexpr int UnitOf(int unit_group, int u) {
    return u / 4 * kVectorStride + unit_group * 4 + u % 4;
  }
  // Where a part's sum of (row, unit) lies in its [BM x BN] block of the sums. Each thread
  // writes its sums a vector of 4 units at a time, and 16-byte stores serve 8 lanes a cycle, so
  // the vectors of the rows 8 lanes write, which share banks, are swapped within their rows
  // (rows that share a 32-bank line, and rows a bank line apart, take distinct groups of
  // kUnitGroups vectors). A row's units stay within the row, so the reads of whole rows, a
  // unit a lane, still meet every bank once.
  static constexpr int kRowsPerBankLine = BN >= 32 ? 1 : 32 / BN;
  static constexpr int SumIndex(int row, int unit) {
    const int swap = row / kRowsPerBankLine * kUnitGroups % (BN / 4);
    return row * BN + (unit / 4 ^ swap) * 4 + unit % 4;
  }
};

// The same tile on the tensor cores (3xTF32, SplitTf32): each warp is a part and sums the whole
// BM x BN tile over its kPartEntries of each chunk in m16n8k8 products, MT x NT of them per 8
// entries (P::WarpMultiplyAdd). A lane's place in the fragments: its group g = lane / 4 (A's
// rows g and g + 8, B's unit g, the sums' rows g and g + 8) and member t = lane % 4 (A's and B's
// entries t and t + 4, the sums' units 2t and 2t + 1): GridBlock's row_group and unit_group.
template <int kRows, int kUnits>
struct GridTile<kRows, kUnits, true> {
  static constexpr bool kTensorCores = true;
  static constexpr int BM = kRows, BN = kUnits;
  static constexpr int kThreads = kGridThreads, KC = kGridChunk, kStages = kGridStages;
  static constexpr int kStride = kGridChunkStride;
  static constexpr int kPartThreads = 32, kUnitGroups = 4;
  static constexpr int KS = kThreads / kPartThreads;  // parts of a chunk's entries: warps
  static constexpr int kPartEntries = KC / KS;
  static constexpr int MT = BM / 16, NT = BN / 8;  // a warp's m16n8k8 tiles
  struct Accumulators {
    float v[MT][NT][4];  // C fragments
  };
  static constexpr int kOutputs = BM * BN / kThreads;
  static constexpr int kChunkVectors = BM * KC / 4 / kThreads;
  static_assert(BM % 16 == 0 && BN % 8 == 0 && 32 % BN == 0 && kPartEntries % 8 == 0);
  static_assert((BM * BN) % kThreads == 0 && (BM * KC / 4) % kThreads == 0);
  static_assert(KS * BN <= kStages * kStride, "the parts' sums fit the chunk buffers");
  // Where (line, unit) of a [lines][BN] array lies: R_units (line: entry) and the parts' sums
  // (line: row). Each line's groups of 8 units are swapped by its place among the lines that
  // share a 32-bank line, so that B's fragments (entries t and t + 4, units g of 8) and the
  // sums' 8-byte stores (rows g, units 2t and 2t + 1) meet each bank once a phase, while a
  // whole line read a unit a lane still meets every bank once. The swap repeats every 4
  // lines: Swizzled(l + 4m, u) = Swizzled(l, u) + 4m BN.
  static constexpr int Swizzled(int line, int unit) {
    return line * BN + (unit ^ line * BN / 32 % (BN / 8) * 8);
  }
  static constexpr int RIndex(int entry, int unit) { return Swizzled(entry, unit); }
  static constexpr int SumIndex(int row, int unit) { return Swizzled(row, unit); }
};

struct alignas(16) Float4 {
  float v[4];
};
struct alignas(8) Float2 {
  float x, y;
};

// Per-launch sizes. Element indices are 32-bit (IndexesFit).
struct GridGeometry {
  int T, N, H, D;
  int direction;
  int unit_tiles;     // blocks of a row tile
  int padded_hidden;  // Hp: R's rows kept, the state buffers' row length (whole chunks)
  int state;          // elements of one state buffer
};

// A block's place and shared memory (recurrence_plan.h's GridSharedBytes).
template <typename Tile>
struct GridBlock {
  int row_tile, row0, unit0;  // the tile's first row and unit
  int thread, part, row_group, unit_group;
  float* R_units;  // [Hp][BN]: entry i of the tile's unit u at Tile::RIndex(i, u)
  float* chunks;   // kStages x [BM][kStride]; the parts' sums [KS][BM][BN] at a step's end
  uint64_t* filled;    // [kStages] mbarriers: the buffer's copies have landed
  uint64_t* released;  // [kStages] mbarriers: every thread has read the buffer
  int32_t* lengths;  // [BM]

  SGRNN_DEVICE GridBlock(const GridGeometry& g, int block, int thread_index, float* shared) {
    row_tile = block / g.unit_tiles;
    row0 = row_tile * Tile::BM;
    unit0 = (block % g.unit_tiles) * Tile::BN;
    thread = thread_index;
    part = thread / Tile::kPartThreads;
    row_group = thread % Tile::kPartThreads / Tile::kUnitGroups;
    unit_group = thread % Tile::kUnitGroups;
    R_units = shared;
    chunks = R_units + g.padded_hidden * Tile::BN;
    filled = reinterpret_cast<uint64_t*>(chunks + Tile::kStages * Tile::BM * Tile::kStride);
    released = filled + Tile::kStages;
    lengths = reinterpret_cast<int32_t*>(released + Tile::kStages);
  }
  // This thread's output e: its row within the tile, and its unit.
  SGRNN_DEVICE int OutputRow(int e) const { return (thread + e * Tile::kThreads) / Tile::BN; }
  SGRNN_DEVICE int OutputUnit(int e) const { return (thread + e * Tile::kThreads) % Tile::BN; }
};

// One output of a thread: where it lies, and whether it exists (rows past N and units past H
// only pad the tile).
struct GridOutput {
  int row, n, unit;  // row in the tile, batch row, hidden unit j
  int column, index;  // d*H + j; the element (n, column) of [N, D*H]
  bool live;
  // This output's element of a state buffer.
  SGRNN_DEVICE int StateIndex(const GridGeometry& g) const { return n * g.padded_hidden + unit; }
};
template <typename Tile>
SGRNN_DEVICE inline GridOutput OutputOf(const GridBlock<Tile>& blk, const GridGeometry& g,
                                        int e) {
  const int row = blk.OutputRow(e), n = blk.row0 + row, j = blk.unit0 + blk.OutputUnit(e);
  const int column = g.direction * g.H + j;
  return {row, n, j, column, n * g.D * g.H + column, n < g.N && j < g.H};
}

// Fills the block's R (its units' rows of R, or with `columns` its columns; zero past H) and
// its rows' lengths, sets up the chunk buffers' mbarriers, then meets at the block barrier.
template <typename Tile, typename P>
SGRNN_DEVICE void LoadBlock(const GridBlock<Tile>& blk, const GridGeometry& g, const float* R,
                            const int32_t* seq_lengths, bool columns) {
  const float* R_d = R + g.direction * g.H * g.H;
  for (int i = blk.thread; i < g.padded_hidden * Tile::BN; i += Tile::kThreads) {
    // Rows of R are read along their entries; columns along the units.
    const int u = columns ? i % Tile::BN : i / g.padded_hidden;
    const int entry = columns ? i / Tile::BN : i % g.padded_hidden;
    const int j = blk.unit0 + u;
    float w = 0.0f;
    if (entry < g.H && j < g.H) w = columns ? R_d[entry * g.H + j] : R_d[j * g.H + entry];
    blk.R_units[Tile::RIndex(entry, u)] = w;
  }
  for (int b = blk.thread; b < Tile::BM; b += Tile::kThreads) {
    const int n = blk.row0 + b;
    blk.lengths[b] = n < g.N ? static_cast<int32_t>(RowLength(seq_lengths, n, g.T)) : 0;
  }
  if (blk.thread == 0) {
    for (int s = 0; s < Tile::kStages; ++s) {
      P::InitBarrier(blk.filled + s, Tile::kThreads);
      P::InitBarrier(blk.released + s, Tile::kThreads);
    }
  }
  P::Sync();
}

// A chunk's products on the FMA lanes: the thread's TM x TN register tile over its part's
// entries, `h` the chunk's first entry of the part, `w` R_units' first entry of the part.
template <typename Tile>
SGRNN_DEVICE void ChunkOnFmaLanes(const GridBlock<Tile>& blk, const float* h, const float* w,
                                  float (&acc)[Tile::TM][Tile::TN]) {
  constexpr int TM = Tile::TM, TN = Tile::TN, BN = Tile::BN;
  w += Tile::UnitOf(blk.unit_group, 0);
SGRNN_UNROLL
  for (int k = 0; k < Tile::kPartEntries; k += 4) {
    // 16-byte shared loads: 4 entries of each row; each entry's units, a vector at a time
    Float4 a[TM], b[4][Tile::kUnitVectors];
SGRNN_UNROLL
    for (int i = 0; i < TM; ++i) {
      a[i] = *reinterpret_cast<const Float4*>(
          h + (blk.row_group + i * Tile::kRowGroups) * Tile::kStride + k);
    }
SGRNN_UNROLL
    for (int x = 0; x < 4; ++x) {
SGRNN_UNROLL
      for (int v = 0; v < Tile::kUnitVectors; ++v) {
        b[x][v] = *reinterpret_cast<const Float4*>(w + (k + x) * BN + v * Tile::kVectorStride);
      }
    }
SGRNN_UNROLL
    for (int i = 0; i < TM; ++i) {
SGRNN_UNROLL
      for (int x = 0; x < 4; ++x) {
SGRNN_UNROLL
        for (int u = 0; u < TN; ++u) acc[i][u] += a[i].v[x] * b[x][u / 4].v[u % 4];
      }
    }
  }
}

// A chunk's products on the tensor cores: the warp's MT x NT m16n8k8 tiles over its part's
// entries, 8 at a time; `h` and `w` as above (w's part starts at a multiple of 4 entries, so
// Swizzled's offsets from it are those from entry 0).
template <typename Tile, typename P>
SGRNN_DEVICE void ChunkOnTensorCores(const GridBlock<Tile>& blk, const float* h, const float* w,
                                     float (&acc)[Tile::MT][Tile::NT][4]) {
  constexpr int MT = Tile::MT, NT = Tile::NT, kStride = Tile::kStride;
  const int g = blk.row_group, t = blk.unit_group;
SGRNN_UNROLL
  for (int k = 0; k < Tile::kPartEntries; k += 8) {
    float a[MT][4], b[NT][2];
SGRNN_UNROLL
    for (int m = 0; m < MT; ++m) {
      const float* top = h + (m * 16 + g) * kStride + k + t;
      a[m][0] = top[0];
      a[m][1] = top[8 * kStride];
      a[m][2] = top[4];
      a[m][3] = top[8 * kStride + 4];
    }
SGRNN_UNROLL
    for (int n = 0; n < NT; ++n) {
      b[n][0] = w[Tile::Swizzled(k + t, n * 8 + g)];
      b[n][1] = w[Tile::Swizzled(k + t + 4, n * 8 + g)];
    }
    P::WarpMultiplyAdd(acc, a, b);
  }
}

// The step's products of the block's tile: sum over i of state[n][i] R_units[i][u] for its rows
// and units, left with each output's owner in `total`. `state` is the state buffer the step
// reads, `step_index` the steps the launch ran before it. The chunk buffers are a ring over all
// steps' chunks, each with two mbarriers: `filled` completes when every thread's copies into
// it have landed, `released` when every thread has read it. A chunk's copies are issued
// kGridChunksAhead chunks before its products, into the buffer read kStages chunks before, so
// the warps run up to kStages - kGridChunksAhead - 1 chunks apart instead of meeting at a block
// barrier a chunk (where the two warps of a scheduler waited on their shared-memory loads
// together, with no FMAs to hide them). The chunks are free again when this returns (after a
// block barrier); the next step's copies start only after the hand-over, whose barrier follows
// the reads of the sums.
template <typename Tile, typename P>
SGRNN_DEVICE void StepProducts(const GridBlock<Tile>& blk, const GridGeometry& g, int step_index,
                               const float* state, float (&total)[Tile::kOutputs]) {
  constexpr int BM = Tile::BM, BN = Tile::BN, KC = Tile::KC;
  constexpr int kStages = Tile::kStages, kStride = Tile::kStride, kAhead = kGridChunksAhead;
  const int chunks = g.padded_hidden / KC;
  const int first = step_index * chunks;  // the step's first use of the ring of chunk buffers
  const float* rows = state + blk.row0 * g.padded_hidden;
  // Copies chunk c into its buffer, once every thread has released the buffer's previous use.
  const auto load = [&](int c) {
    const int use = first + c, s = use % kStages;
    if (use >= kStages) P::WaitPhase(blk.released + s, (use / kStages - 1) & 1);
    float* to = blk.chunks + s * BM * kStride;
SGRNN_UNROLL
    for (int e = 0; e < Tile::kChunkVectors; ++e) {
      const int v = blk.thread + e * Tile::kThreads, r = v / (KC / 4), q = v % (KC / 4);
      P::CopyAsync16(to + r * kStride + q * 4, rows + r * g.padded_hidden + c * KC + q * 4);
    }
    P::ArriveOnCopies(blk.filled + s);
  };
  for (int c = 0; c < kAhead && c < chunks; ++c) load(c);
  typename Tile::Accumulators acc{};
  for (int c = 0; c < chunks; ++c) {
    if (c + kAhead < chunks) load(c + kAhead);
    const int use = first + c, s = use % kStages;
    P::WaitPhase(blk.filled + s, (use / kStages) & 1);  // every thread's copies of chunk c
    const float* h = blk.chunks + s * BM * kStride + blk.part * Tile::kPartEntries;
    const float* w = blk.R_units + (c * KC + blk.part * Tile::kPartEntries) * BN;
    if constexpr (Tile::kTensorCores) {
      ChunkOnTensorCores<Tile, P>(blk, h, w, acc.v);
    } else {
      ChunkOnFmaLanes<Tile>(blk, h, w, acc.v);
    }
    P::Release(blk.released + s);
  }
  P::Sync();  // every part is done with the chunks, which now take the parts' sums
  float* sums = blk.chunks + blk.part * BM * BN;
  if constexpr (Tile::kTensorCores) {  // the m16n8k8 tiles' C fragments, 2 units at a time
SGRNN_UNROLL
    for (int m = 0; m < Tile::MT; ++m) {
SGRNN_UNROLL
      for (int n = 0; n < Tile::NT; ++n) {
SGRNN_UNROLL
        for (int half = 0; half < 2; ++half) {
          const int at = Tile::SumIndex(m * 16 + blk.row_group + 8 * half,
                                        n * 8 + 2 * blk.unit_group);
          *reinterpret_cast<Float2*>(sums + at) = {acc.v[m][n][2 * half],
                                                   acc.v[m][n][2 * half + 1]};
        }
      }
    }
  } else {  // the register tile, a vector of 4 units at a time
SGRNN_UNROLL
    for (int i = 0; i < Tile::TM; ++i) {
SGRNN_UNROLL
      for (int v = 0; v < Tile::kUnitVectors; ++v) {
        const int at = Tile::SumIndex(blk.row_group + i * Tile::kRowGroups,
                                      Tile::UnitOf(blk.unit_group, 4 * v));
        *reinterpret_cast<Float4*>(sums + at) = {acc.v[i][4 * v], acc.v[i][4 * v + 1],
                                                 acc.v[i][4 * v + 2], acc.v[i][4 * v + 3]};
      }
    }
  }
  P::Sync();
SGRNN_UNROLL
  for (int e = 0; e < Tile::kOutputs; ++e) {
    const int at = Tile::SumIndex(blk.OutputRow(e), blk.OutputUnit(e));
    float sum = 0.0f;
SGRNN_UNROLL
    for (int p = 0; p < Tile::KS; ++p) sum += blk.chunks[p * BM * BN + at];
    total[e] = sum;
  }
}

// The hand-over after the state's writes of hand-over `index` (0: the initial state; k + 1:
// after step k): every block of the row tile has written its part before any reads on. Its
// first barrier also keeps the next step's chunk copies from overwriting the sums still read.
template <typename P>
SGRNN_DEVICE void HandOver(uint32_t* counter, int index, int unit_tiles, int thread) {
  P::Sync();
  if (thread == 0) {
    P::Arrive(counter);
    P::WaitFor(counter, static_cast<uint32_t>((index + 1) * unit_tiles));
  }
  P::Sync();
}

// Forward, step k = 0, 1, ... of direction g.direction: z_k = x_k + (h_{k-1} m_k) R^T,
// h_k = act(z_k), stored in the direction's output slot; a finished row keeps its state and
// gives zeros (recurrence.cu's ForwardKernel, per output). `states` holds the two state
// buffers, `counters` a counter per row tile (both zeroed before the launch).
template <Activation A, typename Tile, typename P>
SGRNN_DEVICE void GridForwardSteps(const Config& c, const GridGeometry& g,
                                   const ForwardArgs<float>& a, float* states,
                                   uint32_t* counters, int block, int thread, float* shared) {
  const GridBlock<Tile> blk(g, block, thread, shared);
  const DirectionLayout layout = LayoutOf(c, g.direction);
  const int step = g.N * g.D * g.H;
  uint32_t* counter = counters + blk.row_tile;
  LoadBlock<Tile, P>(blk, g, a.R, a.seq_lengths, false);
  // The state an output's row carries (kept over its padded steps).
  float carried[Tile::kOutputs];
SGRNN_UNROLL
  for (int e = 0; e < Tile::kOutputs; ++e) {
    const GridOutput o = OutputOf(blk, g, e);
    carried[e] = o.live && a.h0 ? a.h0[o.index] : 0.0f;
    if (o.live) {
      states[o.StateIndex(g)] = carried[e] * MaskAt(a.mask, 0, o.n, o.column);
    }
  }
  HandOver<P>(counter, 0, g.unit_tiles, thread);
  for (int k = 0; k < g.T; ++k) {
    float input[Tile::kOutputs], mask_next[Tile::kOutputs];
SGRNN_UNROLL
    for (int e = 0; e < Tile::kOutputs; ++e) {  // read before the products, which hide them
      const GridOutput o = OutputOf(blk, g, e);
      const StepTimes t = TimesOf(layout, k, blk.lengths[o.row]);
      input[e] = o.live && t.valid ? a.source[t.in_time * step + o.index] : 0.0f;
      mask_next[e] = o.live && k + 1 < g.T ? MaskAt(a.mask, k + 1, o.n, o.column) : 1.0f;
    }
    float total[Tile::kOutputs];
    StepProducts<Tile, P>(blk, g, k, states + (k & 1) * g.state, total);
    float* next = states + ((k + 1) & 1) * g.state;
SGRNN_UNROLL
    for (int e = 0; e < Tile::kOutputs; ++e) {
      const GridOutput o = OutputOf(blk, g, e);
      if (!o.live) continue;
      const StepTimes t = TimesOf(layout, k, blk.lengths[o.row]);
      const float z = input[e] + total[e];
      const float h = t.valid ? Activate<A>(z) : carried[e];
      const int out = t.slot * step + o.index;
      a.y[out] = t.valid ? h : 0.0f;
      if (a.z) a.z[out] = t.valid ? z : 0.0f;
      carried[e] = h;
      if (k + 1 < g.T) next[o.StateIndex(g)] = h * mask_next[e];
    }
    if (k + 1 < g.T) HandOver<P>(counter, k + 1, g.unit_tiles, thread);
  }
}

// Backward, step k = T-1, T-2, ... (the i-th processed is k = T - 1 - i) of direction
// g.direction: the step reads dz_k, and its products give the carry (dz_k R) m_k (zero at a
// padded step), from which dz_{k-1} = (dy_{k-1} + carry) act'(z_{k-1}) (zero at a padded
// step), stored in source time, is the next step's state; step 0's carry is dh0
// (recurrence.cu's BackwardKernel, per output).
template <Activation A, typename Tile, typename P>
SGRNN_DEVICE void GridGradientSteps(const Config& c, const GridGeometry& g,
                                    const GradientArgs<float>& a, float* states,
                                    uint32_t* counters, int block, int thread, float* shared) {
  const GridBlock<Tile> blk(g, block, thread, shared);
  const DirectionLayout layout = LayoutOf(c, g.direction);
  const int step = g.N * g.D * g.H;
  uint32_t* counter = counters + blk.row_tile;
  LoadBlock<Tile, P>(blk, g, a.R, a.seq_lengths, true);
SGRNN_UNROLL
  for (int e = 0; e < Tile::kOutputs; ++e) {  // dz_{T-1}
    const GridOutput o = OutputOf(blk, g, e);
    if (!o.live) continue;
    const StepTimes t = TimesOf(layout, g.T - 1, blk.lengths[o.row]);
    const int at = t.slot * step + o.index;
    const float dz = t.valid ? a.dy[at] * ActivateGrad<A>(a.z[at]) : 0.0f;
    a.d_source[t.in_time * step + o.index] = dz;
    states[o.StateIndex(g)] = dz;
  }
  HandOver<P>(counter, 0, g.unit_tiles, thread);
  for (int i = 0; i < g.T; ++i) {
    const int k = g.T - 1 - i;
    float mask[Tile::kOutputs], dy[Tile::kOutputs], slope[Tile::kOutputs];
SGRNN_UNROLL
    for (int e = 0; e < Tile::kOutputs; ++e) {  // m_k, dy_{k-1} and act'(z_{k-1})
      const GridOutput o = OutputOf(blk, g, e);
      const StepTimes previous = TimesOf(layout, k > 0 ? k - 1 : 0, blk.lengths[o.row]);
      const bool has_previous = o.live && k > 0 && previous.valid;
      const int at = previous.slot * step + o.index;
      mask[e] = o.live ? MaskAt(a.mask, k, o.n, o.column) : 0.0f;
      dy[e] = has_previous ? a.dy[at] : 0.0f;
      slope[e] = has_previous ? ActivateGrad<A>(a.z[at]) : 0.0f;
    }
    float total[Tile::kOutputs];
    StepProducts<Tile, P>(blk, g, i, states + (i & 1) * g.state, total);
    float* next = states + ((i + 1) & 1) * g.state;
SGRNN_UNROLL
    for (int e = 0; e < Tile::kOutputs; ++e) {
      const GridOutput o = OutputOf(blk, g, e);
      if (!o.live) continue;
      const int length = blk.lengths[o.row];
      const float carry = k < length ? total[e] * mask[e] : 0.0f;
      if (k > 0) {
        const StepTimes previous = TimesOf(layout, k - 1, length);
        const float dz = previous.valid ? (dy[e] + carry) * slope[e] : 0.0f;
        a.d_source[previous.in_time * step + o.index] = dz;
        next[o.StateIndex(g)] = dz;
      } else if (a.dh0) {
        a.dh0[o.index] = carry;
      }
    }
    if (k > 0) HandOver<P>(counter, i + 1, g.unit_tiles, thread);
  }
}

inline GridGeometry GridGeometryOf(const Dims& d, const GridPlan& plan, int direction) {
  return {static_cast<int>(d.T),          static_cast<int>(d.N),
          static_cast<int>(d.H),          static_cast<int>(d.D),
          direction,                      static_cast<int>(plan.unit_tiles),
          static_cast<int>(plan.padded_hidden), static_cast<int>(plan.StateElements())};
}

// A call's workspace (GridPlan::WorkspaceBytes), zeroed before the first direction's launch:
// the state buffers' padding (rows past N, entries past H) must read as zeros.
struct GridWorkspace {
  uint32_t* counters;  // [D][row_tiles]
  float* states;       // two buffers of GridPlan::StateElements()

  GridWorkspace(void* base, const GridPlan& plan, int64_t D)
      : counters(static_cast<uint32_t*>(base)),
        states(reinterpret_cast<float*>(static_cast<char*>(base) + plan.WorkspaceBytes(D) -
                                        2 * plan.StateElements() * sizeof(float))) {}
  uint32_t* CountersOf(const GridPlan& plan, int direction) const {
    return counters + direction * plan.row_tiles;
  }
};

// Calls f.template operator()<GridTile<...>>() with the plan's tile as a type (on the tensor
// cores with kTensorCores).
template <bool kTensorCores = false, typename F>
decltype(auto) DispatchGridTile(const GridTileShape& tile, F&& f) {
  static_assert(sizeof(kGridTiles) / sizeof(kGridTiles[0]) == 5, "a case per tile below");
  constexpr bool T = kTensorCores;
  if (tile.rows == 32 && tile.units == 32) return f.template operator()<GridTile<32, 32, T>>();
  if (tile.rows == 64 && tile.units == 32) return f.template operator()<GridTile<64, 32, T>>();
  if (tile.rows == 128 && tile.units == 16) return f.template operator()<GridTile<128, 16, T>>();
  if (tile.rows == 64 && tile.units == 16) return f.template operator()<GridTile<64, 16, T>>();
  return f.template operator()<GridTile<128, 8, T>>();
}

}  // namespace sgrnn::cuda

#endif  // JAX_SGRNN_CUDA_GRID_STEPS_H_
