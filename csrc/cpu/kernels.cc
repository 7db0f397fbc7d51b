#include "cpu/kernels.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

#include "cpu/blas.h"

// SGRNN_ISA names the instruction-set build this translation unit is (see kernels.h).
namespace sgrnn::cpu::SGRNN_ISA {
namespace {

// Row-major C = alpha op(A) op(B) + beta C, on the calling thread.
void Gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
          const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
          int64_t ldc) {
  if (m == 0 || n == 0) return;
  SGRNN_BLAS_THREAD_SETUP();
  SGRNN_CBLAS(sgemm)(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
                    trans_b ? CblasTrans : CblasNoTrans, m, n, k, alpha, a, lda, b, ldb, beta,
                    c, ldc);
}

void Gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, double alpha,
          const double* a, int64_t lda, const double* b, int64_t ldb, double beta, double* c,
          int64_t ldc) {
  if (m == 0 || n == 0) return;
  SGRNN_BLAS_THREAD_SETUP();
  SGRNN_CBLAS(dgemm)(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
                    trans_b ? CblasTrans : CblasNoTrans, m, n, k, alpha, a, lda, b, ldb, beta,
                    c, ldc);
}

// --------------------------------------------------------------------------------------------
// Products of many or few rows against one small fixed matrix: the per-step product of the
// recurrence (a band of the batch times one direction's R, every step), the input projection
// x W^T and the input gradient dz W. A general GEMM re-packs B into its panel layout on every
// call, and OpenBLAS's AVX2 (Haswell) kernels have no unpacked small-matrix path, so with a
// handful of rows that repacking is a large share of the step. Here B is packed once per call
// into panels of kPanel columns (k-major), and a register-blocked kernel keeps a
// kRowBlock x kPanel tile of the product in vector registers while it walks k. Each finished
// row goes to the caller's epilogue (the activation, the bias) while it is in cache. Vector
// width and tile follow the instruction set this file is compiled for (kernels.h).

#if defined(__AVX512F__)
constexpr int kLanes = 16, kRowBlock = 8, kRegisters = 32;  // 16 zmm accumulate
#elif defined(__AVX2__)
constexpr int kLanes = 8, kRowBlock = 6, kRegisters = 16;  // 12 ymm accumulate
#else
constexpr int kLanes = 4, kRowBlock = 4, kRegisters = 16;  // SSE2: 8 xmm accumulate
#endif
constexpr int kPanel = 2 * kLanes;
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));
// One vector of packed panel data, as a type of this build's own namespace: the std::vector
// code for a plain vector type would be a weak symbol outside it, which the linker may share
// between the builds (cmake/check_isa_symbols.cmake rejects it).
struct PanelVector {
  Lanes lanes;
};

// The packed kernel runs a product while B's panels stay in a core's L2 (on 2 MiB of L2 it
// matched or beat single-threaded OpenBLAS at any number of rows up to 512 x 512, and lost at
// 1024 x 1024), and a per-step product of a band of at most kPackedMaxRows rows at any H (there
// OpenBLAS's repacking of R every step costs more). Measured: docs/performance.md.
constexpr int64_t kPackedMaxFloats = 512 * 512;
constexpr int64_t kPackedMaxRows = 32;

// Whether the per-step product of bands of up to `band_rows` rows runs the packed kernel.
constexpr bool PackStepProduct(int64_t band_rows, int64_t H) {
  return band_rows <= kPackedMaxRows || H * H <= kPackedMaxFloats;
}

// Panels one tile covers for a block of kRows rows: two when their accumulators, the four
// vectors of B and a broadcast fit the registers (few rows), so that each load of A and each
// loop step feed twice the multiply-adds; else one.
template <int kRows>
constexpr int kTilePanels = 4 * kRows + 5 <= kRegisters ? 2 : 1;

