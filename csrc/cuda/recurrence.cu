// The persistent recurrence kernels (recurrence.h; the split over the GPU is recurrence_plan.h).
//
// One launch runs every step. Block (cluster c, rank r) of direction d owns batch rows
// [c B, c B + B) and hidden units [r U, r U + U); thread (tile t, slice s) keeps kSlice entries
// of R for each of the tile's kTile units (forward: rows j of R, backward: columns j) in
// registers. A step reads the previous state (forward: h_{k-1} * m_k; backward: dz_k) for the
// block's rows from an exchange buffer in shared memory, sums each unit's S slices with warp
// shuffles (SumOverSlices), which leave each unit's total with its owner thread, and the owner
// applies the elementwise rule and writes the result into the other exchange buffer of
// every block of the cluster (StepSignal: a block barrier ends the step, or in a cluster each
// block waits on an mbarrier for its rows' values). Two buffers alternate, so that no block
// overwrites what another is still reading. The owners read a step's operands from global
// memory before its products. Hidden sizes that one block holds whole run "wide" blocks with
// twice the slice per thread (recurrence_plan.h, BlockShape says where).
#include <cooperative_groups.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cuda/recurrence.h"

namespace sgrnn::cuda {
namespace {

namespace cg = ::cooperative_groups;

// Per-launch sizes, from the plan. Element indices are 32-bit (IndexesFit).
struct Geometry {
  int T, N, H, D;
  int slices, cluster, units, rows;
  int stride;    // elements from one slice of the exchange buffer to the next (slice + padding)
  int exchange;  // elements of one exchange buffer

