"""Bad input reaching the native handlers directly, bypassing every Python check.

The custom calls are invoked with ``jax.ffi.ffi_call`` exactly as ``jax_sgrnn/_lowering.py``
does (operands in schema order, absent ones as ``[0]`` placeholders, the typed attributes of
``OpConfig.ffi_attributes``), but with one thing wrong at a time: a buffer's rank, shape or
dtype, a ``has_*`` flag that contradicts its placeholder, an out-of-range activation, a
missing or mistyped attribute. Each must come back as an FFI error (``JaxRuntimeError`` with
``csrc/sgrnn/ffi_schema.cc``'s message), never as an out-of-bounds access, and the process
must keep working afterwards.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sgrnn
from conftest import requires_native

pytestmark = requires_native
TARGETS = jax_sgrnn.backends()["native"].targets

F32, F64 = jnp.float32, jnp.float64
T, N, I, H = 3, 2, 4, 5
#: What the handlers raise: jax.errors.JaxRuntimeError (XlaRuntimeError in older jaxlibs).
RuntimeErrors = (getattr(jax.errors, "JaxRuntimeError", RuntimeError), RuntimeError)


def attrs(activation=2, reverse=False, bidirectional=False, training=True, W=True, b=True,
          h0=True, mask=True, lengths=True, **override) -> dict:
    """The typed attributes, as OpConfig.ffi_attributes writes them."""
    a = dict(activation=np.int32(activation), reverse=np.bool_(reverse),
             bidirectional=np.bool_(bidirectional), training=np.bool_(training),
             has_input_weight=np.bool_(W), has_bias=np.bool_(b), has_init_state=np.bool_(h0),
             has_mask=np.bool_(mask), has_seq_lengths=np.bool_(lengths))
    a.update(override)
    return {k: v for k, v in a.items() if v is not None}


def arr(shape, dtype=F32, scale=0.3):
    size = int(np.prod(shape))
    data = np.sin(np.arange(size) * 0.7 + 0.1).reshape(shape) * scale
    return jnp.asarray(data).astype(dtype)


def empty(dtype=F32):
    return jnp.zeros((0,), dtype)


def sds(shape, dtype=F32):
    return jax.ShapeDtypeStruct(shape, dtype)


def forward_operands(dtype=F32) -> dict:
    """A valid forward problem: every optional present, training on."""
    return dict(x=arr((T, N, I), dtype), R=arr((1, H, H), dtype), W=arr((H, I), dtype),
                b=arr((H,), dtype), h0=arr((N, H), dtype), mask=arr((T, 1, H), dtype, 1.0),
                lengths=jnp.array([T, 1], jnp.int32), y=sds((T, N, H), dtype),
                z=sds((T, N, H), dtype))


def call_forward(ops: dict, attributes: dict):
    results = (ops["y"], ops["z"])
    out = jax.ffi.ffi_call(TARGETS["forward"], results)(
        ops["x"], ops["R"], ops["W"], ops["b"], ops["h0"], ops["mask"], ops["lengths"],
        **attributes)
    return jax.block_until_ready(out)


def gradient_operands(dtype=F32) -> dict:
    """A valid gradient problem (G = 1): every optional present."""
    return dict(x=arr((1, T, N, I), dtype), R=arr((1, H, H), dtype),
                dy=arr((1, T, N, H), dtype), z=arr((1, T, N, H), dtype, 1.0),
                W=arr((H, I), dtype), b=arr((H,), dtype), h0=arr((1, N, H), dtype),
                mask=arr((1, T, 1, H), dtype, 1.0), lengths=jnp.array([[2, 0]], jnp.int32),
                dx=sds((1, T, N, I), dtype), dR=sds((1, 1, H, H), dtype),
                dW=sds((1, H, I), dtype), db=sds((1, H), dtype), dh0=sds((1, N, H), dtype))


def call_gradients(ops: dict, attributes: dict):
    results = tuple(ops[k] for k in ("dx", "dR", "dW", "db", "dh0"))
    out = jax.ffi.ffi_call(TARGETS["gradients"], results)(
        *(ops[k] for k in ("x", "R", "dy", "z", "W", "b", "h0", "mask", "lengths")),
        **attributes)
    return jax.block_until_ready(out)


def _check_valid_forward():
    ops = forward_operands()
    y, z = call_forward(ops, attrs())
    want_y, want_z = jax_sgrnn.reference(ops["x"], ops["R"][0], ops["W"], ops["b"], ops["h0"],
                                         ops["mask"], seq_lengths=ops["lengths"],
                                         activation="tanh", training=True)
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(z, want_z, rtol=1e-5, atol=1e-6)


def _check_valid_gradients():
    ops = gradient_operands()
    got = call_gradients(ops, attrs(training=False))
    want = jax_sgrnn.reference_gradients(
        ops["x"][0], ops["R"][0], ops["dy"][0], ops["z"][0], ops["W"], ops["b"], ops["h0"][0],
        ops["mask"][0], seq_lengths=ops["lengths"][0], activation="tanh")
    for g, w in zip(got, want):
        np.testing.assert_allclose(g[0].reshape(w.shape), w, rtol=1e-5, atol=1e-6)


def test_valid_calls_match_reference():
    """The call convention used below is right: unmodified, both handlers succeed and agree
    with the reference."""
    _check_valid_forward()
    _check_valid_gradients()


@pytest.mark.parametrize("lengths", [[-5, 2**31 - 1], [-(2**31), T + 1]])
def test_out_of_range_lengths_are_clamped(lengths):
    """Python refuses or clamps lengths outside [0, T]; a raw call with them is clamped in the
    handler too (never read out of bounds), in both handlers."""
    ops = {**forward_operands(), "lengths": jnp.array(lengths, jnp.int32)}
    clamped = np.clip(lengths, 0, T)
    y, z = call_forward(ops, attrs())
    want_y, want_z = jax_sgrnn.reference(ops["x"], ops["R"][0], ops["W"], ops["b"], ops["h0"],
                                         ops["mask"], seq_lengths=clamped, activation="tanh",
                                         training=True)
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(z, want_z, rtol=1e-5, atol=1e-6)
    ops = {**gradient_operands(), "lengths": jnp.array([lengths], jnp.int32)}
    got = call_gradients(ops, attrs(training=False))
    want = jax_sgrnn.reference_gradients(
        ops["x"][0], ops["R"][0], ops["dy"][0], ops["z"][0], ops["W"], ops["b"], ops["h0"][0],
        ops["mask"][0], seq_lengths=clamped, activation="tanh")
    for g, w in zip(got, want):
        np.testing.assert_allclose(g[0].reshape(w.shape), w, rtol=1e-5, atol=1e-6)


# (id, changes to the operands, changes to the attributes, expected message)
FORWARD_CASES = [
    ("x-rank2", dict(x=arr((T * N, I))), {},
     r"source: expected rank 3 \[T, N, I\], got \[6, 4\]"),
    ("x-rank4", dict(x=arr((1, T, N, I))), {},
     r"source: expected rank 3 \[T, N, I\], got \[1, 3, 2, 4\]"),
    ("R-rank2", dict(R=arr((H, H))), {},
     r"recurrent_weight: expected rank 3 \[D, H, H\], got \[5, 5\]"),
    ("R-not-square", dict(R=arr((1, H - 1, H))), {},
     r"recurrent_weight: expected shape \[1, 5, 5\], got \[1, 4, 5\]"),
    ("R-two-directions-unidirectional", dict(R=arr((2, H, H))), {},
     r"recurrent_weight: expected shape \[1, 5, 5\], got \[2, 5, 5\]"),
    ("R-one-direction-bidirectional", {}, dict(bidirectional=np.bool_(True)),
     r"recurrent_weight: expected shape \[2, 5, 5\], got \[1, 5, 5\]"),
    ("R-H0", dict(R=jnp.zeros((1, 0, 0), F32)), {},
     r"recurrent_weight: hidden size H must be >= 1"),
    ("R-dtype", dict(R=arr((1, H, H), F64)), {},
     r"recurrent_weight: dtype does not match the source's"),
    ("W-shape", dict(W=arr((H, I - 1))), {},
     r"input_weight: expected shape \[5, 4\], got \[5, 3\]"),
    ("W-rank1", dict(W=arr((H * I,))), {},
     r"input_weight: expected shape \[5, 4\], got \[20\]"),
    ("W-flag-set-placeholder-given", dict(W=empty()), {},
     r"input_weight: expected shape \[5, 4\], got \[0\]"),
    ("W-flag-clear-buffer-given", {}, dict(has_input_weight=np.bool_(False)),
     r"input_weight: absent, so expected the empty placeholder \[0\], got \[5, 4\]"),
    ("W-absent-feature-size", dict(W=empty()), dict(has_input_weight=np.bool_(False)),
     r"source: without input_weight the feature size must be D\*H = 5, got 4"),
    ("I0", dict(x=jnp.zeros((T, N, 0), F32), W=jnp.zeros((H, 0), F32)), {},
     r"source: feature size I must be >= 1"),
    ("W-dtype", dict(W=arr((H, I), F64)), {}, r"input_weight: dtype does not match"),
    ("b-shape", dict(b=arr((H - 1,))), {}, r"bias: expected shape \[5\], got \[4\]"),
    ("b-flag-clear-buffer-given", {}, dict(has_bias=np.bool_(False)),
     r"bias: absent, so expected the empty placeholder \[0\], got \[5\]"),
    ("b-int-dtype", dict(b=jnp.ones((H,), jnp.int32)), {}, r"bias: dtype does not match"),
    ("h0-shape", dict(h0=arr((N + 1, H))), {},
     r"init_state: expected shape \[2, 5\], got \[3, 5\]"),
    ("h0-flag-set-placeholder-given", dict(h0=empty()), {},
     r"init_state: expected shape \[2, 5\], got \[0\]"),
    ("h0-flag-clear-buffer-given", {}, dict(has_init_state=np.bool_(False)),
     r"init_state: absent, so expected the empty placeholder \[0\], got \[2, 5\]"),
    ("mask-rank2", dict(mask=arr((T, N))), {},
     r"mask: expected a 3-d shape broadcastable to \[3, 2, 5\] in the source's dtype, "
     r"got \[3, 2\]"),
    ("mask-not-broadcastable", dict(mask=arr((T, N, H - 1))), {},
     r"mask: expected a 3-d shape broadcastable to \[3, 2, 5\].*got \[3, 2, 4\]"),
    ("mask-too-long", dict(mask=arr((T + 1, 1, 1))), {},
     r"mask: expected a 3-d shape broadcastable to \[3, 2, 5\].*got \[4, 1, 1\]"),
    ("mask-bool", dict(mask=jnp.ones((T, 1, H), bool)), {},
     r"mask: expected a 3-d shape broadcastable to \[3, 2, 5\] in the source's dtype"),
    ("mask-flag-set-placeholder-given", dict(mask=empty()), {},
     r"mask: expected a 3-d shape broadcastable to \[3, 2, 5\].*got \[0\]"),
    ("mask-flag-clear-buffer-given", {}, dict(has_mask=np.bool_(False)),
     r"mask: absent, so expected the empty placeholder \[0\], got \[3, 1, 5\]"),
    ("lengths-float", dict(lengths=jnp.array([T, 1], F32)), {}, r"seq_lengths: expected int32"),
    ("lengths-int64", dict(lengths=np.array([T, 1], np.int64)), {},
     r"seq_lengths: expected int32"),
    ("lengths-shape", dict(lengths=jnp.array([T, 1, 1], jnp.int32)), {},
     r"seq_lengths: expected shape \[2\], got \[3\]"),
    ("lengths-flag-set-placeholder-given", dict(lengths=jnp.zeros((0,), jnp.int32)), {},
     r"seq_lengths: expected shape \[2\], got \[0\]"),
    ("lengths-flag-clear-buffer-given", {}, dict(has_seq_lengths=np.bool_(False)),
     r"seq_lengths: absent, so expected the empty placeholder \[0\], got \[2\]"),
    ("y-shape", dict(y=sds((T, N, H - 1))), {}, r"y: expected shape \[3, 2, 5\], got \[3, 2, 4\]"),
    ("y-too-small", dict(y=sds((T - 1, N, H))), {},
     r"y: expected shape \[3, 2, 5\], got \[2, 2, 5\]"),
    ("y-dtype", dict(y=sds((T, N, H), F64)), {}, r"y: dtype does not match"),
    ("z-training-placeholder", dict(z=sds((0,))), {},
     r"z: expected shape \[3, 2, 5\], got \[0\]"),
    ("z-not-training-buffer", {}, dict(training=np.bool_(False)),
     r"z: absent, so expected the empty placeholder \[0\], got \[3, 2, 5\]"),
    ("activation-5", {}, dict(activation=np.int32(5)), r"activation: expected 0\.\.4, got 5"),
    ("activation-negative", {}, dict(activation=np.int32(-1)),
     r"activation: expected 0\.\.4, got -1"),
    ("activation-huge", {}, dict(activation=np.int32(2**31 - 1)),
     r"activation: expected 0\.\.4, got 2147483647"),
]


@pytest.mark.parametrize("change,attr_change,message",
                         [pytest.param(*c[1:], id=c[0]) for c in FORWARD_CASES])
def test_forward_rejects(change, attr_change, message):
    ops = {**forward_operands(), **change}
    with pytest.raises(RuntimeErrors, match="jax_sgrnn: " + message):
        call_forward(ops, attrs(**attr_change))


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.int32],
                         ids=["float16", "bfloat16", "int32"])
@pytest.mark.parametrize("which", ["forward", "gradients"])
def test_handlers_reject_unsupported_dtypes(which, dtype):
    """Half types are widened in Python; reaching the handler they are refused."""
    if which == "forward":
        call, ops, a = call_forward, forward_operands(dtype), attrs()
    else:
        call, ops, a = call_gradients, gradient_operands(dtype), attrs(training=False)
    with pytest.raises(RuntimeErrors, match="jax_sgrnn: the CPU handler takes float32 or "
                                            "float64"):
        call(ops, a)


GRADIENT_CASES = [
    ("x-rank3", dict(x=arr((T, N, I))), {},
     r"source: expected rank 4 \[G, T, N, I\], got \[3, 2, 4\]"),
    ("R-shape", dict(R=arr((1, H, H - 1))), {},
     r"recurrent_weight: expected shape \[1, 4, 4\], got \[1, 5, 4\]"),
    ("R-dtype", dict(R=arr((1, H, H), F64)), {}, r"recurrent_weight: dtype does not match"),
    ("dy-shape", dict(dy=arr((1, T, N, H + 1))), {},
     r"source_gradient: expected shape \[1, 3, 2, 5\], got \[1, 3, 2, 6\]"),
    ("dy-group", dict(dy=arr((2, T, N, H))), {},
     r"source_gradient: expected shape \[1, 3, 2, 5\], got \[2, 3, 2, 5\]"),
    ("dy-no-group", dict(dy=arr((T, N, H))), {},
     r"source_gradient: expected shape \[1, 3, 2, 5\], got \[3, 2, 5\]"),
    ("z-shape", dict(z=arr((1, T - 1, N, H))), {},
     r"z_state: expected shape \[1, 3, 2, 5\], got \[1, 2, 2, 5\]"),
    ("z-dtype", dict(z=arr((1, T, N, H), F64)), {}, r"z_state: dtype does not match"),
    ("W-flag-set-placeholder-given", dict(W=empty()), {},
     r"input_weight: expected shape \[5, 4\], got \[0\]"),
    ("W-flag-clear-buffer-given", {}, dict(has_input_weight=np.bool_(False)),
     r"input_weight: absent, so expected the empty placeholder \[0\], got \[5, 4\]"),
    ("b-flag-clear-buffer-given", {}, dict(has_bias=np.bool_(False)),
     r"bias: absent, so expected the empty placeholder \[0\], got \[5\]"),
    ("h0-no-group", dict(h0=arr((N, H))), {},
     r"init_state: expected shape \[1, 2, 5\], got \[2, 5\]"),
    ("h0-flag-clear-buffer-given", {}, dict(has_init_state=np.bool_(False)),
     r"init_state: absent, so expected the empty placeholder \[0\], got \[1, 2, 5\]"),
    ("mask-rank3", dict(mask=arr((T, 1, H))), {},
     r"mask: expected a 4-d shape broadcastable to \[1, 3, 2, 5\].*got \[3, 1, 5\]"),
    ("mask-group", dict(mask=arr((2, T, 1, H))), {},
     r"mask: expected a 4-d shape broadcastable to \[1, 3, 2, 5\].*got \[2, 3, 1, 5\]"),
    ("mask-flag-clear-buffer-given", {}, dict(has_mask=np.bool_(False)),
     r"mask: absent, so expected the empty placeholder \[0\], got \[1, 3, 1, 5\]"),
    ("lengths-no-group", dict(lengths=jnp.array([2, 0], jnp.int32)), {},
     r"seq_lengths: expected shape \[1, 2\], got \[2\]"),
    ("lengths-float", dict(lengths=jnp.array([[2, 0]], F32)), {}, r"seq_lengths: expected int32"),
    ("dx-shape", dict(dx=sds((1, T, N, H))), {},
     r"d_source: expected shape \[1, 3, 2, 4\], got \[1, 3, 2, 5\]"),
    ("dR-no-group", dict(dR=sds((1, H, H))), {},
     r"d_recurrent_weight: expected shape \[1, 1, 5, 5\], got \[1, 5, 5\]"),
    ("dR-dtype", dict(dR=sds((1, 1, H, H), F64)), {}, r"d_recurrent_weight: dtype does not"),
    ("dW-placeholder", dict(dW=sds((0,))), {},
     r"d_input_weight: expected shape \[1, 5, 4\], got \[0\]"),
    ("db-shape", dict(db=sds((H,))), {}, r"d_bias: expected shape \[1, 5\], got \[5\]"),
    ("db-absent-but-real", dict(b=empty()), dict(has_bias=np.bool_(False)),
     r"d_bias: absent, so expected the empty placeholder \[0\], got \[1, 5\]"),
    ("dh0-shape", dict(dh0=sds((1, N, H - 1))), {},
     r"d_init_state: expected shape \[1, 2, 5\], got \[1, 2, 4\]"),
    ("dh0-absent-but-real", dict(h0=empty()), dict(has_init_state=np.bool_(False)),
     r"d_init_state: absent, so expected the empty placeholder \[0\], got \[1, 2, 5\]"),
    ("activation-7", {}, dict(activation=np.int32(7)), r"activation: expected 0\.\.4, got 7"),
]


@pytest.mark.parametrize("change,attr_change,message",
                         [pytest.param(*c[1:], id=c[0]) for c in GRADIENT_CASES])
def test_gradients_rejects(change, attr_change, message):
    ops = {**gradient_operands(), **change}
    with pytest.raises(RuntimeErrors, match="jax_sgrnn: " + message):
        call_gradients(ops, attrs(training=False, **attr_change))


# A mistyped scalar attribute (activation as int64, a flag as int32) is converted by jax to the
# type the handler declares before the call is built, so it never reaches the decoder; a
# missing, extra or array-valued attribute does.
ATTRIBUTE_CASES = [
    ("missing", dict(has_mask=None), r"Wrong number of attributes: expected 9 attributes but "
                                     r"got 8"),
    ("extra", dict(extra=np.int32(1)), r"Wrong number of attributes: expected 9 attributes "
                                       r"but got 10"),
    ("activation-array", dict(activation=np.array([2], np.int32)),
     r"Wrong attribute type: expected scalar but got array"),
]


@pytest.mark.parametrize("which", ["forward", "gradients"])
@pytest.mark.parametrize("attr_change,message",
                         [pytest.param(*c[1:], id=c[0]) for c in ATTRIBUTE_CASES])
def test_attribute_decoding_errors(which, attr_change, message):
    """XLA's FFI attribute decoding refuses a wrong attribute set before the handler runs."""
    with pytest.raises(RuntimeErrors, match=message):
        if which == "forward":
            call_forward(forward_operands(), attrs(**attr_change))
        else:
            call_gradients(gradient_operands(), attrs(training=False, **attr_change))


def test_error_inside_a_larger_jitted_computation():
    """The error surfaces from a jitted program that does more than the custom call."""
    ops = {**forward_operands(), "h0": arr((N + 1, H))}

    @jax.jit
    def program(x, R, W, b, h0, mask, lengths):
        y, z = jax.ffi.ffi_call(TARGETS["forward"], (ops["y"], ops["z"]))(
            x * 2, R, W, b, h0, mask, lengths, **attrs())
        return jnp.sum(y) + jnp.sum(z)

    args = [ops[k] for k in ("x", "R", "W", "b", "h0", "mask", "lengths")]
    with pytest.raises(RuntimeErrors, match=re.escape("init_state: expected shape [2, 5]")):
        jax.block_until_ready(program(*args))


def test_process_survives_after_errors():
    """After all the refused calls above (and a few more here), valid calls still work."""
    for _ in range(3):
        with pytest.raises(RuntimeErrors):
            call_forward({**forward_operands(), "y": sds((T, N, 1))}, attrs())
        with pytest.raises(RuntimeErrors):
            call_gradients({**gradient_operands(), "dx": sds((1, 1, 1, 1))},
                           attrs(training=False))
    _check_valid_forward()
    _check_valid_gradients()
