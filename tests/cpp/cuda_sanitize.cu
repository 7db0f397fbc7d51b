// A standalone driver of the CUDA recurrence kernels (csrc/cuda/recurrence.cu), for
// compute-sanitizer (scripts/sanitize_cuda.sh), which cannot follow a Python process running
// JAX. It runs the forward and gradient kernels over every kind of launch their plans make
// (wide blocks, narrow blocks of their own, one narrow block per cluster, clusters of 2, 4
// and 8, one row, one group of rows or several, both directions, masks, lengths, float and
// double), with
// outputs poisoned with NaN first, and checks that each run returns no CUDA error and writes
// every output element with a finite value. The values themselves are checked against the
// reference by tests/test_cuda.py.
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "cuda/recurrence.h"
#include "cuda/recurrence_plan.h"

namespace {

using namespace sgrnn;
using namespace sgrnn::cuda;

int failures = 0;

void Check(bool ok, const std::string& what) {
  if (!ok) {
    ++failures;
    std::printf("FAILED: %s\n", what.c_str());
  }
}

bool Ok(cudaError_t err, const std::string& what) {
  Check(err == cudaSuccess, what + ": " + cudaGetErrorString(err));
  return err == cudaSuccess;
}

// A device copy of host data, freed with the object.
template <typename T>
struct DeviceArray {
  T* data = nullptr;
  size_t size = 0;
  explicit DeviceArray(const std::vector<T>& host) : size(host.size()) {
    cudaMalloc(&data, std::max<size_t>(1, size) * sizeof(T));
    cudaMemcpy(data, host.data(), size * sizeof(T), cudaMemcpyHostToDevice);
  }
  DeviceArray(const DeviceArray&) = delete;
  ~DeviceArray() { cudaFree(data); }
  std::vector<T> Host() const {
    std::vector<T> out(size);
    cudaMemcpy(out.data(), data, size * sizeof(T), cudaMemcpyDeviceToHost);
    return out;
  }
};

template <typename T>
std::vector<T> Random(size_t n, std::mt19937& rng, double scale = 1.0) {
  std::normal_distribution<double> normal(0.0, scale);
  std::vector<T> out(n);
  for (T& v : out) v = static_cast<T>(normal(rng));
  return out;
}

template <typename T>
void CheckWritten(const DeviceArray<T>& a, const std::string& what) {
  for (T v : a.Host()) {
    if (!std::isfinite(static_cast<double>(v))) {
      Check(false, what + ": an element was not written (still NaN) or is not finite");
      return;
    }
  }
}

struct Case {
  int64_t T, N, H;
  bool bidirectional, reverse, mask, lengths, h0;
};

template <typename T>
void Run(const Case& k, std::mt19937& rng) {
  const int64_t D = k.bidirectional ? 2 : 1, DH = D * k.H, state = k.T * k.N * DH;
  const std::string name = std::string(sizeof(T) == 4 ? "float" : "double") + " T=" +
                           std::to_string(k.T) + " N=" + std::to_string(k.N) + " H=" +
                           std::to_string(k.H) + (k.bidirectional ? " bi" : "") +
                           (k.reverse ? " rev" : "") + (k.mask ? " mask" : "") +
                           (k.lengths ? " lengths" : "");
  const Config c{Activation::kTanh, k.reverse, k.bidirectional, true, false, false, k.h0,
                 k.mask, k.lengths};
  const Dims d{k.T, k.N, DH, k.H, D};
  int device = 0, sms = 0, shared = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  cudaDeviceGetAttribute(&shared, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);

  const T nan = std::numeric_limits<T>::quiet_NaN();
  DeviceArray<T> x(Random<T>(state, rng)), R(Random<T>(D * k.H * k.H, rng, 0.5 / std::sqrt(k.H)));
  DeviceArray<T> h0(Random<T>(k.h0 ? k.N * DH : 0, rng));
  std::vector<T> mask_host(k.mask ? state : 0);
  for (T& m : mask_host) m = static_cast<T>(rng() % 4 == 0 ? 0 : 1);
  DeviceArray<T> mask(mask_host);
  std::vector<int32_t> lengths_host(k.lengths ? k.N : 0);
  for (int32_t& L : lengths_host) L = static_cast<int32_t>(rng() % (k.T + 1));
  DeviceArray<int32_t> lengths(lengths_host);
  DeviceArray<T> y(std::vector<T>(state, nan)), z(std::vector<T>(state, nan));

  const auto plan = PlanRecurrence(k.H, k.N, D, sizeof(T), sms, shared);
  if (!plan) return;  // sizes the lowering gives to the decomposition
  const ForwardArgs<T> fa{x.data, R.data, k.h0 ? h0.data : nullptr,
                          k.mask ? MaskView<T>(mask.data, k.T, k.N, DH) : MaskView<T>(),
                          k.lengths ? lengths.data : nullptr, y.data, z.data};
  if (!Ok(LaunchForward<T>(c, d, *plan, fa, nullptr), name + ": forward launch") ||
      !Ok(cudaDeviceSynchronize(), name + ": forward run")) {
    return;
  }
  CheckWritten(y, name + ": y");
  CheckWritten(z, name + ": z");

  DeviceArray<T> dy(Random<T>(state, rng)), dx(std::vector<T>(state, nan));
  DeviceArray<T> dh0(std::vector<T>(k.N * DH, nan));
  const GradientArgs<T> ga{R.data, dy.data, z.data, fa.mask, fa.seq_lengths, dx.data, dh0.data};
  if (!Ok(LaunchGradients<T>(c, d, *plan, ga, nullptr), name + ": gradients launch") ||
      !Ok(cudaDeviceSynchronize(), name + ": gradients run")) {
    return;
  }
  CheckWritten(dx, name + ": dz");
  CheckWritten(dh0, name + ": dh0");
}

}  // namespace

int main() {
  std::mt19937 rng(7);
  const Case cases[] = {
      {6, 8, 128, false, false, false, false, true},  // wide blocks, one row each
      {4, 1000, 100, true, false, false, false, true},  // wide blocks of two groups of 4 rows
      {5, 5000, 37, false, true, true, true, true},   // several groups of 4 rows a block
                                                      // (10 forward, 5 backward), H off the
                                                      // slice size
      {6, 1000, 64, true, false, true, true, true},   // one group of 4 rows (forward), two of
                                                      // 1 (backward), blocks sharing an SM
      {4, 5, 256, true, false, true, true, false},    // clusters of 2 (forward) and 4
      {3, 6, 512, false, true, false, false, true},   // float: clusters of 8 (forward only)
      {7, 3, 1, true, true, true, false, true},       // H = 1
      {0, 3, 16, false, false, false, false, true},   // no steps
      {9, 4, 64, true, true, true, true, true},       // narrow blocks of one row, a step ahead
      {100, 1, 48, false, false, false, true, true},  // ... over many steps, with a length
  };
  int runs = 0;
  for (const Case& k : cases) {
    Run<float>(k, rng);
    Run<double>(k, rng);
    runs += 2;
  }
  std::printf("%d failures in %d runs\n", failures, runs);
  return failures == 0 ? 0 : 1;
}
