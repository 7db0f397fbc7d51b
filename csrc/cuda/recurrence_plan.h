// How the CUDA recurrence kernels (recurrence.cu) split one problem over the GPU: plain C++ with
// no CUDA types, so that it is unit-tested on any machine (tests/cpp/test_cuda_plan.cc).
//
// Batch rows are independent, so each thread-block cluster owns a group of rows and runs all T
// steps for them with R held in registers: a block's threads each hold a tile of R, kSlice
// entries of each of kUnitsPerThread hidden units (forward: rows of R; backward: columns),
// `slices` threads share a tile's units, and the `cluster` blocks of a cluster split the H
// units between them. Per step a cluster exchanges the new state through (distributed) shared
// memory and meets at one barrier. The forward and the backward recurrence have the same
// shape of work (the backward's dR is one product after it, XLA's), so one plan serves both.
#ifndef JAX_SGRNN_CUDA_RECURRENCE_PLAN_H_
#define JAX_SGRNN_CUDA_RECURRENCE_PLAN_H_

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <string_view>

namespace sgrnn::cuda {

// Hidden units whose rows (forward) or columns (backward) of R one thread holds: each value
// of the state that a thread reads from shared memory then feeds 4 FMAs instead of one. With
// one unit per thread, a 16-byte shared load (4 wavefronts a warp) per 4 FMAs saturated shared
// memory first (docs/performance.md, "Floors, and what limits each row", on an H200).
inline constexpr int64_t kUnitsPerThread = 4;

// Entries of R each thread keeps in registers: 256 bytes (64 floats). With __launch_bounds__
// of kMaxThreads each thread may use 128 registers, which these fit. Wide blocks (at most
// kWideThreads threads, so up to 255 registers each) keep twice as many: for
// hidden sizes that one such block holds whole, fewer threads do the same products, with fewer
// warp shuffles and the per-unit step work spread over fewer warps. The slice is what a thread
// holds of each of its units: those entries over kUnitsPerThread.
inline constexpr int64_t SliceLength(int64_t element_bytes, bool wide) {
  return 256 * (wide ? 2 : 1) / element_bytes / kUnitsPerThread;
}
// Padding after each slice in the exchange buffer (one 16-byte vector), so that the S slices
// that one warp reads at once sit in different shared-memory banks.
inline constexpr int64_t SlicePadding(int64_t element_bytes) { return 16 / element_bytes; }

inline constexpr int64_t kMaxThreads = 512;
inline constexpr int64_t kWideThreads = 256;
// The registers each thread may use under the kernels' __launch_bounds__ (65536 per block),
// counted as the hardware allocates them (whole warps, 8-register steps).
inline constexpr int64_t kNarrowRegisters = 128;
inline constexpr int64_t kWideRegisters = 256;
// Thread-block clusters of up to 8 blocks are portable on sm_90.
inline constexpr int64_t kMaxCluster = 8;

struct RecurrencePlan {
  int64_t slice;     // entries of each of its units' R per thread (SliceLength)
  int64_t slices;    // S: threads per tile of units, a power of two in [kUnitsPerThread, 32]
  int64_t cluster;   // C: blocks of a cluster, splitting the H units
  int64_t units;     // U: hidden units per block, ceil(H / C)
  int64_t threads;   // ceil(U / kUnitsPerThread) * S rounded up to whole warps
  int64_t rows;      // B: batch rows per cluster
  int64_t clusters;  // K: clusters per direction, ceil(N / B)
  int64_t shared_bytes;  // dynamic shared memory per block
  bool wide;  // a wide block (SliceLength): one block of at most kWideThreads holds all H units