  // Elements from one time step to the next in [T, N, D*H] tensors.
  __device__ int StepStride() const { return N * D * H; }
};

// Writes `value` at `index` of the exchange buffer `buffer` in every block of the cluster
// (before the loop, where a cluster barrier follows).
template <typename T>
__device__ inline void Broadcast(T* buffer, int index, T value, int cluster) {
  if (cluster == 1) {
    buffer[index] = value;
    return;
  }
  cg::cluster_group group = cg::this_cluster();
  for (int r = 0; r < cluster; ++r) group.map_shared_rank(buffer, r)[index] = value;
}

__device__ inline void ClusterBarrier(int cluster) {
  if (cluster == 1) {
    __syncthreads();
  } else {
    cg::this_cluster().sync();  // release/acquire: the other blocks' writes are visible
  }
}

__device__ inline unsigned SharedAddress(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// How the steps of the loop hand their state over. Step i (the i-th processed) reads one of the
// two exchange buffers, which the owner threads filled during step i - 1, and fills the other;
// mbarrier i & 1 tracks the buffer that step i reads.
//
// In one block that takes a block barrier at the end of each step. In a cluster, a barrier
// (barrier.cluster with release semantics) also waits for every global store the block has
// issued (MEMBAR.GPU in SASS: y, z, dz of the step), which only needs to be ordered before the
// kernel ends. So there the owners write with st.async, which signals the receiving block's
// mbarrier of that buffer with the bytes written, and each block waits on its own mbarrier for
// the bytes of all H units of its rows: no cluster barrier and no fence inside the loop.
// Reuse is safe: a block writes step i + 1's buffer of another block only after it received
// all of step i's values, each of which its owner sent after its warp had read that buffer for
// step i - 1 (every warp with a unit holds owners; warps without one skip the products).
//
// kClustered (the plan's cluster has more than one block) is a template parameter: as a runtime
// check, the cluster's branches, never taken in one-block kernels, still ran those 16-17%
// slower ((1000,8,128) forward 412 against 346 us, kernels alone on an H200).
template <typename T, bool kClustered>
struct StepSignal {
  uint64_t* arrived;  // [2]: per exchange buffer, in the block's shared memory
  unsigned bytes;     // per use: rows * H values
  int cluster;

  // Thread 0 sets up the mbarriers; a cluster barrier must follow before any block sends.
  __device__ StepSignal(uint64_t* signals, int rows, int H, int cluster_blocks)
      : arrived(signals), bytes(static_cast<unsigned>(rows * H * sizeof(T))),
        cluster(cluster_blocks) {
    if (kClustered && threadIdx.x == 0) {
      for (int b = 0; b < 2; ++b) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(SharedAddress(arrived + b))
                     : "memory");
      }
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
  }

  // Step i's start, before it reads its buffer (i >= 1; step 0's comes from before the loop,
  // through a cluster barrier): wait for the buffer, then thread 0 expects step i + 1's bytes
  // (the mbarrier's previous phase, step i - 1's, is complete: thread 0 waited for it).
  __device__ void Begin(int i, int steps) const {
    if constexpr (kClustered) {
      if (i >= 1) {
        const unsigned address = SharedAddress(arrived + (i & 1));
        const unsigned parity = ((i - 1) >> 1) & 1;
        asm volatile(
            "{\n.reg .pred done;\nWAIT_%=:\n"
            "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\n"
            "@!done bra WAIT_%=;\n}\n" ::"r"(address),
            "r"(parity)
            : "memory");
      }
      if (threadIdx.x == 0 && i + 1 < steps) {
        asm volatile(
            "mbarrier.arrive.expect_tx.relaxed.cta.shared::cta.b64 _, [%0], %1;\n" ::"r"(
                SharedAddress(arrived + ((i + 1) & 1))),
            "r"(bytes)
            : "memory");
      }
    }
  }

  // Writes `value` at shared-window address `element` of step i + 1's exchange buffer, in
  // every block of the cluster.
  __device__ void Send(unsigned element, T value, int i) const {
    if constexpr (!kClustered) {
      if constexpr (sizeof(T) == 4) {
        asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(element), "f"(value) : "memory");
      } else {
        asm volatile("st.shared.f64 [%0], %1;\n" ::"r"(element), "d"(value) : "memory");
      }
    } else {
      const unsigned signal = SharedAddress(arrived + ((i + 1) & 1));
      for (int r = 0; r < cluster; ++r) {
        unsigned remote_element, remote_signal;
        asm("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote_element) : "r"(element), "r"(r));
        asm("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote_signal) : "r"(signal), "r"(r));
        if constexpr (sizeof(T) == 4) {
          asm volatile(
              "st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];\n" ::"r"(
                  remote_element),
              "r"(__float_as_uint(value)), "r"(remote_signal)
              : "memory");
        } else {
          asm volatile(
              "st.async.shared::cluster.mbarrier::complete_tx::bytes.b64 [%0], %1, [%2];\n" ::"r"(
                  remote_element),
              "l"(__double_as_longlong(value)), "r"(remote_signal)
              : "memory");
        }
      }
    }
  }

  // Step i's end: in one block, the barrier that publishes the owners' writes.
  __device__ void End() const {
    if constexpr (!kClustered) __syncthreads();
  }

  // After the last step: in a cluster, no block leaves while another may still write to it.
  __device__ void Finish() const {
    if constexpr (kClustered) ClusterBarrier(cluster);
  }
};

// Sums each of a tile's kTile partial products over the tile's S slices (S >= kTile, a power
// of two; lanes slice s of one tile are consecutive) and returns the total of unit
// OwnUnit(slice, S) of the tile. The first log2(kTile) rounds halve the values each lane keeps
// (a lane whose bit `offset` is set keeps the upper half and sends the lower), so a tile of 4
// costs 3 shuffles where summing each unit alone would cost 4 log2(S); the rest add one value.
// kFixedSlices, where not 0, is S (FixedSlices: float32 blocks of their own): the shuffles'
// offsets and lanes are then constants and no check for further rounds sits on the step's
// path (6-7% of the wide forwards, kernels alone on an H100). The further rounds stay a loop:
// unrolled, they cost the clustered backwards 9-10%.
template <int kTile, int kFixedSlices, typename T>
__device__ inline T SumOverSlices(T (&v)[kTile], int slices, int slice) {
  if constexpr (kFixedSlices != 0) slices = kFixedSlices;
  int offset = slices / 2;
#pragma unroll
  for (int n = kTile; n > 1; n /= 2, offset /= 2) {
    const bool upper = (slice & offset) != 0;
#pragma unroll
    for (int i = 0; i < n / 2; ++i) {
      const T send = upper ? v[i] : v[i + n / 2];
      v[i] = (upper ? v[i + n / 2] : v[i]) + __shfl_xor_sync(0xffffffffu, send, offset);
    }
  }
  T total = v[0];
  for (; offset > 0; offset /= 2) total += __shfl_xor_sync(0xffffffffu, total, offset);
  return total;
}
// The unit of its tile whose total SumOverSlices leaves with lane `slice`: the bits it kept
// the upper half by, highest first.
__device__ inline int OwnUnit(int slice, int slices, int tile) { return slice / (slices / tile); }

template <typename T>
struct alignas(16) Vector16 {
  T v[16 / sizeof(T)];
};

// The 16 bytes at `address` of the block's shared memory (a shared-window address). Volatile,
// so that the compiler keeps it after the step's barrier.
template <typename T>
__device__ __forceinline__ Vector16<T> LoadShared16(unsigned address) {
  Vector16<T> h;
  if constexpr (sizeof(T) == 4) {
    asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                 : "=f"(h.v[0]), "=f"(h.v[1]), "=f"(h.v[2]), "=f"(h.v[3])
                 : "r"(address));
  } else {
    asm volatile("ld.shared.v2.f64 {%0, %1}, [%2];\n" : "=d"(h.v[0]), "=d"(h.v[1]) : "r"(address));
  }
  return h;
}

// acc[g][q] = sum_i rows[g][i] w[q][i] over this thread's slice (rows[g]: the slice's shared
// address in row g's exchange entries), for kGroup rows and the tile's kTile units at once:
// kGroup * kTile independent chains, enough that FMA latency does not serialise them.
template <typename T, int kSlice, int kGroup, int kTile>
__device__ __forceinline__ void SliceProducts(const unsigned (&rows)[kGroup],
                                              const T (&w)[kTile][kSlice],
                                              T (&acc)[kGroup][kTile]) {
  constexpr int kVec = 16 / sizeof(T);
#pragma unroll
  for (int g = 0; g < kGroup; ++g) {
#pragma unroll
    for (int q = 0; q < kTile; ++q) acc[g][q] = T(0);
  }
#pragma unroll
  for (int v = 0; v < kSlice / kVec; ++v) {
#pragma unroll
    for (int g = 0; g < kGroup; ++g) {
      const Vector16<T> h = LoadShared16<T>(rows[g] + v * 16);
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
#pragma unroll
        for (int q = 0; q < kTile; ++q) acc[g][q] += h.v[e] * w[q][v * kVec + e];
      }
    }
  }
}

// The thread's place in the launch, and the per-thread constants of its step work.
template <int kSlice, int kTile>
struct Place {
  int rank, direction;
  int row0;  // first batch row of the cluster
  int rows;  // its rows (the last cluster may have fewer than plan.rows)
  int slice;
  int tile_first;     // the first unit of the thread's tile within the direction
  int tile_in_block;  // ... and within the block
  int tile_units;  // the tile's units below H and in this block (0 to kTile)
  int unit_in_block;  // the unit this thread owns after the sums (OwnUnit), within the block
  int unit;  // ... and within the direction
  bool has_unit, in_unit, owner;  // the tile holds a unit; OwnUnit is one; this thread owns it
  int column;      // d*H + j in [*, D*H] tensors
  int row_stride;  // D*H
  int first;       // row0's element of this column in [N, D*H]
  int exchange_row, exchange_unit;  // exchange buffer: elements per row; this unit's entry
  int read_offset;  // exchange buffer: this thread's slice of row 0

