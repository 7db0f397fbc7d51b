// The persistent recurrence kernels (recurrence.h; the split over the GPU is recurrence_plan.h).
//
// One launch runs every step. Block (cluster c, rank r) of direction d owns batch rows
// [c B, c B + B) and hidden units [r U, r U + U); thread (unit j, slice s) keeps kSlice entries
// of R (forward: row j, the gradients: column j) in registers. A step reads the previous state
// (forward: h_{k-1} * m_k; gradients: dz_k) for the block's rows from an exchange buffer in
// shared memory, sums each unit's S slices with warp shuffles, and the unit's owner thread
// (s == 0) applies the elementwise rule and writes the result into the other exchange buffer of
// every block of the cluster; one cluster barrier ends the step. Two buffers alternate, so
// that no block overwrites what another is still reading.
#include <cooperative_groups.h>

#include <algorithm>
#include <cstdint>

#include "cuda/recurrence.h"

namespace sgrnn::cuda {
namespace {

namespace cg = ::cooperative_groups;

// Per-launch sizes, from the plan.
struct Geometry {
  int64_t T, N, H, D;
  int slices, cluster, units, rows;
  int stride;  // elements from one slice of the exchange buffer to the next (slice + padding)
  int64_t exchange;  // elements of one exchange buffer

  __device__ int64_t ExchangeIndex(int64_t row, int64_t unit, int slice) const {
    return (row * slices + unit / slice) * stride + unit % slice;
  }
};

template <typename T>
__device__ inline T MaskAt(const MaskView<T>& m, int64_t k, int64_t n, int64_t col) {
  return m.data ? m.data[k * m.t_stride + n * m.n_stride + col * m.h_stride] : T(1);
}

// Where processing step k of a row with `length` valid steps reads its source (in_time) and
// stores its outputs (slot); padded steps (k >= length) stay at k.
struct StepTimes {
  int64_t in_time, slot;
  bool valid;
};
__device__ inline StepTimes TimesOf(const DirectionLayout& layout, int64_t k, int64_t length) {
  const bool valid = k < length;
  const int64_t flipped = length - 1 - k;
  return {layout.read_reversed && valid ? flipped : k, layout.store_flipped && valid ? flipped : k,
          valid};
}

// Writes `value` at `index` of the exchange buffer `buffer` in every block of the cluster.
template <typename T>
__device__ inline void Broadcast(T* buffer, int64_t index, T value, int cluster) {
  if (cluster == 1) {
    buffer[index] = value;
    return;
  }
  cg::cluster_group group = cg::this_cluster();
  for (int r = 0; r < cluster; ++r) group.map_shared_rank(buffer, r)[index] = value;
}

__device__ inline void StepBarrier(int cluster) {
  if (cluster == 1) {
    __syncthreads();
  } else {
    cg::this_cluster().sync();  // release/acquire: the other blocks' writes are visible
  }
}

template <typename T>
__device__ inline T SumOverSlices(T v, int slices) {
  for (int offset = slices / 2; offset > 0; offset /= 2) {
    v += __shfl_xor_sync(0xffffffffu, v, offset);
  }
  return v;
}

template <typename T>
struct alignas(16) Vector16 {
  T v[16 / sizeof(T)];
};

// acc[g] = sum_i rows[g][i] w[i] over this thread's slice, for kGroup rows at once; with
// kAccumulate, also dR[i] += rows[g][i] hm[g]. One row alone splits its sum into 4 chains so
// that FMA latency does not serialise it.
template <typename T, int kSlice, int kGroup, bool kAccumulate>
__device__ inline void SliceProducts(const T* const (&rows)[kGroup], const T (&w)[kSlice],
                                     const T (&hm)[kGroup], T (&dR)[kSlice], T (&acc)[kGroup]) {
  constexpr int kVec = 16 / sizeof(T);
  constexpr int kChains = kGroup == 1 ? 4 : 1;
  T part[kGroup][kChains];
#pragma unroll
  for (int g = 0; g < kGroup; ++g) {
#pragma unroll
    for (int c = 0; c < kChains; ++c) part[g][c] = T(0);
  }
#pragma unroll
  for (int v = 0; v < kSlice / kVec; ++v) {
#pragma unroll
    for (int g = 0; g < kGroup; ++g) {
      const Vector16<T> h = reinterpret_cast<const Vector16<T>*>(rows[g])[v];
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const int i = v * kVec + e;
        part[g][i % kChains] += h.v[e] * w[i];
        if constexpr (kAccumulate) dR[i] += h.v[e] * hm[g];
      }
    }
  }
#pragma unroll
  for (int g = 0; g < kGroup; ++g) {
    acc[g] = part[g][0];
#pragma unroll
    for (int c = 1; c < kChains; ++c) acc[g] += part[g][c];
  }
}

// The thread's place in the launch.
struct Place {
  int rank, direction;
  int64_t row0;  // first batch row of the cluster
  int rows;      // its rows (the last cluster may have fewer than plan.rows)
  int unit_in_block, slice;
  int64_t unit;  // hidden unit j within the direction
  bool has_unit, owner;
  int64_t column;  // d*H + j in [*, D*H] tensors

