#include "cpu/kernels.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu/packed_product.h"
#include "cpu/parallel.h"
#include "cpu/phase_timer.h"

// SGRNN_ISA names the instruction-set build this translation unit is (see kernels.h).
namespace sgrnn::cpu::SGRNN_ISA {
namespace {

// Reverses the time order of each row's first RowLength steps (all T without lengths) in the
// [T, N, H] block at p (row stride ld), for batch rows n0..n1-1, in place.
template <typename T>
void FlipTime(T* p, const Dims& d, int64_t ld, const int32_t* seq_lengths, int64_t n0,
              int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const int64_t length = RowLength(seq_lengths, n, d.T);
    for (int64_t t = 0; t < length / 2; ++t) {
      T* a = p + (t * d.N + n) * ld;
      T* b = p + ((length - 1 - t) * d.N + n) * ld;
      std::swap_ranges(a, a + d.H, b);
    }
  }
}

// Zeros the steps at and past each row's length in the [T, N, H] block at p (row stride ld),
// for batch rows n0..n1-1: the padding of a run with per-row lengths.
template <typename T>
void ZeroPadding(T* p, const Dims& d, int64_t ld, const int32_t* seq_lengths, int64_t n0,
                 int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t t = RowLength(seq_lengths, n, d.T); t < d.T; ++t) {
      std::fill_n(p + (t * d.N + n) * ld, d.H, T(0));
    }
  }
}

// The layout a direction's step loop runs in: its own, or processing order when rows have
// their own lengths (DirectionLayout::InProcessingOrder).
DirectionLayout RunLayout(const Config& c, int64_t dir, const int32_t* seq_lengths) {
  const DirectionLayout layout = LayoutOf(c, dir);
  return seq_lengths ? layout.InProcessingOrder() : layout;
}

// out[n, j] = h[n, j] * mask[k, n0 + n, col0 + j] for an [n1-n0, H] block (h: row stride ld).
template <typename T>
void MaskRows(const MaskView<T>& mask, int64_t k, int64_t col0, int64_t n0, int64_t n1,
              int64_t H, const T* h, int64_t ld, T* mask_block, T* out) {
  mask.Expand(k, col0, n0, n1, H, mask_block);
  for (int64_t n = 0; n < n1 - n0; ++n) {
    for (int64_t j = 0; j < H; ++j) out[n * H + j] = h[n * ld + j] * mask_block[n * H + j];
  }
}

}  // namespace

