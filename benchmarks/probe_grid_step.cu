// The floor of one step of the grid kernels (csrc/cuda/grid_steps.h, which spread each step
// over the whole GPU) at (100,256,1024,1024), part by part: the kernels' own step loop, launched
// as the handler launches it (grid_launch.cuh), on machines that leave parts of a step out:
//   products  the FMAs from shared memory over stale chunks: no chunk copies, no hand-over
//   + loads   the chunks copied from L2 too; no hand-over (each block reads whatever the state
//             buffer holds)
//   whole     the step as the handler runs it; y checked against a double-precision loop on
//             the host for rows of every row tile
// Every mode runs the step's end (the sum over parts, the source, tanh, the stores). Each tile
// shape the plan knows (recurrence_plan.h, kGridTiles) whose blocks fit the device runs, with
// the products on the FMA lanes (the handler's) and on the tensor cores (3xTF32,
// GridTile<BM, BN, true>).
// Forward, tanh, float32, h0, no mask, lengths or z. Time: CUDA events (cuda_timing.h), the
// median of 30 launches after 5, each zeroing its workspace first; us a step = / T.
//
//   nvcc -std=c++20 -O3 -arch=sm_90 --expt-relaxed-constexpr -Icsrc \
//     benchmarks/probe_grid_step.cu -o probe_grid_step && ./probe_grid_step
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "cuda/grid_launch.cuh"
#include "cuda_timing.h"

namespace {

using namespace sgrnn;
using namespace sgrnn::cuda;

constexpr int kSteps = 100, kRows = 256, kHidden = 1024;

// The step without the hand-over: blocks do not wait for each other.
struct NoHandOver : GpuMachine {
  static __device__ void Arrive(uint32_t*) {}
  static __device__ void WaitFor(uint32_t*, uint32_t) {}
};
// ... and without the chunk copies.
struct ProductsOnly : NoHandOver {
  static __device__ void CopyAsync16(float*, const float*) {}
};

struct Problem {
  std::vector<float> R, source, h0;
  float *R_device, *source_device, *h0_device, *y_device;
};

// The largest difference between the kernel's y of row n and a double-precision loop.
double RowError(const Problem& p, const std::vector<float>& y, int n) {
  std::vector<double> h(p.h0.begin() + n * kHidden, p.h0.begin() + (n + 1) * kHidden);
  std::vector<double> next(kHidden);
  double worst = 0;
  for (int t = 0; t < kSteps; ++t) {
    for (int j = 0; j < kHidden; ++j) {
      double z = p.source[(static_cast<size_t>(t) * kRows + n) * kHidden + j];
      for (int k = 0; k < kHidden; ++k) z += h[k] * p.R[static_cast<size_t>(j) * kHidden + k];
      next[j] = std::tanh(z);
      const double got = y[(static_cast<size_t>(t) * kRows + n) * kHidden + j];
      worst = std::max(worst, std::abs(got - next[j]));
    }
    h.swap(next);
  }
  return worst;
}

template <typename Tile, typename Machine>
void Time(const Problem& p, const GridPlan& plan, void* workspace, const char* parts,
          bool check) {
  const Config c{Activation::kTanh, false, false, false, false, false, true, false, false};
  const Dims d{kSteps, kRows, kHidden, kHidden, 1};
  const ForwardArgs<float> args{p.source_device, p.R_device, p.h0_device, MaskView<float>(),
                                nullptr, p.y_device, nullptr};
  const double us = MedianMicroseconds([&] {
    return LaunchDirections(GridForwardKernel<Activation::kTanh, Tile, Machine>, c, d, plan,
                            args, workspace, nullptr);
  });
  std::printf("| %lld x %lld | %s | %lld | %lld | %s | %.1f | %.2f |",
              static_cast<long long>(plan.tile.rows), static_cast<long long>(plan.tile.units),
              Tile::kTensorCores ? "tensor cores" : "FMA lanes",
              static_cast<long long>(plan.blocks()),
              static_cast<long long>(plan.shared_bytes / 1024), parts, us, us / kSteps);
  if (check) {
    std::vector<float> y(static_cast<size_t>(kSteps) * kRows * kHidden);
    CHECK(cudaMemcpy(y.data(), p.y_device, y.size() * sizeof(float), cudaMemcpyDeviceToHost));
    double worst = 0;
    for (int n : {0, 1, 63, 64, 127, 130, 191, 200, 255}) {
      worst = std::max(worst, RowError(p, y, n));
    }
    std::printf(" %.1e %s |\n", worst, worst < 1e-4 ? "ok" : "WRONG");
  } else {
    std::printf(" - |\n");
  }
}

float* Upload(const std::vector<float>& host) {
  float* device = nullptr;
  CHECK(cudaMalloc(&device, host.size() * sizeof(float)));
  CHECK(cudaMemcpy(device, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice));
  return device;
}

}  // namespace

