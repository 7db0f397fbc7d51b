// The floor of one recurrence step in the kernels' design (one block a batch row, R in
// registers, the state handed over through shared memory and a block barrier), part by part:
// a bare kernel of that shape runs T steps with the parts of a step switched on one at a time,
// for several splits of a row's H x H products over the block's threads. It computes nothing
// useful (its R and source are random, its output unchecked); it exists to say what each part
// of a step costs on the GPU it runs on, without the kernels' own bookkeeping (indexing, masks,
// lengths, directions, clusters), so that the gap between a kernel and this floor is known.
//
// A thread holds kSlice entries of each of kTile units' rows of R; S = H / kSlice threads share
// a tile (as in csrc/cuda/recurrence.cu), and sums each unit's products in kSplit interleaved
// chains ("chains a unit"), added at the end. Per step and part:
//   barrier   each owner stores its unit's state to the other exchange buffer, block barrier
//   shared    the thread loads its slice of the state (16-byte loads)
//   products  kTile x kSlice FMAs (without "shared": on a register, no load to wait for)
//   shuffles  the sum over the S slices (the kernels' SumOverSlices)
//   tanh      the kernels' activation (sgrnn/core.h); "tanh.approx" the hardware's
//             approximation instead (2^-11 relative error, too coarse for float32 results)
//   global    the source load before the products and the output store after
// Time: CUDA events (cuda_timing.h), N = 8 blocks (one per SM) of T = 1000 steps; cycles a
// step from clock64 in block 0.
//
//   nvcc -std=c++20 -O3 -arch=sm_90 --expt-relaxed-constexpr -Icsrc \
//     benchmarks/probe_step.cu -o probe_step && ./probe_step
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "cuda_timing.h"
#include "sgrnn/core.h"

