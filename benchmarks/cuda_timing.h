// What the CUDA benchmark programs (time_cuda_kernels.cu, probe_step.cu, probe_grid_step.cu)
// share: error checks and the timing of a launch with CUDA events.
#ifndef JAX_SGRNN_BENCHMARKS_CUDA_TIMING_H_
#define JAX_SGRNN_BENCHMARKS_CUDA_TIMING_H_

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#define CHECK(call)                                                                      \
  do {                                                                                   \
    const cudaError_t err_ = (call);                                                     \
    if (err_ != cudaSuccess) {                                                           \
      std::fprintf(stderr, "%s: %s\n", #call, cudaGetErrorString(err_));                 \
      std::exit(1);                                                                      \
    }                                                                                    \
  } while (0)

// Holds a device buffer whose memset evicts everything from L2.
struct L2Flush {
  void* buffer = nullptr;
  size_t bytes = 0;
  L2Flush() {
    int device = 0, l2 = 0;
    CHECK(cudaGetDevice(&device));
    CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device));
    bytes = 5 * static_cast<size_t>(l2);
    CHECK(cudaMalloc(&buffer, bytes));
  }
  ~L2Flush() { cudaFree(buffer); }
  void operator()() const { CHECK(cudaMemsetAsync(buffer, 1, bytes)); }
};

// Median microseconds of `launch` over 30 timed runs after 5 untimed ones, each timed run
// after `idle` of the GPU doing nothing, and after L2 is emptied where `flush` is given.
template <typename F>
double MedianMicroseconds(F&& launch, std::chrono::microseconds idle = {},
                          const L2Flush* flush = nullptr) {
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  for (int i = 0; i < 5; ++i) CHECK(launch());
  std::vector<double> times;
  for (int i = 0; i < 30; ++i) {
    if (idle.count() > 0) std::this_thread::sleep_for(idle);
    if (flush) (*flush)();
    CHECK(cudaEventRecord(start));
    CHECK(launch());
    CHECK(cudaEventRecord(stop));
    CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(1000.0 * ms);
  }
  std::sort(times.begin(), times.end());
  CHECK(cudaEventDestroy(start));
  CHECK(cudaEventDestroy(stop));
  return times[times.size() / 2];
}

#endif  // JAX_SGRNN_BENCHMARKS_CUDA_TIMING_H_
