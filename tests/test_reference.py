"""The lax.scan reference (the oracle for every backend) against the spec itself: a plain
numpy loop of the spec's equations, and finite differences for its gradients."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_sgrnn
from jax_sgrnn.reference import contraction_parts
from conftest import (ACTIVATIONS, MASK_KINDS, OPTIONAL_PATTERNS, assert_close, flags_id,
                      make_inputs, out_shape, pattern_id, random_array, ref_jit,
                      spec_numpy_forward)

op = jax_sgrnn.single_gate_rnn
ref = jax_sgrnn.reference


def _spec_grid():
    cases = []
    for i, (act, rev, bi) in enumerate(itertools.product(ACTIVATIONS, (False, True),
                                                         (False, True))):
        pattern = OPTIONAL_PATTERNS[(5 * i + 3) % len(OPTIONAL_PATTERNS)]
        mask = MASK_KINDS[(i + 1) % len(MASK_KINDS)]
        T, N, H = ((4, 3, 5), (1, 3, 5), (4, 1, 1), (4, 3, 1))[i % 4]
        cases.append(pytest.param(act, rev, bi, pattern, mask, (T, N, H),
                                  id=f"{flags_id(act, rev, bi)}-{pattern_id(pattern)}-"
                                     f"mask_{mask}-T{T}N{N}H{H}"))
    return cases


@pytest.mark.parametrize("act,rev,bi,pattern,mask,shape", _spec_grid())
def test_reference_and_op_match_numpy_spec_loop(rng, act, rev, bi, pattern, mask, shape):
    """y and z of the reference (and of the op) equal an independent numpy transcription of
    the spec: processing order, time layout of reversed/backward halves, mask by step."""
    T, N, H = shape
    w, b, h = pattern
    inputs = make_inputs(rng, T, N, 3, H, bidirectional=bi, input_weight=w, bias=b,
                         init_state=h, mask=mask)
    flags = dict(activation=act, reverse=rev, bidirectional=bi)
    y_np, z_np = spec_numpy_forward(**inputs, **flags)
    y_ref, z_ref = ref_jit(lambda i: ref(**i, **flags, training=True))(inputs)
    np.testing.assert_allclose(np.asarray(z_ref), z_np, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(np.asarray(y_ref), y_np, rtol=1e-12, atol=1e-12)
    y_op, z_op = jax.jit(lambda i: op(**i, **flags, training=True))(inputs)
    np.testing.assert_allclose(np.asarray(z_op), z_np, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(np.asarray(y_op), y_np, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("act,rev,bi,pattern,mask", [
    pytest.param("tanh", False, False, (True, True, True), None, id="tanh-fwd-uni-WbH0"),
    pytest.param("sigmoid", True, False, (True, True, True), "float",
                 id="sigmoid-rev-uni-Wbh0-mask_float"),
    pytest.param("none", False, True, (True, True, True), "bool",
                 id="none-fwd-bi-Wbh0-mask_bool"),
    pytest.param("tanh", True, True, (False, True, True), "float",
                 id="tanh-rev-bi-bh0-mask_float"),
])
def test_reference_gradients_match_finite_differences(rng, act, rev, bi, pattern, mask):
    w, b, h = pattern
    inputs = make_inputs(rng, 4, 3, 3, 5, bidirectional=bi, input_weight=w, bias=b,
                         init_state=h, mask=mask)
    flags = dict(activation=act, reverse=rev, bidirectional=bi)
    names = [n for n in ("source", "recurrent_weight", "input_weight", "bias", "init_state")
             if inputs[n] is not None]
    c = random_array(rng, out_shape(inputs, bi), jnp.float64)

    @jax.jit  # check_grads differentiates it: compiler_options are top-level only
    def f(*args):
        return jnp.sum(ref(**{**inputs, **dict(zip(names, args))}, **flags) * c)

    check_grads(f, tuple(inputs[n] for n in names), order=1, modes=["rev"])


@pytest.mark.parametrize("bi", [False, True], ids=["uni", "bi"])
def test_reference_gradients_equal_vjp_of_reference(rng, bi):
    """The explicit BPTT (reference_gradients) equals JAX's autodiff of the forward."""
    inputs = make_inputs(rng, 4, 3, 3, 5, bidirectional=bi, mask="float")
    flags = dict(activation="tanh", reverse=True, bidirectional=bi)
    dy = random_array(rng, out_shape(inputs, bi), jnp.float64)
    names = ["source", "recurrent_weight", "input_weight", "bias", "init_state"]

    @ref_jit
    def run(inputs, dy):
        _, z = ref(**inputs, **flags, training=True)
        explicit = jax_sgrnn.reference_gradients(
            inputs["source"], inputs["recurrent_weight"], dy, z, inputs["input_weight"],
            inputs["bias"], inputs["init_state"], inputs["mask"], **flags)
        _, vjp = jax.vjp(lambda *a: ref(**{**inputs, **dict(zip(names, a))}, **flags),
                         *(inputs[n] for n in names))
        return explicit, list(vjp(dy))

    explicit, autodiff = run(inputs, dy)
    assert_close(explicit, autodiff)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32],
                         ids=["float16", "bfloat16", "float32"])
def test_reference_keeps_input_dtype(rng, dtype):
    inputs = make_inputs(rng, 4, 3, 3, 5, mask="bool", dtype=dtype)
    y, z = ref_jit(lambda i: ref(**i, activation="tanh", training=True))(inputs)
    assert y.dtype == dtype and z.dtype == dtype
    y_np, _ = spec_numpy_forward(**inputs, activation="tanh")
    tol = {np.dtype(jnp.float32): 1e-5}.get(np.dtype(dtype), 2e-2)
    np.testing.assert_allclose(np.asarray(y.astype(jnp.float64)), y_np, rtol=tol, atol=tol)