int main() {
  int device = 0, clock_khz = 0, sms = 0, shared = 0;
  cudaDeviceProp prop;
  CHECK(cudaGetDevice(&device));
  CHECK(cudaGetDeviceProperties(&prop, device));
  CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, device));
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  CHECK(cudaDeviceGetAttribute(&shared, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  std::printf("%s, %d SMs, %.0f MHz; T = %d, N = %d, H = %d, float32, tanh\n\n", prop.name, sms,
              clock_khz / 1000.0, kSteps, kRows, kHidden);
  std::mt19937 rng(1);
  // R's spectral radius near 0.5: the state neither vanishes nor saturates over the steps.
  std::normal_distribution<float> weight(0.0f, 0.5f / std::sqrt(static_cast<float>(kHidden)));
  std::normal_distribution<float> unit(0.0f, 1.0f);
  Problem p;
  p.R.resize(static_cast<size_t>(kHidden) * kHidden);
  p.source.resize(static_cast<size_t>(kSteps) * kRows * kHidden);
  p.h0.resize(static_cast<size_t>(kRows) * kHidden);
  for (float& v : p.R) v = weight(rng);
  for (float& v : p.source) v = unit(rng);
  for (float& v : p.h0) v = 0.5f * unit(rng);
  p.R_device = Upload(p.R);
  p.source_device = Upload(p.source);
  p.h0_device = Upload(p.h0);
  CHECK(cudaMalloc(&p.y_device, p.source.size() * sizeof(float)));
  // The step's products: N H^2 FMAs over all SMs' 128 float32 lanes, at this clock.
  const double floor_us = 1e3 * kRows * kHidden * kHidden / (128.0 * sms * clock_khz);
  std::printf("products' floor (all SMs' float32 FMA lanes): %.2f us a step\n\n", floor_us);
  std::printf("| tile | products on | blocks | shared KB | parts | us | us/step | max error |\n"
              "|---|---|---:|---:|---|---:|---:|---|\n");
  for (const GridTileShape& tile : kGridTiles) {
    const GridPlan plan = GridPlanOf(kHidden, kRows, tile);
    if (plan.blocks() > sms || plan.shared_bytes > shared) continue;
    void* workspace = nullptr;
    CHECK(cudaMalloc(&workspace, plan.WorkspaceBytes(1)));
    const auto time_parts = [&]<typename Tile>() {
      Time<Tile, ProductsOnly>(p, plan, workspace, "products", false);
      Time<Tile, NoHandOver>(p, plan, workspace, "+ loads", false);
      Time<Tile, GpuMachine>(p, plan, workspace, "whole", true);
    };
    DispatchGridTile(tile, time_parts);
    DispatchGridTile<true>(tile, time_parts);
    CHECK(cudaFree(workspace));
  }
  for (float* q : {p.R_device, p.source_device, p.h0_device, p.y_device}) CHECK(cudaFree(q));
  return 0;
}
