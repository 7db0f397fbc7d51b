// The floor of one recurrence step where a step's product is too large for one block or one
// cluster (many rows and a large H, as (100,256,1024,1024)), in a design that spreads every
// step over the whole GPU: one block an SM, all resident at once (a cooperative launch); block
// (row tile, column tile) keeps its columns of R in shared memory for all steps and computes
// a BM x BN tile of the step's [N, H] product from the previous state, which it streams from
// L2 in chunks of KC entries (cp.async, kStages chunks in flight). The threads split the
// chunk's entries in KS parts, each part a TM x TN register tile of outputs over its share,
// and add the parts through shared memory at the step's end. The state is handed over in
// global memory: each block stores its tile of h_t (y_t), then counts itself in its row
// tile's counter, and waits for all H / BN column tiles of the row tile before it reads h_t.
//
// Today the op runs these sizes as the lax.scan decomposition, one cuBLAS product a step
// (docs/performance.md, "Floors, and what limits each row"). This program computes a plain
// tanh forward (no mask, lengths or directions) for T = 100, N = 256, H = 1024, float32,
// checks the whole-step kernel's y against a double-precision loop on the host for rows of
// every row tile, and times each tiling with parts of the step switched off:
//   products  the FMAs from shared memory (over stale chunks: no loads, no hand-over)
//   loads     + the chunk loads from L2 (no hand-over: reads whatever y holds)
//   whole     + the hand-over (counter and wait): the step as a kernel would run it
//   hand-over the hand-over and the step's end alone (no loads, no products)
//   grid      the whole step with a barrier of the whole grid (cooperative groups' grid.sync)
//             for the hand-over instead of the row tile's counter: no counters to keep
// Every mode runs the step's end (the sum over parts, the source, tanh and the store of y).
// Time: CUDA events (cuda_timing.h), the median of 30 launches after 5; us a step = / T.
//
//   nvcc -std=c++20 -O3 -arch=sm_90 --expt-relaxed-constexpr -Icsrc \
//     benchmarks/probe_grid_step.cu -o probe_grid_step && ./probe_grid_step
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "cuda_timing.h"
#include "sgrnn/core.h"

namespace {

constexpr int kSteps = 100, kRows = 256, kHidden = 1024;

enum Part : int { kProducts = 1, kLoads = 2, kHandOver = 4, kGridBarrier = 8 };

// The split of a block's BM x BN outputs over its threads: KS parts of the contraction, each
// (BM / TM) x (BN / TN) threads with a TM x TN register tile. A thread's rows are strided by
// BM / TM, so that the rows one warp reads at once lie in different shared-memory banks.
template <int BM, int BN, int KS, int TM, int TN>
struct Tiling {
  static constexpr int kRowGroups = BM / TM, kColumnGroups = BN / TN;
  static constexpr int kPartThreads = kRowGroups * kColumnGroups;
  static constexpr int kThreads = kPartThreads * KS;
  static_assert(BM % TM == 0 && BN % TN == 0 && (TN == 2 || TN == 4));
  static_assert(kPartThreads % 32 == 0, "a warp within one part");
  static_assert(kHidden % BN == 0 && kRows % BM == 0);
};

__device__ __forceinline__ void CopyAsync16(float* shared, const float* global) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(
                   static_cast<unsigned>(__cvta_generic_to_shared(shared))),
               "l"(global)
               : "memory");
}
__device__ __forceinline__ void CommitCopies() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void WaitCopies() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}
__device__ __forceinline__ unsigned LoadAcquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Shared memory: R's columns [H][BN] (entry k of output column c at k * BN + c), then kStages
// chunk buffers of [BM][KC + 4] (a 16-byte pad a row: the rows a warp reads fall in different
// banks), which the step's end reuses for the parts' sums [KS][BM][BN].
template <int BM, int BN, int KS, int KC, int kStages>
constexpr int SharedBytes() {
  static_assert(KS * BN <= kStages * (KC + 4), "the parts' sums fit the chunk buffers");
  return static_cast<int>(sizeof(float)) * (kHidden * BN + kStages * BM * (KC + 4));
}

