// Backend-independent rules of the single-gate RNN: flags, sizes, time order, mask
// broadcasting and the activations. Every handler (CPU, CUDA, MPSGraph) shares these; none of
// this depends on XLA. docs/semantics.md is the contract.
#ifndef JAX_SGRNN_CORE_H_
#define JAX_SGRNN_CORE_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

// The rules below that kernels use are compiled for the GPU too (csrc/cuda), so that every
// handler shares one definition of them.
#if defined(__CUDACC__)
#define SGRNN_HOST_DEVICE __host__ __device__
#else
#define SGRNN_HOST_DEVICE
#endif

namespace sgrnn {

// MPSGraphRNNActivation's numbering; the Python enum uses the same values.
enum class Activation : int32_t {
  kNone = 0,
  kRelu = 1,
  kTanh = 2,
  kSigmoid = 3,
  kHardSigmoid = 4,
};

inline constexpr int32_t kActivationCount = 5;

inline bool IsValidActivation(Activation a) {
  return static_cast<int32_t>(a) >= 0 && static_cast<int32_t>(a) < kActivationCount;
}

// Hard sigmoid: clamp(slope z + offset, 0, 1), saturated beyond +-edge (MPS's and ONNX's
// defaults; MPSGraph does not document them). reference.py spells the same three numbers.
inline constexpr double kHardSigmoidSlope = 0.2, kHardSigmoidOffset = 0.5,
                        kHardSigmoidEdge = 2.5;

// The typed FFI attributes of both ops: the descriptor and which optional operands are given.
struct Config {
  Activation activation;
  bool reverse;
  bool bidirectional;
  bool training;  // forward only: whether z is returned
  bool has_input_weight;
  bool has_bias;
  bool has_init_state;
  bool has_mask;
  bool has_seq_lengths;  // per-row sequence lengths (int32 [N]); not an MPSGraph operand

  int64_t directions() const { return bidirectional ? 2 : 1; }
  bool operator==(const Config&) const = default;
};

// Problem sizes: T steps, N batch, I source features, H hidden, D directions.
struct Dims {
  int64_t T, N, I, H, D;
  int64_t DH() const { return D * H; }
  int64_t rows() const { return T * N; }  // rows of every [T, N, *] tensor seen as a matrix
};

// Where one direction reads its input and stores its outputs (spec, "time order").
struct DirectionLayout {
  bool read_reversed;  // step k consumes x[T-1-k]
  bool store_flipped;  // step k is stored at time T-1-k (backward half of a bidirectional RNN)

  // Time index of the y/z slot written at processing step k.
  SGRNN_HOST_DEVICE int64_t Slot(int64_t k, int64_t T) const { return store_flipped ? T - 1 - k : k; }
  // True when projected inputs, computed in source time order, must be flipped in time to sit
  // in their step's slot (unidirectional reverse), and gradients flipped back the same way.
  SGRNN_HOST_DEVICE bool source_order_differs() const { return read_reversed != store_flipped; }
  // With per-row lengths a flipped slot differs from row to row, so a run stores step k at k
  // and flips each row's first `length` steps into place afterwards.
  SGRNN_HOST_DEVICE DirectionLayout InProcessingOrder() const { return {read_reversed, false}; }
};

// Row n's number of valid steps: seq_lengths[n] clamped to [0, T] (the Python side rejects
// concrete lengths outside it and documents the clamp for traced ones); T without lengths.
// Steps k >= length leave the row's state alone and give zeros; a reversed direction starts at
// the row's own last valid step, so DirectionLayout's T becomes the row's length.
SGRNN_HOST_DEVICE inline int64_t RowLength(const int32_t* seq_lengths, int64_t n, int64_t T) {
  return seq_lengths ? std::clamp<int64_t>(seq_lengths[n], 0, T) : T;
}

SGRNN_HOST_DEVICE inline DirectionLayout LayoutOf(const Config& c, int64_t direction) {
  if (direction == 1) return {true, true};
  return {c.reverse && !c.bidirectional, false};
}

// A mask of shape [Tm, Nm, Hm], each either 1 (broadcast) or the full size; the mask is indexed
// by processing step and multiplies the recurrent input only.
template <typename T>
struct MaskView {
  const T* data = nullptr;  // null: no mask
  int64_t t_stride = 0, n_stride = 0, h_stride = 0;

