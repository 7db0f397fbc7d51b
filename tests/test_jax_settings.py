"""The op under JAX's process-wide settings: everything runs under ``jax.disable_jit()``, and
every path works under strict rank and dtype promotion (``jax_numpy_rank_promotion="raise"``,
``jax_numpy_dtype_promotion="strict"``), with x64 on and int32 lengths."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import jax_sgrnn
from conftest import assert_close, diff_inputs, make_inputs, random_array

op, ref = jax_sgrnn.single_gate_rnn, jax_sgrnn.reference


def _grads(fn, inputs, flags, cotangent):
    return jax.grad(lambda d: jnp.sum(fn(**{**inputs, **d}, **flags) * cotangent))(
        diff_inputs(inputs))


# ------------------------------------------------------------------------ disable_jit


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


# ---------------------------------------------------- strict rank and dtype promotion


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
