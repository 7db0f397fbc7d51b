"""Edge sizes: T = 0 and N = 0 give empty outputs and zero gradients (not errors); the
smallest non-empty problem (T = N = H = 1)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sgrnn
from conftest import (assert_close, diff_inputs, full_results, make_inputs, out_shape,
                      random_array, ref_jit)

op = jax_sgrnn.single_gate_rnn
ref = jax_sgrnn.reference


@pytest.mark.parametrize("bi", [False, True], ids=["uni", "bi"])
@pytest.mark.parametrize("h0", [True, False], ids=["h0", "no_h0"])
@pytest.mark.parametrize("T,N", [(0, 3), (4, 0), (0, 0)], ids=["T0", "N0", "T0N0"])
def test_empty_sequence_or_batch(rng, T, N, h0, bi):
    inputs = make_inputs(rng, T, N, 3, 5, bidirectional=bi, init_state=h0, mask="float")
    flags = dict(activation="tanh", reverse=True, bidirectional=bi)
    shape = out_shape(inputs, bi)
    c = random_array(rng, shape, jnp.float64)

    got = full_results(op, inputs, c, flags)
    for key in ("y", "y_train", "z"):
        assert got[key].shape == shape and got[key].dtype == jnp.float64
    assert set(got["grads"]) == set(diff_inputs(inputs))
    for name, g in got["grads"].items():
        assert g.shape == inputs[name].shape, name
        np.testing.assert_array_equal(np.asarray(g), 0.0, err_msg=name)
    assert_close(got, full_results(ref, inputs, c, flags))

    # Eager too (the primitives' own impl), and the explicit gradient op.
    assert op(**inputs, **flags).shape == shape
    grads = jax_sgrnn.single_gate_rnn_gradients(
        inputs["source"], inputs["recurrent_weight"], c, got["z"], inputs["input_weight"],
        inputs["bias"], inputs["init_state"], inputs["mask"], **flags)
    names = ["source", "recurrent_weight", "input_weight", "bias"] + (["init_state"] if h0
                                                                       else [])
    assert [g.shape for g in grads] == [inputs[n].shape for n in names]
    for g in grads:
        np.testing.assert_array_equal(np.asarray(g), 0.0)


def test_empty_without_input_weight(rng):
    inputs = make_inputs(rng, 0, 3, 3, 5, input_weight=False, bias=False)
    y, g = jax.value_and_grad(lambda d: jnp.sum(op(**{**inputs, **d}) ** 2))(
        diff_inputs(inputs))
    assert float(y) == 0.0
    assert g["source"].shape == (0, 3, 5)
    np.testing.assert_array_equal(np.asarray(g["recurrent_weight"]), 0.0)
    np.testing.assert_array_equal(np.asarray(g["init_state"]), 0.0)


def test_empty_batch_under_vmap(rng):
    inputs = make_inputs(rng, 4, 0, 3, 5)
    xs = jnp.stack([inputs["source"]] * 2)
    rest = {k: v for k, v in inputs.items() if k != "source"}
    assert jax.vmap(lambda x: op(x, **rest))(xs).shape == (2, 4, 0, 5)


@pytest.mark.parametrize("bi", [False, True], ids=["uni", "bi"])
@pytest.mark.parametrize("act", ["tanh", "sigmoid"])
def test_smallest_problem_T1_N1_H1(rng, act, bi):
    inputs = make_inputs(rng, 1, 1, 3, 1, bidirectional=bi, mask="float")
    flags = dict(activation=act, bidirectional=bi)
    c = random_array(rng, out_shape(inputs, bi), jnp.float64)
    assert_close(full_results(op, inputs, c, flags), full_results(ref, inputs, c, flags))


def test_H1_without_input_weight(rng):
    inputs = make_inputs(rng, 4, 3, 1, 1, input_weight=False, mask="bool")
    c = random_array(rng, (4, 3, 1), jnp.float64)
    flags = dict(activation="none", reverse=True)
    assert_close(full_results(op, inputs, c, flags), full_results(ref, inputs, c, flags))


def test_longer_sequence_and_wider_batch(rng):
    """A size where BLAS blocking and XLA's thread pool may matter (still fast)."""
    inputs = make_inputs(rng, 33, 17, 7, 12, bidirectional=True, mask="float")
    flags = dict(activation="tanh", bidirectional=True)
    c = random_array(rng, out_shape(inputs, True), jnp.float64)
    assert_close(full_results(op, inputs, c, flags), full_results(ref, inputs, c, flags))


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32], ids=["float64", "float32"])
def test_sizes_that_take_the_parallel_kernel_paths(rng, dtype):
    """N*H*H and the big products reach the CPU kernels' multi-threaded threshold (2^20
    multiply-adds): the banded recurrent products and row-split GEMMs must agree with the
    single-threaded reference."""
    inputs = make_inputs(rng, 5, 64, 130, 128, bidirectional=True, mask="float", dtype=dtype)
    flags = dict(activation="tanh", bidirectional=True)
    c = random_array(rng, out_shape(inputs, True), dtype)
    assert_close(full_results(op, inputs, c, flags), full_results(ref, inputs, c, flags))
    # Per-example weight gradients (the gradient op's G > 1) at that size.
    xs = random_array(rng, (2, *inputs["source"].shape), dtype)
    rest = {k: v for k, v in inputs.items() if k != "source"}

    def per_example(fn):
        return jax.vmap(jax.grad(lambda x, r: jnp.sum(fn(x, **r, **flags) * c), argnums=(0, 1)),
                        in_axes=(0, None))

    got = jax.jit(per_example(op))(xs, rest)
    want = ref_jit(per_example(ref))(xs, rest)
    assert_close(got, want)