  __device__ Place(const Geometry& g) {
    rank = blockIdx.x % g.cluster;
    direction = blockIdx.y;
    row0 = static_cast<int64_t>(blockIdx.x / g.cluster) * g.rows;
    rows = static_cast<int>(min(static_cast<int64_t>(g.rows), g.N - row0));
    unit_in_block = threadIdx.x / g.slices;
    slice = threadIdx.x % g.slices;
    unit = static_cast<int64_t>(rank) * g.units + unit_in_block;
    has_unit = unit_in_block < g.units && unit < g.H;
    owner = has_unit && slice == 0;
    column = direction * g.H + unit;
  }
};

template <typename T>
__device__ inline T* ZeroShared(int64_t elements) {
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  T* shared = reinterpret_cast<T*>(shared_bytes);
  for (int64_t i = threadIdx.x; i < elements; i += blockDim.x) shared[i] = T(0);
  return shared;
}

template <typename T, Activation A, int kGroup>
__global__ void __launch_bounds__(kMaxThreads)
    ForwardKernel(Config c, Geometry g, ForwardArgs<T> a) {
  constexpr int kSlice = SliceLength(sizeof(T), false);
  const Place p(g);
  const int64_t DH = g.D * g.H, N = g.N;
  T* exchange = ZeroShared<T>(2 * g.exchange + static_cast<int64_t>(g.rows) * g.units);
  T* state = exchange + 2 * g.exchange;  // [rows][units]: the owners' unmasked h
  const DirectionLayout layout = LayoutOf(c, p.direction);

  T w[kSlice];  // row j of R
  const T* R = a.R + p.direction * g.H * g.H;
#pragma unroll
  for (int i = 0; i < kSlice; ++i) {
    const int64_t k = static_cast<int64_t>(p.slice) * kSlice + i;
    w[i] = p.has_unit && k < g.H ? R[p.unit * g.H + k] : T(0);
  }
  T unused[kSlice], no_hm[kGroup];
  StepBarrier(g.cluster);  // every block's buffers are zero before any block writes into them

  if (p.owner && g.T > 0) {
    for (int b = 0; b < p.rows; ++b) {
      const int64_t n = p.row0 + b;
      const T h = a.h0 ? a.h0[n * DH + p.column] : T(0);
      state[b * g.units + p.unit_in_block] = h;
      Broadcast(exchange, g.ExchangeIndex(b, p.unit, kSlice), h * MaskAt(a.mask, 0, n, p.column),
                g.cluster);
    }
  }
  StepBarrier(g.cluster);

  for (int64_t k = 0; k < g.T; ++k) {
    const T* current = exchange + (k & 1) * g.exchange;
    T* next = exchange + ((k + 1) & 1) * g.exchange;
    for (int b0 = 0; b0 < p.rows; b0 += kGroup) {
      // The owners' loads go out before the products, so their latency hides behind them.
      const T* rows[kGroup];
      T input[kGroup], mask_next[kGroup];
      StepTimes times[kGroup];
#pragma unroll
      for (int r = 0; r < kGroup; ++r) {
        const int b = min(b0 + r, p.rows - 1);
        const int64_t n = p.row0 + b;
        rows[r] = current + (static_cast<int64_t>(b) * g.slices + p.slice) * g.stride;
        times[r] = TimesOf(layout, k, RowLength(a.seq_lengths, n, g.T));
        input[r] = p.owner && times[r].valid ? a.source[(times[r].in_time * N + n) * DH + p.column]
                                             : T(0);
        mask_next[r] = p.owner && k + 1 < g.T ? MaskAt(a.mask, k + 1, n, p.column) : T(1);
        no_hm[r] = T(0);
      }
      T acc[kGroup];
      SliceProducts<T, kSlice, kGroup, false>(rows, w, no_hm, unused, acc);
#pragma unroll
      for (int r = 0; r < kGroup; ++r) acc[r] = SumOverSlices(acc[r], g.slices);
      if (!p.owner) continue;
#pragma unroll
      for (int r = 0; r < kGroup; ++r) {
        const int b = b0 + r;
        if (b >= p.rows) break;
        const int64_t n = p.row0 + b, out = (times[r].slot * N + n) * DH + p.column;
        T& h_state = state[b * g.units + p.unit_in_block];
        if (times[r].valid) {
          const T z = input[r] + acc[r];
          h_state = Activate<A>(z);
          a.y[out] = h_state;
          if (a.z) a.z[out] = z;
        } else {  // a finished row keeps its state and gives zeros
          a.y[out] = T(0);
          if (a.z) a.z[out] = T(0);
        }
        if (k + 1 < g.T) {
          Broadcast(next, g.ExchangeIndex(b, p.unit, kSlice), h_state * mask_next[r], g.cluster);
        }
      }
    }
    StepBarrier(g.cluster);
  }
}

template <typename T, Activation A, int kGroup>
__global__ void __launch_bounds__(kMaxThreads)
    GradientsKernel(Config c, Geometry g, GradientArgs<T> a, int64_t cluster_stride) {
  constexpr int kSlice = SliceLength(sizeof(T), true);
  const Place p(g);
  const int64_t DH = g.D * g.H, N = g.N;
  T* exchange = ZeroShared<T>(2 * g.exchange + static_cast<int64_t>(g.rows) * g.units);
  T* carry = exchange + 2 * g.exchange;  // [rows][units]: dL/dh_{k-1} at the owners
  const DirectionLayout layout = LayoutOf(c, p.direction);

  T w[kSlice], dR[kSlice];  // column j of R, and this thread's share of dR's column j
  const T* R = a.R + p.direction * g.H * g.H;
#pragma unroll
  for (int i = 0; i < kSlice; ++i) {
    const int64_t k = static_cast<int64_t>(p.slice) * kSlice + i;
    w[i] = p.has_unit && k < g.H ? R[k * g.H + p.unit] : T(0);
    dR[i] = T(0);
  }
  StepBarrier(g.cluster);

  // dz_k = (dy + carry) act'(z) at one owner's unit of row b (zero at padded steps), stored
  // and sent to every block of the cluster for step k's products.
  const auto send_dz = [&](int64_t k, int b, const StepTimes& t, T z, T dy, T carry_value) {
    const T dz = t.valid ? (dy + carry_value) * ActivateGrad<A>(z, Activate<A>(z)) : T(0);
    a.d_source[(t.in_time * N + p.row0 + b) * DH + p.column] = dz;
    Broadcast(exchange + (k & 1) * g.exchange, g.ExchangeIndex(b, p.unit, kSlice), dz,
              g.cluster);
  };
  if (p.owner && g.T > 0) {
    for (int b = 0; b < p.rows; ++b) {
      const int64_t n = p.row0 + b;
      const StepTimes t = TimesOf(layout, g.T - 1, RowLength(a.seq_lengths, n, g.T));
      const int64_t at = (t.slot * N + n) * DH + p.column;
      send_dz(g.T - 1, b, t, t.valid ? a.z[at] : T(0), t.valid ? a.dy[at] : T(0), T(0));
    }
  }
  StepBarrier(g.cluster);

  // Step k: carry = (dz_k R) * m_k and dR[:, j] += dz_k (h_{k-1} m_k)[j]; then the owners
  // send dz_{k-1}, which needs the same z_{k-1} as h_{k-1}: its loads go out before the
  // products, so their latency hides behind them.
  for (int64_t k = g.T - 1; k >= 0; --k) {
    const T* current = exchange + (k & 1) * g.exchange;
    for (int b0 = 0; b0 < p.rows; b0 += kGroup) {
      const T* rows[kGroup];
      T hm[kGroup], mask[kGroup], z_prev[kGroup], dy_prev[kGroup];
      bool valid[kGroup];
      StepTimes prev[kGroup];
#pragma unroll
      for (int r = 0; r < kGroup; ++r) {
        const int b = min(b0 + r, p.rows - 1);
        const int64_t n = p.row0 + b, length = RowLength(a.seq_lengths, n, g.T);
        rows[r] = current + (static_cast<int64_t>(b) * g.slices + p.slice) * g.stride;
        valid[r] = TimesOf(layout, k, length).valid && b0 + r < p.rows;  // repeats add nothing
        prev[r] = TimesOf(layout, k > 0 ? k - 1 : 0, length);
        const int64_t prev_at = (prev[r].slot * N + n) * DH + p.column;
        z_prev[r] = p.has_unit && k > 0 && prev[r].valid ? a.z[prev_at] : T(0);
        dy_prev[r] = p.owner && k > 0 && prev[r].valid ? a.dy[prev_at] : T(0);
        mask[r] = p.has_unit ? MaskAt(a.mask, k, n, p.column) : T(0);
        const T h_prev = k > 0 ? Activate<A>(z_prev[r])
                               : (a.h0 && p.has_unit ? a.h0[n * DH + p.column] : T(0));
        hm[r] = valid[r] ? h_prev * mask[r] : T(0);
      }
      T acc[kGroup];
      SliceProducts<T, kSlice, kGroup, true>(rows, w, hm, dR, acc);
#pragma unroll
      for (int r = 0; r < kGroup; ++r) acc[r] = SumOverSlices(acc[r], g.slices);
      if (!p.owner) continue;
#pragma unroll
      for (int r = 0; r < kGroup; ++r) {
        const int b = b0 + r;
        if (b >= p.rows) break;
        T& carry_value = carry[b * g.units + p.unit_in_block];
        carry_value = valid[r] ? acc[r] * mask[r] : T(0);
        if (k > 0) send_dz(k - 1, b, prev[r], z_prev[r], dy_prev[r], carry_value);
      }
    }
    StepBarrier(g.cluster);
  }

  if (p.owner && a.dh0) {
    for (int b = 0; b < p.rows; ++b) {
      a.dh0[(p.row0 + b) * DH + p.column] = carry[b * g.units + p.unit_in_block];
    }
  }
  if (p.has_unit) {
    T* partial = a.partial_dR + (blockIdx.x / g.cluster) * cluster_stride +
                 p.direction * g.H * g.H;
#pragma unroll
    for (int i = 0; i < kSlice; ++i) {
      const int64_t k = static_cast<int64_t>(p.slice) * kSlice + i;
      if (k < g.H) partial[k * g.H + p.unit] = dR[i];
    }
  }
}

// out[i] = sum over c of partial[c * size + i], in order of c (deterministic).
template <typename T>
__global__ void SumPartials(const T* partial, int64_t count, int64_t size, T* out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < size;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    T sum = T(0);
    for (int64_t c = 0; c < count; ++c) sum += partial[c * size + i];
    out[i] = sum;
  }
}

