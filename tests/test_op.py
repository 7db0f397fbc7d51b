"""The custom-call op against the lax.scan reference: forward, z, gradients (jax.grad), the
explicit gradient op, dtypes and mask broadcasting. What the op lowers to: test_lowering.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sgrnn
from conftest import (ACTIVATIONS, MASK_KINDS, OPTIONAL_PATTERNS, assert_close, backends_over,
                      diff_inputs, full_results, grid_every_activation, grid_every_pattern,
                      make_inputs, make_mask, out_shape, pattern_id, random_array, ref_jit,
                      value_and_grads)

op = jax_sgrnn.single_gate_rnn
ref = jax_sgrnn.reference

# (T, N, H) cycled through the grid; I = 3 != H always.
SHAPES = ((4, 3, 5), (1, 1, 5), (4, 1, 1), (1, 3, 5), (4, 3, 1), (4, 3, 5), (1, 3, 1))


def _check_results(inputs, got, want, dtype, bi):
    """Shapes and dtypes of the op's results, then values against the reference's."""
    shape = out_shape(inputs, bi)
    for key in ("y", "y_train", "z"):
        assert got[key].shape == shape and got[key].dtype == dtype, (key, got[key].shape,
                                                                      got[key].dtype)
    assert set(got["grads"]) == set(diff_inputs(inputs))
    for name, g in got["grads"].items():
        assert g.shape == inputs[name].shape and g.dtype == dtype, (name, g.shape, g.dtype)
    for key in ("y", "y_train", "z", "grads"):
        assert_close(got[key], want[key], err_msg=key)


def _check_op_vs_reference(rng, act, rev, bi, pattern, mask, shape, dtype):
    T, N, H = shape
    w, b, h = pattern
    inputs = make_inputs(rng, T, N, 3, H, bidirectional=bi, input_weight=w, bias=b,
                         init_state=h, mask=mask, dtype=dtype)
    flags = dict(activation=act, reverse=rev, bidirectional=bi)
    c = random_array(rng, out_shape(inputs, bi), dtype)
    _check_results(inputs, full_results(op, inputs, c, flags),
                   full_results(ref, inputs, c, flags), dtype, bi)


@pytest.mark.parametrize("cpu_backend,act,rev,bi,pattern,mask,shape",
                         backends_over(grid_every_pattern(SHAPES), grid_every_activation(SHAPES)),
                         indirect=["cpu_backend"])
def test_op_matches_reference_float64(cpu_backend, rng, act, rev, bi, pattern, mask, shape):
    _check_op_vs_reference(rng, act, rev, bi, pattern, mask, shape, jnp.float64)


@pytest.mark.parametrize("act,rev,bi,pattern,mask,shape", grid_every_activation(SHAPES))
def test_op_matches_reference_float32(cpu_backend, rng, act, rev, bi, pattern, mask, shape):
    _check_op_vs_reference(rng, act, rev, bi, pattern, mask, shape, jnp.float32)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("act,bi,pattern,mask", [
    pytest.param("tanh", False, (True, True, True), "float", id="tanh-uni-Wbh0-mask_float"),
    pytest.param("sigmoid", True, (True, True, True), "bool", id="sigmoid-bi-Wbh0-mask_bool"),
    pytest.param("hard_sigmoid", True, (False, True, False), None, id="hard_sigmoid-bi-b"),
])
def test_op_half_precision_smoke(cpu_backend, rng, dtype, act, bi, pattern, mask):
    """Half inputs: outputs and gradients keep the input dtype and agree with the reference
    run on the same half inputs (both accumulate in float32)."""
    w, b, h = pattern
    inputs = make_inputs(rng, 4, 3, 3, 5, bidirectional=bi, input_weight=w, bias=b,
                         init_state=h, mask=mask, dtype=dtype)
    flags = dict(activation=act, bidirectional=bi)
    c = random_array(rng, out_shape(inputs, bi), dtype)
    _check_results(inputs, full_results(op, inputs, c, flags),
                   full_results(ref, inputs, c, flags), dtype, bi)
    # Eager (un-jitted) calls keep the dtype too.
    assert op(**inputs, **flags).dtype == dtype


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


def _gradients_args(inputs, dy, z):
    return (inputs["source"], inputs["recurrent_weight"], dy, z, inputs["input_weight"],
            inputs["bias"], inputs["init_state"], inputs["mask"])


def _reference_gradient_oracles(inputs, dy, flags):
    """(z, reference_gradients, jax.vjp of reference) from one fast-compiled jit."""

    def run(inputs, dy):
        _, z = ref(**inputs, **flags, training=True)
        expected = jax_sgrnn.reference_gradients(*_gradients_args(inputs, dy, z), **flags)
        names = ["source", "recurrent_weight"] + [
            n for n in ("input_weight", "bias", "init_state") if inputs[n] is not None]
        _, vjp = jax.vjp(lambda *a: ref(**{**inputs, **dict(zip(names, a))}, **flags),
                         *(inputs[n] for n in names))
        return z, expected, list(vjp(dy))

    return ref_jit(run)(inputs, dy)


@pytest.mark.parametrize("bi", [False, True], ids=["uni", "bi"])
@pytest.mark.parametrize("pattern", OPTIONAL_PATTERNS, ids=pattern_id)
def test_gradients_op_list_order_and_values(cpu_backend, rng, bi, pattern):
    """single_gate_rnn_gradients returns MPSGraph's list: [dx, dR] + [dW] + [db] + [dh0] for
    the inputs given, shaped like them; values equal reference_gradients and jax.vjp of the
    reference."""
    w, b, h = pattern
    act = ACTIVATIONS[(sum(pattern) + 2 * bi) % len(ACTIVATIONS)]
    mask = MASK_KINDS[(sum(pattern) + bi) % len(MASK_KINDS)]
    inputs = make_inputs(rng, 4, 3, 3, 5, bidirectional=bi, input_weight=w, bias=b,
                         init_state=h, mask=mask)
    flags = dict(activation=act, reverse=not bi, bidirectional=bi)
    dy = random_array(rng, out_shape(inputs, bi), jnp.float64)
    z, expected, from_vjp = _reference_gradient_oracles(inputs, dy, flags)

    grads = jax_sgrnn.single_gate_rnn_gradients(*_gradients_args(inputs, dy, z), **flags)
    assert isinstance(grads, list)
    expected_names = ["source", "recurrent_weight"] + [
        n for n in ("input_weight", "bias", "init_state") if inputs[n] is not None]
    assert len(grads) == len(expected_names) == 2 + sum(pattern)
    for g, name in zip(grads, expected_names):
        assert g.shape == inputs[name].shape, (name, g.shape, inputs[name].shape)
        assert g.dtype == jnp.float64

    assert isinstance(expected, list) and len(expected) == len(grads)
    assert_close(grads, expected, err_msg="vs reference_gradients")
    assert_close(grads, from_vjp, err_msg="vs jax.vjp(reference)")


def test_gradients_op_accepts_descriptor_and_training_flag(rng):
    inputs = make_inputs(rng, 4, 3, 3, 5)
    desc = jax_sgrnn.SingleGateRNNDescriptor(activation="sigmoid", reverse=True)
    _, z = op(**inputs, descriptor=desc, training=True)
    dy = random_array(rng, z.shape, jnp.float64)
    args = _gradients_args(inputs, dy, z)
    a = jax_sgrnn.single_gate_rnn_gradients(*args, descriptor=desc)
    b = jax_sgrnn.single_gate_rnn_gradients(*args, descriptor=desc, training=True)
    c = jax_sgrnn.single_gate_rnn_gradients(*args, activation="sigmoid", reverse=True)
    assert_close(a, b)
    assert_close(a, c)


def test_gradients_op_under_jit(rng):
    inputs = make_inputs(rng, 4, 3, 3, 5, bidirectional=True, mask="float")
    flags = dict(activation="tanh", bidirectional=True)
    dy = random_array(rng, out_shape(inputs, True), jnp.float64)
    z, expected, _ = _reference_gradient_oracles(inputs, dy, flags)
    got = jax.jit(lambda i, dy, z: jax_sgrnn.single_gate_rnn_gradients(
        *_gradients_args(i, dy, z), **flags))(inputs, dy, z)
    assert_close(got, expected)


# ----------------------------------------------------------------------- training / z


@pytest.mark.parametrize("act,bi", [("tanh", False), ("relu", True), ("hard_sigmoid", True),
                                    ("sigmoid", False)])
def test_training_z_and_grad_through_y_and_z(rng, act, bi):
    """training=True: z equals the reference's; a loss that uses z too is differentiated
    exactly (the op falls back to the reference's vjp for z cotangents); losses of y only and
    of z only too."""
    inputs = make_inputs(rng, 4, 3, 3, 5, bidirectional=bi, mask="float")
    flags = dict(activation=act, reverse=True, bidirectional=bi, training=True)
    cy = random_array(rng, out_shape(inputs, bi), jnp.float64)
    cz = random_array(rng, out_shape(inputs, bi), jnp.float64)

    def run(fn):
        def loss(diff, wy, wz):
            y, z = fn(**{**inputs, **diff}, **flags)
            return wy * jnp.sum(y * cy) + wz * jnp.sum(jnp.sin(z) * cz)

        def both(diff):
            return jnp.sum(fn(**{**inputs, **diff}, **flags)[0] * cy) + jnp.sum(
                jnp.sin(fn(**{**inputs, **diff}, **flags)[1]) * cz)

        def y_only(diff):
            return jnp.sum(fn(**{**inputs, **diff}, **flags)[0] * cy)

        def z_only(diff):
            return jnp.sum(jnp.sin(fn(**{**inputs, **diff}, **flags)[1]) * cz)

        def all_(diff):
            return (fn(**{**inputs, **diff}, **flags), jax.grad(both)(diff),
                    jax.grad(y_only)(diff), jax.grad(z_only)(diff))

        return all_

    diff = diff_inputs(inputs)
    got = jax.jit(run(op))(diff)
    want = ref_jit(run(ref))(diff)
    for name, g, w in zip(("(y, z)", "grad y and z", "grad y only", "grad z only"), got, want):
        assert_close(g, w, err_msg=name)


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


# ------------------------------------------------------------ activation kinks (spec)


def _kink_inputs(act):
    """Inputs whose pre-activation sits exactly on the activation's kink at some steps:
    relu at z = 0 (zero-padded first step, no h0/bias), hard sigmoid at z = +-2.5."""
    H = 3
    R = jnp.eye(H) * 0.5
    if act == "relu":
        x = jnp.zeros((3, 2, H)).at[1].set(1.0)  # z[0] = 0 exactly
    else:
        x = jnp.zeros((3, 2, H)).at[0].set(2.5).at[2, 1].set(-2.5)  # z = 2.5 / -2.5 exactly
        R = jnp.zeros((H, H))  # keep later steps on the kink too
    return x, R


@pytest.mark.parametrize("act", ["relu", "hard_sigmoid"])
def test_op_gradient_at_activation_kinks_follows_spec(act):
    """At z exactly on a kink the op's gradient uses the spec's act' (relu'(0) = 0, hard
    sigmoid's open interval), i.e. equals reference_gradients' explicit BPTT."""
    x, R = _kink_inputs(act)
    _, z = ref(x, R, activation=act, training=True)
    dy = jnp.ones_like(z)
    expected = jax_sgrnn.reference_gradients(x, R, dy, z, activation=act)
    got = jax.grad(lambda x, R: jnp.sum(op(x, R, activation=act)), argnums=(0, 1))(x, R)
    assert_close(list(got), expected)
    assert_close(jax_sgrnn.single_gate_rnn_gradients(x, R, dy, z, activation=act), expected)


@pytest.mark.parametrize("act", ["relu", "hard_sigmoid"])
def test_op_gradient_at_kinks_does_not_depend_on_z_in_the_loss(act):
    """Adding 0 * sum(z) to a loss of y must not change d loss / d inputs. (The training op
    falls back to jax.vjp(reference) as soon as z has a cotangent; that path must use the
    same act' at the kinks as the gradient op.)"""
    x, R = _kink_inputs(act)

    def loss_y(x, R):
        y, _ = op(x, R, activation=act, training=True)
        return jnp.sum(y)

    def loss_y_plus_zero_z(x, R):
        y, z = op(x, R, activation=act, training=True)
        return jnp.sum(y) + 0.0 * jnp.sum(z)

    y_only = jax.grad(loss_y, argnums=(0, 1))(x, R)
    with_z = jax.grad(loss_y_plus_zero_z, argnums=(0, 1))(x, R)
    assert_close(with_z, y_only)