  MaskView() = default;
  MaskView(const T* d, int64_t Tm, int64_t Nm, int64_t Hm)
      : data(d),
        t_stride(Tm == 1 ? 0 : Nm * Hm),
        n_stride(Nm == 1 ? 0 : Hm),
        h_stride(Hm == 1 ? 0 : 1) {}

  // Writes mask[k, n0:n1, col0:col0+H] broadcast to a dense [n1-n0, H] block.
  void Expand(int64_t k, int64_t col0, int64_t n0, int64_t n1, int64_t H, T* out) const {
    for (int64_t n = n0; n < n1; ++n) {
      const T* row = data + k * t_stride + n * n_stride + col0 * h_stride;
      for (int64_t j = 0; j < H; ++j) out[(n - n0) * H + j] = row[j * h_stride];
    }
  }
};

// Every operand and result of the forward op for one problem as typed pointers, null where
// absent, in the FFI schema's order (ffi_schema.h's BindForward, which makes them from the
// buffers). The CPU kernels take it as it is.
template <typename T>
struct ForwardOperands {
  const T* x;   // source [T, N, I]
  const T* R;   // [D, H, H]
  const T* W;   // [D*H, I] or null
  const T* b;   // [D*H] or null
  const T* h0;  // [N, D*H] or null
  MaskView<T> mask;            // [Tm, Nm, Hm]; null data: no mask
  const int32_t* seq_lengths;  // [N] or null (RowLength clamps them)
  T* y;  // [T, N, D*H]
  T* z;  // [T, N, D*H], or null when not training
};

// The same for the gradient op (BindGradients), for one problem of its group.
template <typename T>
struct GradientOperands {
  const T* x;   // [T, N, I]
  const T* R;   // [D, H, H]
  const T* dy;  // [T, N, D*H]
  const T* z;   // [T, N, D*H]
  const T* W;   // [D*H, I] or null
  const T* b;   // [D*H] or null (only its presence matters)
  const T* h0;  // [N, D*H] or null
  MaskView<T> mask;
  const int32_t* seq_lengths;  // [N] or null
  T* dx;   // [T, N, I]
  T* dR;   // [D, H, H], or null where the lowering computes it (CUDA)
  T* dW;   // [D*H, I] or null
  T* db;   // [D*H] or null
  T* dh0;  // [N, D*H] or null
};

// std::bit_cast, which libc++ lacks before LLVM 14 (Xcode 14's SDK, the oldest this package
// supports on macOS); compilers turn the copy into a register move.
template <typename To, typename From>
SGRNN_HOST_DEVICE inline To BitCast(const From& from) {
  static_assert(sizeof(To) == sizeof(From), "BitCast between types of different sizes");
  To to;
  __builtin_memcpy(&to, &from, sizeof(To));
  return to;
}

// a / b in the activations' rational forms, where b lies in [2^-8, 2^8]. On the GPU it is a
// reciprocal instruction and a multiply (within 2 ulp) instead of an IEEE division, which
// takes a dozen instructions and a slow-path branch on the recurrence's critical path. The
// reciprocal is written out: __fdividef's result is the same for such b, but it also rescales
// subnormal b, a compare and two multiplies on that path.
SGRNN_HOST_DEVICE inline float ActivationDivide(float a, float b) {
#ifdef __CUDA_ARCH__
  float reciprocal;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(reciprocal) : "f"(b));
  return a * reciprocal;
#else
  return a / b;
#endif
}
SGRNN_HOST_DEVICE inline double ActivationDivide(double a, double b) { return a / b; }