  __device__ explicit Place(const Geometry& g) {
    rank = blockIdx.x % g.cluster;
    direction = blockIdx.y;
    row0 = (blockIdx.x / g.cluster) * g.rows;
    rows = min(g.rows, g.N - row0);
    slice = threadIdx.x % g.slices;
    tile_in_block = threadIdx.x / g.slices * kTile;
    tile_first = rank * g.units + tile_in_block;
    tile_units = max(0, min(kTile, min(g.units - tile_in_block, g.H - tile_first)));
    const int own = OwnUnit(slice, g.slices, kTile);
    unit_in_block = tile_in_block + own;
    unit = tile_first + own;
    has_unit = tile_units > 0;
    in_unit = own < tile_units;
    owner = in_unit && slice % (g.slices / kTile) == 0;
    column = direction * g.H + unit;
    row_stride = g.D * g.H;
    first = row0 * row_stride + column;
    exchange_row = g.slices * g.stride;
    exchange_unit = (unit / kSlice) * g.stride + unit % kSlice;
    read_offset = slice * g.stride;
  }
  // Element (row row0 + b, this column) of [N, D*H]; add t * StepStride() for [T, N, D*H].
  __device__ int Offset(int b) const { return first + b * row_stride; }
  // This unit's entry for row b in an exchange buffer.
  __device__ int ExchangeIndex(int b) const { return b * exchange_row + exchange_unit; }
  // Exchange buffer: this thread's slice of row b (rows past the block's last read its last).
  __device__ int SliceIndex(int b) const { return read_offset + min(b, rows - 1) * exchange_row; }
  // The element (time, row row0 + b, this column) of a [T, N, D*H] tensor that this lane
  // reads: lanes past H read element 0, so that every lane loads with its owner, no branch.
  __device__ int ReadAt(int time, int b, int step_stride) const {
    return in_unit ? time * step_stride + Offset(b) : 0;
  }
};

// This thread's kSlice entries of R for each unit j of its tile in registers: row j (forward)
// or column j (backward) of its direction's R, zero beyond H.
template <typename T, int kSlice, int kTile>
__device__ inline void LoadSlice(T (&w)[kTile][kSlice], const T* R,
                                 const Place<kSlice, kTile>& p, const Geometry& g, bool column) {
  const T* R_d = R + p.direction * g.H * g.H;
#pragma unroll
  for (int q = 0; q < kTile; ++q) {
    const int j = p.tile_first + q;
#pragma unroll
    for (int i = 0; i < kSlice; ++i) {
      const int k = p.slice * kSlice + i;
      w[q][i] = q < p.tile_units && k < g.H ? R_d[column ? k * g.H + j : j * g.H + k] : T(0);
    }
  }
}

// A block's shared memory, laid out as recurrence_plan.h's SharedBytesPerRow counts it. The
// exchange buffers start zeroed (entries past H meet zero weights, and must not be NaN).
template <typename T>
struct BlockMemory {
  uint64_t* signals;  // kSignalBytes: StepSignal's two mbarriers
  T* exchange;  // two buffers of Geometry::exchange elements: step i reads buffer i & 1
  T* state;  // [rows][units]: per owner and row, the forward's h (kept by finished rows; a
             // plain call's stays h0), the backward's next z
  int32_t* length;  // [rows]: each row's valid steps
  int exchange_elements, units;
  // The exchange buffers' shared-window address, computed once and hidden from the compiler:
  // with pointers derived from `exchange`, it rebuilt the window's base (S2UR SR_CgaCtaId) in
  // every step, between the barrier and the first load (docs/performance.md, "Why the kernels
  // are as they are").
  unsigned exchange_address;