template <typename T>
void Forward(const Executor& ex, const Config& c, const Dims& d, const ForwardOperands<T>& a) {
  const int64_t N = d.N, H = d.H, DH = d.DH(), rows = d.rows();
  if (rows == 0) return;
  // Without training, z is built in y and activated in place.
  T* zs = c.training ? a.z : a.y;

  PhaseTimer timer(Phase::kProjection);
  // The input projection of every step and both directions is one product, the bias added
  // to each row as it is finished.
  const auto add_bias = [&](int64_t, T* row) {
    if (!c.has_bias) return;
    for (int64_t j = 0; j < DH; ++j) row[j] += a.b[j];
  };
  if (c.has_input_weight) {
    const Product<T> projection(a.W, d.I, /*K=*/d.I, /*cols=*/DH, /*transpose=*/true,
                                d.I * DH <= kPackedMaxFloats);
    ParallelProduct(ex, projection, rows, d.I, DH, a.x, d.I, zs, add_bias);
  } else {
    std::copy(a.x, a.x + rows * DH, zs);
    if (c.has_bias) ParallelRows(ex, rows, rows * DH, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) add_bias(r, zs + r * DH);
    });
  }
  for (int64_t dir = 0; dir < d.D; ++dir) {  // each step's input into its step's slot
    if (RunLayout(c, dir, a.seq_lengths).source_order_differs()) {
      FlipTime(zs + dir * H, d, DH, a.seq_lengths, 0, N);
    }
  }

  const Bands bands(ex, d);
  std::vector<Product<T>> products;  // h R^T, per direction
  for (int64_t dir = 0; dir < d.D; ++dir) {
    products.emplace_back(a.R + dir * H * H, H, H, H, /*transpose=*/true,
                          PackStepProduct(bands.max_rows(), H));
  }
  // Per piece: the masked previous state, the expanded mask, the zero state standing in for a
  // missing h0 (its product is still taken, so 0 * inf in R gives NaN as the reference does),
  // and the step's product. Allocated here: the pieces may run on pool threads, which must
  // not throw.
  const int64_t block = bands.max_rows() * H;
  const int64_t scratch = 4 * block;
  std::vector<T> scratch_all(bands.count() * scratch);
  timer.Switch(Phase::kRecurrence);
  bands.ForEach(ex, [&](const Band& band) {
    const DirectionLayout run = RunLayout(c, band.dir, a.seq_lengths);
    const int64_t col = band.dir * H, n_rows = band.n1 - band.n0, row0 = band.n0 * DH + col;
    T* masked = scratch_all.data() + band.item * scratch;
    T* mask_block = masked + block;
    const T* zero_state = masked + 2 * block;
    T* product = masked + 3 * block;
    const int64_t steps = band.Steps(a.seq_lengths, d.T);
    DispatchActivation(c.activation, [&]<Activation A>() {
      for (int64_t k = 0; k < steps; ++k) {
        const int64_t slot = run.Slot(k, d.T);
        T* z_k = zs + slot * N * DH + row0;
        T* y_k = a.y + slot * N * DH + row0;
        const T* h_prev = k > 0 ? a.y + run.Slot(k - 1, d.T) * N * DH + row0
                                : (a.h0 ? a.h0 + row0 : zero_state);
        int64_t ld = h_prev == zero_state ? H : DH;
        if (a.mask.data) {
          MaskRows(a.mask, k, col, band.n0, band.n1, H, h_prev, ld, mask_block, masked);
          h_prev = masked, ld = H;
        }
        // z[k] = x'[k] + h[k-1] R^T, then y[k] = act(z[k]), a tile at a time. In place when
        // z is y: a compiler that cannot prove z and y apart guards the two-array loop with an
        // overlap check, which z == y fails, and runs it scalar (clang does).
        products[band.dir](n_rows, h_prev, ld, product, [&](int64_t n, const T* v) {
          T* z = z_k + n * DH;
          T* y = y_k + n * DH;
          if (z == y) {
            for (int64_t j = 0; j < H; ++j) y[j] = Activate<A>(y[j] + v[j]);
          } else {
            for (int64_t j = 0; j < H; ++j) {
              z[j] += v[j];
              y[j] = Activate<A>(z[j]);
            }
          }
        });
      }
    });
    if (a.seq_lengths) {  // padding to zeros, then the flipped half's rows into source time
      for (T* out : {a.y, c.training ? a.z : nullptr}) {
        if (out == nullptr) continue;
        ZeroPadding(out + col, d, DH, a.seq_lengths, band.n0, band.n1);
        if (LayoutOf(c, band.dir).store_flipped) {
          FlipTime(out + col, d, DH, a.seq_lengths, band.n0, band.n1);
        }
      }
    }
  });
}

