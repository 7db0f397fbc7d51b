"""Regression tests for the second reliability round (docs/reliability.md, "Round two"), each
for the whole class of its defect: disable_jit, non-finite masks where an input is absent, the
mask's dtype rule, the accuracy of sigmoid and tanh (and their derivatives) in the tails,
strict rank and dtype promotion, None for required arguments, integer activation scalars.
"""

import itertools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sgrnn
from conftest import (ACTIVATIONS, assert_close, diff_inputs, make_inputs, random_array,
                      requires_native)

op, ref = jax_sgrnn.single_gate_rnn, jax_sgrnn.reference


def _grads(fn, inputs, flags, cotangent):
    return jax.grad(lambda d: jnp.sum(fn(**{**inputs, **d}, **flags) * cotangent))(
        diff_inputs(inputs))


# ------------------------------------------------------------------------ 1. disable_jit


@pytest.mark.parametrize("bi", [False, True], ids=["uni", "bi"])
def test_everything_runs_under_disable_jit(rng, bi):
    inputs = make_inputs(rng, bidirectional=bi, mask="float")
    flags = dict(activation="tanh", bidirectional=bi)
    c = random_array(rng, ref(**inputs, **flags).shape, jnp.float64)
    want_y, want_z = jax.jit(lambda i: ref(**i, **flags, training=True))(inputs)
    want_g = jax.jit(lambda i: _grads(ref, i, flags, c))(inputs)
    want_op_grads = jax_sgrnn.reference_gradients(
        inputs["source"], inputs["recurrent_weight"], c, want_z, inputs["input_weight"],
        inputs["bias"], inputs["init_state"], inputs["mask"], **flags)
    with jax.disable_jit():
        y, z = op(**inputs, **flags, training=True)
        assert_close(op(**inputs, **flags), want_y)
        assert_close((y, z), (want_y, want_z))
        assert_close(_grads(op, inputs, flags, c), want_g)
        got = jax_sgrnn.single_gate_rnn_gradients(
            inputs["source"], inputs["recurrent_weight"], c, z, inputs["input_weight"],
            inputs["bias"], inputs["init_state"], inputs["mask"], **flags)
        assert_close(got, want_op_grads)
        batched = jax.vmap(lambda x: op(x, inputs["recurrent_weight"], inputs["input_weight"],
                                        **flags))(jnp.stack([inputs["source"]] * 2))
        assert_close(batched[1], ref(inputs["source"], inputs["recurrent_weight"],
                                     inputs["input_weight"], **flags))


def test_disable_jit_with_a_raised_recursion_limit_does_not_crash():
    """The defect recursed until RecursionError, or a segfault with a raised limit."""
    code = ("import sys; sys.setrecursionlimit(10000); import jax, numpy as np, jax_sgrnn\n"
            "with jax.disable_jit():\n"
            "    y = jax_sgrnn.single_gate_rnn(np.ones((2, 1, 3), np.float32),"
            " np.eye(3, dtype=np.float32))\n"
            "print(float(y.sum()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=os.path.dirname(__file__), env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert out.returncode == 0, out.stderr[-2000:]


# ------------------------------------------- 2. non-finite masks where an input is absent


@requires_native
@pytest.mark.parametrize("value", [np.inf, -np.inf, np.nan], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("step", [0, 2])
@pytest.mark.parametrize("has_h0,has_w,bi,rev", list(itertools.product(
    (False, True), (False, True), (False, True), (False, True))))
def test_non_finite_mask_propagates_like_the_reference(rng, value, step, has_h0, has_w, bi, rev):
    """A non-finite mask entry multiplies whatever state it meets, the zero state of a missing
    init_state included: forward, every gradient of the gradient op, NaN where the reference
    has NaN and equal values elsewhere."""
    inputs = make_inputs(rng, T=3, N=2, I=2, H=3, bidirectional=bi, input_weight=has_w,
                         init_state=has_h0, mask="float")
    mask = np.array(inputs["mask"])
    mask[step, 1, :] = value
    inputs["mask"] = jnp.asarray(mask)
    flags = dict(activation="sigmoid", bidirectional=bi, reverse=rev)
    y, z = op(**inputs, **flags, training=True)
    want_y, want_z = ref(**inputs, **flags, training=True)
    for got, want in ((y, want_y), (z, want_z)):
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    dy = random_array(rng, y.shape, jnp.float64)
    args = (inputs["source"], inputs["recurrent_weight"], dy, want_z, inputs["input_weight"],
            inputs["bias"], inputs["init_state"], inputs["mask"])
    got = jax_sgrnn.single_gate_rnn_gradients(*args, **flags)
    want = jax_sgrnn.reference_gradients(*args, **flags)
    for i, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w), err_msg=f"gradient {i}")
        finite = np.isfinite(w)
        np.testing.assert_allclose(np.asarray(g)[finite], np.asarray(w)[finite], rtol=1e-9,
                                   atol=1e-9, err_msg=f"gradient {i}")


