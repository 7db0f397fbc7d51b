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

constexpr Pass kPasses[] = {Pass::kForward, Pass::kBackward};

std::string Named(Pass pass) { return pass == Pass::kForward ? " forward" : " backward"; }

// Every block shape covers all H units, with each unit's slices summing over all of R's row
// and at least one slice per unit of a tile, whole warps, and within the kernels' limits. Both
// passes fit at the same sizes (one lowering decision covers both), and a backward block is
// wide only where its slices pad R's rows no more than a narrow block's would.
void BlockShapesCoverEveryUnit() {
  constexpr int64_t tile = kUnitsPerThread;
  for (int64_t bytes : {4, 8}) {
    for (int64_t H = 1; H <= 1100; ++H) {
      Check(BlockShape(H, bytes, Pass::kForward).has_value() ==
                BlockShape(H, bytes, Pass::kBackward).has_value(),
            Case(H, bytes) + ": both passes fit, or neither");
      for (Pass pass : kPasses) {
        const std::optional<RecurrencePlan> p = BlockShape(H, bytes, pass);
        const std::string what = Case(H, bytes) + Named(pass);
        if (!p) continue;
        const int64_t narrow_slice = SliceLength(bytes, false);
        Check(pass == Pass::kForward || !p->wide ||
                  p->slices * p->slice <= SlicesFor(H, narrow_slice) * narrow_slice,
              what + ": a wide backward block pads no more than a narrow one");
        Check(p->slice == SliceLength(bytes, p->wide), what + ": slice");
        Check(p->slice * tile * bytes == 256 * (p->wide ? 2 : 1), what + ": bytes of R per thread");
        Check(!p->wide || (p->cluster == 1 && p->units == H && p->slices <= 2 * tile),
              what + ": a wide block holds every unit");
        Check(p->slices * p->slice >= H && p->slices >= tile &&
                  (p->slices == tile || (p->slices / 2) * p->slice < H),
              what + ": fewest slices covering a row, at least one per unit of a tile");
        Check(p->slices <= 32 && (p->slices & (p->slices - 1)) == 0, what + ": slices");
        const int64_t fixed = FixedSlices(bytes, p->wide);
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
}

// Which sizes stay on chip: float32 to 512, none beyond.
void OnChipLimits() {
  const auto forward = [](int64_t H) { return BlockShape(H, 4, Pass::kForward); };
  for (int64_t H : {1, 64, 128, 256, 512}) Check(forward(H).has_value(), Case(H, 4) + " fits");
  Check(!forward(513), "H=513 does not fit");
  Check(!forward(1024) && !forward(0), "H=1024 and H=0 do not fit");
  Check(forward(128)->cluster == 1, "H=128: one block");
  Check(forward(128)->wide && forward(128)->slices == 4 && forward(128)->threads == 128,
        "H=128 forward: a wide block, four threads per tile of four units");
  const auto backward = [](int64_t H) { return BlockShape(H, 4, Pass::kBackward); };
  Check(backward(128)->wide && backward(128)->slices == 4 && backward(100)->wide,
        "H=128 and H=100 backward: a wide block");
  Check(forward(64)->wide && !backward(64)->wide && backward(64)->slices == 4,
        "H=64: the forward's block is wide, the backward's narrow (a wide one pads half)");
  Check(!forward(129)->wide, "H=129: not wide");
  Check(FixedSlices(4, true) == 4 && FixedSlices(8, true) == 0 && FixedSlices(4, false) == 0,
        "fixed slices: wide float32 blocks only");
  Check(forward(256)->cluster == 2, "H=256: clusters of 2");
  Check(forward(512)->cluster == 8, "H=512: clusters of 8");
}

// Plans give every row to exactly one cluster, fill the device in one wave where shared memory
// allows, and never ask for more shared memory than the device has.
void PlansCoverTheBatch() {
  for (int64_t N : {1, 7, 8, 33, 132, 1000, 100000}) {
    for (int64_t H : {5, 128, 256, 512}) {
      for (auto [D, pass] : {std::pair{1, Pass::kForward}, std::pair{2, Pass::kForward},
                             std::pair{1, Pass::kBackward}, std::pair{2, Pass::kBackward}}) {
        const std::string what = Case(H, 4) + Named(pass) + " N=" + std::to_string(N) +
                                 " D=" + std::to_string(D);
        const std::optional<RecurrencePlan> p = PlanRecurrence(pass, H, N, D, 4, 132, 227 * 1024);
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
  for (Pass pass : kPasses) {
    Check(!PlanRecurrence(pass, 64, 4, 1, 4, 132, 16).has_value(), "no room for one row");
  }
}

// Small blocks share an SM (as many as their threads and registers allow), each with fewer
// rows; blocks of the largest shapes have an SM each.
void SmallBlocksShareAnSM() {
  const auto plan = [](Pass pass, int64_t H, int64_t N, int64_t D) {
    return *PlanRecurrence(pass, H, N, D, 4, 132, 227 * 1024);
  };
  Check(ResidentBlocks(plan(Pass::kForward, 64, 1, 1)) == 4, "H=64 forward: 4 wide blocks an SM");
  Check(ResidentBlocks(plan(Pass::kBackward, 64, 1, 1)) == 8, "H=64 backward: 8 blocks an SM");
  Check(ResidentBlocks(plan(Pass::kForward, 128, 1, 1)) == 2, "H=128 forward: 2 blocks an SM");
  for (int64_t H : {256, 512}) {
    for (Pass pass : kPasses) {
      Check(ResidentBlocks(plan(pass, H, 1, 1)) == 1, Case(H, 4) + Named(pass) + ": an SM each");
    }
  }
  const RecurrencePlan forward = plan(Pass::kForward, 64, 1024, 2);
  Check(forward.rows == 4 && forward.clusters == 256, "(N=1024, H=64, bi) forward: 4 rows a block");
  const RecurrencePlan backward = plan(Pass::kBackward, 64, 1024, 2);
  Check(backward.rows == 2 && backward.clusters == 512, "... backward: 2 rows a block");
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
