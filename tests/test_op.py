"""The custom-call op against the lax.scan reference: forward, z, gradients (jax.grad), the
explicit gradient op, dtypes, mask broadcasting and the lowered HLO."""

from __future__ import annotations

import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sgrnn
from conftest import (ACTIVATIONS, MASK_KINDS, OPTIONAL_PATTERNS, assert_close, diff_inputs,
                      flags_id, make_inputs, make_mask, out_shape, pattern_id, random_array,
                      requires_native, value_and_grads)

op = jax_sgrnn.single_gate_rnn
ref = jax_sgrnn.reference

# (T, N, H) cycled through the grid; I = 3 != H always.
SHAPES = ((4, 3, 5), (1, 1, 5), (4, 1, 1), (1, 3, 5), (4, 3, 1), (4, 3, 5), (1, 3, 1))


def _grid_float64():
    """Every activation x reverse x bidirectional x optional pattern (160 cases); the mask
    kind (none / bool / float) and the shape cycle with the index, so every (pattern, mask
    kind) pair and every shape meet every activation."""
    cases = []
    for i, (act, rev, bi, pattern) in enumerate(itertools.product(
            ACTIVATIONS, (False, True), (False, True), OPTIONAL_PATTERNS)):
        mask = MASK_KINDS[i % len(MASK_KINDS)]
        shape = SHAPES[i % len(SHAPES)]
        cases.append(pytest.param(
            act, rev, bi, pattern, mask, shape,
            id=f"{flags_id(act, rev, bi)}-{pattern_id(pattern)}-mask_{mask}-"
               f"T{shape[0]}N{shape[1]}H{shape[2]}"))
    return cases


def _grid_float32():
    """activation x reverse x bidirectional (20 cases); patterns, masks and shapes cycle."""
    cases = []
    for i, (act, rev, bi) in enumerate(itertools.product(ACTIVATIONS, (False, True),
                                                         (False, True))):
        pattern = OPTIONAL_PATTERNS[(3 * i + 7) % len(OPTIONAL_PATTERNS)]
        mask = MASK_KINDS[i % len(MASK_KINDS)]
        shape = SHAPES[(i + 2) % len(SHAPES)]
        cases.append(pytest.param(
            act, rev, bi, pattern, mask, shape,
            id=f"{flags_id(act, rev, bi)}-{pattern_id(pattern)}-mask_{mask}-"
               f"T{shape[0]}N{shape[1]}H{shape[2]}"))
    return cases


def _check_op_vs_reference(rng, act, rev, bi, pattern, mask, shape, dtype):
    T, N, H = shape
    w, b, h = pattern
    inputs = make_inputs(rng, T, N, 3, H, bidirectional=bi, input_weight=w, bias=b,
                         init_state=h, mask=mask, dtype=dtype)
    flags = dict(activation=act, reverse=rev, bidirectional=bi)
    c = random_array(rng, out_shape(inputs, bi), dtype)
    y, grads = value_and_grads(op, inputs, c, flags)
    y_ref, grads_ref = value_and_grads(ref, inputs, c, flags)
    assert y.shape == out_shape(inputs, bi) and y.dtype == dtype
    assert set(grads) == set(diff_inputs(inputs))
    for name, g in grads.items():
        assert g.shape == inputs[name].shape and g.dtype == dtype, name
    assert_close(y, y_ref, err_msg="y")
    assert_close(grads, grads_ref, err_msg="grads")
    # z (training=True) too.
    y2, z = jax.jit(lambda i: op(**i, **flags, training=True))(inputs)
    y2_ref, z_ref = jax.jit(lambda i: ref(**i, **flags, training=True))(inputs)
    assert z.dtype == dtype
    assert_close((y2, z), (y2_ref, z_ref), err_msg="(y, z)")


@pytest.mark.parametrize("act,rev,bi,pattern,mask,shape", _grid_float64())
def test_op_matches_reference_float64(rng, act, rev, bi, pattern, mask, shape):
    _check_op_vs_reference(rng, act, rev, bi, pattern, mask, shape, jnp.float64)