  template <int kSlice, int kTile>
  __device__ BlockMemory(const Geometry& g, const Place<kSlice, kTile>& p,
                         const int32_t* seq_lengths)
      : exchange_elements(g.exchange), units(g.units) {
    extern __shared__ __align__(16) unsigned char shared_bytes[];
    signals = reinterpret_cast<uint64_t*>(shared_bytes);
    exchange = reinterpret_cast<T*>(shared_bytes + kSignalBytes);
    state = exchange + 2 * g.exchange;
    length = reinterpret_cast<int32_t*>(state + g.rows * g.units);
    exchange_address = SharedAddress(exchange);
    asm volatile("" : "+r"(exchange_address));  // opaque: kept in a register, not rebuilt
    for (int i = threadIdx.x; i < 2 * g.exchange; i += blockDim.x) exchange[i] = T(0);
    for (int b = threadIdx.x; b < p.rows; b += blockDim.x) {
      length[b] = static_cast<int32_t>(RowLength(seq_lengths, p.row0 + b, g.T));
    }
  }
  __device__ T* Exchange(int i) const { return exchange + (i & 1) * exchange_elements; }
  // Element `index` of exchange buffer i & 1, as a shared-window address.
  __device__ unsigned ExchangeAddress(int i, int index) const {
    return exchange_address + ((i & 1) * exchange_elements + index) * sizeof(T);
  }
  __device__ T& State(int b, int unit) const { return state[b * units + unit]; }
};

// Steps ahead of the current one whose dy and z the backward's owners ask L2 for. In a
// training step both come from HBM (z was written by the forward long before, dy by the work
// after it), and a load from HBM outlasts a step of the small shapes: with L2 emptied before
// the kernel, (1000,8,128) ran 774 us without it and 587 with it (2 to 8 steps ahead alike),
// 554 and 548 with L2 warm. The forward's source is the projection's output, just written and
// in L2, and the same hint there cost 25-35% of the wide forward (docs/performance.md, "Tried
// and not kept").
constexpr int kPrefetchSteps = 4;

// A hint that brings the line holding *p into L2; nothing waits for it.
template <typename T>
__device__ inline void PrefetchL2(const T* p) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
}

// Runs the `steps` steps of a kernel, each between the step signal's Begin and End: per group
// of kGroup rows from b0, load(i, b0, ops, ahead) reads step i's operands from global memory
// into `ops` and run(i, b0, ops, ahead) does the step's work; `active` is false in warps that
// hold no unit (they only take part in the signal).
//
// With kAhead, a block whose rows make one group (ahead: true) loads each step's operands
// during the step before, into a second register set that becomes the current one at the
// step's end, so that the loads' latency overlaps a whole step instead of only its products.
// Blocks of several groups (ahead: false) would need a set per group, and their products
// already hide the loads. Both kernels ask for it in one-row blocks: the backward's ran 3-27%
// faster this way than with two register sets and the loop unrolled by two (no copy),
// the wide forwards 15-16% faster than without (kernels alone, an H100). Clustered forwards
// ran 4-5% slower with it, so the forward asks only in blocks of their own.
template <int kGroup, bool kAhead, typename Operands, typename Signal, typename Load,
          typename Run>
__device__ __forceinline__ void RunSteps(int steps, int rows, bool active, const Signal& signal,
                                         Load&& load, Run&& run) {
  if (kAhead && rows <= kGroup) {
    Operands current, next;
    if (active) load(0, 0, current, std::true_type{});
    for (int i = 0; i < steps; ++i) {
      signal.Begin(i, steps);
      if (active) {
        // The last step loads its own operands again rather than branch.
        load(min(i + 1, steps - 1), 0, next, std::true_type{});
        run(i, 0, current, std::true_type{});
        // After the step's work, a whole step after the loads were issued: the copy waits for
        // them only if they took longer than that.
        current = next;
      }
      signal.End();
    }
    return;
  }
  for (int i = 0; i < steps; ++i) {
    signal.Begin(i, steps);
    for (int b0 = 0; active && b0 < rows; b0 += kGroup) {
      Operands ops;
      load(i, b0, ops, std::false_type{});
      run(i, b0, ops, std::false_type{});
    }
    signal.End();
  }
}

