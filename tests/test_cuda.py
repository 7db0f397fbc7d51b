"""The CUDA handler (csrc/cuda) against the lax.scan reference, on an NVIDIA GPU.

Every test here runs on the GPU and is skipped without one (or without the CUDA build); the
suite runs on CPU unless JAX_PLATFORMS says otherwise, so on a GPU machine run it with
``JAX_PLATFORMS=cuda,cpu``. The rest of the suite then also runs on the GPU (the op lowers to
this handler there): test_op.py's flag grid, test_seq_lengths.py, test_transforms.py. The
lowering checks at the end need only the CUDA build, not a GPU.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

import jax_sgrnn
from conftest import (ACTIVATIONS, LOOP_T, assert_close, full_results, lowered_text,
                      make_inputs, out_shape, random_array)

op = jax_sgrnn.single_gate_rnn
ref = jax_sgrnn.reference
CUDA = jax_sgrnn.backends()["cuda"]

requires_cuda_build = pytest.mark.skipif(
    not CUDA.available, reason=f"package built without the CUDA handler ({CUDA.reason})")
ON_GPU = CUDA.available and jax.default_backend() == "gpu"
requires_gpu = pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU and the CUDA build")


def _grid_flags():
    """activation x reverse x bidirectional (20 cases)."""
    return [(a, r, b) for a in ACTIVATIONS for r in (False, True) for b in (False, True)]


def _check(rng, T, N, I, H, dtype, flags, *, mask=None, lengths=None, pattern=(True,) * 3):
    w, b, h = pattern
    inputs = make_inputs(rng, T, N, I, H, bidirectional=flags.get("bidirectional", False),
                         input_weight=w, bias=b, init_state=h, mask=mask, dtype=dtype)
    c = random_array(rng, out_shape(inputs, flags.get("bidirectional", False)), dtype)
    flags = dict(flags, seq_lengths=lengths)
    got, want = full_results(op, inputs, c, flags), full_results(ref, inputs, c, flags)
    assert_close(got, want, err_msg=str(flags))


# Hidden sizes around the kernels' splits: one block (narrow at H <= 64, wide to 128), clusters
# of 2 blocks (256); test_sizes_up_to_and_beyond_the_largest_cluster takes clusters of 8 (300,
# 512) and the decomposition (1024).
@requires_gpu
@pytest.mark.parametrize("act,rev,bi", _grid_flags())
@pytest.mark.parametrize("H", [1, 37, 128, 256])
def test_flag_grid_float32(rng, act, rev, bi, H):
    _check(rng, 6, 5, 7, H, jnp.float32, dict(activation=act, reverse=rev, bidirectional=bi),
           mask="float" if rev else "bool")


@requires_gpu
@pytest.mark.parametrize("act,rev,bi", _grid_flags()[::3])
@pytest.mark.parametrize("H", [5, 100, 256])
def test_flag_grid_float64(rng, act, rev, bi, H):
    _check(rng, 5, 4, 3, H, jnp.float64, dict(activation=act, reverse=rev, bidirectional=bi),
           mask="float")


@requires_gpu
@pytest.mark.parametrize("pattern", [(False, False, False), (True, False, True),
                                     (False, True, False)])
@pytest.mark.parametrize("N", [1, 3, 40, 700])  # a row a block; 700: 3 (forward), 2 (backward)
def test_batch_splits_and_optional_inputs(rng, pattern, N):
    _check(rng, 7, N, 9, 64, jnp.float32, dict(activation="tanh", bidirectional=N % 2 == 0),
           pattern=pattern)


@requires_gpu
def test_blocks_of_several_row_groups(rng):
    """N = 1000, H = 128, both directions: 8 rows a block, two groups of 4, in both passes
    (two blocks share an SM at H = 128, so smaller batches give a block one group)."""
    _check(rng, 5, 1000, 8, 128, jnp.float32, dict(activation="tanh", bidirectional=True))


@requires_gpu
@pytest.mark.parametrize("T", [1, 2, 3])
@pytest.mark.parametrize("H", [64, 256])
def test_one_row_blocks_at_odd_and_even_step_counts(rng, T, H):
    """The backward's one-row blocks load each step's operands during the step before, two
    steps an iteration (RunSteps in recurrence.cu): 1 to 3 steps, both directions, with
    lengths and a mask, at H = 64 and 256."""
    lengths = jnp.asarray(rng.integers(0, T + 1, size=3), jnp.int32)
    _check(rng, T, 3, 5, H, jnp.float32, dict(activation="tanh", bidirectional=True),
           mask="float", lengths=lengths)


@requires_gpu
@pytest.mark.parametrize("H", [300, 512, 1024])
def test_sizes_up_to_and_beyond_the_largest_cluster(rng, H):
    _check(rng, 4, 6, 8, H, jnp.float32, dict(activation="tanh", reverse=True))


@requires_gpu
@pytest.mark.parametrize("rev,bi", [(False, False), (True, False), (False, True)])
def test_seq_lengths(rng, rev, bi):
    lengths = jnp.asarray(rng.integers(0, 9, size=11), jnp.int32)
    _check(rng, 8, 11, 5, 96, jnp.float32,
           dict(activation="sigmoid", reverse=rev, bidirectional=bi), mask="bool",
           lengths=lengths)


@requires_gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precisions_accumulate_in_float32(rng, dtype):
    _check(rng, 6, 4, 8, 48, dtype, dict(activation="tanh"))


@requires_gpu
@pytest.mark.parametrize("T,N", [(0, 3), (4, 0)])
def test_empty_sequence_or_batch(rng, T, N):
    _check(rng, T, N, 3, 16, jnp.float32, dict(activation="relu"))


@requires_gpu
def test_vmap_of_the_gradient_op_runs_groups(rng):
    """vmap over the gradient op (G = 3 problems sharing R) against the reference."""
    inputs = make_inputs(rng, 5, 4, 6, 32, dtype=jnp.float32)
    x = random_array(rng, (3, 5, 4, 6), jnp.float32)
    dy = random_array(rng, (3, 5, 4, 32), jnp.float32)

    def grads(fn, x, dy):
        rest = {k: inputs[k] for k in ("recurrent_weight", "input_weight", "bias", "init_state")}
        _, z = op(x, **rest, training=True, activation="tanh")
        return fn(x, rest["recurrent_weight"], dy, z, rest["input_weight"], rest["bias"],
                  rest["init_state"], activation="tanh")

    got = jax.jit(jax.vmap(lambda x, dy: grads(jax_sgrnn.single_gate_rnn_gradients, x, dy)))
    want = jax.jit(jax.vmap(lambda x, dy: grads(jax_sgrnn.reference_gradients, x, dy)))
    assert_close(got(x, dy), want(x, dy))


@requires_gpu
def test_many_training_steps_in_one_jit(rng):
    """A jitted SGD step run 50 times: the handler inside a real training loop stays equal to
    the same loop on the reference."""
    inputs = make_inputs(rng, 12, 8, 10, 64, dtype=jnp.float32)
    target = random_array(rng, (12, 8, 64), jnp.float32)
    params = {k: inputs[k] for k in ("recurrent_weight", "input_weight", "bias")}

    def make_step(fn):
        def loss(p):
            y = fn(inputs["source"], **p, init_state=inputs["init_state"], activation="tanh")
            return jnp.mean((y - target) ** 2)

        @jax.jit
        def step(p):
            value, g = jax.value_and_grad(loss)(p)
            return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), value

        return step

    got, want = params, params
    op_step, ref_step = make_step(op), make_step(ref)
    losses = []
    for _ in range(50):
        got, loss_got = op_step(got)
        want, _ = ref_step(want)
        losses.append(float(loss_got))
    assert all(b < a for a, b in zip(losses, losses[1:])), losses  # it trains
    assert_close(got, want, rtol=1e-4, atol=1e-5)  # 50 steps of float32 rounding apart


@requires_gpu
@pytest.mark.parametrize("act,rev,bi", _grid_flags()[::2])
@pytest.mark.parametrize("lengths", [False, True], ids=["full", "lengths"])
def test_jvp_through_the_handler(rng, act, rev, bi, lengths):
    """Forward mode: the tangent is one more call of the forward kernel (activation none, a
    mask holding act'(z)), every input perturbed, y and z tangents, float32."""
    inputs = make_inputs(rng, 7, 5, 6, 40, bidirectional=bi, mask="float", dtype=jnp.float32)
    flags = dict(activation=act, reverse=rev, bidirectional=bi, training=True,
                 seq_lengths=jnp.asarray([7, 0, 3, 1, 6]) if lengths else None)
    primals = {n: inputs[n] for n in ("source", "recurrent_weight", "input_weight", "bias",
                                      "init_state")}
    tangents = {n: random_array(rng, a.shape, a.dtype) for n, a in primals.items()}

    def jvp(fn):
        return jax.jit(lambda p, t: jax.jvp(lambda p: fn(**{**inputs, **p}, **flags), (p,),
                                            (t,)))(primals, tangents)

    assert_close(jvp(op), jvp(ref), err_msg=str(flags))


# ---------------------------------------------------------------- lowering (CUDA build only)

@requires_cuda_build
@pytest.mark.parametrize("N,H,fwd_call,bwd_call", [
    (2, 32, True, True), (2, 512, True, True), (2, 1024, False, False),
    (1000, 256, True, True),  # 16 rows per cluster of 2
    (3000, 64, False, False)])  # 24 rows per SM: the decomposition is faster
def test_lowering_for_cuda_emits_the_custom_calls_that_pay(rng, N, H, fwd_call, bwd_call):
    """Lowered for cuda (no GPU needed): the handler's calls and no while loop where R fits
    and the batch is small enough for the kernel to win (recurrence_plan.h, RunsOnChip),
    the lax.scan decomposition elsewhere."""
    inputs = make_inputs(rng, LOOP_T, N, 4, H, dtype=jnp.float32)

    def loss(x, R):
        return jnp.sum(op(x, R, inputs["input_weight"], inputs["bias"], activation="tanh"))

    forward = lowered_text(lambda x, R: op(x, R, activation="tanh", training=False),
                           inputs["source"][..., :1].repeat(H, -1), inputs["recurrent_weight"],
                           platform="cuda")
    both = lowered_text(jax.grad(loss, argnums=(0, 1)), inputs["source"],
                        inputs["recurrent_weight"], platform="cuda")
    assert ("jax_sgrnn_cuda_forward" in forward) == fwd_call
    assert ("stablehlo.while" in forward) != fwd_call
    assert ("jax_sgrnn_cuda_gradients" in both) == bwd_call
    assert ("stablehlo.while" in both) != (fwd_call and bwd_call)
    if fwd_call:  # the projection is XLA's, so the custom call takes no input weight
        call = re.search(r"jax_sgrnn_cuda_forward.*", both).group(0)
        assert "has_input_weight = false" in call and "has_bias = false" in call
    tangent = lowered_text(lambda x, R: jax.jvp(lambda R: loss(x, R), (R,), (R,)),
                           inputs["source"], inputs["recurrent_weight"], platform="cuda")
    assert tangent.count("@jax_sgrnn_cuda_forward") == (2 if fwd_call else 0)
    assert ("stablehlo.while" in tangent) != fwd_call


@requires_cuda_build
@pytest.mark.parametrize("T,fwd_call", [(65535, True), (65536, False)])
def test_calls_beyond_32_bit_indices_lower_to_the_decomposition(T, fwd_call):
    """The kernels index [T, N, D*H] with 32-bit integers: T*N*H = 2^31 - 2^17 runs them,
    2^31 lowers to the decomposition (abstract shapes only: nothing is allocated)."""
    x = jax.ShapeDtypeStruct((T, 256, 128), jnp.float32)
    R = jax.ShapeDtypeStruct((128, 128), jnp.float32)
    text = lowered_text(lambda x, R: op(x, R, activation="tanh", training=False), x, R,
                        platform="cuda")
    assert ("jax_sgrnn_cuda_forward" in text) == fwd_call
    assert ("stablehlo.while" in text) != fwd_call


@requires_cuda_build
def test_gpus_older_than_sm90_lower_to_the_decomposition(rng, monkeypatch):
    """Where the process's GPUs cannot run the kernels (thread-block clusters need sm_90), the
    op lowers to the decomposition instead of failing at run time."""
    from jax_sgrnn import _backends

    inputs = make_inputs(rng, LOOP_T, 2, 4, 32, dtype=jnp.float32)
    args = (inputs["source"], inputs["recurrent_weight"], inputs["input_weight"])

    def forward(x, R, W):
        return op(x, R, W, activation="tanh")

    assert "jax_sgrnn_cuda_forward" in lowered_text(forward, *args, platform="cuda")
    monkeypatch.setattr(_backends, "cuda_devices_run_handler", lambda: False)
    # a new function: not the cached lowering
    text = lowered_text(lambda *a: forward(*a), *args, platform="cuda")
    assert "jax_sgrnn_cuda_forward" not in text and "stablehlo.while" in text
