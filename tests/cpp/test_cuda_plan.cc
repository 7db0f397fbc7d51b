// Unit test of csrc/cuda/recurrence_plan.h, the CUDA handler's split of a problem over the GPU,
// on any machine. Built and run by tests/test_cuda_plan.py; prints each failed check and exits
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
// and at least one slice per unit of a tile, whole warps, and within the kernels' limits.
void BlockShapesCoverEveryUnit() {
  constexpr int64_t tile = kUnitsPerThread;
  for (int64_t bytes : {4, 8}) {
    for (int64_t H = 1; H <= 1100; ++H) {
      const std::optional<RecurrencePlan> p = BlockShape(H, bytes);
      const std::string what = Case(H, bytes);
      if (!p) continue;
      Check(p->slice == SliceLength(bytes, p->wide), what + ": slice");
      Check(p->slice * tile * bytes == 256 * (p->wide ? 2 : 1), what + ": bytes of R per thread");
      Check(!p->wide || (p->cluster == 1 && p->units == H && p->slices <= 2 * tile),
            what + ": a wide block holds every unit");
      Check(p->slices * p->slice >= H && p->slices >= tile &&
                (p->slices == tile || (p->slices / 2) * p->slice < H),
            what + ": fewest slices covering a row, at least one per unit of a tile");
      Check(p->slices <= 32 && (p->slices & (p->slices - 1)) == 0, what + ": slices");
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
  for (int64_t H : {1, 64, 128, 256, 512}) {
    Check(BlockShape(H, 4).has_value(), Case(H, 4) + " fits");
  }
  Check(!BlockShape(513, 4), "H=513 does not fit");
  Check(!BlockShape(1024, 4) && !BlockShape(0, 4), "H=1024 and H=0 do not fit");
  Check(BlockShape(128, 4)->cluster == 1, "H=128: one block");
  Check(BlockShape(128, 4)->wide && BlockShape(128, 4)->slices == 4 &&
            BlockShape(128, 4)->threads == 128,
        "H=128: a wide block, four threads per tile of four units");
  Check(!BlockShape(129, 4)->wide, "H=129: not wide");
  Check(BlockShape(256, 4)->cluster == 2, "H=256: clusters of 2");
  Check(BlockShape(512, 4)->cluster == 8, "H=512: clusters of 8");
}

// Plans give every row to exactly one cluster, fill the device in one wave where shared memory
// allows, and never ask for more shared memory than the device has.
void PlansCoverTheBatch() {
  for (int64_t N : {1, 7, 8, 33, 132, 1000, 100000}) {
    for (int64_t H : {5, 128, 256, 512}) {
      for (int64_t D : {1, 2}) {
        const std::string what = Case(H, 4) + " N=" + std::to_string(N) + " D=" +
                                 std::to_string(D);
        const std::optional<RecurrencePlan> p = PlanRecurrence(H, N, D, 4, 132, 227 * 1024);
        Check(p.has_value(), what + ": planned");
        if (!p) continue;
        Check(p->rows >= 1 && p->clusters * p->rows >= N && (p->clusters - 1) * p->rows < N,
              what + ": rows split");
        Check(p->shared_bytes <= 227 * 1024, what + ": shared memory");
        Check(p->shared_bytes >= 2 * p->ExchangeElements(4) * 4, what + ": two buffers");
        Check(p->shared_bytes == kSignalBytes + p->rows * SharedBytesPerRow(*p, 4),
              what + ": the mbarriers and the rows' memory");
        const bool one_wave = p->clusters * p->cluster * D <= 132;
        const bool memory_bound = p->shared_bytes + p->shared_bytes / p->rows > 227 * 1024;
        Check(one_wave || memory_bound, what + ": one wave unless shared memory limits");
      }
    }
  }
  Check(!PlanRecurrence(64, 4, 1, 4, 132, 16).has_value(), "no room for one row");
}

void PreferenceFollowsRowsPerCluster() {
  Check(PreferOnChip(1000, 128, 8, 1, 4), "(1000,8,128,128) on chip");
  Check(PreferOnChip(100, 256, 32, 1, 4), "(100,32,256,256) on chip");
  Check(PreferOnChip(50, 256, 1024, 1, 4), "(50,1024,256,256) on chip (16 rows per cluster)");
  Check(!PreferOnChip(50, 256, 2048, 1, 4), "(50,2048,256,256) by scan");
  Check(PreferOnChip(200, 512, 64, 1, 4), "(200,64,512,512) on chip");
  Check(!PreferOnChip(100, 1024, 1, 1, 4), "H=1024 by scan");
  // 32-bit element indices: T*N*D*H up to 2^31 - 1.
  Check(PreferOnChip(65535, 256, 128, 1, 4), "T*N*H = 2^31 - 2^17 on chip");
  Check(!PreferOnChip(65536, 256, 128, 1, 4), "T*N*H = 2^31 by scan");
  Check(!PreferOnChip(32768, 256, 128, 2, 4), "T*N*D*H = 2^31 (bidirectional) by scan");
}

}  // namespace

int main() {
  BlockShapesCoverEveryUnit();
  OnChipLimits();
  PlansCoverTheBatch();
  PreferenceFollowsRowsPerCluster();
  return unit_test::Report();
}