@pytest.mark.parametrize("act,rev,bi,pattern,mask,shape", _grid_float32())
def test_op_matches_reference_float32(rng, act, rev, bi, pattern, mask, shape):
    _check_op_vs_reference(rng, act, rev, bi, pattern, mask, shape, jnp.float32)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("act,bi,pattern,mask", [
    ("tanh", False, (True, True, True), "float"),
    ("sigmoid", True, (True, True, True), "bool"),
    ("relu", True, (False, True, False), None),
    ("hard_sigmoid", False, (True, False, True), "float"),
    ("none", False, (False, False, False), None),
])
def test_op_half_precision_smoke(rng, dtype, act, bi, pattern, mask):
    """Half inputs: outputs and gradients keep the input dtype and agree with the reference
    run on the same half inputs (both accumulate in float32)."""
    w, b, h = pattern
    inputs = make_inputs(rng, 4, 3, 3, 5, bidirectional=bi, input_weight=w, bias=b,
                         init_state=h, mask=mask, dtype=dtype)
    flags = dict(activation=act, bidirectional=bi)
    c = random_array(rng, out_shape(inputs, bi), dtype)
    y, grads = value_and_grads(op, inputs, c, flags)
    y_ref, grads_ref = value_and_grads(ref, inputs, c, flags)
    assert y.dtype == dtype
    assert all(g.dtype == dtype for g in grads.values()), {n: g.dtype for n, g in grads.items()}
    assert_close(y, y_ref, err_msg="y")
    assert_close(grads, grads_ref, err_msg="grads")
    y2, z = op(**inputs, **flags, training=True)
    assert y2.dtype == dtype and z.dtype == dtype
    _, z_ref = ref(**inputs, **flags, training=True)
    assert_close(z, z_ref, err_msg="z")


# ------------------------------------------------------------------ mask broadcasting


def _mask_shape(kind, T, N, DH):
    return {"T11": (T, 1, 1), "N_DH": (N, DH), "DH": (DH,), "1N1": (1, N, 1),
            "scalar": (), "TN1": (T, N, 1), "11DH": (1, 1, DH)}[kind]


@pytest.mark.parametrize("bi", [False, True], ids=["uni", "bi"])
@pytest.mark.parametrize("kind,mask_dtype", [
    ("T11", "float"), ("N_DH", "bool"), ("DH", "float"), ("1N1", "bool"),
    ("scalar", "float"), ("TN1", "float"), ("11DH", "bool")])
def test_mask_broadcasting(rng, bi, kind, mask_dtype):
    """A broadcastable mask gives the op's and the reference's results, and the same as the
    mask explicitly broadcast to [T, N, D*H]."""
    T, N, H = 4, 3, 5
    D = 2 if bi else 1
    inputs = make_inputs(rng, T, N, 3, H, bidirectional=bi)
    inputs["mask"] = make_mask(rng, _mask_shape(kind, T, N, D * H), mask_dtype, jnp.float64)
    flags = dict(activation="tanh", reverse=True, bidirectional=bi)
    c = random_array(rng, (T, N, D * H), jnp.float64)
    y, grads = value_and_grads(op, inputs, c, flags)
    y_ref, grads_ref = value_and_grads(ref, inputs, c, flags)
    assert_close(y, y_ref, err_msg="y")
    assert_close(grads, grads_ref, err_msg="grads")
    full = dict(inputs, mask=jnp.broadcast_to(inputs["mask"], (T, N, D * H)))
    y_full, grads_full = value_and_grads(op, full, c, flags)
    assert_close(y, y_full, err_msg="y vs full mask")
    assert_close(grads, grads_full, err_msg="grads vs full mask")


def test_bool_mask_equals_float_mask(rng):
    inputs = make_inputs(rng, 4, 3, 3, 5, mask="bool")
    as_float = dict(inputs, mask=inputs["mask"].astype(jnp.float64))
    assert_close(op(**inputs, activation="tanh"), op(**as_float, activation="tanh"))


def test_mask_gets_no_gradient(rng):
    """The mask is a constant (stop_gradient): its gradient is zero, for op and reference."""
    inputs = make_inputs(rng, 4, 3, 3, 5, mask="float")
    rest = {k: v for k, v in inputs.items() if k != "mask"}
    for fn in (op, ref):
        g = jax.grad(lambda m: jnp.sum(fn(**rest, mask=m, activation="tanh") ** 2))(
            inputs["mask"])
        assert g.shape == inputs["mask"].shape
        np.testing.assert_array_equal(np.asarray(g), 0.0)


