"""Second derivatives through the op (issue 7, "Second derivatives"): Hessians, Hessian-vector
products and gradient penalties equal those of the reference, over the flags; the gradient op
itself is differentiable."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sgrnn
from conftest import ACTIVATIONS, assert_close, make_inputs, random_array

op, ref = jax_sgrnn.single_gate_rnn, jax_sgrnn.reference
WEIGHTS = ("recurrent_weight", "input_weight", "bias", "init_state")


def _loss(fn, inputs, flags, c):
    """A scalar of every differentiable input, nonlinear in y so second derivatives matter."""
    def loss(params):
        y = fn(**{**inputs, **params}, **flags)
        return jnp.sum(c * y) + 0.5 * jnp.sum(y ** 4)
    return loss


def _params(inputs):
    return {n: inputs[n] for n in ("source", *WEIGHTS) if inputs[n] is not None}


# Every activation, the (reverse, bidirectional) pairs cycling with it.
HESSIAN_CASES = [(act, *pair) for act, pair in zip(
    ACTIVATIONS, itertools.cycle(itertools.product((False, True), repeat=2)))]


@pytest.mark.parametrize("act,rev,bi", HESSIAN_CASES,
                         ids=[f"{a}-{'rev' if r else 'fwd'}-{'bi' if b else 'uni'}"
                              for a, r, b in HESSIAN_CASES])
@pytest.mark.parametrize("mask", [None, "float"])
def test_hessian_equals_the_references(rng, act, rev, bi, mask):
    inputs = make_inputs(rng, T=3, N=2, I=2, H=3, bidirectional=bi, mask=mask)
    flags = dict(activation=act, reverse=rev, bidirectional=bi)
    c = random_array(rng, ref(**inputs, **flags).shape, jnp.float64)
    params = _params(inputs)
    got = jax.jit(jax.hessian(_loss(op, inputs, flags, c)))(params)
    want = jax.hessian(_loss(ref, inputs, flags, c))(params)
    assert_close(got, want)


@pytest.mark.parametrize("bi", [False, True], ids=["uni", "bi"])
def test_hessian_vector_product(rng, bi):
    """Forward over reverse: jax.jvp of jax.grad."""
    inputs = make_inputs(rng, T=5, N=3, I=4, H=4, bidirectional=bi, mask="bool")
    flags = dict(activation="sigmoid", bidirectional=bi)
    c = random_array(rng, ref(**inputs, **flags).shape, jnp.float64)
    params = _params(inputs)
    v = jax.tree.map(lambda a: random_array(rng, a.shape, a.dtype), params)

    def hvp(fn):
        return jax.jvp(jax.grad(_loss(fn, inputs, flags, c)), (params,), (v,))[1]

    assert_close(jax.jit(lambda: hvp(op))(), hvp(ref))


@pytest.mark.parametrize("act", ["tanh", "relu", "hard_sigmoid"])
def test_gradient_penalty(rng, act):
    """Reverse over reverse: the gradient of the squared norm of an input gradient (WGAN-GP
    style), with respect to the weights."""
    inputs = make_inputs(rng, T=4, N=3, I=3, H=4, mask="float")
    flags = dict(activation=act)

    def penalty(fn):
        def of_weights(weights):
            def data_term(x):
                return jnp.sum(fn(**{**inputs, **weights, "source": x}, **flags) ** 2)
            g = jax.grad(data_term)(inputs["source"])
            return jnp.sum(g * g)
        return jax.grad(of_weights)({n: inputs[n] for n in WEIGHTS})

    assert_close(jax.jit(lambda: penalty(op))(), penalty(ref))


def test_the_gradient_op_is_differentiable(rng):
    inputs = make_inputs(rng, T=4, N=2, I=3, H=3, mask="float")
    flags = dict(activation="tanh")
    y, z = ref(**inputs, **flags, training=True)
    dy = random_array(rng, y.shape, jnp.float64)

    def total(fn):
        def f(R, W, dy):
            grads = fn(inputs["source"], R, dy, z, W, inputs["bias"], inputs["init_state"],
                       inputs["mask"], **flags)
            return sum(jnp.sum(jnp.sin(g)) for g in grads)
        return jax.grad(f, argnums=(0, 1, 2))(inputs["recurrent_weight"],
                                              inputs["input_weight"], dy)

    assert_close(total(jax_sgrnn.single_gate_rnn_gradients),
                 total(jax_sgrnn.reference_gradients))


def test_second_derivative_under_vmap(rng):
    """Per-example Hessian-vector products (vmap of jvp of grad)."""
    inputs = make_inputs(rng, T=3, N=2, I=2, H=3)
    xs = jnp.stack([inputs["source"], 2 * inputs["source"], -inputs["source"]])
    v = random_array(rng, inputs["recurrent_weight"].shape, jnp.float64)

    def hvp(fn, x):
        g = jax.grad(lambda R: jnp.sum(jnp.tanh(fn(**{**inputs, "source": x,
                                                       "recurrent_weight": R}))))
        return jax.jvp(g, (inputs["recurrent_weight"],), (v,))[1]

    got = jax.jit(jax.vmap(lambda x: hvp(op, x)))(xs)
    want = jnp.stack([hvp(ref, x) for x in xs])
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