Geometry GeometryOf(const Dims& d, const RecurrencePlan& plan, int64_t element_bytes) {
  return Geometry{d.T,
                  d.N,
                  d.H,
                  d.D,
                  static_cast<int>(plan.slices),
                  static_cast<int>(plan.cluster),
                  static_cast<int>(plan.units),
                  static_cast<int>(plan.rows),
                  static_cast<int>(plan.slice + SlicePadding(element_bytes)),
                  plan.ExchangeElements(element_bytes)};
}

// One launch of `kernel` in the plan's grid: (clusters x cluster) blocks per direction.
template <typename... KernelArgs, typename... Args>
cudaError_t Launch(void (*kernel)(KernelArgs...), const RecurrencePlan& plan, int64_t D,
                   cudaStream_t stream, Args... args) {
  if (plan.shared_bytes > 48 * 1024) {  // above the default limit only when raised
    const cudaError_t err = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(plan.shared_bytes));
    if (err != cudaSuccess) return err;
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(plan.clusters * plan.cluster),
                        static_cast<unsigned>(D), 1);
  config.blockDim = dim3(static_cast<unsigned>(plan.threads), 1, 1);
  config.dynamicSmemBytes = static_cast<size_t>(plan.shared_bytes);
  config.stream = stream;
  cudaLaunchAttribute cluster;
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = static_cast<unsigned>(plan.cluster);
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = 1;
  if (plan.cluster > 1) {
    config.attrs = &cluster;
    config.numAttrs = 1;
  }
  const cudaError_t err = cudaLaunchKernelEx(&config, kernel, args...);
  return err != cudaSuccess ? err : cudaGetLastError();
}