// tanh as a clamped rational function (the approximation XLA and Eigen use for float32):
// branch-free, so loops over it vectorise; accurate to a few ulp. Beyond the clamp it returns
// exactly +-1 (with FMA the rational form gives 1 - 2^-22 there, which would leave a
// saturated unit a gradient); NaN stays NaN. double uses std::tanh.
SGRNN_HOST_DEVICE inline float FastTanh(float x) {
  constexpr float kClamp = 7.90531110763549805f;
  const float xc = x > kClamp ? kClamp : (x < -kClamp ? -kClamp : x);  // keeps NaN
  const float x2 = xc * xc;
  float p = -2.76076847742355e-16f;
  p = p * x2 + 2.00018790482477e-13f;
  p = p * x2 - 8.60467152213735e-11f;
  p = p * x2 + 5.12229709037114e-08f;
  p = p * x2 + 1.48572235717979e-05f;
  p = p * x2 + 6.37261928875436e-04f;
  p = p * x2 + 4.89352455891786e-03f;
  p = p * xc;
  float q = 1.19825839466702e-06f;
  q = q * x2 + 1.18534705686654e-04f;
  q = q * x2 + 2.26843463243900e-03f;
  q = q * x2 + 4.89352518554385e-03f;
  // Computed unconditionally so that the selects below vectorise.
  const float ratio = ActivationDivide(p, q);
  const float ax = std::abs(x);
  // Two selects: written as one nested conditional, nvcc branched around the inner one, on
  // the recurrence step's sequential path.
  const float outer = ax >= kClamp ? std::copysign(1.0f, x) : ratio;
  return ax < 0.0004f ? x : outer;
}
SGRNN_HOST_DEVICE inline double FastTanh(double x) { return std::tanh(x); }

// e^x, and e^x - 1, for x <= 0.
template <typename T>
struct ExpParts {
  T exp, expm1;
};

// e^x and e^x - 1 for x <= 0 (NaN stays NaN). float: Cody-Waite range reduction and Cephes'
// degree-6 polynomial, branch-free so loops over it vectorise; e^x within a few ulp wherever
// it is a normal float, and exactly 0 below -104 (where e^x rounds to 0). 2^n is applied as
// two factors so that n down to -150 stays representable. e^x - 1 is 2^n (e^r - 1) + (2^n - 1):
// no cancellation near x = 0, where e^x - 1 would lose its digits (tanh's numerator). Where
// only e^x is used, the compiler drops the rest.
SGRNN_HOST_DEVICE inline ExpParts<float> ExpNonPositiveParts(float x) {
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float xc = x < -104.0f ? -104.0f : x;  // keeps NaN
  const float shifted = xc * 1.44269504088896341f + kRound;
  const float n = shifted - kRound;
  const int32_t ni = BitCast<int32_t>(shifted) - BitCast<int32_t>(kRound);
  const float r = (xc - n * 0.693359375f) - n * -2.12194440e-4f;  // xc - n ln2, in two parts
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float r_expm1 = p * r * r + r;  // e^r - 1
  const int32_t half = ni / 2;  // ni in [-150, 0]: both factors are normal floats
  const float scale_a = BitCast<float>(static_cast<uint32_t>(half + 127) << 23);
  const float scale_b = BitCast<float>(static_cast<uint32_t>(ni - half + 127) << 23);
  const float scale = scale_a * scale_b;  // 2^n, or 0 below 2^-149 (then e^x - 1 is -1)
  return {(r_expm1 + 1.0f) * scale_a * scale_b, scale * r_expm1 + (scale - 1.0f)};
}
SGRNN_HOST_DEVICE inline float ExpNonPositive(float x) { return ExpNonPositiveParts(x).exp; }
SGRNN_HOST_DEVICE inline double ExpNonPositive(double x) { return std::exp(x); }

// The logistic function from e = e^-|z| and 1 / (1 + e), with no cancellation in either tail:
// sigmoid(z) = 1 / (1 + e) for z >= 0, e / (1 + e) below; sigmoid'(z) = e / (1 + e)^2.
// tanh'(z) = 4 sigmoid'(2z) = 4 e2 / (1 + e2)^2 with e2 = e^-2|z|, exact in the tails too.
template <typename T>
struct LogisticParts {
  T e, inverse;
};
template <typename T>
SGRNN_HOST_DEVICE inline LogisticParts<T> LogisticOf(T e) {  // e = e^-|z|
  return {e, ActivationDivide(T(1), T(1) + e)};
}
template <typename T>
SGRNN_HOST_DEVICE inline T SigmoidFrom(const LogisticParts<T>& p, T z) {
  return z >= T(0) ? p.inverse : p.e * p.inverse;  // NaN: e is NaN
}
template <typename T>
SGRNN_HOST_DEVICE inline T SigmoidGradFrom(const LogisticParts<T>& p) {
  return p.e * p.inverse * p.inverse;
}
template <typename T>
SGRNN_HOST_DEVICE inline T Sigmoid(T z) {
  return SigmoidFrom(LogisticOf(ExpNonPositive(-std::abs(z))), z);
}
template <typename T>
SGRNN_HOST_DEVICE inline T SigmoidGrad(T z) {
  return SigmoidGradFrom(LogisticOf(ExpNonPositive(-std::abs(z))));
}
template <typename T>
SGRNN_HOST_DEVICE inline T TanhGrad(T z) {
  return T(4) * SigmoidGradFrom(LogisticOf(ExpNonPositive(T(-2) * std::abs(z))));
}