@pytest.mark.parametrize("act", ["relu", "hard_sigmoid"])
def test_reference_autodiff_at_activation_kinks_follows_spec(act):
    """The spec's act' is 0 at relu's kink (z = 0) and outside hard sigmoid's open interval
    (-2.5, 2.5). jax.grad of the reference must agree with its own explicit BPTT
    (reference_gradients) there, e.g. for zero-padded inputs with relu."""
    H = 3
    if act == "relu":
        x = jnp.zeros((3, 2, H)).at[1].set(1.0)  # z[0] = 0 exactly
        R = jnp.eye(H) * 0.5
    else:
        x = jnp.zeros((3, 2, H)).at[0].set(2.5).at[2, 1].set(-2.5)
        R = jnp.zeros((H, H))
    _, z = ref(x, R, activation=act, training=True)
    expected = jax_sgrnn.reference_gradients(x, R, jnp.ones_like(z), z, activation=act)
    autodiff = jax.grad(lambda x, R: jnp.sum(ref(x, R, activation=act)), argnums=(0, 1))(x, R)
    assert_close(list(autodiff), expected)


@pytest.mark.parametrize("unroll,gpu_form", [(4, False), (1, True), (4, True)],
                         ids=["unroll4", "gpu", "unroll4-gpu"])
@pytest.mark.parametrize("T", [1, 6, 9])
@pytest.mark.parametrize("N,bi,H", [(1, False, 4), (1, True, 4), (3, True, 4), (3, True, 1024),
                                    (2, False, 1024)])
@pytest.mark.parametrize("mask,lengths", [("float", True), (None, False)])
def test_scan_schedules_match_one_scan_per_direction_one_step_per_iteration(
        rng, N, bi, H, T, unroll, gpu_form, mask, lengths):
    """``unroll`` and ``gpu_form`` (what the decomposition lowers with: both directions in
    one scan; with one row, backward products against a transposed R; with a few rows at
    H = 1024, products split along their contraction) change the loops, not the result: the
    forward and the gradient op against one step per iteration and one scan per direction,
    for lengths that are not a multiple of 4, with lengths and a mask and with neither, in
    float64."""
    inputs = make_inputs(rng, T, N, 2, H, bidirectional=bi, mask=mask)
    flags = dict(bidirectional=bi, activation="tanh")
    if lengths:
        flags["seq_lengths"] = jnp.array([T, 0, max(T - 2, 1)][:N], jnp.int32)
    schedules = {"one": dict(unroll=1), "other": dict(unroll=unroll, gpu_form=gpu_form)}
    forward = {k: jax.jit(lambda i, k=k: ref(**i, **flags, training=True, **schedules[k]))(inputs)
               for k in schedules}
    for a, b in zip(forward["other"], forward["one"], strict=True):
        assert_close(a, b)
    y, z = forward["one"]
    dy = random_array(rng, y.shape, y.dtype)
    grads = {k: jax.jit(lambda i, k=k: jax_sgrnn.reference_gradients(
        **i, source_gradient=dy, z_state=z, **flags, **schedules[k]))(inputs) for k in schedules}
    for a, b in zip(grads["other"], grads["one"], strict=True):
        assert_close(a, b)


@pytest.mark.parametrize("rows,directions,H,parts", [
    (3, 2, 1024, 16), (32, 2, 2048, 8), (20, 2, 1024, 8), (4, 1, 1536, 16), (8, 1, 1280, 8),
    (2, 2, 1100, 1), (1, 2, 1024, 1), (33, 2, 1024, 1), (9, 1, 1024, 1), (4, 2, 512, 1)])
def test_contraction_parts(rows, directions, H, parts):
    """The GPU form splits a step's product only for a few rows (2 to 32 with two directions,
    2 to 8 with one) at H >= 1024, into slices of a multiple of 32 and at least 64 long, at
    most 16 of them and at most 256 / rows; never on other platforms."""
    assert contraction_parts(rows, directions, H, gpu_form=True) == parts
    assert contraction_parts(rows, directions, H, gpu_form=False) == 1


@pytest.mark.parametrize("fn", [op, ref], ids=["op", "reference"])
def test_array_likes_are_taken_like_arrays(fn):
    """Lists, scalars and NumPy arrays, as the README's signatures allow, for every operand."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 2, 3))
    R, W = 0.4 * rng.standard_normal((3, 3)), rng.standard_normal((3, 3))
    b, h0 = rng.standard_normal(3), rng.standard_normal((2, 3))
    as_arrays = fn(jnp.asarray(x), jnp.asarray(R), jnp.asarray(W), jnp.asarray(b),
                   jnp.asarray(h0), jnp.asarray(0.5), seq_lengths=jnp.array([3, 1]),
                   activation="tanh")
    as_lists = fn(x.tolist(), R.tolist(), W.tolist(), b.tolist(), h0.tolist(), 0.5,
                  seq_lengths=[3, 1], activation="tanh")
    assert_close(as_lists, as_arrays)
    y, z = fn(x, R, W, training=True)
    dy = np.ones(y.shape).tolist()
    grads_lists = jax_sgrnn.reference_gradients(x.tolist(), R.tolist(), dy, np.asarray(z).tolist(),
                                                W.tolist(), seq_lengths=[4, 2])
    grads_arrays = jax_sgrnn.reference_gradients(x, R, jnp.ones(y.shape), z, W,
                                                 seq_lengths=np.array([4, 2]))
    for a, b_ in zip(grads_lists, grads_arrays):
        assert_close(a, b_)
