// Unit test of csrc/cuda/recurrence_plan.h, the CUDA handler's split of a problem over the GPU,
// on any machine. Built and run by tests/test_cpp_units.py; prints each failed check and exits
// non-zero.
#include "cuda/recurrence_plan.h"

#include "checks.h"

#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>

namespace {

using namespace sgrnn::cuda;

using unit_test::Check;

std::string Case(int64_t H, int64_t bytes) {
  return "H=" + std::to_string(H) + " bytes=" + std::to_string(bytes);
}

// Every block shape covers all H units, with each unit's slices summing over all of R's row
// and at least one slice per unit of a tile, whole warps, and within the kernels' limits; a
// block is wide only where its slices pad R's rows no more than a narrow block's would, and
// has the slices the kernels fix for its kind.
void BlockShapesCoverEveryUnit() {
  constexpr int64_t tile = kUnitsPerThread;
  for (int64_t bytes : {4, 8}) {
    for (int64_t H = 1; H <= 1100; ++H) {
      const std::optional<RecurrencePlan> p = BlockShape(H, bytes);
      const std::string what = Case(H, bytes);
      if (!p) continue;
      const int64_t narrow_slice = SliceLength(bytes, false);
      Check(!p->wide || p->slices * p->slice <= SlicesFor(H, narrow_slice) * narrow_slice,
            what + ": a wide block pads no more than a narrow one");
      Check(p->slice == SliceLength(bytes, p->wide), what + ": slice");
      Check(p->slice * tile * bytes == 256 * (p->wide ? 2 : 1), what + ": bytes of R per thread");
      Check(!p->wide || (p->cluster == 1 && p->units == H && p->slices <= 2 * tile),
            what + ": a wide block holds every unit");
      Check(p->slices * p->slice >= H && p->slices >= tile &&
                (p->slices == tile || (p->slices / 2) * p->slice < H),
            what + ": fewest slices covering a row, at least one per unit of a tile");
      Check(p->slices <= 32 && (p->slices & (p->slices - 1)) == 0, what + ": slices");
      const int64_t fixed = FixedSlices(bytes, p->wide, p->cluster > 1);
      Check(fixed == 0 || p->slices == fixed, what + ": the kernels' fixed slices");
      Check(p->cluster >= 1 && p->cluster <= kMaxCluster, what + ": cluster size");
      Check(p->units * p->cluster >= H && (p->units - 1) * p->cluster < H, what + ": units");
      const int64_t tiles = (p->units + tile - 1) / tile;
      Check(p->threads % 32 == 0 && p->threads >= tiles * p->slices &&
                p->threads <= (p->wide ? kWideThreads : kMaxThreads),
            what + ": threads");
      Check(p->threads - tiles * p->slices < 32, what + ": at most one partial warp");
    }
  }
}

// Which sizes stay on chip: float32 to 512, none beyond.
void OnChipLimits() {
  const auto shape = [](int64_t H) { return BlockShape(H, 4); };
  for (int64_t H : {1, 64, 128, 256, 512}) Check(shape(H).has_value(), Case(H, 4) + " fits");
  Check(!shape(513), "H=513 does not fit");
  Check(!shape(1024) && !shape(0), "H=1024 and H=0 do not fit");
  Check(shape(128)->cluster == 1, "H=128: one block");
  Check(shape(128)->wide && shape(128)->slices == 4 && shape(128)->threads == 128 &&
            shape(100)->wide,
        "H=128 and H=100: a wide block, four threads per tile of four units");
  Check(!shape(64)->wide && shape(64)->slices == 4 && shape(64)->cluster == 1,
        "H=64: a narrow block of its own (a wide one pads half)");
  Check(!shape(129)->wide, "H=129: not wide");
  Check(FixedSlices(4, true, false) == 4 && FixedSlices(4, false, false) == 4 &&
            FixedSlices(4, false, true) == 0 && FixedSlices(8, true, false) == 0,
        "fixed slices: float32 blocks of their own");
  Check(shape(256)->cluster == 2, "H=256: clusters of 2");
  Check(shape(512)->cluster == 8, "H=512: clusters of 8");
}

// Plans give every row to exactly one cluster, fill the device in one wave where shared memory
// allows, and never ask for more shared memory than the device has.
void PlansCoverTheBatch() {
  for (int64_t N : {1, 7, 8, 33, 132, 1000, 100000}) {
    for (int64_t H : {5, 128, 256, 512}) {
      for (int64_t D : {1, 2}) {
        const std::string what =
            Case(H, 4) + " N=" + std::to_string(N) + " D=" + std::to_string(D);
        const std::optional<RecurrencePlan> p = PlanRecurrence(H, N, D, 4, 132, 227 * 1024);
        Check(p.has_value(), what + ": planned");
        if (!p) continue;
        Check(p->rows >= 1 && p->clusters * p->rows >= N && (p->clusters - 1) * p->rows < N,
              what + ": rows split");
        Check(p->shared_bytes <= 227 * 1024, what + ": shared memory");
        Check(p->shared_bytes >= 2 * p->ExchangeElements(4) * 4, what + ": two buffers");
        Check(p->shared_bytes == kSignalBytes + p->rows * SharedBytesPerRow(*p, 4),
              what + ": the mbarriers and the rows' memory");
        const bool one_wave = p->clusters * p->cluster * D <= 132 * ResidentBlocks(*p);
        const bool memory_bound = p->shared_bytes + p->shared_bytes / p->rows > 227 * 1024;
        Check(one_wave || memory_bound, what + ": one wave unless shared memory limits");
      }
    }
  }
  Check(!PlanRecurrence(64, 4, 1, 4, 132, 16).has_value(), "no room for one row");
}

// Small blocks share an SM (as many as their threads and registers allow), each with fewer
// rows; blocks of the largest shapes have an SM each.
void SmallBlocksShareAnSM() {
  const auto plan = [](int64_t H, int64_t N, int64_t D) {
    return *PlanRecurrence(H, N, D, 4, 132, 227 * 1024);
  };
  Check(ResidentBlocks(plan(64, 1, 1)) == 8, "H=64: 8 narrow blocks an SM");
  Check(ResidentBlocks(plan(128, 1, 1)) == 2, "H=128: 2 wide blocks an SM");
  for (int64_t H : {256, 512}) {
    Check(ResidentBlocks(plan(H, 1, 1)) == 1, Case(H, 4) + ": an SM each");
  }
  const RecurrencePlan bi = plan(64, 1024, 2);
  Check(bi.rows == 2 && bi.clusters == 512, "(N=1024, H=64, bi): 2 rows a block");
}

void PreferenceFollowsRowsPerMultiprocessor() {
  Check(RunsOnChip(1000, 128, 8, 1, 4), "(1000,8,128,128) on chip");
  Check(RunsOnChip(100, 256, 32, 1, 4), "(100,32,256,256) on chip");
  Check(RunsOnChip(50, 256, 1024, 1, 4), "(50,1024,256,256) on chip (16 rows per cluster)");
  Check(!RunsOnChip(50, 256, 2048, 1, 4), "(50,2048,256,256) by scan");
  Check(RunsOnChip(200, 512, 64, 1, 4), "(200,64,512,512) on chip");
  Check(!RunsOnChip(100, 1024, 1, 1, 4), "H=1024 by scan");
  Check(RunsOnChip(50, 64, 1024, 2, 4), "(50,1024,64,64 bi) on chip (16 rows per SM)");
  Check(!RunsOnChip(50, 64, 3000, 1, 4), "(50,3000,64,64) by scan (24 rows per SM)");
  // 32-bit element indices: T*N*D*H up to 2^31 - 1.
  Check(RunsOnChip(65535, 256, 128, 1, 4), "T*N*H = 2^31 - 2^17 on chip");
  Check(!RunsOnChip(65536, 256, 128, 1, 4), "T*N*H = 2^31 by scan");
  Check(!RunsOnChip(32768, 256, 128, 2, 4), "T*N*D*H = 2^31 (bidirectional) by scan");
  // The grid kernels where asked for (SGRNN_CUDA_GRID=1): where the block kernels do not run
  // and PlanGrid fits, from 32 rows.
  constexpr GridUse fits = GridUse::kWhereFits, never = GridUse::kNever;
  Check(RunsOnChip(100, 1024, 256, 1, 4, fits) && RunsOnChip(100, 1024, 256, 2, 4, fits),
        "(100,256,1024,1024) by the grid kernels, one direction or two");
  Check(!RunsOnChip(100, 1024, 256, 1, 8, fits), "(100,256,1024,1024) float64 by scan");
  Check(!RunsOnChip(1024, 1024, 1, 1, 4, fits) && !RunsOnChip(50, 1024, 31, 1, 4, fits) &&
            RunsOnChip(50, 1024, 32, 1, 4, fits),
        "the grid kernels from kGridMinRows (32) rows");
  Check(!RunsOnChip(50, 1024, 1024, 1, 4, fits), "(50,1024,1024,1024) by scan (512 tiles)");
  Check(!RunsOnChip(50, 256, 2048, 1, 4, fits), "(50,2048,256,256) by scan (256 tiles at least)");
  Check(RunsOnChip(50, 700, 300, 1, 4, fits) && RunsOnChip(50, 64, 3000, 1, 4, fits),
        "(50,300,700,700) and (50,3000,64,64) by the grid kernels");
  Check(ChoosePath(1000, 128, 8, 1, 4, kTypicalDevice, fits) == CudaPath::kBlocks &&
            ChoosePath(50, 256, 1024, 1, 4, kTypicalDevice, fits) == CudaPath::kBlocks,
        "the block kernels where they run, grid or not");
  Check(ChoosePath(65536, 256, 128, 1, 4, kTypicalDevice, fits) == CudaPath::kDecomposition,
        "T*N*H = 2^31 by scan, grid or not");
  // By default: from kGridPaysRows (96) rows where R is too large for the block kernels.
  Check(RunsOnChip(100, 1024, 256, 1, 4) && RunsOnChip(100, 1024, 96, 1, 4) &&
            RunsOnChip(50, 700, 300, 2, 4),
        "(100,256,1024,1024), (100,96,1024,1024), (50,300,700,700 bi) by the grid kernels");
  Check(!RunsOnChip(100, 1024, 95, 1, 4) && !RunsOnChip(50, 1024, 32, 1, 4),
        "(100,95,1024,1024) and (50,32,1024,1024) by scan (fewer than 96 rows)");
  Check(!RunsOnChip(50, 64, 3000, 1, 4), "(50,3000,64,64) by scan (R fits the block kernels)");
  Check(!RunsOnChip(100, 1024, 256, 1, 4, never) && !RunsOnChip(50, 1024, 32, 1, 4, never),
        "SGRNN_CUDA_GRID=0: the grid kernels never");
  // SGRNN_CUDA_GRID's values: any but these is an error, not the default.
  Check(ParseGridUse("") == GridUse::kWherePaid && ParseGridUse("0") == never &&
            ParseGridUse("1") == fits,
        "SGRNN_CUDA_GRID unset or empty, 0, 1");
  for (const char* value : {"2", "yes", "true", " 1", "1 ", "01", "-1"}) {
    Check(!ParseGridUse(value), std::string("SGRNN_CUDA_GRID=") + value + " refused");
  }
  // A GPU smaller than the typical one (the lowering asks with the visible GPUs' limits).
  const DeviceLimits pcie{114, 227 * 1024}, little_shared{132, 1024};
  Check(!RunsOnChip(100, 1024, 256, 1, 4, fits, pcie),
        "(100,256,1024,1024) by scan on 114 SMs (its tiles need 128)");
  Check(RunsOnChip(100, 1024, 100, 1, 4, fits, pcie),
        "(100,100,1024,1024) by the grid kernels on 114 SMs (2 x 32 tiles of 64 x 32)");
  Check(!RunsOnChip(200, 512, 64, 1, 4, never, little_shared) &&
            RunsOnChip(200, 512, 64, 1, 4, never, kTypicalDevice),
        "(200,64,512,512) by scan where a row does not fit a block's shared memory");
}

}  // namespace

int main() {
  BlockShapesCoverEveryUnit();
  OnChipLimits();
  PlansCoverTheBatch();
  SmallBlocksShareAnSM();
  PreferenceFollowsRowsPerMultiprocessor();
  return unit_test::Report();
}
