// How the CPU kernels split work over the executor's threads: rows of a product, the k rows of
// a weight gradient, and the recurrence's independent bands of batch rows.
// Part of kernels.cc, compiled once per instruction set inside its SGRNN_ISA namespace (see
// kernels.h), so each build gets its own copy; include it from kernels.cc only.
#ifndef JAX_SGRNN_CPU_PARALLEL_H_
#define JAX_SGRNN_CPU_PARALLEL_H_

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu/kernels.h"
#include "cpu/packed_product.h"
#include "sgrnn/core.h"

namespace sgrnn::cpu::SGRNN_ISA {
namespace {

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
}  // namespace sgrnn::cpu::SGRNN_ISA

#endif  // JAX_SGRNN_CPU_PARALLEL_H_