// Rows [0, kRows) of A (row stride lda) times kPanels adjacent packed panels (each K rows of
// kPanel, `panel_stride` floats apart) into out (row stride ldo): out[r][c] = sum_k A[r,k]
// B[k,c] for c < width. The accumulators go straight to out when the tile is whole (a copy
// through a local tile cost as much as the loop at 8 rows x 64), else through a local row.
template <int kRows, int kPanels>
void PanelTile(const float* a, int64_t lda, const float* panel, int64_t panel_stride, int64_t K,
               float* out, int64_t ldo, int64_t width) {
  Lanes acc[kRows][2 * kPanels] = {};
  for (int64_t k = 0; k < K; ++k) {
    Lanes b[2 * kPanels];
    for (int q = 0; q < kPanels; ++q) {
      __builtin_memcpy(&b[2 * q], panel + q * panel_stride + k * kPanel, sizeof(Lanes));
      __builtin_memcpy(&b[2 * q + 1], panel + q * panel_stride + k * kPanel + kLanes,
                       sizeof(Lanes));
    }
    for (int r = 0; r < kRows; ++r) {
      const float s = a[r * lda + k];
      for (int v = 0; v < 2 * kPanels; ++v) acc[r][v] += s * b[v];
    }
  }
  if (width == kPanels * kPanel) {
    for (int r = 0; r < kRows; ++r) __builtin_memcpy(out + r * ldo, acc[r], sizeof acc[r]);
  } else {
    for (int r = 0; r < kRows; ++r) {
      float row[kPanels * kPanel];
      __builtin_memcpy(row, acc[r], sizeof row);
      std::copy_n(row, width, out + r * ldo);
    }
  }
}

// Calls f.template operator()<kRows>() with 1 <= rows <= kRowBlock as a compile-time constant.
template <int kRows = kRowBlock, typename F>
void DispatchRows(int64_t rows, F&& f) {
  if constexpr (kRows > 1) {
    if (rows < kRows) return DispatchRows<kRows - 1>(rows, f);
  }
  f.template operator()<kRows>();
}

// C = A B for m rows of A ([m, K], row stride lda) into out ([m, cols], dense), with B given
// as [cols, K] (transpose: the forward's h R^T, the projection's x W^T) or [K, cols] (the
// backward's dz R, the input gradient's dz W), row stride ldb. Each finished row then goes to
// epilogue(n, row), so the caller fuses what comes next while the row is in cache. float with
// `pack` uses the packed kernel; the rest (double, large bands or matrices) one OpenBLAS call.
template <typename T>
class Product {
 public:
  Product(const T* B, int64_t ldb, int64_t K, int64_t cols, bool transpose, bool pack)
      : B_(B), ldb_(ldb), K_(K), cols_(cols), transpose_(transpose),
        packed_(std::is_same_v<T, float> && pack) {
    if (!packed_) return;
    const int64_t panels = (cols + kPanel - 1) / kPanel;
    panels_.assign(panels * K * 2, PanelVector{});  // kPanel floats a row, zero past cols
    float* packed = PanelData();
    for (int64_t p = 0; p < panels; ++p) {
      for (int64_t k = 0; k < K; ++k) {
        for (int64_t c = 0; c < kPanel && p * kPanel + c < cols; ++c) {
          const int64_t col = p * kPanel + c;
          packed[(p * K + k) * kPanel + c] =
              static_cast<float>(transpose ? B[col * ldb + k] : B[k * ldb + col]);
        }
      }
    }
  }

  template <typename Epilogue>
  void operator()(int64_t m, const T* a, int64_t lda, T* out, Epilogue&& epilogue) const {
    if constexpr (std::is_same_v<T, float>) {
      if (packed_) return Packed(m, a, lda, out, epilogue);
    }
    Gemm(false, transpose_, m, cols_, K_, T(1), a, lda, B_, ldb_, T(0), out, cols_);
    for (int64_t n = 0; n < m; ++n) epilogue(n, out + n * cols_);
  }

