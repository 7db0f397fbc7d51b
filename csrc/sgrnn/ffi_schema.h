// The operand/attribute schema of the two FFI custom calls, shared by every backend, and the
// buffer checks every handler runs before touching memory. A backend binds its kernels with
// BindForward()/BindGradients() (adding its own context, e.g. a stream) and gets validated
// sizes from CheckForward()/CheckGradients().
//
// Absent optional operands (and absent outputs: z when not training, the gradients of absent
// inputs) travel as empty [0] placeholders; the has_* attributes say which are real.
#ifndef JAX_SGRNN_FFI_SCHEMA_H_
#define JAX_SGRNN_FFI_SCHEMA_H_

#include <cstdint>
#include <initializer_list>
#include <string>

#include "sgrnn/core.h"
#include "sgrnn/ffi_dispatch.h"
#include "xla/ffi/api/ffi.h"

XLA_FFI_REGISTER_ENUM_ATTR_DECODING(sgrnn::Activation);
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    sgrnn::Config, ::xla::ffi::StructMember<sgrnn::Activation>("activation"),
    ::xla::ffi::StructMember<bool>("reverse"),
    ::xla::ffi::StructMember<bool>("bidirectional"),
    ::xla::ffi::StructMember<bool>("training"),
    ::xla::ffi::StructMember<bool>("has_input_weight"),
    ::xla::ffi::StructMember<bool>("has_bias"),
    ::xla::ffi::StructMember<bool>("has_init_state"),
    ::xla::ffi::StructMember<bool>("has_mask"),
    ::xla::ffi::StructMember<bool>("has_seq_lengths"));

namespace sgrnn {

namespace ffi = ::xla::ffi;

// Forward: (x, R, W, b, h0, mask, seq_lengths) -> (y, z).
inline auto BindForward() {
  return ffi::Ffi::Bind()
      .Arg<ffi::AnyBuffer>()  // x: source [T, N, I]
      .Arg<ffi::AnyBuffer>()  // R: recurrent weight [D, H, H]
      .Arg<ffi::AnyBuffer>()  // W: input weight [D*H, I], or [0]
      .Arg<ffi::AnyBuffer>()  // b: bias [D*H], or [0]
      .Arg<ffi::AnyBuffer>()  // h0: init state [N, D*H], or [0]
      .Arg<ffi::AnyBuffer>()  // mask: [Tm, Nm, Hm], each 1 or full, or [0]
      .Arg<ffi::AnyBuffer>()  // seq_lengths: int32 [N], or int32 [0]
      .Attrs<Config>()
      .Ret<ffi::AnyBuffer>()   // y: [T, N, D*H]
      .Ret<ffi::AnyBuffer>();  // z: [T, N, D*H] when training, else [0]
}

// Gradients, over G independent problems sharing the weights (G > 1 under vmap):
// (x, R, dy, z, W, b, h0, mask, seq_lengths) -> (dx, dR, dW, db, dh0).
inline auto BindGradients() {
  return ffi::Ffi::Bind()
      .Arg<ffi::AnyBuffer>()  // x: source [G, T, N, I]
      .Arg<ffi::AnyBuffer>()  // R: recurrent weight [D, H, H]
      .Arg<ffi::AnyBuffer>()  // dy: source gradient [G, T, N, D*H]
      .Arg<ffi::AnyBuffer>()  // z: forward's z state [G, T, N, D*H]
      .Arg<ffi::AnyBuffer>()  // W: input weight [D*H, I], or [0]
      .Arg<ffi::AnyBuffer>()  // b: bias [D*H], or [0] (only its presence matters)
      .Arg<ffi::AnyBuffer>()  // h0: init state [G, N, D*H], or [0]
      .Arg<ffi::AnyBuffer>()  // mask: [Gm, Tm, Nm, Hm], each 1 or full, or [0]
      .Arg<ffi::AnyBuffer>()  // seq_lengths: int32 [G, N], or int32 [0]
      .Attrs<Config>()
      .Ret<ffi::AnyBuffer>()   // dx: [G, T, N, I]
      .Ret<ffi::AnyBuffer>()   // dR: [G, D, H, H] (CUDA: [0], see CheckGradients)
      .Ret<ffi::AnyBuffer>()   // dW: [G, D*H, I], or [0]
      .Ret<ffi::AnyBuffer>()   // db: [G, D*H], or [0]
      .Ret<ffi::AnyBuffer>();  // dh0: [G, N, D*H], or [0]
}

// Each op's buffers, in Bind*'s order (absent ones: their [0] placeholders). Handlers make
// one from their arguments and pass it to the checks and to TypedOperands.
struct ForwardBuffers {
  ffi::AnyBuffer x, R, W, b, h0, mask, seq_lengths;  // operands
  ffi::AnyBuffer y, z;                               // results
};
struct GradientBuffers {
  ffi::AnyBuffer x, R, dy, z, W, b, h0, mask, seq_lengths;  // operands
  ffi::AnyBuffer dx, dR, dW, db, dh0;                       // results
};

// Element offsets of problem g inside the gradient op's grouped buffers. The G problems share
// the weights; each has its own weight gradients.
struct GroupOffsets {
  int64_t source;              // x and dx
  int64_t state;               // dy and z
  int64_t init_state;          // h0 and dh0
  int64_t seq_lengths;         // seq_lengths
  int64_t mask;                // 0 when every group shares the mask
  int64_t d_recurrent_weight;  // dR
  int64_t d_input_weight;      // dW
  int64_t d_bias;              // db
};

// Sizes found by the checks, with the mask's own (broadcast) shape.
struct CheckedDims {
  Dims dims;
  int64_t G = 1;                         // gradient op: independent problems
  int64_t mask_shape[4] = {1, 1, 1, 1};  // [Gm, Tm, Nm, Hm]
  bool recurrent_weight_gradient = true;  // gradient op: dR is a real output

