"""Forward mode through the op: jax.jvp, jax.jacfwd, jax.linearize and their compositions with
reverse mode and vmap equal the same transforms of the ``lax.scan`` reference, over the flags,
on every CPU backend; the tangent runs as one more call of the forward recurrence."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sgrnn
from conftest import (ACTIVATIONS, DIFF_NAMES, assert_close, backends_over, diff_inputs,
                      flags_id, grid_every_activation, grid_every_pattern, make_inputs,
                      random_array, ref_jit)

op, ref = jax_sgrnn.single_gate_rnn, jax_sgrnn.reference
SHAPES = [(4, 3, 3, 5), (5, 2, 4, 3), (3, 1, 2, 4)]


def _inputs(rng, pattern, mask, shape, bi, dtype=jnp.float64):
    T, N, I, H = shape
    w, b, h = pattern
    return make_inputs(rng, T, N, I, H, bidirectional=bi, input_weight=w, bias=b,
                       init_state=h, mask=mask, dtype=dtype)


def _tangents(rng, primals: dict) -> dict:
    return {n: random_array(rng, a.shape, a.dtype) for n, a in primals.items()}


def _jvp(fn, inputs, primals, tangents, flags, jit=jax.jit):
    """(outputs, output tangents) of ``fn`` as a function of ``primals`` (a dict of inputs)."""
    def run(primals, tangents):
        return jax.jvp(lambda p: fn(**{**inputs, **p}, **flags), (primals,), (tangents,))
    return jit(run)(primals, tangents)


@pytest.mark.parametrize(
    "cpu_backend,act,rev,bi,pattern,mask,shape",
    backends_over(grid_every_pattern(SHAPES), grid_every_activation(SHAPES)),
    indirect=["cpu_backend"])
def test_jvp_of_every_input_at_once_float64(cpu_backend, rng, act, rev, bi, pattern, mask,
                                             shape):
    """y and z (training) with their tangents, every differentiable input perturbed."""
    inputs = _inputs(rng, pattern, mask, shape, bi)
    flags = dict(activation=act, reverse=rev, bidirectional=bi, training=True)
    primals = diff_inputs(inputs)
    tangents = _tangents(rng, primals)
    assert_close(_jvp(op, inputs, primals, tangents, flags),
                 _jvp(ref, inputs, primals, tangents, flags, ref_jit))


@pytest.mark.parametrize("name", DIFF_NAMES)
@pytest.mark.parametrize("act,rev,bi,mask", [("tanh", False, False, None),
                                             ("relu", True, False, "float"),
                                             ("sigmoid", False, True, "bool"),
                                             ("hard_sigmoid", True, True, "float")],
                         ids=lambda v: str(v))
def test_jvp_of_each_input_alone(native_backend, rng, name, act, rev, bi, mask):
    """A tangent for one input only (the others symbolically zero: the tangent call then
    carries only that input's term)."""
    inputs = make_inputs(rng, 5, 3, 4, 4, bidirectional=bi, mask=mask)
    flags = dict(activation=act, reverse=rev, bidirectional=bi)
    primals = {name: inputs[name]}
    tangents = _tangents(rng, primals)
    assert_close(_jvp(op, inputs, primals, tangents, flags),
                 _jvp(ref, inputs, primals, tangents, flags, ref_jit))


@pytest.mark.parametrize("act,rev,bi,pattern,mask,shape", grid_every_activation(SHAPES))
def test_jvp_float32(native_backend, rng, act, rev, bi, pattern, mask, shape):
    inputs = _inputs(rng, pattern, mask, shape, bi, jnp.float32)
    flags = dict(activation=act, reverse=rev, bidirectional=bi, training=True)
    primals = diff_inputs(inputs)
    tangents = _tangents(rng, primals)
    assert_close(_jvp(op, inputs, primals, tangents, flags),
                 _jvp(ref, inputs, primals, tangents, flags, ref_jit))


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("bi", [False, True], ids=["uni", "bi"])
def test_jvp_half_types(native_backend, rng, dtype, bi):
    """Half types: computed in float32 (as the forward is), stored in their own dtype."""
    inputs = make_inputs(rng, 5, 3, 4, 4, bidirectional=bi, mask="float", dtype=dtype)
    flags = dict(activation="tanh", bidirectional=bi, training=True)
    primals = diff_inputs(inputs)
    tangents = _tangents(rng, primals)
    got = _jvp(op, inputs, primals, tangents, flags)
    assert all(a.dtype == dtype for a in jax.tree.leaves(got))
    assert_close(got, _jvp(ref, inputs, primals, tangents, flags, ref_jit))


LENGTH_CASES = list(itertools.product(("tanh", "relu"), (False, True), (False, True)))


@pytest.mark.parametrize("act,rev,bi", LENGTH_CASES,
                         ids=[flags_id(*c) for c in LENGTH_CASES])
def test_jvp_with_seq_lengths(cpu_backend, rng, act, rev, bi):
    """Rows of lengths T, 0 and in between: padded steps have zero tangents, and a reversed
    direction's tangent starts at each row's own last valid step."""
    inputs = make_inputs(rng, 6, 4, 3, 4, bidirectional=bi, mask="float")
    flags = dict(activation=act, reverse=rev, bidirectional=bi, training=True,
                 seq_lengths=jnp.asarray([6, 0, 3, 1]))
    primals = diff_inputs(inputs)
    tangents = _tangents(rng, primals)
    got = _jvp(op, inputs, primals, tangents, flags)
    assert_close(got, _jvp(ref, inputs, primals, tangents, flags, ref_jit))
    (_, _), (dy, dz) = got
    assert not np.any(np.asarray(dy[3:, 2])) and not np.any(np.asarray(dz[:, 1]))


def _small(rng, bi, mask="float", **kw):
    return make_inputs(rng, 4, 2, 3, 3, bidirectional=bi, mask=mask, **kw)


@pytest.mark.parametrize("act,rev,bi", [("tanh", False, False), ("relu", True, False),
                                        ("sigmoid", False, True)],
                         ids=lambda v: str(v))
def test_jacfwd_equals_jacrev(native_backend, rng, act, rev, bi):
    inputs = _small(rng, bi)
    flags = dict(activation=act, reverse=rev, bidirectional=bi)
    f = lambda p: op(**{**inputs, **p}, **flags)
    primals = diff_inputs(inputs)
    fwd = jax.jit(jax.jacfwd(f))(primals)
    assert_close(fwd, jax.jit(jax.jacrev(f))(primals))
    assert_close(fwd, jax.jacfwd(lambda p: ref(**{**inputs, **p}, **flags))(primals))


@pytest.mark.parametrize("bi", [False, True], ids=["uni", "bi"])
def test_linearize_then_transpose_equals_vjp(native_backend, rng, bi):
    inputs = _small(rng, bi)
    flags = dict(activation="tanh", bidirectional=bi, training=True)
    f = lambda p: op(**{**inputs, **p}, **flags)
    primals = diff_inputs(inputs)
    out, linear = jax.linearize(f, primals)
    cotangents = tuple(random_array(rng, a.shape, a.dtype) for a in out)
    (transposed,) = jax.linear_transpose(linear, primals)(cotangents)
    _, vjp = jax.vjp(f, primals)
    (want,) = vjp(cotangents)
    assert_close(transposed, want)
    # ... and the linear map itself is the jvp.
    tangents = _tangents(rng, primals)
    assert_close(linear(tangents), jax.jvp(f, (primals,), (tangents,))[1])


def _loss(fn, inputs, flags, c):
    def loss(params):
        y = fn(**{**inputs, **params}, **flags)
        return jnp.sum(c * y) + 0.5 * jnp.sum(y ** 4)
    return loss


@pytest.mark.parametrize("act,bi", list(zip(ACTIVATIONS, itertools.cycle((False, True)))),
                         ids=lambda v: str(v))
def test_hessian_reverse_over_forward(native_backend, rng, act, bi):
    """jax.jacrev of jax.jacfwd equals the reference's Hessian (forward over reverse,
    jax.hessian, is test_second_derivatives.py's)."""
    inputs = _small(rng, bi)
    flags = dict(activation=act, bidirectional=bi, reverse=not bi)
    c = random_array(rng, ref(**inputs, **flags).shape, jnp.float64)
    params = diff_inputs(inputs)
    want = ref_jit(jax.hessian(_loss(ref, inputs, flags, c)))(params)
    got = jax.jit(jax.jacrev(jax.jacfwd(_loss(op, inputs, flags, c))))(params)
    assert_close(got, want)


def test_forward_over_forward(native_backend, rng):
    inputs = _small(rng, False)
    u, v = (random_array(rng, inputs["recurrent_weight"].shape, jnp.float64) for _ in "uv")

    def second(fn):
        f = lambda R: fn(**{**inputs, "recurrent_weight": R}, activation="tanh")
        df = lambda R: jax.jvp(f, (R,), (u,))[1]
        return jax.jvp(df, (inputs["recurrent_weight"],), (v,))[1]

    assert_close(jax.jit(lambda: second(op))(), second(ref))


def test_vmap_of_jvp(native_backend, rng):
    """Batched tangents (jacfwd's pattern: the weights' tangents mapped, the primals not) and
    batched primals and tangents together."""
    inputs = _small(rng, True, mask="bool")
    flags = dict(activation="relu", bidirectional=True)
    R = inputs["recurrent_weight"]
    dRs = random_array(rng, (3, *R.shape), jnp.float64)

    def jvp_R(fn, x, dR):
        return jax.jvp(lambda R: fn(**{**inputs, "source": x, "recurrent_weight": R}, **flags),
                       (R,), (dR,))[1]

    x = inputs["source"]
    got = jax.jit(jax.vmap(lambda d: jvp_R(op, x, d)))(dRs)
    assert_close(got, jnp.stack([jvp_R(ref, x, d) for d in dRs]))
    xs = random_array(rng, (3, *x.shape), jnp.float64)
    got = jax.jit(jax.vmap(lambda x, d: jvp_R(op, x, d)))(xs, dRs)
    assert_close(got, jnp.stack([jvp_R(ref, x, d) for x, d in zip(xs, dRs)]))


def test_grad_of_z_with_forward_mode_inside(native_backend, rng):
    """A cotangent for z (which the gradient op does not take) and a jvp in one program."""
    inputs = _small(rng, False)
    v = random_array(rng, inputs["recurrent_weight"].shape, jnp.float64)

    def f(fn):
        def of_R(R):
            y, z = fn(**{**inputs, "recurrent_weight": R}, activation="tanh", training=True)
            return jnp.sum(jnp.sin(z)) + jnp.sum(y ** 2)
        return jax.jvp(jax.grad(of_R), (inputs["recurrent_weight"],), (v,))

    assert_close(jax.jit(lambda: f(op))(), f(ref))