template <int BM, int BN, int KS, int TM, int TN, int KC, int kStages, int kParts>
__global__ void __launch_bounds__(Tiling<BM, BN, KS, TM, TN>::kThreads, 1)
    GridSteps(const float* R, const float* source, const float* h0, float* y, unsigned* arrived,
              unsigned launch) {
  using Tile = Tiling<BM, BN, KS, TM, TN>;
  constexpr int kThreads = Tile::kThreads, kStride = KC + 4, kChunks = kHidden / KC;
  constexpr int kPartEntries = KC / KS, kColumnTiles = kHidden / BN;
  constexpr int kOutputs = BM * BN / kThreads;  // per thread at the step's end
  static_assert(kHidden % KC == 0 && KC % (4 * KS) == 0 && (BM * BN) % kThreads == 0 &&
                (BM * KC / 4) % kThreads == 0);
  extern __shared__ float4 shared_vectors[];
  float* R_columns = reinterpret_cast<float*>(shared_vectors);
  float* chunks = R_columns + kHidden * BN;
  float* sums = chunks;

  const int row_tile = blockIdx.x / kColumnTiles, column_tile = blockIdx.x % kColumnTiles;
  const int row0 = row_tile * BM, column0 = column_tile * BN;
  const int part = threadIdx.x / Tile::kPartThreads;
  const int local = threadIdx.x % Tile::kPartThreads;
  const int row_group = local / Tile::kColumnGroups, column_group = local % Tile::kColumnGroups;

  for (int i = threadIdx.x; i < kHidden * BN; i += kThreads) {
    const int c = i / kHidden, k = i % kHidden;  // reads along R's rows
    R_columns[k * BN + c] = R[(column0 + c) * kHidden + k];
  }
  for (int i = threadIdx.x; i < kStages * BM * kStride; i += kThreads) chunks[i] = 0.0f;
  __syncthreads();

  for (int t = 0; t < kSteps; ++t) {
    const float* previous = t == 0 ? h0 : y + (t - 1) * kRows * kHidden;
    float input[kOutputs];
#pragma unroll
    for (int e = 0; e < kOutputs; ++e) {
      const int o = threadIdx.x + e * kThreads;
      input[e] = source[(t * kRows + row0 + o / BN) * kHidden + column0 + o % BN];
    }
    const auto load_chunk = [&](int c) {
      if ((kParts & kLoads) && c < kChunks) {
        float* to = chunks + (c % kStages) * BM * kStride;
#pragma unroll
        for (int e = 0; e < BM * KC / 4 / kThreads; ++e) {
          const int v = threadIdx.x + e * kThreads, r = v / (KC / 4), q = v % (KC / 4);
          CopyAsync16(to + r * kStride + q * 4, previous + (row0 + r) * kHidden + c * KC + q * 4);
        }
      }
      CommitCopies();  // an empty group past the last chunk keeps the count of groups uniform
    };
#pragma unroll 1
    for (int c = 0; c < kStages - 1; ++c) load_chunk(c);
    float acc[TM][TN] = {};
#pragma unroll 1
    for (int c = 0; c < kChunks; ++c) {
      WaitCopies<kStages - 2>();  // chunk c is in (this thread's copies) ...
      __syncthreads();  // ... everyone's, and chunk c - 1's buffer is no longer read
      load_chunk(c + kStages - 1);
      if constexpr ((kParts & kProducts) != 0) {
        const float* h = chunks + (c % kStages) * BM * kStride + part * kPartEntries;
        const float* r = R_columns + (c * KC + part * kPartEntries) * BN + column_group * TN;
#pragma unroll
        for (int kk = 0; kk < kPartEntries; kk += 4) {
          float4 a[TM];
#pragma unroll
          for (int i = 0; i < TM; ++i) {
            a[i] = *reinterpret_cast<const float4*>(h + (row_group + i * Tile::kRowGroups) *
                                                            kStride + kk);
          }
          float b[4][TN];
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            if constexpr (TN == 4) {
              const float4 v = *reinterpret_cast<const float4*>(r + (kk + j) * BN);
              b[j][0] = v.x, b[j][1] = v.y, b[j][2] = v.z, b[j][3] = v.w;
            } else {
              const float2 v = *reinterpret_cast<const float2*>(r + (kk + j) * BN);
              b[j][0] = v.x, b[j][1] = v.y;
            }
          }
#pragma unroll
          for (int i = 0; i < TM; ++i) {
            const float e[4] = {a[i].x, a[i].y, a[i].z, a[i].w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
#pragma unroll
              for (int n = 0; n < TN; ++n) acc[i][n] += e[j] * b[j][n];
            }
          }
        }
      }
    }
    WaitCopies<0>();
    __syncthreads();  // the chunk buffers are free for the parts' sums
#pragma unroll
    for (int i = 0; i < TM; ++i) {
      float* to = sums + (part * BM + row_group + i * Tile::kRowGroups) * BN + column_group * TN;
#pragma unroll
      for (int n = 0; n < TN; ++n) to[n] = acc[i][n];
    }
    __syncthreads();
#pragma unroll
    for (int e = 0; e < kOutputs; ++e) {
      const int o = threadIdx.x + e * kThreads;
      float z = input[e];
#pragma unroll
      for (int p = 0; p < KS; ++p) z += sums[p * BM * BN + o];
      y[(t * kRows + row0 + o / BN) * kHidden + column0 + o % BN] =
          sgrnn::Activate<sgrnn::Activation::kTanh>(z);
    }
    __syncthreads();  // y_t stored by every thread; the sums read before chunks overwrite them
    if constexpr ((kParts & kHandOver) != 0) {
      if (threadIdx.x == 0) {  // the pattern of cooperative groups' grid barrier, per row tile
        __threadfence();
        atomicAdd(arrived + row_tile, 1u);
        const unsigned expected = (launch * kSteps + t + 1) * kColumnTiles;
        // A wait that never ends is a bug of this program: stop the kernel instead of the GPU.
        for (int spins = 0; LoadAcquire(arrived + row_tile) < expected;) {
          if (++spins == 1 << 26) __trap();
        }
        __threadfence();
      }
      __syncthreads();
    } else if constexpr ((kParts & kGridBarrier) != 0) {
      cooperative_groups::this_grid().sync();
    }
  }
}