def test_mask_multiplies_recurrent_input_only(rng):
    """An all-zero mask cuts the recurrence (h0 included) but does not mask the output:
    y = act(x W^T + b)."""
    inputs = make_inputs(rng, 4, 3, 3, 5, mask="float")
    inputs["mask"] = jnp.zeros_like(inputs["mask"])
    y = op(**inputs, activation="tanh")
    x, W, b = inputs["source"], inputs["input_weight"], inputs["bias"]
    np.testing.assert_allclose(np.asarray(y), np.tanh(np.asarray(x @ W.T + b)), rtol=1e-12)


# ------------------------------------------------------------- the explicit gradient op


@pytest.mark.parametrize("bi", [False, True], ids=["uni", "bi"])
@pytest.mark.parametrize("pattern", OPTIONAL_PATTERNS, ids=pattern_id)
def test_gradients_op_list_order_and_values(rng, bi, pattern):
    """single_gate_rnn_gradients returns MPSGraph's list: [dx, dR] + [dW] + [db] + [dh0] for
    the inputs given, shaped like them; values equal reference_gradients and jax.vjp of the
    reference."""
    w, b, h = pattern
    act = ACTIVATIONS[(sum(pattern) + 2 * bi) % len(ACTIVATIONS)]
    mask = MASK_KINDS[(sum(pattern) + bi) % len(MASK_KINDS)]
    inputs = make_inputs(rng, 4, 3, 3, 5, bidirectional=bi, input_weight=w, bias=b,
                         init_state=h, mask=mask)
    flags = dict(activation=act, reverse=not bi, bidirectional=bi)
    _, z = ref(**inputs, **flags, training=True)
    dy = random_array(rng, z.shape, jnp.float64)

    grads = jax_sgrnn.single_gate_rnn_gradients(
        inputs["source"], inputs["recurrent_weight"], dy, z, inputs["input_weight"],
        inputs["bias"], inputs["init_state"], inputs["mask"], **flags)
    assert isinstance(grads, list)
    expected_names = ["source", "recurrent_weight"] + [
        n for n in ("input_weight", "bias", "init_state") if inputs[n] is not None]
    assert len(grads) == len(expected_names) == 2 + sum(pattern)
    for g, name in zip(grads, expected_names):
        assert g.shape == inputs[name].shape, (name, g.shape, inputs[name].shape)
        assert g.dtype == jnp.float64

    expected = jax_sgrnn.reference_gradients(
        inputs["source"], inputs["recurrent_weight"], dy, z, inputs["input_weight"],
        inputs["bias"], inputs["init_state"], inputs["mask"], **flags)
    assert isinstance(expected, list) and len(expected) == len(grads)
    assert_close(grads, expected, err_msg="vs reference_gradients")

    names = [n for n in expected_names]
    _, vjp = jax.vjp(lambda *a: ref(**{**inputs, **dict(zip(names, a))}, **flags),
                     *(inputs[n] for n in names))
    assert_close(grads, list(vjp(dy)), err_msg="vs jax.vjp(reference)")


def test_gradients_op_accepts_descriptor_and_training_flag(rng):
    inputs = make_inputs(rng, 4, 3, 3, 5)
    desc = jax_sgrnn.SingleGateRNNDescriptor(activation="sigmoid", reverse=True)
    _, z = op(**inputs, descriptor=desc, training=True)
    dy = random_array(rng, z.shape, jnp.float64)
    args = (inputs["source"], inputs["recurrent_weight"], dy, z, inputs["input_weight"],
            inputs["bias"], inputs["init_state"])
    a = jax_sgrnn.single_gate_rnn_gradients(*args, descriptor=desc)
    b = jax_sgrnn.single_gate_rnn_gradients(*args, descriptor=desc, training=True)
    c = jax_sgrnn.single_gate_rnn_gradients(*args, activation="sigmoid", reverse=True)
    assert_close(a, b)
    assert_close(a, c)


def test_gradients_op_under_jit(rng):
    inputs = make_inputs(rng, 4, 3, 3, 5, bidirectional=True, mask="float")
    flags = dict(activation="tanh", bidirectional=True)
    _, z = ref(**inputs, **flags, training=True)
    dy = random_array(rng, z.shape, jnp.float64)

    def f(fn, i, dy, z):
        return fn(i["source"], i["recurrent_weight"], dy, z, i["input_weight"], i["bias"],
                  i["init_state"], i["mask"], **flags)

    got = jax.jit(lambda *a: f(jax_sgrnn.single_gate_rnn_gradients, *a))(inputs, dy, z)
    assert_close(got, f(jax_sgrnn.reference_gradients, inputs, dy, z))