  // Elements of one exchange buffer: B rows of S padded slices.
  int64_t ExchangeElements(int64_t element_bytes) const {
    return rows * slices * (slice + SlicePadding(element_bytes));
  }
};

// Shared memory a block holds whatever its rows: the two mbarriers that signal the exchange
// buffers' arrival in a cluster (recurrence.cu), 16 bytes so that what follows stays aligned.
inline constexpr int64_t kSignalBytes = 16;

// Shared memory per batch row of a block: two exchange buffers (double-buffered steps), per
// unit a value its owner carries from step to step (the forward's h, kept over a row's padded
// steps; the backward's z of the next step), and the row's length (int32).
inline int64_t SharedBytesPerRow(const RecurrencePlan& plan, int64_t element_bytes) {
  return element_bytes * (2 * plan.slices * (plan.slice + SlicePadding(element_bytes)) +
                          plan.units) +
         static_cast<int64_t>(sizeof(int32_t));
}

// The threads sharing a tile of units: enough slices to cover a row of R, a power of two, and
// at least one per unit of the tile (the kernels' sum over slices leaves each unit's total with
// its own thread; slices past H hold zeros).
inline constexpr int64_t SlicesFor(int64_t H, int64_t slice) {
  int64_t slices = 1;
  while (slices * slice < H) slices *= 2;
  return std::max(slices, kUnitsPerThread);
}

// The block shape (everything but rows, clusters and shared_bytes) for hidden size H, or
// nothing when R does not fit on chip at this size. Independent of the batch and the device,
// so the lowering can ask it (jax_sgrnn/_backends.py) before any GPU is seen. A wide block
// wherever one holds all H units and its slices pad R's rows no more than a narrow block's:
// at H <= 64 (float32) half of a wide slice would be zeros, and there the narrow kernels ran
// faster, the forward 9% at (3000,1,64), the backward about 30% (kernels alone, an H100;
// docs/performance.md, "Floors, and what limits each row"), while at H = 100 and 128 the
// wide ones ran 6-10% faster.
inline constexpr std::optional<RecurrencePlan> BlockShape(int64_t H, int64_t element_bytes) {
  if (H < 1) return std::nullopt;
  const auto threads_for = [](int64_t units, int64_t slices) {
    return ((units + kUnitsPerThread - 1) / kUnitsPerThread * slices + 31) / 32 * 32;
  };
  const int64_t wide_slice = SliceLength(element_bytes, true);
  const int64_t wide_slices = SlicesFor(H, wide_slice);
  const int64_t slice = SliceLength(element_bytes, false);
  const int64_t slices = SlicesFor(H, slice);
  const bool wide_pads_more = wide_slices * wide_slice > slices * slice;
  if (threads_for(H, wide_slices) <= kWideThreads && !wide_pads_more) {
    return RecurrencePlan{wide_slice, wide_slices, 1, H, threads_for(H, wide_slices), 0, 0, 0,
                          true};
  }
  if (slices > 32) return std::nullopt;
  for (int64_t cluster = 1; cluster <= kMaxCluster; cluster *= 2) {
    const int64_t units = (H + cluster - 1) / cluster;
    const int64_t threads = threads_for(units, slices);
    if (threads <= kMaxThreads) {
      return RecurrencePlan{slice, slices, cluster, units, threads, 0, 0, 0, false};
    }
  }
  return std::nullopt;
}

// The slices of every block of this kind (wide or not, one block or a cluster) where all
// hidden sizes give it the same count, else 0: a compile-time constant for the kernels' sums
// over slices (recurrence.cu). In float32, wide blocks and narrow blocks of their own (H <= 64)
// have kUnitsPerThread slices. No block holds more than 8 * kMaxThreads units.
inline constexpr int64_t FixedSlices(int64_t element_bytes, bool wide, bool clustered) {
  int64_t fixed = 0;
  for (int64_t H = 1; H <= kMaxCluster * kMaxThreads; ++H) {
    const std::optional<RecurrencePlan> plan = BlockShape(H, element_bytes);
    if (!plan || plan->wide != wide || (plan->cluster > 1) != clustered) continue;
    if (fixed != 0 && plan->slices != fixed) return 0;
    fixed = plan->slices;
  }
  return fixed;
}

// Blocks of this shape that one SM (2048 threads, 65536 registers, sm_90) holds at once, by
// their threads and the registers the launch bounds let them use; shared memory, a few KB a
// row at the sizes where this exceeds one, is not counted. Small blocks leave most of an SM
// idle alone: at H = 64 (64 threads) eight blocks share an SM, each with an eighth of the
// rows, and work through their steps side by side instead of one row group after another.
inline int64_t ResidentBlocks(const RecurrencePlan& plan) {
  const int64_t registers = plan.wide ? kWideRegisters : kNarrowRegisters;
  return std::max<int64_t>(1, std::min(2048 / plan.threads, 65536 / (plan.threads * registers)));
}

// The full plan for N rows and D directions on a device with `multiprocessors` SMs and
// `max_shared_bytes` of shared memory per block: as few rows per cluster as fill the device in
// one wave (ResidentBlocks per SM), and no more than fit in shared memory (further clusters
// then run in later waves).
inline std::optional<RecurrencePlan> PlanRecurrence(int64_t H, int64_t N, int64_t D,
                                                    int64_t element_bytes,
                                                    int64_t multiprocessors,
                                                    int64_t max_shared_bytes) {
  std::optional<RecurrencePlan> plan = BlockShape(H, element_bytes);
  if (!plan || N < 1) return plan;
  // The fewest rows per cluster whose clusters, whole, fit the device in one wave.
  const int64_t blocks_per_cluster = plan->cluster * D;
  const int64_t cluster_slots =
      std::max<int64_t>(1, multiprocessors * ResidentBlocks(*plan) / blocks_per_cluster);
  int64_t rows = (N + cluster_slots - 1) / cluster_slots;
  const int64_t per_row = SharedBytesPerRow(*plan, element_bytes);
  rows = std::min(rows, (max_shared_bytes - kSignalBytes) / per_row);
  if (rows < 1) return std::nullopt;
  plan->rows = rows;
  plan->clusters = (N + rows - 1) / rows;
  plan->shared_bytes = kSignalBytes + rows * per_row;
  return plan;
}

// The recurrence with each step spread over the whole GPU (grid_steps.h), for float32 sizes
// whose step no block or cluster above holds: one block of kGridThreads threads an SM, all
// resident at once, each owning a tile of rows x units of one direction for every step. A
// tile's units' R sits in the block's shared memory, the previous state streams from L2 in
// chunks of kGridChunk entries through a ring of kGridStages buffers, each chunk's copies
// issued kGridChunksAhead chunks before its products, and each thread sums a register tile of
// its outputs over its part of a chunk (grid_steps.h's GridTile).
inline constexpr int64_t kGridThreads = 256;
inline constexpr int64_t kGridChunk = 64;
inline constexpr int64_t kGridStages = 4;
// Chunks between a chunk's copies and its products; the warps may run kGridStages -
// kGridChunksAhead - 1 chunks apart (grid_steps.h's StepProducts).
inline constexpr int kGridChunksAhead = 2;
// A chunk's rows are padded by one 16-byte vector, so that the rows one warp reads at once
// fall in different shared-memory banks.
inline constexpr int64_t kGridChunkStride = kGridChunk + 4;

// The tiles of rows x units a grid kernel is built for, in the order the plan tries them:
// the least work a block first (a step lasts as long as a block's products), then more units
// a tile (each block reads its rows' whole state from L2 every step, so the fewer column
// tiles, the less L2 traffic), then fewer rows.
struct GridTileShape {
  int64_t rows, units;
};
inline constexpr GridTileShape kGridTiles[] = {{32, 32}, {64, 32}, {128, 16}, {64, 16}, {128, 8}};

struct GridPlan {
  GridTileShape tile;
  int64_t row_tiles, unit_tiles;  // blocks per direction: row_tiles * unit_tiles
  int64_t padded_hidden;  // H rounded up to whole chunks: R's rows kept, the state's row length
  int64_t shared_bytes;   // dynamic shared memory per block

