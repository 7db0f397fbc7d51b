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

std::string Case(int64_t H, int64_t bytes, bool gradients) {
  return "H=" + std::to_string(H) + " bytes=" + std::to_string(bytes) +
         (gradients ? " gradients" : " forward");
}

// Every block shape covers all H units, with each unit's slices summing over all of R's row
// and at least one slice per unit of a tile, whole warps, and within the kernels' limits.
void BlockShapesCoverEveryUnit() {
  for (int64_t bytes : {4, 8}) {
    for (bool gradients : {false, true}) {
      for (int64_t H = 1; H <= 1100; ++H) {
        const std::optional<RecurrencePlan> p = BlockShape(H, bytes, gradients);
        const std::string what = Case(H, bytes, gradients);
        if (!p) continue;
        Check(p->slice == SliceLength(bytes, gradients, p->wide), what + ": slice");
        Check(p->tile == UnitsPerThread(gradients), what + ": tile");
        Check(p->slice * p->tile * bytes == (gradients ? 128 : 256) * (p->wide ? 2 : 1),
              what + ": bytes of R per thread");
        Check(!p->wide || (p->cluster == 1 && p->units == H && p->slices <= 2 * p->tile),
              what + ": a wide block holds every unit");
        Check(p->slices * p->slice >= H && p->slices >= p->tile &&
                  (p->slices == p->tile || (p->slices / 2) * p->slice < H),
              what + ": fewest slices covering a row, at least one per unit of a tile");
        Check(p->slices <= 32 && (p->slices & (p->slices - 1)) == 0, what + ": slices");
        Check(p->cluster >= 1 && p->cluster <= kMaxCluster, what + ": cluster size");
        Check(p->units * p->cluster >= H && (p->units - 1) * p->cluster < H, what + ": units");
        const int64_t tiles = (p->units + p->tile - 1) / p->tile;
        Check(p->threads % 32 == 0 && p->threads >= tiles * p->slices &&
                  p->threads <= (p->wide ? kWideThreads : kMaxThreads),
              what + ": threads");
        Check(p->threads - tiles * p->slices < 32, what + ": at most one partial warp");
      }
    }
  }
}

// Which sizes stay on chip: float32 forward to 512, gradients to 256; none beyond.
void OnChipLimits() {
  for (int64_t H : {1, 64, 128, 256, 512}) Check(BlockShape(H, 4, false).has_value(),
                                                 Case(H, 4, false) + " fits");
  Check(!BlockShape(513, 4, false), "H=513 forward does not fit");
  Check(BlockShape(256, 4, true).has_value(), "H=256 gradients fit");
  Check(!BlockShape(257, 4, true), "H=257 gradients do not fit");
  Check(!BlockShape(1024, 4, false) && !BlockShape(0, 4, false), "H=1024 and H=0 do not fit");
  Check(BlockShape(128, 4, false)->cluster == 1, "H=128 forward: one block");
  Check(BlockShape(128, 4, false)->wide && BlockShape(128, 4, false)->slices == 4 &&
            BlockShape(128, 4, false)->threads == 128,
        "H=128 forward: a wide block, four threads per tile of four units");
  Check(BlockShape(128, 4, true)->wide && BlockShape(128, 4, true)->slices == 2 &&
            BlockShape(128, 4, true)->threads == 256,
        "H=128 gradients: a wide block, two threads per unit");
  Check(!BlockShape(129, 4, false)->wide && !BlockShape(129, 4, true)->wide,
        "H=129: not wide");
  Check(BlockShape(256, 4, false)->cluster == 2, "H=256 forward: clusters of 2");
  Check(BlockShape(256, 4, true)->cluster == 4, "H=256 gradients: clusters of 4");
  Check(BlockShape(512, 4, false)->cluster == 8, "H=512 forward: clusters of 8");
}

// Plans give every row to exactly one cluster, fill the device in one wave where shared memory
// allows, and never ask for more shared memory than the device has.
void PlansCoverTheBatch() {
  for (int64_t N : {1, 7, 8, 33, 132, 1000, 100000}) {
    for (int64_t H : {5, 128, 256}) {
      for (int64_t D : {1, 2}) {
        for (bool gradients : {false, true}) {
          const std::string what = Case(H, 4, gradients) + " N=" + std::to_string(N) +
                                   " D=" + std::to_string(D);
          const std::optional<RecurrencePlan> p =
              PlanRecurrence(H, N, D, 4, gradients, 132, 227 * 1024);
          Check(p.has_value(), what + ": planned");
          if (!p) continue;
          Check(p->rows >= 1 && p->clusters * p->rows >= N && (p->clusters - 1) * p->rows < N,
                what + ": rows split");
          Check(p->shared_bytes <= 227 * 1024, what + ": shared memory");
          Check(p->shared_bytes >= 2 * p->ExchangeElements(4) * 4, what + ": two buffers");
          Check(p->shared_bytes == kSignalBytes + p->rows * SharedBytesPerRow(*p, 4, gradients),
                what + ": the mbarriers and the rows' memory");
          const bool one_wave = p->clusters * p->cluster * D <= 132;
          const bool memory_bound = p->shared_bytes + p->shared_bytes / p->rows > 227 * 1024;
          Check(one_wave || memory_bound, what + ": one wave unless shared memory limits");
        }
      }
    }
  }
  Check(!PlanRecurrence(64, 4, 1, 4, false, 132, 16).has_value(), "no room for one row");
}

void PreferenceFollowsRowsPerCluster() {
  Check(PreferOnChip(1000, 128, 8, 1, 4, false), "(1000,8,128,128) forward on chip");
  Check(PreferOnChip(100, 256, 32, 1, 4, true), "(100,32,256,256) gradients on chip");
  Check(!PreferOnChip(50, 256, 1024, 1, 4, true), "(50,1024,256,256) gradients by scan");
  Check(PreferOnChip(50, 256, 1024, 1, 4, false), "(50,1024,256,256) forward on chip");
  Check(!PreferOnChip(50, 256, 2048, 1, 4, false), "(50,2048,256,256) forward by scan");
  Check(PreferOnChip(200, 512, 64, 1, 4, false), "(200,64,512,512) forward on chip");
  Check(!PreferOnChip(200, 512, 64, 1, 4, true), "H=512 gradients by scan");
  Check(!PreferOnChip(100, 1024, 1, 1, 4, false), "H=1024 by scan");
  // 32-bit element indices: T*N*D*H up to 2^31 - 1.
  Check(PreferOnChip(65535, 256, 128, 1, 4, false), "T*N*H = 2^31 - 2^17 on chip");
  Check(!PreferOnChip(65536, 256, 128, 1, 4, false), "T*N*H = 2^31 by scan");
  Check(!PreferOnChip(32768, 256, 128, 2, 4, true), "T*N*D*H = 2^31 (bidirectional) by scan");
}

}  // namespace

int main() {
  BlockShapesCoverEveryUnit();
  OnChipLimits();
  PlansCoverTheBatch();
  PreferenceFollowsRowsPerCluster();
  return unit_test::Report();
}