# ----------------------------------------------------------------------- training / z


@pytest.mark.parametrize("bi", [False, True], ids=["uni", "bi"])
@pytest.mark.parametrize("act", ["tanh", "relu", "hard_sigmoid"])
def test_training_z_and_grad_through_y_and_z(rng, bi, act):
    """training=True: z equals the reference's; a loss that uses z too is differentiated
    exactly (the op falls back to the reference's vjp for z cotangents)."""
    inputs = make_inputs(rng, 4, 3, 3, 5, bidirectional=bi, mask="float")
    flags = dict(activation=act, reverse=True, bidirectional=bi, training=True)
    cy = random_array(rng, out_shape(inputs, bi), jnp.float64)
    cz = random_array(rng, out_shape(inputs, bi), jnp.float64)

    y, z = op(**inputs, **flags)
    y_ref, z_ref = ref(**inputs, **flags)
    assert_close((y, z), (y_ref, z_ref))

    def losses(fn):
        def both(diff):
            y, z = fn(**{**inputs, **diff}, **flags)
            return jnp.sum(y * cy) + jnp.sum(jnp.sin(z) * cz)

        def y_only(diff):
            return jnp.sum(fn(**{**inputs, **diff}, **flags)[0] * cy)

        def z_only(diff):
            return jnp.sum(fn(**{**inputs, **diff}, **flags)[1] * cz)

        return both, y_only, z_only

    diff = diff_inputs(inputs)
    for name, l_op, l_ref in zip(("y and z", "y only", "z only"), losses(op), losses(ref)):
        got = jax.jit(jax.grad(l_op))(diff)
        want = jax.jit(jax.grad(l_ref))(diff)
        assert_close(got, want, err_msg=name)


def test_training_flag_returns_pair_and_default_returns_array(rng):
    inputs = make_inputs(rng, 4, 3, 3, 5)
    y = op(**inputs)
    assert isinstance(y, jax.Array) and y.shape == (4, 3, 5)
    out = op(**inputs, training=True)
    assert isinstance(out, tuple) and len(out) == 2
    assert_close(out[0], y)


# ------------------------------------------------------------------ semantics checks


def test_reverse_final_state_is_last(rng):
    """Unidirectional reverse keeps outputs in processing order: the op equals the forward
    RNN run on the time-flipped source (mask indexed by step, not flipped)."""
    inputs = make_inputs(rng, 4, 3, 3, 5, mask="float")
    flipped = dict(inputs, source=inputs["source"][::-1])
    assert_close(op(**inputs, reverse=True, activation="tanh"),
                 op(**flipped, reverse=False, activation="tanh"))


def test_bidirectional_layout_and_reverse_ignored(rng):
    """Bidirectional: [..., :H] is the forward RNN, [..., H:] the backward one flipped back to
    source time; ``reverse`` is ignored."""
    T, N, I, H = 4, 3, 3, 5
    inputs = make_inputs(rng, T, N, I, H, bidirectional=True)
    y = op(**inputs, bidirectional=True, activation="tanh")
    assert_close(op(**inputs, bidirectional=True, reverse=True, activation="tanh"), y)
    x, R, W, b, h0 = (inputs[n] for n in ("source", "recurrent_weight", "input_weight",
                                          "bias", "init_state"))
    fwd = op(x, R[0], W[:H], b[:H], h0[:, :H], activation="tanh")
    bwd = op(x, R[1], W[H:], b[H:], h0[:, H:], activation="tanh", reverse=True)
    assert_close(y[..., :H], fwd)
    assert_close(y[..., H:], bwd[::-1])


def test_missing_optionals_mean_identity_zeros_ones(rng):
    """Missing W = identity (source has D*H features), missing b/h0 = zeros, mask = ones."""
    H = 5
    inputs = make_inputs(rng, 4, 3, H, H, input_weight=False, bias=False, init_state=False)
    x, R = inputs["source"], inputs["recurrent_weight"]
    y = op(x, R, activation="sigmoid")
    full = op(x, R, jnp.eye(H), jnp.zeros(H), jnp.zeros((3, H)), jnp.ones((4, 3, H)),
              activation="sigmoid")
    assert_close(y, full)