// kPlain: no mask and no lengths, so that every row runs all T steps unmasked and the per-step
// checks for both drop out (the common case). Measured at 1-10% faster forwards.
//
// The forward and the backward kernel have the same skeleton (the products, the sums, the
// hand-over, RunSteps) and differ in what the owners read and do per row. They are written out
// separately: one template with the per-row work in functions ran the forwards markedly slower
// with the same instructions per step (docs/performance.md, "Floors, and what limits each row").
//
// Forward, step k = 0, 1, ...: z_k = x_k + (h_{k-1} m_k) R^T, h_k = act(z_k); y and z are
// stored in the direction's output slot, and the next step reads h_k m_{k+1}. A finished row
// keeps its state and gives zeros.
template <typename T, Activation A, int kGroup, bool kWide, bool kClustered, bool kPlain>
__global__ void __launch_bounds__(kWide ? kWideThreads : kMaxThreads)
    ForwardKernel(Config c, Geometry g, ForwardArgs<T> a) {
  constexpr int kTile = kUnitsPerThread;
  constexpr int kSlice = SliceLength(sizeof(T), kWide);
  constexpr int kFixedSlices = FixedSlices(sizeof(T), kWide, kClustered);
  const Place<kSlice, kTile> p(g);
  const BlockMemory<T> mem(g, p, a.seq_lengths);
  const DirectionLayout layout = LayoutOf(c, p.direction);
  const int step = g.StepStride(), u = p.unit_in_block;
  const auto length_of = [&](int b) { return kPlain ? g.T : static_cast<int>(mem.length[b]); };
  const bool masked = !kPlain && a.mask.data != nullptr;
  T w[kTile][kSlice];  // rows j of R
  LoadSlice(w, a.R, p, g, false);

  const StepSignal<T, kClustered> signal(mem.signals, p.rows, g.H, g.cluster);
  const bool warp_has_unit = __any_sync(0xffffffffu, p.has_unit);
  // Every block's buffers are zero and its mbarriers set up before any block writes into them.
  ClusterBarrier(g.cluster);

  if (p.owner) {
    for (int b = 0; b < p.rows; ++b) {
      const T h = a.h0 ? a.h0[p.Offset(b)] : T(0);
      mem.State(b, u) = h;
      Broadcast(mem.Exchange(0), p.ExchangeIndex(b),
                h * MaskAt(a.mask, 0, p.row0 + b, p.column), g.cluster);
    }
  }
  ClusterBarrier(g.cluster);

  // Step k's operands of a unit: its source x_k and mask m_{k+1} for each row. In blocks of
  // their own every lane of a unit reads with its owner and does the step's work with it
  // (lanes past H read element 0), and only owners store: the owners' branch around that work
  // cost the wide forwards 2-4%, while clustered ones, with several lanes a unit, ran 2-7%
  // slower without it.
  const bool works = !kClustered || p.owner;
  // In a plain call every step is valid, TimesOf's times are k or T - 1 - k, and so the
  // offset of step k in a [T, N, D*H] tensor is first + k * delta. Written so, nvcc steps the
  // offsets instead of rebuilding them from TimesOf in every step: wide blocks ran 2% faster
  // at (1000,8,128) and (2621,4,100), narrow ones 6% slower at H = 64 and level at H = 256,
  // so only wide blocks do (docs/performance.md). Lanes past H read element 0, as in ReadAt.
  constexpr bool kSteppedOffsets = kPlain && kWide;
  const int read_delta = !p.in_unit ? 0 : layout.read_reversed ? -step : step;
  const int read_first = !p.in_unit ? 0 : layout.read_reversed ? (g.T - 1) * step : 0;
  const int slot_delta = layout.store_flipped ? -step : step;
  const int slot_first = layout.store_flipped ? (g.T - 1) * step : 0;
  struct Operands {
    T input[kGroup], mask_next[kGroup];
  };
  const auto load = [&](int k, int b0, Operands& o, auto) {
#pragma unroll
    for (int r = 0; r < kGroup; ++r) {
      const int b = min(b0 + r, p.rows - 1);
      const StepTimes t = TimesOf(layout, k, length_of(b));
      // One condition, which the compiler predicates: behind an early return for non-owners
      // the loads of clustered blocks took a branch before the products (15-18% slower), and
      // wide blocks' unconditional loads ran 21-24% slower with L2 emptied (2% faster warm).
      const int at = kSteppedOffsets
                         ? read_first + k * read_delta + (p.in_unit ? p.Offset(b) : 0)
                         : p.ReadAt(t.in_time, b, step);
      o.input[r] = works && t.valid ? a.source[at] : T(0);
      o.mask_next[r] = masked && p.owner && k + 1 < g.T
                           ? *MaskPointer(a.mask, k + 1, p.row0 + b, p.column)
                           : T(1);
    }
  };
  const auto run = [&](int k, int b0, const Operands& o, auto) {
    unsigned rows[kGroup];
#pragma unroll
    for (int r = 0; r < kGroup; ++r) {
      rows[r] = mem.ExchangeAddress(k, p.SliceIndex(b0 + r));
    }
    T products[kGroup][kTile], acc[kGroup];
    SliceProducts(rows, w, products);
#pragma unroll
    for (int r = 0; r < kGroup; ++r) {
      acc[r] = SumOverSlices<kTile, kFixedSlices>(products[r], g.slices, p.slice);
    }
    if (!works) return;
#pragma unroll
    for (int r = 0; r < kGroup; ++r) {
      const int b = b0 + r;
      if (b >= p.rows) break;
      const StepTimes t = TimesOf(layout, k, length_of(b));
      const T z = o.input[r] + acc[r];
      T h = Activate<A>(z);
      if (!kPlain && !t.valid) h = p.owner ? mem.State(b, u) : T(0);  // a finished row keeps it
      if (p.owner) {
        const int out =
            (kSteppedOffsets ? slot_first + k * slot_delta : t.slot * step) + p.Offset(b);
        a.y[out] = t.valid ? h : T(0);  // a finished row gives zeros
        if (a.z) a.z[out] = t.valid ? z : T(0);
        if (!kPlain) mem.State(b, u) = h;
        if (k + 1 < g.T) {
          signal.Send(mem.ExchangeAddress(k + 1, p.ExchangeIndex(b)), h * o.mask_next[r], k);
        }
      }
    }
  };
  RunSteps<kGroup, !kClustered && kGroup == 1, Operands>(g.T, p.rows, warp_has_unit, signal, load,
                                                         run);
  signal.Finish();
}

