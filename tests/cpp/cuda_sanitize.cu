// A standalone driver of the CUDA recurrence kernels (csrc/cuda/recurrence.cu and
// grid_recurrence.cu), for compute-sanitizer (scripts/sanitize_cuda.sh), which cannot follow a
// Python process running JAX. It runs the forward and gradient kernels over every kind of
// launch their plans make (wide blocks, narrow blocks of their own, one narrow block per
// cluster, clusters of 2, 4 and 8, one row, one group of rows or several, both directions,
// masks, lengths, float and double; the grid kernels wherever PlanGrid fits, float only), with
// outputs poisoned with NaN first, and checks that each run returns no CUDA error and writes
// every output element with a finite value, and that where both the block and the grid kernels
// run they agree. The values themselves are checked against the reference by
// tests/test_cuda.py.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>
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
  DeviceArray<T> dy(Random<T>(state, rng));
  const MaskView<T> mask_view =
      k.mask ? MaskView<T>(mask.data, k.T, k.N, DH) : MaskView<T>();
  const int32_t* seq_lengths = k.lengths ? lengths.data : nullptr;

  // Runs the forward and the gradients with `launch_forward` and `launch_gradients` (given the
  // arguments) into outputs poisoned with NaN, checks that each wrote every element, and
  // returns them: y, z, dz and dh0.
  const auto run = [&](const std::string& path, auto launch_forward, auto launch_gradients) {
    std::vector<std::vector<T>> out;
    const std::string what = name + " (" + path + ")";
    DeviceArray<T> y(std::vector<T>(state, nan)), z(std::vector<T>(state, nan));
    const ForwardArgs<T> fa{x.data, R.data, k.h0 ? h0.data : nullptr, mask_view, seq_lengths,
                            y.data, z.data};
    if (!Ok(launch_forward(fa), what + ": forward launch") ||
        !Ok(cudaDeviceSynchronize(), what + ": forward run")) {
      return out;
    }
    CheckWritten(y, what + ": y");
    CheckWritten(z, what + ": z");
    DeviceArray<T> dx(std::vector<T>(state, nan)), dh0(std::vector<T>(k.N * DH, nan));
    const GradientArgs<T> ga{R.data, dy.data, z.data, mask_view, seq_lengths, dx.data, dh0.data};
    if (!Ok(launch_gradients(ga), what + ": gradients launch") ||
        !Ok(cudaDeviceSynchronize(), what + ": gradients run")) {
      return out;
    }
    CheckWritten(dx, what + ": dz");
    CheckWritten(dh0, what + ": dh0");
    return std::vector<std::vector<T>>{y.Host(), z.Host(), dx.Host(), dh0.Host()};
  };

  std::vector<std::vector<T>> blocks_out;
  if (const auto plan = PlanRecurrence(k.H, k.N, D, sizeof(T), sms, shared)) {
    blocks_out = run(
        "blocks",
        [&](const ForwardArgs<T>& fa) { return LaunchForward<T>(c, d, *plan, fa, nullptr); },
        [&](const GradientArgs<T>& ga) { return LaunchGradients<T>(c, d, *plan, ga, nullptr); });
  }
  if constexpr (std::is_same_v<T, float>) {
    const std::optional<GridPlan> grid = PlanGrid(k.H, k.N, sizeof(T), sms, shared);
    if (!grid) return;  // sizes the lowering gives to another path
    void* workspace = nullptr;
    if (!Ok(cudaMalloc(&workspace, grid->WorkspaceBytes(D)), name + ": workspace")) return;
    const auto grid_out = run(
        "grid",
        [&](const ForwardArgs<T>& fa) {
          return LaunchGridForward(c, d, *grid, fa, workspace, nullptr);
        },
        [&](const GradientArgs<T>& ga) {
          return LaunchGridGradients(c, d, *grid, ga, workspace, nullptr);
        });
    cudaFree(workspace);
    // Where both paths run, the same results up to the order of the sums.
    const char* names[] = {"y", "z", "dz", "dh0"};
    for (size_t i = 0; i < blocks_out.size() && i < grid_out.size(); ++i) {
      double worst = 0;
      for (size_t e = 0; e < blocks_out[i].size(); ++e) {
        const double a = grid_out[i][e], b = blocks_out[i][e];
        worst = std::max(worst, std::abs(a - b) / (1 + std::abs(b)));
      }
      Check(worst < 1e-4, name + ": grid against blocks, " + names[i] + " differs by " +
                              std::to_string(worst));
    }
  }
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
      {5, 70, 700, true, false, true, true, true},    // grid only: 2 x 22 tiles of 64 x 32
      {3, 2, 1024, false, true, false, true, false},  // grid only: 32 unit tiles, 16 chunks
      {4, 129, 33, false, false, true, false, true},  // grid and blocks: 3 x 2 tiles
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