@pytest.mark.parametrize("act", ACTIVATIONS)
def test_activation_values_at_one_step(rng, act):
    """T=1 with no h0: y = act(x W^T + b) with the spec's formulas (hard sigmoid 0.2/0.5)."""
    inputs = make_inputs(rng, 1, 3, 3, 5, init_state=False)
    inputs["source"] = inputs["source"] * 4  # reach the hard sigmoid's clamps
    z = np.asarray(inputs["source"] @ inputs["input_weight"].T + inputs["bias"])
    expected = {"none": z, "relu": np.maximum(z, 0), "tanh": np.tanh(z),
                "sigmoid": 1 / (1 + np.exp(-z)),
                "hard_sigmoid": np.clip(0.2 * z + 0.5, 0, 1)}[act]
    y, zz = op(**inputs, activation=act, training=True)
    np.testing.assert_allclose(np.asarray(zz), z, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-12, atol=1e-12)


# -------------------------------------------------------------------- lowered HLO


def _custom_call_lines(text, target):
    return [l for l in text.splitlines() if "custom_call" in l and f"@{target}" in l]


@requires_native
@pytest.mark.parametrize("bi", [False, True], ids=["uni", "bi"])
def test_hlo_forward_and_grad_use_custom_calls(rng, bi):
    inputs = make_inputs(rng, 4, 3, 3, 5, bidirectional=bi, mask="bool")
    flags = dict(activation="tanh", bidirectional=bi)
    fwd_text = jax.jit(lambda i: op(**i, **flags)).lower(inputs).as_text()
    fwd_calls = _custom_call_lines(fwd_text, "jax_sgrnn_forward")
    assert fwd_calls, fwd_text
    assert not _custom_call_lines(fwd_text, "jax_sgrnn_gradients")
    # Inference: no z is produced.
    assert all(re.search(r"training = false", l) for l in fwd_calls), fwd_calls
    # The op does not fall back to the scan decomposition on CPU.
    assert "stablehlo.while" not in fwd_text

    c = random_array(rng, out_shape(inputs, bi), jnp.float64)
    grad_fn = jax.grad(lambda d: jnp.sum(op(**{**inputs, **d}, **flags) * c))
    grad_text = jax.jit(grad_fn).lower(diff_inputs(inputs)).as_text()
    fwd_in_grad = _custom_call_lines(grad_text, "jax_sgrnn_forward")
    assert fwd_in_grad, grad_text
    assert _custom_call_lines(grad_text, "jax_sgrnn_gradients"), grad_text
    # Under differentiation the inference op runs the training forward (z saved).
    assert all(re.search(r"training = true", l) for l in fwd_in_grad), fwd_in_grad
    assert "stablehlo.while" not in grad_text


@requires_native
def test_hlo_gradients_op_uses_custom_call(rng):
    inputs = make_inputs(rng, 4, 3, 3, 5)
    _, z = ref(**inputs, training=True)
    text = jax.jit(lambda i, dy, z: jax_sgrnn.single_gate_rnn_gradients(
        i["source"], i["recurrent_weight"], dy, z, i["input_weight"], i["bias"],
        i["init_state"])).lower(inputs, z, z).as_text()
    assert _custom_call_lines(text, "jax_sgrnn_gradients"), text
    assert not _custom_call_lines(text, "jax_sgrnn_forward")


@requires_native
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32],
                         ids=["float16", "bfloat16", "float32"])
def test_hlo_custom_call_for_other_dtypes(rng, dtype):
    inputs = make_inputs(rng, 4, 3, 3, 5, dtype=dtype)
    text = jax.jit(jax.grad(lambda d: jnp.sum(op(**{**inputs, **d}).astype(jnp.float32)))
                   ).lower(diff_inputs(inputs)).as_text()
    assert _custom_call_lines(text, "jax_sgrnn_forward")
    assert _custom_call_lines(text, "jax_sgrnn_gradients")


def test_lowering_for_other_platforms_is_the_decomposition(rng):
    """Off CPU (here: lowering for TPU, which needs no device) the op lowers to the lax.scan
    decomposition, not to the CPU custom calls."""
    inputs = make_inputs(rng, 4, 3, 3, 5)
    traced = jax.jit(jax.grad(lambda d: jnp.sum(op(**{**inputs, **d})))).trace(
        diff_inputs(inputs))
    try:
        text = traced.lower(lowering_platforms=("tpu",)).as_text()
    except TypeError as err:  # pragma: no cover - older/newer jax without the keyword
        pytest.skip(f"cross-platform lowering unavailable: {err}")
    assert "jax_sgrnn_" not in text
    assert "stablehlo.while" in text
