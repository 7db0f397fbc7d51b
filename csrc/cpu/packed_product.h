// The matrix products of the CPU kernels: OpenBLAS's GEMM, and a packed kernel for products
// against one small fixed matrix (the recurrence's per-step product, the projection, dx).
// Part of kernels.cc, compiled once per instruction set inside its SGRNN_ISA namespace (see
// kernels.h), so each build gets its own copy; include it from kernels.cc only.
#ifndef JAX_SGRNN_CPU_PACKED_PRODUCT_H_
#define JAX_SGRNN_CPU_PACKED_PRODUCT_H_

#include <algorithm>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

#include "cpu/blas.h"
#include "sgrnn/core.h"

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
// between the builds (cmake/check_isa_symbols.py rejects it).
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

}  // namespace
}  // namespace sgrnn::cpu::SGRNN_ISA

#endif  // JAX_SGRNN_CPU_PACKED_PRODUCT_H_