// Backward, step k = T-1, T-2, ... (the i-th processed is k = T - 1 - i): the step reads dz_k,
// and its products give the carry (dz_k R) m_k (zero at a padded step), from which
// dz_{k-1} = (dy_{k-1} + carry) act'(z_{k-1}) (zero at a padded step), stored in source time,
// is what step k - 1 reads. Step 0's carry is dh0. dR is not formed here: it is one product
// over all steps, XLA's (jax_sgrnn/_lowering.py).
//
// act'(z_{k-1}) does not depend on the carry, so the owners compute it before the products,
// which hide it; computed after the sums it lay on the sequential path of every step (2-5% of
// the kernel at H >= 256, docs/performance.md, "Floors, and what limits each row"). z_{k-1}
// comes a step ahead: with the other operands in a block of one row group (RunSteps), else
// through the block's state, which each step fills with the next step's z.
template <typename T, Activation A, int kGroup, bool kWide, bool kClustered, bool kPlain>
__global__ void __launch_bounds__(kWide ? kWideThreads : kMaxThreads)
    BackwardKernel(Config c, Geometry g, GradientArgs<T> a) {
  constexpr int kTile = kUnitsPerThread;
  constexpr int kSlice = SliceLength(sizeof(T), kWide);
  constexpr int kFixedSlices = FixedSlices(sizeof(T), kWide, kClustered);
  const Place<kSlice, kTile> p(g);
  const BlockMemory<T> mem(g, p, a.seq_lengths);
  const DirectionLayout layout = LayoutOf(c, p.direction);
  const int step = g.StepStride(), u = p.unit_in_block;
  const auto length_of = [&](int b) { return kPlain ? g.T : static_cast<int>(mem.length[b]); };
  const bool masked = !kPlain && a.mask.data != nullptr;
  T w[kTile][kSlice];  // columns j of R
  LoadSlice(w, a.R, p, g, true);
  const auto derivative = [](T z) { return ActivateGrad<A>(z); };
  // z at step k of row b (with `length` valid steps), zero for k < 0 and at padded steps.
  const auto z_at = [&](int b, int k, int length) {
    if (k < 0) return T(0);
    const StepTimes t = TimesOf(layout, k, length);
    return t.valid ? a.z[t.slot * step + p.Offset(b)] : T(0);
  };
  // Stores dz of row b at a step with times t (zero at a padded step) and returns it.
  const auto store_dz = [&](int b, const StepTimes& t, T dz) {
    dz = t.valid ? dz : T(0);
    a.d_source[t.in_time * step + p.Offset(b)] = dz;
    return dz;
  };

  const StepSignal<T, kClustered> signal(mem.signals, p.rows, g.H, g.cluster);
  const bool warp_has_unit = __any_sync(0xffffffffu, p.has_unit);
  ClusterBarrier(g.cluster);  // zeroed buffers and set-up mbarriers, as in the forward

  if (p.owner) {  // dz_{T-1}, and z_{T-2} for the first step
    for (int b = 0; b < p.rows; ++b) {
      const int length = length_of(b);
      const StepTimes t = TimesOf(layout, g.T - 1, length);
      const int at = t.slot * step + p.Offset(b);
      const T dz = t.valid ? a.dy[at] * derivative(a.z[at]) : T(0);
      Broadcast(mem.Exchange(0), p.ExchangeIndex(b), store_dz(b, t, dz), g.cluster);
      mem.State(b, u) = z_at(b, g.T - 2, length);
    }
  }
  ClusterBarrier(g.cluster);

  // Step k's operands of an owner for each row: m_k, dy_{k-1}, z_{k-1}, and z_{k-2} for the
  // block's state where that carries z. Written without branches, which here would split the
  // warps between the barrier and the products, on the step's sequential path: every lane of
  // a unit reads what its owner reads (the same addresses, one access a warp), lanes past H
  // read element 0, and each drops what it does not own.
  struct Operands {
    T mask[kGroup], dy[kGroup], z[kGroup], z_ahead[kGroup];
  };
  const auto load = [&](int i, int b0, Operands& o, auto ahead) {
    const int k = g.T - 1 - i;
#pragma unroll
    for (int r = 0; r < kGroup; ++r) {
      const int b = min(b0 + r, p.rows - 1);
      const int length = length_of(b);
      o.mask[r] = masked && p.owner ? *MaskPointer(a.mask, k, p.row0 + b, p.column) : T(1);
      // dy_{k-1} and z_{k-1} share their slot.
      const StepTimes prev = TimesOf(layout, max(k - 1, 0), length);
      const bool has_prev = p.owner && k > 0 && prev.valid;
      const int prev_at = p.ReadAt(prev.slot, b, step);
      const T dy = a.dy[prev_at], z = a.z[prev_at];
      o.dy[r] = has_prev ? dy : T(0);
      if constexpr (decltype(ahead)::value) {
        o.z[r] = has_prev ? z : T(0);
      } else {
        o.z[r] = p.owner ? mem.State(b, u) : T(0);
        const StepTimes next = TimesOf(layout, max(k - 2, 0), length);
        const T z_next = a.z[p.ReadAt(next.slot, b, step)];
        o.z_ahead[r] = p.owner && k > 1 && next.valid ? z_next : T(0);
      }
      // dy and z of step f = k - kPrefetchSteps's load. Blocks of one row group ask only for
      // steps that exist, under a branch; blocks of several ask every step (the last for step
      // 0's again), without one: each ran 3-6% faster so (kernels alone, an H100).
      const int f = k - kPrefetchSteps;
      const StepTimes later = TimesOf(layout, max(f - 1, 0), length);
      if (!decltype(ahead)::value || (p.owner && f > 0 && later.valid)) {
        const int later_at = p.ReadAt(later.slot, b, step);
        PrefetchL2(a.dy + later_at);
        PrefetchL2(a.z + later_at);
      }
      if (masked && p.owner && f > 0) PrefetchL2(MaskPointer(a.mask, f, p.row0 + b, p.column));
    }
  };
  const auto run = [&](int i, int b0, const Operands& o, auto ahead) {
    const int k = g.T - 1 - i;
    unsigned rows[kGroup];
    T slope[kGroup];
    // Outside the owners' branch, so that the scheduler can interleave it with the products.
#pragma unroll
    for (int r = 0; r < kGroup; ++r) {
      rows[r] = mem.ExchangeAddress(i, p.SliceIndex(b0 + r));
      slope[r] = derivative(o.z[r]);
    }
    T products[kGroup][kTile], acc[kGroup];
    SliceProducts(rows, w, products);
#pragma unroll
    for (int r = 0; r < kGroup; ++r) {
      acc[r] = SumOverSlices<kTile, kFixedSlices>(products[r], g.slices, p.slice);
    }
    if (!p.owner) return;
#pragma unroll
    for (int r = 0; r < kGroup; ++r) {
      const int b = b0 + r;
      if (b >= p.rows) break;
      const int length = length_of(b);
      const T carry = k < length ? acc[r] * o.mask[r] : T(0);
      if (k > 0) {
        const StepTimes prev = TimesOf(layout, k - 1, length);
        signal.Send(mem.ExchangeAddress(i + 1, p.ExchangeIndex(b)),
                    store_dz(b, prev, (o.dy[r] + carry) * slope[r]), i);
        if constexpr (!decltype(ahead)::value) mem.State(b, u) = o.z_ahead[r];
      } else if (a.dh0) {
        a.dh0[p.Offset(b)] = carry;
      }
    }
  };
  RunSteps<kGroup, kGroup == 1, Operands>(g.T, p.rows, warp_has_unit, signal, load, run);
  signal.Finish();
}