# ----------------------------------------------------------------- 3. the mask's dtype


@requires_native
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("mask_value", [1 / 0.9, 1e5, 3e-8])
def test_half_inputs_with_a_float32_mask_follow_the_one_rule(rng, dtype, mask_value):
    """The mask is converted once, straight to the dtype the computation runs in (float32 for
    half inputs), by the op and the reference alike: no overflow of 1e5 in float16, no early
    rounding of 1/0.9 to bfloat16."""
    inputs = make_inputs(rng, T=5, N=4, I=3, H=6, dtype=dtype)
    if mask_value > 1e3:  # keep h * m * R in range: the point is the mask itself, not overflow
        inputs["recurrent_weight"] = inputs["recurrent_weight"] * 1e-5
    inputs["mask"] = jnp.where(jnp.asarray(rng.random((5, 4, 6)) < 0.8), mask_value,
                               0.0).astype(jnp.float32)
    flags = dict(activation="tanh")
    got_y, got_z = op(**inputs, **flags, training=True)
    want_y, want_z = ref(**inputs, **flags, training=True)
    for got, want in ((got_y, want_y), (got_z, want_z)):
        assert got.dtype == dtype
        np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
        assert_close(got, want, dtype=dtype)
    text = jax.jit(lambda i: op(**i, **flags)).lower(inputs).as_text()
    call = next(line for line in text.splitlines() if "stablehlo.custom_call" in line)
    assert "tensor<5x4x6xf32>" in call.split("->")[0], call  # the mask operand: float32


def test_the_mask_reaches_the_primitive_in_the_compute_dtype(rng):
    inputs = make_inputs(rng, dtype=jnp.bfloat16, mask="float")
    inputs["mask"] = inputs["mask"].astype(jnp.float32)
    def equations(jaxpr):  # every equation, those inside custom_vjp's sub-jaxprs included
        for eqn in jaxpr.eqns:
            yield eqn
            for param in eqn.params.values():
                inner = getattr(param, "jaxpr", param)
                if hasattr(inner, "eqns"):
                    yield from equations(inner)

    jaxpr = jax.make_jaxpr(lambda i: op(**i))(inputs).jaxpr
    (eqn,) = [e for e in equations(jaxpr) if e.primitive.name == "sgrnn_forward"]
    assert eqn.invars[0].aval.dtype == jnp.bfloat16
    assert eqn.invars[-1].aval.dtype == jnp.float32


# ------------------------------------------------- 4. sigmoid and tanh over the whole range


def _truth(activation, z):
    """act(z) and act'(z) in long double, from formulas without cancellation."""
    z = z.astype(np.longdouble)
    if activation == "sigmoid":
        e = np.exp(-np.abs(z))
        return np.where(z >= 0, 1 / (1 + e), e / (1 + e)), e / (1 + e) ** 2
    e = np.exp(-2 * np.abs(z))
    return np.tanh(z), 4 * e / (1 + e) ** 2