// Calls f.template operator()<kGroup>() with the row group the plan's rows call for.
template <typename F>
cudaError_t DispatchGroup(const RecurrencePlan& plan, F&& f) {
  return plan.rows >= 3 ? f.template operator()<4>() : f.template operator()<1>();
}

template <typename F>
cudaError_t DispatchActivationOf(Activation activation, F&& f) {
  cudaError_t err = cudaSuccess;
  DispatchActivation(activation, [&]<Activation A>() { err = f.template operator()<A>(); });
  return err;
}

}  // namespace

template <typename T>
cudaError_t LaunchForward(const Config& c, const Dims& d, const RecurrencePlan& plan,
                          const ForwardArgs<T>& args, cudaStream_t stream) {
  if (d.T == 0 || d.N == 0) return cudaSuccess;
  const Geometry geometry = GeometryOf(d, plan, sizeof(T));
  return DispatchActivationOf(c.activation, [&]<Activation A>() {
    return DispatchGroup(plan, [&]<int kGroup>() {
      return Launch(ForwardKernel<T, A, kGroup>, plan, d.D, stream, c, geometry, args);
    });
  });
}

template <typename T>
cudaError_t LaunchGradients(const Config& c, const Dims& d, const RecurrencePlan& plan,
                            const GradientArgs<T>& args, cudaStream_t stream) {
  const int64_t weight_elements = d.D * d.H * d.H;
  if (d.T == 0 || d.N == 0) {  // no steps: every gradient is zero
    cudaError_t err = cudaMemsetAsync(args.dR, 0, weight_elements * sizeof(T), stream);
    if (err == cudaSuccess && args.dh0 && d.N > 0) {
      err = cudaMemsetAsync(args.dh0, 0, d.N * d.DH() * sizeof(T), stream);
    }
    return err;
  }
  const Geometry geometry = GeometryOf(d, plan, sizeof(T));
  const cudaError_t err = DispatchActivationOf(c.activation, [&]<Activation A>() {
    return DispatchGroup(plan, [&]<int kGroup>() {
      return Launch(GradientsKernel<T, A, kGroup>, plan, d.D, stream, c, geometry, args,
                    weight_elements);
    });
  });
  if (err != cudaSuccess) return err;
  constexpr int kThreads = 256;
  const int64_t blocks = std::min<int64_t>((weight_elements + kThreads - 1) / kThreads, 1024);
  SumPartials<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      args.partial_dR, plan.clusters, weight_elements, args.dR);
  return cudaGetLastError();
}

template cudaError_t LaunchForward<float>(const Config&, const Dims&, const RecurrencePlan&,
                                          const ForwardArgs<float>&, cudaStream_t);
template cudaError_t LaunchForward<double>(const Config&, const Dims&, const RecurrencePlan&,
                                           const ForwardArgs<double>&, cudaStream_t);
template cudaError_t LaunchGradients<float>(const Config&, const Dims&, const RecurrencePlan&,
                                            const GradientArgs<float>&, cudaStream_t);
template cudaError_t LaunchGradients<double>(const Config&, const Dims&, const RecurrencePlan&,
                                             const GradientArgs<double>&, cudaStream_t);

}  // namespace sgrnn::cuda