namespace {

enum Part : int { kBarrier = 1, kShared = 2, kProducts = 4, kShuffles = 8, kTanh = 16,
                  kTanhApprox = 32, kGlobal = 64 };

constexpr int kSteps = 1000, kRows = 8, kMaxH = 128;

__device__ __forceinline__ float HardwareTanh(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

template <int H, int kTile, int kSlice, int kParts, int kSplit>
__global__ void __launch_bounds__(H / kSlice * H / kTile)
    Steps(const float* R, const float* source, float* y, long long* cycles) {
  constexpr int S = H / kSlice;
  constexpr int kStride = kSlice + 4;  // a 16-byte pad per slice, as the kernels' SlicePadding
  constexpr int kExchange = S * kStride;
  __shared__ __align__(16) float exchange[2][kExchange];
  const int row = blockIdx.x, slice = threadIdx.x % S, tile = threadIdx.x / S * kTile;
  float w[kTile][kSlice];
#pragma unroll
  for (int q = 0; q < kTile; ++q) {
#pragma unroll
    for (int i = 0; i < kSlice; ++i) w[q][i] = R[(tile + q) * H + slice * kSlice + i];
  }
  const bool owner = slice % (S / kTile) == 0;
  const int unit = tile + slice / (S / kTile);
  const int index = (unit / kSlice) * kStride + unit % kSlice;
  for (int i = threadIdx.x; i < 2 * kExchange; i += blockDim.x) {
    (&exchange[0][0])[i] = 0.01f * static_cast<float>(i % 7);
  }
  __syncthreads();
  float h = 0.1f;
  const long long start = clock64();
  for (int k = 0; k < kSteps; ++k) {
    const float input = (kParts & kGlobal) ? source[(k * kRows + row) * H + unit] : 0.0f;
    float acc[kTile], part[kSplit][kTile];
#pragma unroll
    for (int c = 0; c < kSplit; ++c) {
#pragma unroll
      for (int q = 0; q < kTile; ++q) part[c][q] = (kParts & (kShared | kProducts)) ? 0.0f : h;
    }
    if constexpr ((kParts & kShared) != 0) {
      const float4* current = reinterpret_cast<const float4*>(exchange[k & 1] + slice * kStride);
#pragma unroll
      for (int v = 0; v < kSlice / 4; ++v) {
        const float4 loaded = current[v];
        const float e[4] = {loaded.x, loaded.y, loaded.z, loaded.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
#pragma unroll
          for (int q = 0; q < kTile; ++q) {
            if (kParts & kProducts) {
              part[v % kSplit][q] += e[j] * w[q][v * 4 + j];
            } else if (v == 0 && j == 0) {
              part[0][q] += e[j];
            }
          }
        }
      }
    } else if constexpr ((kParts & kProducts) != 0) {
#pragma unroll
      for (int i = 0; i < kSlice; ++i) {
#pragma unroll
        for (int q = 0; q < kTile; ++q) part[(i / 4) % kSplit][q] += h * w[q][i];
      }
    }
#pragma unroll
    for (int width = kSplit / 2; width > 0; width /= 2) {
#pragma unroll
      for (int c = 0; c < width; ++c) {
#pragma unroll
        for (int q = 0; q < kTile; ++q) part[c][q] += part[c + width][q];
      }
    }
#pragma unroll
    for (int q = 0; q < kTile; ++q) acc[q] = part[0][q];
    float total = acc[0];
    if constexpr ((kParts & kShuffles) != 0) {
      int offset = S / 2;
#pragma unroll
      for (int n = kTile; n > 1; n /= 2, offset /= 2) {
        const bool upper = (slice & offset) != 0;
#pragma unroll
        for (int i = 0; i < n / 2; ++i) {
          const float send = upper ? acc[i] : acc[i + n / 2];
          acc[i] = (upper ? acc[i + n / 2] : acc[i]) + __shfl_xor_sync(0xffffffffu, send, offset);
        }
      }
      total = acc[0];
#pragma unroll
      for (; offset > 0; offset /= 2) total += __shfl_xor_sync(0xffffffffu, total, offset);
    } else {
#pragma unroll
      for (int q = 1; q < kTile; ++q) total += acc[q];
    }
    const float z = input + total;
    if constexpr ((kParts & kTanh) != 0) {
      h = sgrnn::Activate<sgrnn::Activation::kTanh>(z);
    } else if constexpr ((kParts & kTanhApprox) != 0) {
      h = HardwareTanh(z);
    } else {
      h = 0.5f * z;
    }
    if (kParts & kGlobal) y[(k * kRows + row) * H + unit] = h;
    if (owner) exchange[(k + 1) & 1][index] = h;
    if constexpr ((kParts & kBarrier) != 0) __syncthreads();
  }
  const long long stop = clock64();
  if (threadIdx.x == 0) cycles[row] = stop - start;
  if (h == 12345.0f) y[0] = h;  // keeps the chain alive in parts that store nothing
}

struct Buffers {
  float *R, *source, *y;
  long long* cycles;
};

template <int H, int kTile, int kSlice, int kParts, int kSplit = 1>
void Time(const Buffers& b, const char* parts) {
  constexpr int threads = H / kSlice * H / kTile;
  const auto kernel = Steps<H, kTile, kSlice, kParts, kSplit>;
  const double us = MedianMicroseconds([&] {
    kernel<<<kRows, threads>>>(b.R, b.source, b.y, b.cycles);
    return cudaGetLastError();
  });
  long long cycles = 0;
  CHECK(cudaMemcpy(&cycles, b.cycles, sizeof(cycles), cudaMemcpyDeviceToHost));
  std::printf("| %d | %d | %d x %d | %d | %s | %.1f | %.3f | %lld |\n", H, threads, kTile, kSlice,
              kSplit, parts, us, us / kSteps, cycles / kSteps);
}

// Each part added to the ones before, then the whole step without its barrier (wrong results:
// the barrier's own share).
template <int H, int kTile, int kSlice, int kSplit = 1>
void TimeLayout(const Buffers& b) {
  constexpr int kChain = kBarrier | kShared | kProducts | kShuffles;
  Time<H, kTile, kSlice, kBarrier, kSplit>(b, "barrier");
  Time<H, kTile, kSlice, kBarrier | kShared, kSplit>(b, "+ shared");
  Time<H, kTile, kSlice, kBarrier | kProducts, kSplit>(b, "barrier + products (no shared)");
  Time<H, kTile, kSlice, kBarrier | kShared | kProducts, kSplit>(b, "+ shared + products");
  Time<H, kTile, kSlice, kChain, kSplit>(b, "+ shuffles");
  Time<H, kTile, kSlice, kChain | kTanhApprox, kSplit>(b, "+ tanh.approx");
  Time<H, kTile, kSlice, kChain | kTanh, kSplit>(b, "+ tanh");
  Time<H, kTile, kSlice, kChain | kTanh | kGlobal, kSplit>(b, "+ global: whole step");
  Time<H, kTile, kSlice, (kChain & ~kBarrier) | kTanh | kGlobal, kSplit>(b,
                                                                       "whole step, no barrier");
}

// The whole step alone, and its products and shared loads alone (with the barrier).
template <int H, int kTile, int kSlice, int kSplit>
void TimeStep(const Buffers& b) {
  constexpr int kChain = kBarrier | kShared | kProducts | kShuffles;
  Time<H, kTile, kSlice, kBarrier | kShared | kProducts, kSplit>(b, "barrier + shared + products");
  Time<H, kTile, kSlice, kChain | kTanh | kGlobal, kSplit>(b, "whole step");
}

}  // namespace

int main() {
  int device = 0, clock_khz = 0;
  cudaDeviceProp prop;
  CHECK(cudaGetDevice(&device));
  CHECK(cudaGetDeviceProperties(&prop, device));
  CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, device));
  std::printf("%s, %d SMs, %.0f MHz; T = %d, N = %d, float32\n\n", prop.name,
              prop.multiProcessorCount, clock_khz / 1000.0, kSteps, kRows);
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 0.05f);
  std::vector<float> host(static_cast<size_t>(kSteps) * kRows * kMaxH);
  for (float& v : host) v = normal(rng);
  Buffers b;
  CHECK(cudaMalloc(&b.R, kMaxH * kMaxH * sizeof(float)));
  CHECK(cudaMalloc(&b.source, host.size() * sizeof(float)));
  CHECK(cudaMalloc(&b.y, host.size() * sizeof(float)));
  CHECK(cudaMalloc(&b.cycles, kRows * sizeof(long long)));
  CHECK(cudaMemcpy(b.R, host.data(), kMaxH * kMaxH * sizeof(float), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(b.source, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice));
  std::printf("| H | threads | units x entries | chains a unit | parts | us | us/step | cycles/step |\n");
  std::printf("|---:|---:|---|---:|---|---:|---:|---:|\n");
  TimeLayout<128, 4, 32>(b);  // the wide forward block at H = 128
  TimeStep<128, 4, 32, 2>(b);   // ... with two chains a unit
  TimeStep<128, 4, 32, 4>(b);
  TimeLayout<128, 2, 64, 2>(b);  // two slices: one shuffle
  TimeStep<128, 2, 64, 4>(b);
  TimeLayout<128, 1, 128, 4>(b);  // a whole row of R a thread: no shuffles
  TimeStep<128, 1, 128, 8>(b);
  TimeStep<128, 4, 16, 1>(b);
  TimeStep<128, 2, 32, 2>(b);
  TimeLayout<64, 4, 16>(b);  // the wide forward block at H = 64 (without its zero half)
  TimeStep<64, 4, 16, 2>(b);
  TimeStep<64, 2, 32, 2>(b);
  TimeStep<64, 1, 64, 4>(b);
  TimeStep<64, 4, 8, 1>(b);
  TimeStep<64, 2, 16, 2>(b);
  TimeStep<64, 1, 32, 4>(b);
  CHECK(cudaFree(b.R));
  CHECK(cudaFree(b.source));
  CHECK(cudaFree(b.y));
  CHECK(cudaFree(b.cycles));
  return 0;
}