ACCURACY_CHECK = """
import sys
import numpy as np, jax, jax_sgrnn
jax.config.update("jax_enable_x64", True)
activation, dtype, ulps = sys.argv[1], np.dtype(sys.argv[2]), float(sys.argv[3])
lim = 120 if dtype == np.float32 else 760
z = np.concatenate([np.linspace(-lim, lim, 100001), np.geomspace(1e-8, 1, 1001),
                    -np.geomspace(1e-8, 1, 1001)]).astype(dtype)
x, R = z.reshape(-1, 1, 1), np.zeros((1, 1), dtype)
y, zs = jax_sgrnn.single_gate_rnn(x, R, activation=activation, training=True)
(dx, _) = jax_sgrnn.single_gate_rnn_gradients(x, R, np.ones_like(x), zs, activation=activation)
L = np.longdouble
e = np.exp(-np.abs(z.astype(L)) * (1 if activation == "sigmoid" else 2))
want = ((np.where(z >= 0, 1 / (1 + e), e / (1 + e)), e / (1 + e) ** 2) if activation == "sigmoid"
        else (np.tanh(z.astype(L)), 4 * e / (1 + e) ** 2))
# The gradient op computes h = act(z) again, for dR (on the CPU by a formula of its own, shared
# with act'). With T = 2, R = 0, z[1] = 0 and dy = (0, 1): dR[i, j] = act'(0) h[0, j], and
# act'(0) (1 for tanh, 1/4 for sigmoid) scales exactly.
H = 2048
rows = np.concatenate([z, np.zeros(-len(z) % H, dtype)]).reshape(-1, H)
R2, dy2 = np.zeros((H, H), dtype), np.stack([np.zeros(H, dtype), np.ones(H, dtype)])[:, None]
grad_at_0 = 1.0 if activation == "tanh" else 0.25
h_back = []
for row in rows:
    x2 = np.stack([row, np.zeros(H, dtype)])[:, None]
    _, z2 = jax_sgrnn.single_gate_rnn(x2, R2, activation=activation, training=True)
    _, dR2 = jax_sgrnn.single_gate_rnn_gradients(x2, R2, dy2, z2, activation=activation)
    h_back.append(np.asarray(dR2)[0] / grad_at_0)
h_back = np.concatenate(h_back)[:len(z)]
# XLA's CPU threads flush subnormals, and intermediates of results near the smallest normal
# are subnormal: a few ulp is the claim from 4x the smallest normal up, |error| <= 4x tiny below.
floor = 4 * np.finfo(dtype).tiny
for name, got, truth in (("y", y, want[0]), ("dx", dx, want[1]), ("h in dR", h_back, want[0])):
    got = np.ravel(got).astype(L)
    big = np.abs(truth) >= floor
    err = np.abs(got[big] - truth[big]) / (np.abs(truth[big]) * np.finfo(dtype).eps)
    worst = int(np.argmax(err))
    assert err[worst] <= ulps, (name, float(err[worst]), float(z[big][worst]))
    assert np.all(np.abs(got[~big] - truth[~big]) <= floor), name
print("ok")
"""


def _accuracy_in_subprocess(activation, dtype, isa=None):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    if isa:
        env["SGRNN_CPU_ISA"] = isa
    out = subprocess.run([sys.executable, "-c", ACCURACY_CHECK, activation, dtype, "4"],
                         capture_output=True, text=True, env=env, cwd=os.path.dirname(__file__))
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


@requires_native
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("activation", ["sigmoid", "tanh"])
def test_activation_and_derivative_within_4_ulp_everywhere(activation, dtype):
    """The whole range, both tails included, for the forward's act(z), the gradient's act'(z)
    and the act(z) the gradient op computes again for dR: the handlers' sigmoid lost its
    negative tail (0.5 tanh(z/2) + 0.5 cancels: sigmoid(-16) was 0 in float32), and
    1 - tanh^2 and s (1 - s) cancel to 0 where the derivative is not 0."""
    _accuracy_in_subprocess(activation, dtype)


@requires_native
@pytest.mark.parametrize("activation", ["sigmoid", "tanh"])
def test_activation_accuracy_in_the_baseline_build(activation):
    """The build without FMA rounds differently: the same claim holds there."""
    _accuracy_in_subprocess(activation, "float32", isa="baseline")


def test_reference_derivatives_keep_the_tails():
    from jax_sgrnn.reference import activate_grad

    for activation in (jax_sgrnn.Activation.SIGMOID, jax_sgrnn.Activation.TANH):
        z = np.array([-60.0, -20.0, -3.0, 0.0, 3.0, 20.0, 60.0])
        got = np.asarray(activate_grad(activation, jnp.asarray(z)))
        want = _truth(activation.name.lower(), z)[1]
        np.testing.assert_allclose(got, want.astype(np.float64), rtol=1e-14)
        assert np.all(got > 0)


# ---------------------------------------------------- 5. strict rank and dtype promotion


