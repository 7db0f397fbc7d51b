#include "cpu/kernels.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cblas.h"  // scipy-openblas32: symbols carry a scipy_ prefix

// SGRNN_ISA names the instruction-set build this translation unit is (see kernels.h).
namespace sgrnn::cpu::SGRNN_ISA {
namespace {

// Row-major C = alpha op(A) op(B) + beta C, on the calling thread.
void Gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
          const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
          int64_t ldc) {
  if (m == 0 || n == 0) return;
  scipy_cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
                    trans_b ? CblasTrans : CblasNoTrans, m, n, k, alpha, a, lda, b, ldb, beta,
                    c, ldc);
}

void Gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, double alpha,
          const double* a, int64_t lda, const double* b, int64_t ldb, double beta, double* c,
          int64_t ldc) {
  if (m == 0 || n == 0) return;
  scipy_cblas_dgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
                    trans_b ? CblasTrans : CblasNoTrans, m, n, k, alpha, a, lda, b, ldb, beta,
                    c, ldc);
}

// Below this many multiply-adds, splitting work across threads costs more than it saves
// (a wake-up is a few microseconds; this is ~10 us of single-core work).
constexpr int64_t kMinParallelMacs = int64_t{1} << 20;

// Splits [0, n) into contiguous ranges, one per thread when `macs` is worth it, and runs
// body(begin, end) on each.
template <typename F>
void ForRanges(const Executor& ex, int64_t n, int64_t macs, F&& body) {
  const int64_t parts = macs >= kMinParallelMacs ? std::min(ex.width(), n) : 1;
  if (parts <= 1) {
    body(int64_t{0}, n);
    return;
  }
  ex.ForEach(parts, [&](int64_t p) { body(n * p / parts, n * (p + 1) / parts); });
}

// Gemm with the rows of C split across the executor's threads.
template <typename T>
void ParallelGemm(const Executor& ex, bool trans_a, bool trans_b, int64_t m, int64_t n,
                  int64_t k, const T* a, int64_t lda, const T* b, int64_t ldb, T beta, T* c,
                  int64_t ldc) {
  ForRanges(ex, m, m * n * k, [&](int64_t r0, int64_t r1) {
    Gemm(trans_a, trans_b, r1 - r0, n, k, T(1), trans_a ? a + r0 : a + r0 * lda, lda, b, ldb,
         beta, c + r0 * ldc, ldc);
  });
}

// Reverses the time order of the [T, N, H] block at p (row stride ld) in place.
template <typename T>
void FlipTime(T* p, const Dims& d, int64_t ld) {
  for (int64_t t = 0; t < d.T / 2; ++t) {
    for (int64_t n = 0; n < d.N; ++n) {
      T* a = p + (t * d.N + n) * ld;
      T* b = p + ((d.T - 1 - t) * d.N + n) * ld;
      std::swap_ranges(a, a + d.H, b);
    }
  }
}

// out[n, j] = h[n, j] * mask[k, n, col0 + j] for an [N, H] block (h has row stride ld).
template <typename T>
void MaskRows(const MaskView<T>& mask, int64_t k, int64_t col0, const Dims& d, const T* h,
              int64_t ld, T* mask_block, T* out) {
  mask.Expand(k, col0, d.N, d.H, mask_block);
  for (int64_t n = 0; n < d.N; ++n) {
    for (int64_t j = 0; j < d.H; ++j) out[n * d.H + j] = h[n * ld + j] * mask_block[n * d.H + j];
  }
}

}  // namespace

template <typename T>
void Forward(const Executor& ex, const Config& c, const Dims& d, const ForwardArgs<T>& a) {
  const int64_t N = d.N, H = d.H, DH = d.DH(), rows = d.rows();
  if (rows == 0) return;
  // Without training, z is built in y and activated in place.
  T* zs = c.training ? a.z : a.y;

  // The input projection of every step and both directions is one large product.
  if (c.has_input_weight) {
    ParallelGemm(ex, false, true, rows, DH, d.I, a.x, d.I, a.W, d.I, T(0), zs, DH);
  } else {
    std::copy(a.x, a.x + rows * DH, zs);
  }
  if (c.has_bias) {
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t j = 0; j < DH; ++j) zs[r * DH + j] += a.b[j];
    }
  }

  std::vector<T> masked, mask_block;
  if (a.mask.data) masked.resize(N * H), mask_block.resize(N * H);
  for (int64_t dir = 0; dir < d.D; ++dir) {
    const DirectionLayout layout = LayoutOf(c, dir);
    const int64_t col = dir * H;
    const T* R = a.R + dir * H * H;
    if (layout.source_order_differs()) FlipTime(zs + col, d, DH);
    for (int64_t k = 0; k < d.T; ++k) {
      const int64_t slot = layout.Slot(k, d.T);
      T* z_k = zs + slot * N * DH + col;
      T* y_k = a.y + slot * N * DH + col;
      const T* h_prev = k > 0 ? a.y + layout.Slot(k - 1, d.T) * N * DH + col
                              : (a.h0 ? a.h0 + col : nullptr);  // missing h0: zeros
      int64_t ld = DH;
      if (h_prev && a.mask.data) {
        MaskRows(a.mask, k, col, d, h_prev, DH, mask_block.data(), masked.data());
        h_prev = masked.data(), ld = H;
      }
      // Each thread owns a band of hidden units: z[:, band] += h_prev R[band]^T, then act.
      ForRanges(ex, H, h_prev ? N * H * H : 0, [&](int64_t j0, int64_t j1) {
        if (h_prev) Gemm(false, true, N, j1 - j0, H, T(1), h_prev, ld, R + j0 * H, H, T(1),
                         z_k + j0, DH);
        DispatchActivation(c.activation, [&]<Activation A>() {
          for (int64_t n = 0; n < N; ++n) {
            for (int64_t j = j0; j < j1; ++j) y_k[n * DH + j] = Activate<A>(z_k[n * DH + j]);
          }
        });
      });
    }
  }
}