  int64_t blocks() const { return row_tiles * unit_tiles; }
  // Elements of one of the two state buffers, [row_tiles * tile.rows][padded_hidden].
  int64_t StateElements() const { return row_tiles * tile.rows * padded_hidden; }
  // Device memory a call needs beside its operands (grid_steps.h): per direction and row tile
  // a counter of the blocks that handed over, then the two state buffers, all zeroed first.
  int64_t WorkspaceBytes(int64_t D) const {
    return (D * row_tiles * static_cast<int64_t>(sizeof(uint32_t)) + 15) / 16 * 16 +
           2 * StateElements() * static_cast<int64_t>(sizeof(float));
  }
};

// A block's shared memory: R's columns of its units [padded_hidden][units], kGridStages chunk
// buffers [rows][kGridChunkStride] (at a step's end the threads' partial sums), two mbarriers
// a buffer, its rows' lengths.
inline constexpr int64_t GridSharedBytes(int64_t padded_hidden, const GridTileShape& tile) {
  return static_cast<int64_t>(sizeof(float)) *
             (padded_hidden * tile.units + kGridStages * tile.rows * kGridChunkStride) +
         static_cast<int64_t>(sizeof(uint64_t)) * 2 * kGridStages +
         static_cast<int64_t>(sizeof(int32_t)) * tile.rows;
}

// The first tile whose blocks, one an SM, all fit the device at once with their shared memory,
// or nothing (then the decomposition runs). float32 only: float64's R takes twice the memory.
inline GridPlan GridPlanOf(int64_t H, int64_t N, const GridTileShape& tile) {
  const int64_t padded_hidden = (H + kGridChunk - 1) / kGridChunk * kGridChunk;
  return {tile, (N + tile.rows - 1) / tile.rows, (H + tile.units - 1) / tile.units, padded_hidden,
          GridSharedBytes(padded_hidden, tile)};
}
inline std::optional<GridPlan> PlanGrid(int64_t H, int64_t N, int64_t element_bytes,
                                        int64_t multiprocessors, int64_t max_shared_bytes) {
  if (element_bytes != 4 || H < 1 || N < 1) return std::nullopt;
  for (const GridTileShape& tile : kGridTiles) {
    const GridPlan plan = GridPlanOf(H, N, tile);
    if (plan.blocks() <= multiprocessors && plan.shared_bytes <= max_shared_bytes) return plan;
  }
  return std::nullopt;
}

// The kernels index [T, N, D*H] tensors with 32-bit integers (half the instructions of 64-bit
// ones on the per-step path), so they run only where every element index fits.
inline bool IndexesFit(int64_t T, int64_t N, int64_t D, int64_t H) {
  return T * N * D * H <= std::numeric_limits<int32_t>::max() &&
         D * H * H <= std::numeric_limits<int32_t>::max();
}

// Which of the CUDA handler's paths runs N rows and D directions: the kernels of blocks and
// clusters (PlanRecurrence), the grid kernels (PlanGrid, where GridUse lets them), or the
// lax.scan decomposition, whose steps are cuBLAS products. Measured on an H200
// (docs/performance.md, "GPU"): the block kernels are several times faster while each SM works
// through a few rows a step, still faster at 16 rows; more rows an SM were not compared. The
// handler asks with its device's limits; the lowering (RunsOnChip) with the smallest of the
// visible GPUs' (ffi_cuda.cc's LoweringDeviceLimits), so that the handler has a plan on any of
// them, or a typical GPU's where none is visible.
inline constexpr int64_t kMaxRowsPerMultiprocessor = 16;

// What the plans need to know of a GPU.
struct DeviceLimits {
  int64_t multiprocessors;
  int64_t shared_bytes;  // opt-in shared memory per block
};
inline constexpr DeviceLimits kTypicalDevice{132, 227 * 1024};  // H100 SXM, H200

enum class CudaPath { kBlocks, kGrid, kDecomposition };

// Where the grid kernels run, beside the block kernels: from kGridPaysRows rows where R is too
// large for the block kernels (the default), never (SGRNN_CUDA_GRID=0), or from kGridMinRows
// rows wherever their plan fits (SGRNN_CUDA_GRID=1: how the tests run them at small sizes). A
// tile computes all its rows (32 in the first tile shape), live or not, so with fewer than 32
// a step costs about as much as with 32. Against the decomposition, measured at H = 1024
// (docs/performance.md, "NVIDIA H100"), they win both ways from 96 rows; below, their
// forward+backward is slower.
enum class GridUse { kNever, kWherePaid, kWhereFits };
inline constexpr int64_t kGridMinRows = 32;
inline constexpr int64_t kGridPaysRows = 96;

// SGRNN_CUDA_GRID's value: unset or empty is the default, "0" never, "1" wherever they fit;
// nullopt for anything else, which the extension reports rather than read as the default.
inline std::optional<GridUse> ParseGridUse(std::string_view value) {
  if (value.empty()) return GridUse::kWherePaid;
  if (value == "0") return GridUse::kNever;
  if (value == "1") return GridUse::kWhereFits;
  return std::nullopt;
}

inline CudaPath ChoosePath(int64_t T, int64_t H, int64_t N, int64_t D, int64_t element_bytes,
                           const DeviceLimits& device, GridUse grid) {
  if (!IndexesFit(T, N, D, H)) return CudaPath::kDecomposition;
  // The block kernels' rows an SM, counted as if shared memory held every row in one wave;
  // they run where R and a row fit the device.
  const std::optional<RecurrencePlan> blocks =
      PlanRecurrence(H, N, D, element_bytes, device.multiprocessors,
                     std::numeric_limits<int64_t>::max());
  if (blocks && blocks->rows * ResidentBlocks(*blocks) <= kMaxRowsPerMultiprocessor &&
      PlanRecurrence(H, N, D, element_bytes, device.multiprocessors, device.shared_bytes)) {
    return CudaPath::kBlocks;
  }
  const bool grid_may_run = grid == GridUse::kWhereFits
                                ? N >= kGridMinRows
                                : grid == GridUse::kWherePaid && !blocks && N >= kGridPaysRows;
  if (grid_may_run &&
      PlanGrid(H, N, element_bytes, device.multiprocessors, device.shared_bytes)) {
    return CudaPath::kGrid;
  }
  return CudaPath::kDecomposition;
}

// The lowering's question: whether the handler runs these sizes (the forward and the gradient
// op share one plan), or the decomposition does.
inline bool RunsOnChip(int64_t T, int64_t H, int64_t N, int64_t D, int64_t element_bytes,
                       GridUse grid = GridUse::kWherePaid,
                       const DeviceLimits& device = kTypicalDevice) {
  return ChoosePath(T, H, N, D, element_bytes, device, grid) != CudaPath::kDecomposition;
}

}  // namespace sgrnn::cuda

#endif  // JAX_SGRNN_CUDA_RECURRENCE_PLAN_H_