 private:
  template <typename Epilogue>
  void Packed(int64_t m, const float* a, int64_t lda, float* out, Epilogue& epilogue) const {
    // Blocks of equal size (8 rows on AVX2: 4 + 4, not 6 + 2, whose 2-row tile is load-bound).
    const int64_t blocks = (m + kRowBlock - 1) / kRowBlock;
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t r0 = m * b / blocks;
      DispatchRows(m * (b + 1) / blocks - r0, [&]<int kRows>() {
        int64_t c0 = 0;
        const auto tiles = [&]<int kPanels>() {
          for (; c0 + (kPanels - 1) * kPanel < cols_; c0 += kPanels * kPanel) {
            PanelTile<kRows, kPanels>(a + r0 * lda, lda, PanelData() + c0 * K_, K_ * kPanel, K_,
                                      out + r0 * cols_ + c0, cols_,
                                      std::min<int64_t>(kPanels * kPanel, cols_ - c0));
          }
        };
        constexpr int kPanels = kTilePanels<kRows>;
        tiles.template operator()<kPanels>();  // whole groups of kPanels panels
        if constexpr (kPanels > 1) tiles.template operator()<1>();  // a last odd panel
        for (int r = 0; r < kRows; ++r) epilogue(r0 + r, out + (r0 + r) * cols_);
      });
    }
  }

  float* PanelData() { return reinterpret_cast<float*>(panels_.data()); }
  const float* PanelData() const { return reinterpret_cast<const float*>(panels_.data()); }

  const T* B_;
  int64_t ldb_, K_, cols_;
  bool transpose_;
  bool packed_;
  // Panel p: K rows of kPanel columns. Held as vectors so that every row of a panel is aligned
  // to the vector width: unaligned, each load splits across two cache lines (5-12% slower).
  std::vector<PanelVector> panels_;
};

// Adds wall time to the current phase, when timing is on: from construction (or the last
// Switch) to the next Switch or the end of the scope.
class PhaseTimer {
 public:
  explicit PhaseTimer(Phase phase) : phase_(phase), on_(PhaseTimingOn()), start_(Now()) {}
  ~PhaseTimer() { Switch(phase_); }

  void Switch(Phase next) {
    if (on_) {
      const auto now = Now();
      AddPhaseTime(phase_,
                   std::chrono::duration_cast<std::chrono::nanoseconds>(now - start_).count());
      start_ = now;
    }
    phase_ = next;
  }

 private:
  std::chrono::steady_clock::time_point Now() const {
    return on_ ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
  }

  Phase phase_;
  bool on_;
  std::chrono::steady_clock::time_point start_;
};

// Below this many multiply-adds, splitting work across threads costs more than it saves
// (a wake-up is a few microseconds; this is ~10 us of single-core work).
constexpr int64_t kMinParallelMacs = int64_t{1} << 20;

// body(r0, r1) over [0, m) in one contiguous range of rows per thread, split across the
// executor's threads when the work (`macs` multiply-adds) is large enough.
template <typename F>
void ParallelRows(const Executor& ex, int64_t m, int64_t macs, F&& body) {
  const int64_t parts = macs >= kMinParallelMacs ? std::min(ex.width(), m) : 1;
  if (parts <= 1) return body(int64_t{0}, m);
  ex.ForEach(parts, [&](int64_t p) { body(m * p / parts, m * (p + 1) / parts); });
}

// C = A^T B (A: [k, m], B: [k, n]; the weight gradients, k = T*N) with the k rows split across
// the executor's threads: each thread packs only its own rows of both operands, where a split
// of C's rows packs all of B on every thread (slower per thread at the benchmark's shapes).
// The partial products are then added in a fixed order, so the result does not depend on
// which thread ran which part.
template <typename T>
void ParallelGemmTransposedA(const Executor& ex, int64_t m, int64_t n, int64_t k, const T* a,
                             int64_t lda, const T* b, int64_t ldb, T* c, int64_t ldc) {
  const int64_t parts = m * n * k >= kMinParallelMacs ? std::min(ex.width(), k) : 1;
  std::vector<T> partials((parts - 1) * m * n);  // parts 1.. (part 0 writes c)
  const auto part = [&](int64_t p) {
    const int64_t k0 = k * p / parts, k1 = k * (p + 1) / parts;
    T* out = p == 0 ? c : partials.data() + (p - 1) * m * n;
    Gemm(true, false, m, n, k1 - k0, T(1), a + k0 * lda, lda, b + k0 * ldb, ldb, T(0), out,
         p == 0 ? ldc : n);
  };
  if (parts <= 1) return part(0);
  ex.ForEach(parts, part);
  for (int64_t p = 1; p < parts; ++p) {
    const T* partial = partials.data() + (p - 1) * m * n;
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) c[i * ldc + j] += partial[i * n + j];
    }
  }
}

