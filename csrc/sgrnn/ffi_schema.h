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
ffi::Error CheckForward(const Config& c, ffi::AnyBuffer x, ffi::AnyBuffer R, ffi::AnyBuffer W,
                        ffi::AnyBuffer b, ffi::AnyBuffer h0, ffi::AnyBuffer mask,
                        ffi::AnyBuffer seq_lengths, ffi::AnyBuffer y, ffi::AnyBuffer z,
                        CheckedDims* out);

// A handler that leaves dR to the lowering (CUDA: one product over all steps, XLA's) passes
// with_recurrent_weight_gradient = false, and dR is then the [0] placeholder.
ffi::Error CheckGradients(const Config& c, ffi::AnyBuffer x, ffi::AnyBuffer R, ffi::AnyBuffer dy,
                          ffi::AnyBuffer z, ffi::AnyBuffer W, ffi::AnyBuffer b, ffi::AnyBuffer h0,
                          ffi::AnyBuffer mask, ffi::AnyBuffer seq_lengths, ffi::AnyBuffer dx,
                          ffi::AnyBuffer dR,
                          ffi::AnyBuffer dW, ffi::AnyBuffer db, ffi::AnyBuffer dh0,
                          CheckedDims* out, bool with_recurrent_weight_gradient = true);

}  // namespace sgrnn

#endif  // JAX_SGRNN_FFI_SCHEMA_H_