struct Problem {
  std::vector<float> R, source, h0;
  float *R_device, *source_device, *h0_device, *y_device;
  unsigned* arrived;
};

// y of row n over all steps, in double precision, against the kernel's y: the largest
// difference.
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

template <int BM, int BN, int KS, int TM, int TN, int KC, int kStages, int kParts>
void Time(const Problem& p, const char* parts, bool check) {
  using Tile = Tiling<BM, BN, KS, TM, TN>;
  const auto kernel = GridSteps<BM, BN, KS, TM, TN, KC, kStages, kParts>;
  constexpr int kShared = SharedBytes<BM, BN, KS, KC, kStages>();
  constexpr int kBlocks = (kRows / BM) * (kHidden / BN);
  CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kShared));
  CHECK(cudaMemset(p.arrived, 0, kRows * sizeof(unsigned)));
  unsigned launch = 0;
  const auto run = [&] {
    const float *R = p.R_device, *source = p.source_device, *h0 = p.h0_device;
    float* y = p.y_device;
    unsigned* arrived = p.arrived;
    void* args[] = {&R, &source, &h0, &y, &arrived, &launch};
    // Cooperative: the launch fails unless every block is resident at once, which the
    // hand-over needs (a block waiting for one that never starts would wait forever).
    const cudaError_t err = cudaLaunchCooperativeKernel(
        reinterpret_cast<const void*>(kernel), dim3(kBlocks), dim3(Tile::kThreads), args,
        kShared, nullptr);
    ++launch;
    return err;
  };
  const double us = MedianMicroseconds(run);
  std::printf("| %d x %d | %d | %d x %d x %d | %d x %d | %d | %s | %.1f | %.2f |", BM, BN, kBlocks,
              KS, TM, TN, KC, kStages, kShared / 1024, parts, us, us / kSteps);
  if (check) {
    std::vector<float> y(static_cast<size_t>(kSteps) * kRows * kHidden);
    CHECK(cudaMemcpy(y.data(), p.y_device, y.size() * sizeof(float), cudaMemcpyDeviceToHost));
    double worst = 0;
    for (int n : {0, 1, 63, 64, 127, 130, 191, 200, 255}) worst = std::max(worst, RowError(p, y, n));
    std::printf(" %.1e %s |\n", worst, worst < 1e-4 ? "ok" : "WRONG");
  } else {
    std::printf(" - |\n");
  }
}