  GroupOffsets Group(int64_t g) const {
    const Dims& d = dims;
    const int64_t mask_group =
        mask_shape[0] == 1 ? 0 : mask_shape[1] * mask_shape[2] * mask_shape[3];
    return {g * d.rows() * d.I, g * d.rows() * d.DH(), g * d.N * d.DH(), g * d.N, g * mask_group,
            g * d.D * d.H * d.H, g * d.DH() * d.I, g * d.DH()};
  }
};

// Checks every buffer against the schema; on success fills `out`. Returns an FFI error
// naming the operand, the expected and the received shape.
ffi::Error CheckForward(const Config& c, const ForwardBuffers& buffers, CheckedDims* out);

// A handler that leaves dR to the lowering (CUDA: one product over all steps, XLA's) passes
// with_recurrent_weight_gradient = false, and dR is then the [0] placeholder.
ffi::Error CheckGradients(const Config& c, const GradientBuffers& buffers, CheckedDims* out,
                          bool with_recurrent_weight_gradient = true);

// The checked buffers as typed pointers (null where absent); the gradient op's for problem
// `group` of its G.
template <typename T>
ForwardOperands<T> TypedOperands(const Config& c, const ForwardBuffers& f,
                                 const CheckedDims& checked) {
  const int64_t* ms = checked.mask_shape;
  return {.x = DataOrNull<T>(true, f.x),
          .R = DataOrNull<T>(true, f.R),
          .W = DataOrNull<T>(c.has_input_weight, f.W),
          .b = DataOrNull<T>(c.has_bias, f.b),
          .h0 = DataOrNull<T>(c.has_init_state, f.h0),
          .mask = c.has_mask ? MaskView<T>(DataOrNull<T>(true, f.mask), ms[1], ms[2], ms[3])
                             : MaskView<T>(),
          .seq_lengths = DataOrNull<int32_t>(c.has_seq_lengths, f.seq_lengths),
          .y = MutableOrNull<T>(true, f.y),
          .z = MutableOrNull<T>(c.training, f.z)};
}

template <typename T>
GradientOperands<T> TypedOperands(const Config& c, const GradientBuffers& g,
                                  const CheckedDims& checked, int64_t group) {
  const GroupOffsets o = checked.Group(group);
  const int64_t* ms = checked.mask_shape;
  auto at = [](auto* data, int64_t offset) { return data ? data + offset : nullptr; };
  return {.x = at(DataOrNull<T>(true, g.x), o.source),
          .R = DataOrNull<T>(true, g.R),
          .dy = at(DataOrNull<T>(true, g.dy), o.state),
          .z = at(DataOrNull<T>(true, g.z), o.state),
          .W = DataOrNull<T>(c.has_input_weight, g.W),
          .b = DataOrNull<T>(c.has_bias, g.b),
          .h0 = at(DataOrNull<T>(c.has_init_state, g.h0), o.init_state),
          .mask = c.has_mask ? MaskView<T>(DataOrNull<T>(true, g.mask) + o.mask, ms[1], ms[2],
                                           ms[3])
                             : MaskView<T>(),
          .seq_lengths = at(DataOrNull<int32_t>(c.has_seq_lengths, g.seq_lengths),
                            o.seq_lengths),
          .dx = at(MutableOrNull<T>(true, g.dx), o.source),
          .dR = at(MutableOrNull<T>(checked.recurrent_weight_gradient, g.dR),
                   o.d_recurrent_weight),
          .dW = at(MutableOrNull<T>(c.has_input_weight, g.dW), o.d_input_weight),
          .db = at(MutableOrNull<T>(c.has_bias, g.db), o.d_bias),
          .dh0 = at(MutableOrNull<T>(c.has_init_state, g.dh0), o.init_state)};
}

}  // namespace sgrnn

#endif  // JAX_SGRNN_FFI_SCHEMA_H_