template <typename T>
void Gradients(const Executor& ex, const Config& c, const Dims& d, const GradientOperands<T>& a) {
  const int64_t N = d.N, H = d.H, DH = d.DH(), rows = d.rows();
  if (rows == 0) {  // empty sequence or batch: every gradient is zero
    std::fill(a.dR, a.dR + d.D * H * H, T(0));
    if (a.dW) std::fill(a.dW, a.dW + DH * d.I, T(0));
    if (a.db) std::fill(a.db, a.db + DH, T(0));
    if (a.dh0) std::fill(a.dh0, a.dh0 + N * DH, T(0));
    return;
  }
  PhaseTimer timer(Phase::kBackRecurrence);
  // dz = dL/dz, [T, N, D*H]. Without W it is exactly dx, so it is built there.
  // Both buffers below are written in full before they are read, so they are not zeroed (for
  // small problems zeroing them cost as much as a phase).
  std::unique_ptr<T[]> dz_storage(new T[a.W ? rows * DH : 0]);
  T* dz = a.W ? dz_storage.get() : a.dx;
  // Per direction, hm[slot(k)] = h[k-1] * m[k], the recurrent input of step k, for dR in one
  // product; one spare slot at the end takes the last step's h, keeping the loop branch-free.
  const int64_t hm_size = (d.T + 1) * N * H;
  // With lengths, ZeroPadding writes the slots no step reaches.
  std::unique_ptr<T[]> hm(new T[d.D * hm_size]);

  const Bands bands(ex, d);
  std::vector<Product<T>> products;  // dz R, per direction
  for (int64_t dir = 0; dir < d.D; ++dir) {
    products.emplace_back(a.R + dir * H * H, H, H, H, /*transpose=*/false,
                          PackStepProduct(bands.max_rows(), H));
  }
  // Per piece: the carried (dz[k+1] R) * m[k+1] and the expanded mask.
  const int64_t scratch = 2 * bands.max_rows() * H;
  std::vector<T> scratch_all(bands.count() * scratch);
  // Per piece, db's part from its rows: column sums of dz, long ones, so in double.
  std::vector<double> bias_sums(a.db ? bands.count() * H : 0, 0.0);
  bands.ForEach(ex, [&](const Band& band) {
    const DirectionLayout layout = LayoutOf(c, band.dir), run = RunLayout(c, band.dir,
                                                                         a.seq_lengths);
    const int64_t col = band.dir * H, n_rows = band.n1 - band.n0, row0 = band.n0 * DH + col;
    T* hm_dir = hm.get() + band.dir * hm_size + band.n0 * H;
    T* carry = scratch_all.data() + band.item * scratch;
    T* mask_block = carry + scratch / 2;

    T* hm_first = hm_dir + run.Slot(0, d.T) * N * H;
    if (!a.h0) {
      // The zero state is still masked, so a non-finite mask gives NaN as the reference does.
      std::fill(hm_first, hm_first + n_rows * H, T(0));
      if (a.mask.data) MaskRows(a.mask, 0, col, band.n0, band.n1, H, hm_first, H, mask_block,
                                hm_first);
    } else if (a.mask.data) {
      MaskRows(a.mask, 0, col, band.n0, band.n1, H, a.h0 + row0, DH, mask_block, hm_first);
    } else {
      for (int64_t n = 0; n < n_rows; ++n) std::copy_n(a.h0 + row0 + n * DH, H, hm_first + n * H);
    }

    std::fill(carry, carry + n_rows * H, T(0));
    for (int64_t k = band.Steps(a.seq_lengths, d.T) - 1; k >= 0; --k) {
      const int64_t slot = run.Slot(k, d.T);
      T* dz_k = dz + slot * N * DH + row0;
      // h[k] feeds step k+1: store it while act(z[k]) is at hand.
      T* hm_next = hm_dir + (k + 1 < d.T ? run.Slot(k + 1, d.T) : d.T) * N * H;
      DispatchActivation(c.activation, [&]<Activation A>() {
        for (int64_t n = 0; n < n_rows; ++n) {
          // dy and z where the forward stored step k: a flipped slot depends on the row's
          // length (a finished row reads any in-bounds slot; its results are discarded).
          const int64_t length = RowLength(a.seq_lengths, band.n0 + n, d.T);
          const int64_t in = (k < length ? layout.Slot(k, length) : k) * N * DH + row0 + n * DH;
          const T* dy_row = a.dy + in;
          const T* z_row = a.z + in;
          for (int64_t j = 0; j < H; ++j) {
            const T zv = z_row[j];
            T h, grad;
            ActivateWithGrad<A>(zv, h, grad);
            dz_k[n * DH + j] = (dy_row[j] + carry[n * H + j]) * grad;
            hm_next[n * H + j] = h;
          }
        }
      });
      if (a.mask.data && k + 1 < d.T) {
        MaskRows(a.mask, k + 1, col, band.n0, band.n1, H, hm_next, H, mask_block, hm_next);
      }
      if (k == 0 && !a.dh0) break;
      products[band.dir](n_rows, dz_k, DH, carry, [](int64_t, const T*) {});  // carry = dz[k] R
      if (a.mask.data) MaskRows(a.mask, k, col, band.n0, band.n1, H, carry, H, mask_block, carry);
      for (int64_t n = 0; a.seq_lengths && n < n_rows; ++n) {  // a finished row feeds nothing
        if (k >= RowLength(a.seq_lengths, band.n0 + n, d.T)) std::fill_n(carry + n * H, H, T(0));
      }
    }
    if (a.dh0) {
      for (int64_t n = 0; n < n_rows; ++n) std::copy_n(carry + n * H, H, a.dh0 + row0 + n * DH);
    }
    if (a.seq_lengths) {  // no gradient and no dR term from a row's padded steps
      ZeroPadding(dz + col, d, DH, a.seq_lengths, band.n0, band.n1);
      ZeroPadding(hm.get() + band.dir * hm_size, d, H, a.seq_lengths, band.n0, band.n1);
    }
    if (a.db) {  // on the threads, while the piece's dz is still in cache
      double* sums = bias_sums.data() + band.item * H;
      for (int64_t t = 0; t < d.T; ++t) {
        for (int64_t n = band.n0; n < band.n1; ++n) {
          const T* row = dz + (t * N + n) * DH + col;
          for (int64_t j = 0; j < H; ++j) sums[j] += row[j];
        }
      }
    }
  });
  if (a.db) {  // the pieces' sums added in a fixed order
    std::vector<double> sums(DH, 0.0);
    for (int64_t item = 0; item < bands.count(); ++item) {
      const int64_t col = bands.At(item).dir * H;
      for (int64_t j = 0; j < H; ++j) sums[col + j] += bias_sums[item * H + j];
    }
    std::copy(sums.begin(), sums.end(), a.db);
  }

  timer.Switch(Phase::kWeightGradients);
  for (int64_t dir = 0; dir < d.D; ++dir) {
    ParallelGemmTransposedA(ex, H, H, rows, dz + dir * H, DH, hm.get() + dir * hm_size, H,
                            a.dR + dir * H * H, H);
  }
  timer.Switch(Phase::kInputGradient);
  for (int64_t dir = 0; dir < d.D; ++dir) {
    if (RunLayout(c, dir, a.seq_lengths).source_order_differs()) {  // to source time
      FlipTime(dz + dir * H, d, DH, a.seq_lengths, 0, N);
    }
  }

  // dz is now dx' in source time order for both directions: the rest are large products.
  if (a.W) {
    timer.Switch(Phase::kWeightGradients);
    ParallelGemmTransposedA(ex, DH, d.I, rows, dz, DH, a.x, d.I, a.dW, d.I);
    timer.Switch(Phase::kInputGradient);
    const Product<T> input_gradient(a.W, d.I, /*K=*/DH, /*cols=*/d.I, /*transpose=*/false,
                                    DH * d.I <= kPackedMaxFloats);
    ParallelProduct(ex, input_gradient, rows, DH, d.I, dz, DH, a.dx, [](int64_t, T*) {});
  }
}

template void Forward<float>(const Executor&, const Config&, const Dims&, const ForwardOperands<float>&);
template void Forward<double>(const Executor&, const Config&, const Dims&, const ForwardOperands<double>&);
template void Gradients<float>(const Executor&, const Config&, const Dims&, const GradientOperands<float>&);
template void Gradients<double>(const Executor&, const Config&, const Dims&, const GradientOperands<double>&);

}  // namespace sgrnn::cpu::SGRNN_ISA