Geometry GeometryOf(const Dims& d, const RecurrencePlan& plan, int64_t element_bytes) {
  return Geometry{static_cast<int>(d.T),
                  static_cast<int>(d.N),
                  static_cast<int>(d.H),
                  static_cast<int>(d.D),
                  static_cast<int>(plan.slices),
                  static_cast<int>(plan.cluster),
                  static_cast<int>(plan.units),
                  static_cast<int>(plan.rows),
                  static_cast<int>(plan.slice + SlicePadding(element_bytes)),
                  static_cast<int>(plan.ExchangeElements(element_bytes))};
}

// One launch of `kernel` in the plan's grid: (clusters x cluster) blocks per direction.
template <typename... KernelArgs, typename... Args>
cudaError_t Launch(void (*kernel)(KernelArgs...), const RecurrencePlan& plan, int64_t D,
                   cudaStream_t stream, Args... args) {
  if (plan.shared_bytes > 48 * 1024) {  // above the default limit only when raised
    const cudaError_t err = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(plan.shared_bytes));
    if (err != cudaSuccess) return err;
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(plan.clusters * plan.cluster),
                        static_cast<unsigned>(D), 1);
  config.blockDim = dim3(static_cast<unsigned>(plan.threads), 1, 1);
  config.dynamicSmemBytes = static_cast<size_t>(plan.shared_bytes);
  config.stream = stream;
  cudaLaunchAttribute cluster;
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = static_cast<unsigned>(plan.cluster);
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = 1;
  if (plan.cluster > 1) {
    config.attrs = &cluster;
    config.numAttrs = 1;
  }
  const cudaError_t err = cudaLaunchKernelEx(&config, kernel, args...);
  return err != cudaSuccess ? err : cudaGetLastError();
}

