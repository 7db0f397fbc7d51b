// The two arithmetic rates that bound a float32 step's products on an SM: float32 FMAs (the
// FMA lanes, what the kernels use) and tf32 tensor-core products (mma.sync m16n8k8, what a
// float32 product split into three tf32 ones, "3xTF32", would use). Every warp runs
// independent chains of one instruction, so that neither latency nor memory limits it; one
// block an SM, at 128, 256 and 512 threads. Products a clock an SM at the device's nominal
// clock, from CUDA events (cuda_timing.h's CHECK); the chains' results are kept live and
// otherwise unused.
//
//   nvcc -std=c++20 -O3 -arch=sm_90 -Ibenchmarks benchmarks/probe_arith_rate.cu \
//     -o probe_arith_rate && ./probe_arith_rate
#include <cuda_runtime.h>

#include <cstdio>

#include "cuda_timing.h"

namespace {

constexpr int kMmaChains = 8, kFmaChains = 16, kIterations = 20000;

// Stores the sum only where it cannot be 12345 (never, in practice): the work stays live.
__device__ void Keep(float sum, float* out) {
  if (sum == 12345.0f) out[threadIdx.x] = sum;
}

__global__ void MmaChains(float* out, int iterations, float seed) {
  float d[kMmaChains][4] = {};
  const unsigned a = __float_as_uint(seed + threadIdx.x), b = __float_as_uint(2.0f * seed);
  for (int it = 0; it < iterations; ++it) {
#pragma unroll
    for (int c = 0; c < kMmaChains; ++c) {
      asm volatile(
          "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, "
          "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
          : "+f"(d[c][0]), "+f"(d[c][1]), "+f"(d[c][2]), "+f"(d[c][3])
          : "r"(a), "r"(b), "r"(a), "r"(b), "r"(a), "r"(b));
    }
  }
  float sum = 0.0f;
  for (int c = 0; c < kMmaChains; ++c) sum += d[c][0] + d[c][1] + d[c][2] + d[c][3];
  Keep(sum, out);
}

__global__ void FmaChains(float* out, int iterations, float seed) {
  float d[kFmaChains];
  for (int c = 0; c < kFmaChains; ++c) d[c] = threadIdx.x + c;
  const float x = seed, y = 0.5f * seed;
  for (int it = 0; it < iterations; ++it) {
#pragma unroll
    for (int c = 0; c < kFmaChains; ++c) d[c] = fmaf(d[c], x, y);
  }
  float sum = 0.0f;
  for (int c = 0; c < kFmaChains; ++c) sum += d[c];
  Keep(sum, out);
}

}  // namespace

int main() {
  int device = 0, sms = 0, clock_khz = 0;
  cudaDeviceProp prop;
  CHECK(cudaGetDevice(&device));
  CHECK(cudaGetDeviceProperties(&prop, device));
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, device));
  std::printf("%s, %d SMs, %.0f MHz (nominal; the rates below are at this clock)\n\n", prop.name,
              sms, clock_khz / 1000.0);
  float* out = nullptr;
  CHECK(cudaMalloc(&out, 512 * sizeof(float)));
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  // Clocks one launch of `kernel` takes, after a short untimed one.
  const auto clocks = [&](void (*kernel)(float*, int, float), int threads) {
    kernel<<<sms, threads>>>(out, 10, 1.0f);
    CHECK(cudaEventRecord(start));
    kernel<<<sms, threads>>>(out, kIterations, 1.0f);
    CHECK(cudaEventRecord(stop));
    CHECK(cudaEventSynchronize(stop));
    CHECK(cudaGetLastError());
    float ms = 0.0f;
    CHECK(cudaEventElapsedTime(&ms, start, stop));
    return static_cast<double>(ms) * clock_khz;
  };
  std::printf("| threads an SM | FMA lanes: FMAs/clock/SM | tf32 mma.sync: MACs/clock/SM | "
              "3xTF32: float32 MACs/clock/SM |\n|---:|---:|---:|---:|\n");
  for (int threads : {128, 256, 512}) {
    const double fmas = static_cast<double>(threads) * kIterations * kFmaChains;
    const double macs = static_cast<double>(threads / 32) * kIterations * kMmaChains * 16 * 8 * 8;
    const double fma_rate = fmas / clocks(FmaChains, threads);
    const double mma_rate = macs / clocks(MmaChains, threads);
    std::printf("| %d | %.0f | %.0f | %.0f |\n", threads, fma_rate, mma_rate, mma_rate / 3);
  }
  CHECK(cudaFree(out));
  return 0;
}