// act(z), and act'(z) from z alone.
template <Activation A, typename T>
SGRNN_HOST_DEVICE inline T Activate(T z) {
  if constexpr (A == Activation::kNone) return z;
  if constexpr (A == Activation::kRelu) return (z > T(0) || z != z) ? z : T(0);  // NaN stays
  if constexpr (A == Activation::kTanh) return FastTanh(z);
  if constexpr (A == Activation::kSigmoid) return Sigmoid(z);
  if constexpr (A == Activation::kHardSigmoid)  // written so that NaN stays NaN
    return z >= T(kHardSigmoidEdge)
               ? T(1)
               : (z <= T(-kHardSigmoidEdge) ? T(0)
                                            : T(kHardSigmoidSlope) * z + T(kHardSigmoidOffset));
}

template <Activation A, typename T>
SGRNN_HOST_DEVICE inline T ActivateGrad(T z) {
  if constexpr (A == Activation::kNone) return T(1);
  if constexpr (A == Activation::kRelu) return z > T(0) ? T(1) : T(0);
  if constexpr (A == Activation::kTanh) return TanhGrad(z);
  if constexpr (A == Activation::kSigmoid) return SigmoidGrad(z);
  if constexpr (A == Activation::kHardSigmoid)
    return ((z > T(-kHardSigmoidEdge)) & (z < T(kHardSigmoidEdge))) ? T(kHardSigmoidSlope) : T(0);
}

// act(z) and act'(z) together, for the backward pass, which needs both. tanh (float) and the
// logistic function then share one exponential and one division: tanh(z) = -(e2 - 1) / (1 + e2)
// with e2 = e^-2|z| and z's sign: more accurate than FastTanh and, sharing the work, faster on
// the CPU backward. double's tanh stays std::tanh.
template <Activation A, typename T>
SGRNN_HOST_DEVICE inline void ActivateWithGrad(T z, T& h, T& grad) {
  if constexpr (A == Activation::kTanh && std::is_same_v<T, float>) {
    const ExpParts<float> e2 = ExpNonPositiveParts(-2.0f * std::abs(z));
    const LogisticParts<float> p = LogisticOf(e2.exp);
    h = std::copysign(-e2.expm1 * p.inverse, z);  // NaN stays NaN
    grad = 4.0f * SigmoidGradFrom(p);
  } else if constexpr (A == Activation::kSigmoid) {
    const LogisticParts<T> p = LogisticOf(ExpNonPositive(-std::abs(z)));
    h = SigmoidFrom(p, z);
    grad = SigmoidGradFrom(p);
  } else {
    h = Activate<A>(z);
    grad = ActivateGrad<A>(z);
  }
}

// Calls f.template operator()<A>() with the activation as a compile-time constant, so each
// elementwise loop is compiled once per activation with no branch inside.
template <typename F>
inline void DispatchActivation(Activation a, F&& f) {
  switch (a) {
    case Activation::kNone: return f.template operator()<Activation::kNone>();
    case Activation::kRelu: return f.template operator()<Activation::kRelu>();
    case Activation::kTanh: return f.template operator()<Activation::kTanh>();
    case Activation::kSigmoid: return f.template operator()<Activation::kSigmoid>();
    case Activation::kHardSigmoid: return f.template operator()<Activation::kHardSigmoid>();
  }
}

}  // namespace sgrnn

#endif  // JAX_SGRNN_CORE_H_