template <int BM, int BN, int KS, int TM, int TN, int KC, int kStages>
void TimeParts(const Problem& p) {
  Time<BM, BN, KS, TM, TN, KC, kStages, kProducts>(p, "products", false);
  Time<BM, BN, KS, TM, TN, KC, kStages, kProducts | kLoads>(p, "+ loads", false);
  Time<BM, BN, KS, TM, TN, KC, kStages, kProducts | kLoads | kHandOver>(p, "+ hand-over: whole", true);
  Time<BM, BN, KS, TM, TN, KC, kStages, kHandOver>(p, "hand-over alone", false);
  Time<BM, BN, KS, TM, TN, KC, kStages, kProducts | kLoads | kGridBarrier>(p, "whole, grid barrier",
                                                                         true);
  Time<BM, BN, KS, TM, TN, KC, kStages, kGridBarrier>(p, "grid barrier alone", false);
}

template <int BM, int BN, int KS, int TM, int TN, int KC, int kStages>
void TimeWhole(const Problem& p) {
  Time<BM, BN, KS, TM, TN, KC, kStages, kProducts | kLoads | kHandOver>(p, "whole", true);
}

float* Upload(const std::vector<float>& host) {
  float* device = nullptr;
  CHECK(cudaMalloc(&device, host.size() * sizeof(float)));
  CHECK(cudaMemcpy(device, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice));
  return device;
}

}  // namespace

int main() {
  int device = 0, clock_khz = 0;
  cudaDeviceProp prop;
  CHECK(cudaGetDevice(&device));
  CHECK(cudaGetDeviceProperties(&prop, device));
  CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, device));
  std::printf("%s, %d SMs, %.0f MHz; T = %d, N = %d, H = %d, float32, tanh\n\n", prop.name,
              prop.multiProcessorCount, clock_khz / 1000.0, kSteps, kRows, kHidden);
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
  CHECK(cudaMalloc(&p.arrived, kRows * sizeof(unsigned)));
  // The step's products: 2 N H^2 flops, at the SMs' float32 FMA rate (128 lanes, this clock).
  const double floor_us = 1e3 * kRows * kHidden * kHidden /
                          (128.0 * prop.multiProcessorCount * clock_khz);
  std::printf("products' floor (all SMs' float32 FMA lanes): %.2f us a step\n\n", floor_us);
  std::printf("| BM x BN | blocks | KS x TM x TN | KC x stages | shared KB | parts | us | "
              "us/step | max error |\n|---|---:|---|---|---:|---|---:|---:|---|\n");
  TimeParts<64, 32, 4, 8, 4, 64, 4>(p);
  TimeWhole<64, 32, 8, 4, 4, 64, 4>(p);    // twice the threads, half the tile a thread
  TimeWhole<64, 32, 4, 8, 4, 128, 2>(p);   // longer chunks, two stages
  TimeWhole<64, 32, 4, 8, 4, 32, 8>(p);    // shorter chunks, eight stages
  TimeWhole<128, 16, 4, 8, 4, 64, 4>(p);   // taller tiles: half the column tiles a row tile
  CHECK(cudaFree(p.R_device));
  CHECK(cudaFree(p.source_device));
  CHECK(cudaFree(p.h0_device));
  CHECK(cudaFree(p.y_device));
  CHECK(cudaFree(p.arrived));
  return 0;
}