template <typename T>
void Gradients(const Executor& ex, const Config& c, const Dims& d, const GradientArgs<T>& a) {
  const int64_t N = d.N, H = d.H, DH = d.DH(), rows = d.rows();
  if (rows == 0) {  // empty sequence or batch: every gradient is zero
    std::fill(a.dR, a.dR + d.D * H * H, T(0));
    if (a.dW) std::fill(a.dW, a.dW + DH * d.I, T(0));
    if (a.db) std::fill(a.db, a.db + DH, T(0));
    if (a.dh0) std::fill(a.dh0, a.dh0 + N * DH, T(0));
    return;
  }
  // dz = dL/dz, [T, N, D*H]. Without W it is exactly dx, so it is built there.
  std::vector<T> dz_storage(a.W ? rows * DH : 0);
  T* dz = a.W ? dz_storage.data() : a.dx;
  // hm[slot(k)] = h[k-1] * m[k], the recurrent input of step k, for dR in one product.
  std::vector<T> hm((rows + N) * H), carry(N * H), mask_block;
  if (a.mask.data) mask_block.resize(N * H);

  for (int64_t dir = 0; dir < d.D; ++dir) {
    const DirectionLayout layout = LayoutOf(c, dir);
    const int64_t col = dir * H;
    const T* R = a.R + dir * H * H;
    T* hm_first = hm.data() + layout.Slot(0, d.T) * N * H;
    if (!a.h0) {
      std::fill(hm_first, hm_first + N * H, T(0));
    } else if (a.mask.data) {
      MaskRows(a.mask, 0, col, d, a.h0 + col, DH, mask_block.data(), hm_first);
    } else {
      for (int64_t n = 0; n < N; ++n) std::copy_n(a.h0 + n * DH + col, H, hm_first + n * H);
    }

    std::fill(carry.begin(), carry.end(), T(0));  // (dz[k+1] R) * m[k+1]
    for (int64_t k = d.T - 1; k >= 0; --k) {
      const int64_t slot = layout.Slot(k, d.T);
      const T* dy_k = a.dy + slot * N * DH + col;
      const T* z_k = a.z + slot * N * DH + col;
      T* dz_k = dz + slot * N * DH + col;
      // h[k] feeds step k+1: store it while act(z[k]) is at hand (the last step's goes to
      // the spare slot at the end, which keeps the loop free of branches).
      T* hm_next = hm.data() + (k + 1 < d.T ? layout.Slot(k + 1, d.T) : d.T) * N * H;
      const T* carry_k = carry.data();
      DispatchActivation(c.activation, [&]<Activation A>() {
        for (int64_t n = 0; n < N; ++n) {
          for (int64_t j = 0; j < H; ++j) {
            const T zv = z_k[n * DH + j];
            const T h = Activate<A>(zv);
            dz_k[n * DH + j] = (dy_k[n * DH + j] + carry_k[n * H + j]) * ActivateGrad<A>(zv, h);
            hm_next[n * H + j] = h;
          }
        }
      });
      if (a.mask.data && k + 1 < d.T) {
        MaskRows(a.mask, k + 1, col, d, hm_next, H, mask_block.data(), hm_next);
      }
      if (k == 0 && !a.dh0) break;
      ForRanges(ex, H, N * H * H, [&](int64_t j0, int64_t j1) {
        Gemm(false, false, N, j1 - j0, H, T(1), dz_k, DH, R + j0, H, T(0), carry.data() + j0, H);
      });
      if (a.mask.data) MaskRows(a.mask, k, col, d, carry.data(), H, mask_block.data(),
                                carry.data());
    }
    if (a.dh0) {
      for (int64_t n = 0; n < N; ++n) std::copy_n(&carry[n * H], H, a.dh0 + n * DH + col);
    }
    ParallelGemm(ex, true, false, H, H, rows, dz + col, DH, hm.data(), H, T(0),
                 a.dR + dir * H * H, H);
    if (layout.source_order_differs()) FlipTime(dz + col, d, DH);  // back to source time
  }

  // dz is now dx' in source time order for both directions: the rest are large products.
  if (a.db) {
    std::vector<double> sums(DH, 0.0);  // long column sums: accumulate in double
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t j = 0; j < DH; ++j) sums[j] += dz[r * DH + j];
    }
    std::copy(sums.begin(), sums.end(), a.db);
  }
  if (a.W) {
    ParallelGemm(ex, true, false, DH, d.I, rows, dz, DH, a.x, d.I, T(0), a.dW, d.I);
    ParallelGemm(ex, false, false, rows, d.I, DH, dz, DH, a.W, d.I, T(0), a.dx, d.I);
  }
}

template void Forward<float>(const Executor&, const Config&, const Dims&, const ForwardArgs<float>&);
template void Forward<double>(const Executor&, const Config&, const Dims&, const ForwardArgs<double>&);
template void Gradients<float>(const Executor&, const Config&, const Dims&, const GradientArgs<float>&);
template void Gradients<double>(const Executor&, const Config&, const Dims&, const GradientArgs<double>&);

}  // namespace sgrnn::cpu::SGRNN_ISA