// Calls f.template operator()<kGroup, kWide, kClustered>() with the row group the plan's rows
// call for, its block width, and whether its cluster has more than one block.
template <typename F>
cudaError_t DispatchShape(const RecurrencePlan& plan, F&& f) {
  if (plan.wide) {  // one block holds all H units
    return plan.rows >= 3 ? f.template operator()<4, true, false>()
                          : f.template operator()<1, true, false>();
  }
  if (plan.cluster > 1) {
    return plan.rows >= 3 ? f.template operator()<4, false, true>()
                          : f.template operator()<1, false, true>();
  }
  return plan.rows >= 3 ? f.template operator()<4, false, false>()
                        : f.template operator()<1, false, false>();
}

// Calls f.template operator()<kPlain>(): whether the call has neither a mask nor lengths.
template <typename F>
cudaError_t DispatchPlain(bool plain, F&& f) {
  return plain ? f.template operator()<true>() : f.template operator()<false>();
}

template <typename F>
cudaError_t DispatchActivationOf(Activation activation, F&& f) {
  cudaError_t err = cudaSuccess;
  DispatchActivation(activation, [&]<Activation A>() { err = f.template operator()<A>(); });
  return err;
}

// Launches the forward kernel (ForwardArgs) or the backward kernel (GradientArgs) under `plan`,
// which must be PlanRecurrence's for that pass.
template <typename T, typename Args>
cudaError_t LaunchRecurrence(const Config& c, const Dims& d, const RecurrencePlan& plan,
                             const Args& args, cudaStream_t stream) {
  constexpr bool kBackward = std::is_same_v<Args, GradientArgs<T>>;
  const Geometry geometry = GeometryOf(d, plan, sizeof(T));
  return DispatchActivationOf(c.activation, [&]<Activation A>() {
    return DispatchShape(plan, [&]<int kGroup, bool kWide, bool kClustered>() {
      return DispatchPlain(!args.mask.data && !args.seq_lengths, [&]<bool kPlain>() {
        if constexpr (kBackward) {
          return Launch(BackwardKernel<T, A, kGroup, kWide, kClustered, kPlain>, plan, d.D, stream, c,
                        geometry, args);
        } else {
          return Launch(ForwardKernel<T, A, kGroup, kWide, kClustered, kPlain>, plan, d.D, stream, c,
                        geometry, args);
        }
      });
    });
  });
}

}  // namespace

template <typename T>
cudaError_t LaunchForward(const Config& c, const Dims& d, const RecurrencePlan& plan,
                          const ForwardArgs<T>& args, cudaStream_t stream) {
  if (d.T == 0 || d.N == 0) return cudaSuccess;
  return LaunchRecurrence<T>(c, d, plan, args, stream);
}

template <typename T>
cudaError_t LaunchGradients(const Config& c, const Dims& d, const RecurrencePlan& plan,
                            const GradientArgs<T>& args, cudaStream_t stream) {
  if (d.T == 0 || d.N == 0) {  // no steps: dh0 is zero
    return args.dh0 && d.N > 0 ? cudaMemsetAsync(args.dh0, 0, d.N * d.DH() * sizeof(T), stream)
                               : cudaSuccess;
  }
  return LaunchRecurrence<T>(c, d, plan, args, stream);
}

template cudaError_t LaunchForward<float>(const Config&, const Dims&, const RecurrencePlan&,
                                          const ForwardArgs<float>&, cudaStream_t);
template cudaError_t LaunchForward<double>(const Config&, const Dims&, const RecurrencePlan&,
                                           const ForwardArgs<double>&, cudaStream_t);
template cudaError_t LaunchGradients<float>(const Config&, const Dims&, const RecurrencePlan&,
                                            const GradientArgs<float>&, cudaStream_t);
template cudaError_t LaunchGradients<double>(const Config&, const Dims&, const RecurrencePlan&,
                                             const GradientArgs<double>&, cudaStream_t);

}  // namespace sgrnn::cuda