@pytest.mark.parametrize("lengths", [False, True], ids=["", "seq_lengths"])
@pytest.mark.parametrize("backend", ["native", "scan"])
@pytest.mark.parametrize("bi", [False, True], ids=["uni", "bi"])
def test_library_works_under_strict_promotion(rng, bi, backend, lengths):
    """Every path: the op, its grad, the z-loss fallback to the reference's autodiff, vmap over
    the weights (the batched reference), the gradient op, and the reference itself; on the
    native handler and the decomposition, with and without int32 lengths (x64 is on, so JAX's
    default integers are int64)."""
    inputs = make_inputs(rng, bidirectional=bi, mask="float", dtype=jnp.float32)
    if lengths:
        inputs["seq_lengths"] = jnp.array([4, 0, 2], jnp.int32)
    flags = dict(activation="sigmoid", bidirectional=bi)
    with jax.numpy_rank_promotion("raise"), jax.numpy_dtype_promotion("strict"), \
            jax_sgrnn.cpu_backend(backend):
        y, z = op(**inputs, **flags, training=True)
        c = jnp.ones_like(y)
        results = dict(
            y=y, ref=ref(**inputs, **flags),
            grad=_grads(op, inputs, flags, c),
            z_loss=jax.grad(lambda R: jnp.sum(op(**{**inputs, "recurrent_weight": R}, **flags,
                                                 training=True)[1]))(inputs["recurrent_weight"]),
            vmap_w=jax.vmap(lambda W: op(**{**inputs, "input_weight": W}, **flags))(
                jnp.stack([inputs["input_weight"]] * 2)),
            grads_op=jax_sgrnn.single_gate_rnn_gradients(
                inputs["source"], inputs["recurrent_weight"], c, z, inputs["input_weight"],
                inputs["bias"], inputs["init_state"], inputs["mask"],
                seq_lengths=inputs.get("seq_lengths"), **flags),
            ref_grads=jax_sgrnn.reference_gradients(
                inputs["source"], inputs["recurrent_weight"], c, z, inputs["input_weight"],
                inputs["bias"], inputs["init_state"], inputs["mask"],
                seq_lengths=inputs.get("seq_lengths"), **flags))
    assert_close(results["y"], results["ref"])
    assert_close(results["vmap_w"][0], results["ref"])
    assert_close(results["grads_op"], results["ref_grads"])


# ----------------------------------------------------- 6. None for a required argument


@pytest.mark.parametrize("position,name", [(0, "source"), (1, "recurrent_weight")])
@pytest.mark.parametrize("fn", [op, ref], ids=["op", "reference"])
def test_none_for_a_required_forward_argument(rng, fn, position, name):
    inputs = make_inputs(rng)
    args = [inputs["source"], inputs["recurrent_weight"]]
    args[position] = None
    with pytest.raises(TypeError, match=f"^{name}: expected an array, got None"):
        fn(*args)


@pytest.mark.parametrize("position,name", [(0, "source"), (1, "recurrent_weight"),
                                           (2, "source_gradient"), (3, "z_state")])
@pytest.mark.parametrize("fn", [jax_sgrnn.single_gate_rnn_gradients,
                                jax_sgrnn.reference_gradients], ids=["op", "reference"])
def test_none_for_a_required_gradient_argument(rng, fn, position, name):
    inputs = make_inputs(rng)
    y = ref(**inputs)
    args = [inputs["source"], inputs["recurrent_weight"], y, y]
    args[position] = None
    with pytest.raises(TypeError, match=f"^{name}: expected an array, got None"):
        fn(*args)


# ------------------------------------------------------ integer scalars as the activation


@pytest.mark.parametrize("make", [int, np.int8, np.int64, np.uint8, jnp.int32, jnp.int8,
                                  lambda v: np.array(v, np.int16), lambda v: jnp.array(v)],
                         ids=["int", "np.int8", "np.int64", "np.uint8", "jnp.int32", "jnp.int8",
                              "np.array", "jnp.array"])
def test_any_concrete_integer_scalar_names_an_activation(rng, make):
    inputs = make_inputs(rng)
    for number, name in enumerate(ACTIVATIONS):
        assert jax_sgrnn.Activation.parse(make(number)) == jax_sgrnn.Activation.parse(name)
    np.testing.assert_array_equal(op(**inputs, activation=make(2)),
                                  op(**inputs, activation="tanh"))


@pytest.mark.parametrize("value", [True, np.bool_(True), 2.0, jnp.float32(2), jnp.array([2]),
                                   np.int32(7)], ids=str)
def test_non_integer_or_out_of_range_activations_are_rejected(value):
    with pytest.raises(ValueError, match="activation: expected one of"):
        jax_sgrnn.Activation.parse(value)
