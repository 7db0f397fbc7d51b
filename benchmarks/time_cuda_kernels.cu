// Times the CUDA recurrence kernels alone (csrc/cuda/recurrence.cu; and grid_recurrence.cu's
// wherever PlanGrid fits, each launch zeroing its workspace first), without JAX: for A/B runs
// of kernel variants, where a build of the whole package per variant would cost minutes of
// GPU time. Float32, tanh, with h0, no mask; each shape runs the forward and the backward
// recurrence (dz and dh0; dR is XLA's product after it), timed with CUDA events: the median
// of 30 runs after 5 warm-up runs, printed in microseconds a call and a step; then again with
// the GPU left idle for 1 ms before each run ("waited"), as a caller that waits for each call
// leaves it, to tell the kernel's cost after idle from the host's share; then with L2 emptied
// before each run ("cold": a memset of a buffer five times L2's size), as in a training step,
// whose other work evicts the operands a kernel reads from what it last wrote. Also the host's
// time to do what the forward's FFI handler does before returning (query the device, plan,
// enqueue the launch), per call over 100 calls.
//
//   nvcc -std=c++20 -O3 -arch=sm_90 --expt-relaxed-constexpr -Icsrc \
//     benchmarks/time_cuda_kernels.cu csrc/cuda/recurrence.cu csrc/cuda/grid_recurrence.cu \
//     -o time_cuda_kernels
//   ./time_cuda_kernels 1000,8,128 100,32,256 200,64,512     # T,N,H per shape
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "cuda_timing.h"
#include "cuda/recurrence.h"
#include "cuda/recurrence_plan.h"

namespace {

using namespace sgrnn;
using namespace sgrnn::cuda;

float* DeviceRandom(size_t n, std::mt19937& rng, float scale) {
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> host(n);
  for (float& v : host) v = normal(rng);
  float* device = nullptr;
  CHECK(cudaMalloc(&device, std::max<size_t>(1, n) * sizeof(float)));
  CHECK(cudaMemcpy(device, host.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  return device;
}

constexpr std::chrono::milliseconds kIdle{1};

void TimeShape(int64_t T, int64_t N, int64_t H, std::mt19937& rng, const L2Flush& flush) {
  const int64_t D = 1, state = T * N * H;
  const Config c{Activation::kTanh, false, false, true, false, false, true, false, false};
  const Dims d{T, N, H, H, D};
  int device = 0, sms = 0, shared = 0;
  CHECK(cudaGetDevice(&device));
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  CHECK(cudaDeviceGetAttribute(&shared, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  const auto plan = PlanRecurrence(H, N, D, sizeof(float), sms, shared);

  float* source = DeviceRandom(state, rng, 1.0f);
  float* R = DeviceRandom(H * H, rng, 1.0f / std::sqrt(static_cast<float>(H)));
  float* h0 = DeviceRandom(N * H, rng, 1.0f);
  float* dy = DeviceRandom(state, rng, 1.0f);
  float *y, *z, *dz, *dh0;
  CHECK(cudaMalloc(&y, state * sizeof(float)));
  CHECK(cudaMalloc(&z, state * sizeof(float)));
  CHECK(cudaMalloc(&dz, state * sizeof(float)));
  CHECK(cudaMalloc(&dh0, N * H * sizeof(float)));

  std::printf("T=%lld N=%lld H=%lld", static_cast<long long>(T), static_cast<long long>(N),
              static_cast<long long>(H));
  if (plan) {
    const ForwardArgs<float> fa{source, R, h0, MaskView<float>(), nullptr, y, z};
    const auto launch = [&] { return LaunchForward<float>(c, d, *plan, fa, nullptr); };
    const double us = MedianMicroseconds(launch);
    const double waited_us = MedianMicroseconds(launch, kIdle);
    const double cold_us = MedianMicroseconds(launch, {}, &flush);
    std::printf("  forward %8.1f us, waited %8.1f, cold %8.1f (%.3f us/step; cluster %lld, "
                "rows %lld, %s)",
                us, waited_us, cold_us, us / T,
                static_cast<long long>(plan->cluster), static_cast<long long>(plan->rows),
                plan->wide ? "wide" : "narrow");
    const auto host_start = std::chrono::steady_clock::now();
    for (int i = 0; i < 100; ++i) {
      CHECK(cudaGetDevice(&device));
      CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
      CHECK(cudaDeviceGetAttribute(&shared, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
      const auto planned = PlanRecurrence(H, N, D, sizeof(float), sms, shared);
      CHECK(LaunchForward<float>(c, d, *planned, fa, nullptr));
    }
    const double host_us = std::chrono::duration<double, std::micro>(
                               std::chrono::steady_clock::now() - host_start).count() / 100;
    CHECK(cudaDeviceSynchronize());
    std::printf(" host %.1f us", host_us);
    const GradientArgs<float> ga{R, dy, z, MaskView<float>(), nullptr, dz, dh0};
    const auto gradients = [&] { return LaunchGradients<float>(c, d, *plan, ga, nullptr); };
    std::printf("  gradients %8.1f us, waited %8.1f, cold %8.1f",
                MedianMicroseconds(gradients), MedianMicroseconds(gradients, kIdle),
                MedianMicroseconds(gradients, {}, &flush));
  }
  std::printf("\n");
  if (const auto grid = PlanGrid(H, N, sizeof(float), sms, shared)) {
    void* workspace = nullptr;
    CHECK(cudaMalloc(&workspace, grid->WorkspaceBytes(D)));
    const ForwardArgs<float> fa{source, R, h0, MaskView<float>(), nullptr, y, z};
    const auto forward = [&] { return LaunchGridForward(c, d, *grid, fa, workspace, nullptr); };
    std::printf("  grid (%lld x %lld tiles of %lld x %lld):", static_cast<long long>(grid->row_tiles),
                static_cast<long long>(grid->unit_tiles), static_cast<long long>(grid->tile.rows),
                static_cast<long long>(grid->tile.units));
    const double us = MedianMicroseconds(forward);
    std::printf("  forward %8.1f us, waited %8.1f, cold %8.1f (%.3f us/step)", us,
                MedianMicroseconds(forward, kIdle), MedianMicroseconds(forward, {}, &flush),
                us / T);
    const GradientArgs<float> ga{R, dy, z, MaskView<float>(), nullptr, dz, dh0};
    const auto gradients = [&] {
      return LaunchGridGradients(c, d, *grid, ga, workspace, nullptr);
    };
    std::printf("  gradients %8.1f us, waited %8.1f, cold %8.1f\n",
                MedianMicroseconds(gradients), MedianMicroseconds(gradients, kIdle),
                MedianMicroseconds(gradients, {}, &flush));
    CHECK(cudaFree(workspace));
  }
  for (float* p : {source, R, h0, dy, y, z, dz, dh0}) CHECK(cudaFree(p));
}

}  // namespace

int main(int argc, char** argv) {
  std::mt19937 rng(11);
  const L2Flush flush;
  for (int i = 1; i < argc; ++i) {
    long long T = 0, N = 0, H = 0;
    if (std::sscanf(argv[i], "%lld,%lld,%lld", &T, &N, &H) != 3) {
      std::fprintf(stderr, "shape %s: expected T,N,H\n", argv[i]);
      return 2;
    }
    TimeShape(T, N, H, rng, flush);
  }
  return 0;
}