// out = A B for the m rows of A (row stride lda), as `product` does, split across threads.
template <typename T, typename Epilogue>
void ParallelProduct(const Executor& ex, const Product<T>& product, int64_t m, int64_t K,
                     int64_t cols, const T* a, int64_t lda, T* out, Epilogue&& epilogue) {
  ParallelRows(ex, m, m * K * cols, [&](int64_t r0, int64_t r1) {
    product(r1 - r0, a + r0 * lda, lda, out + r0 * cols,
            [&](int64_t n, T* row) { epilogue(r0 + n, row); });
  });
}

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

// A recurrence splits into independent pieces: its directions, and bands of batch rows
// (row n of a step only ever reads row n of the step before). Each piece runs all T steps
// without synchronising with the others.
struct Band {
  int64_t item;    // 0 .. count-1, to find the piece's scratch memory
  int64_t dir;     // direction
  int64_t n0, n1;  // batch rows

  // The steps the piece runs: up to its longest row (rows past their length compute values
  // that are never used and zeroed at the end; the product stays one GEMM for all rows).
  int64_t Steps(const int32_t* seq_lengths, int64_t T) const {
    int64_t steps = seq_lengths ? 0 : T;
    for (int64_t n = n0; seq_lengths && n < n1; ++n) {
      steps = std::max(steps, RowLength(seq_lengths, n, T));
    }
    return steps;
  }
};

class Bands {
 public:
  Bands(const Executor& ex, const Dims& d)
      : d_(d),
        parallel_(d.T * d.N * d.H * d.H * d.D >= kMinParallelMacs),
        per_dir_(parallel_ ? std::clamp<int64_t>((ex.width() + d.D - 1) / d.D, 1, d.N) : 1) {}

  int64_t count() const { return d_.D * per_dir_; }
  int64_t max_rows() const { return (d_.N + per_dir_ - 1) / per_dir_; }

  Band At(int64_t item) const {
    const int64_t b = item % per_dir_;
    return Band{item, item / per_dir_, d_.N * b / per_dir_, d_.N * (b + 1) / per_dir_};
  }

  template <typename F>
  void ForEach(const Executor& ex, F&& body) const {
    auto run = [&](int64_t item) { body(At(item)); };
    if (!parallel_) {
      for (int64_t item = 0; item < count(); ++item) run(item);
    } else {
      ex.ForEach(count(), run);
    }
  }

 private:
  Dims d_;
  bool parallel_;
  int64_t per_dir_;
};

}  // namespace

template <typename T>
void Forward(const Executor& ex, const Config& c, const Dims& d, const ForwardArgs<T>& a) {
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
        // z[k] = x'[k] + h[k-1] R^T, then y[k] = act(z[k]), a tile at a time.
        products[band.dir](n_rows, h_prev, ld, product, [&](int64_t n, const T* v) {
          T* z = z_k + n * DH;
          T* y = y_k + n * DH;
          for (int64_t j = 0; j < H; ++j) {
            z[j] += v[j];
            y[j] = Activate<A>(z[j]);
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
void Gradients(const Executor& ex, const Config& c, const Dims& d, const GradientArgs<T>& a) {
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

template void Forward<float>(const Executor&, const Config&, const Dims&, const ForwardArgs<float>&);
template void Forward<double>(const Executor&, const Config&, const Dims&, const ForwardArgs<double>&);
template void Gradients<float>(const Executor&, const Config&, const Dims&, const GradientArgs<float>&);
template void Gradients<double>(const Executor&, const Config&, const Dims&, const GradientArgs<double>&);

}  // namespace sgrnn::cpu::SGRNN_ISA
