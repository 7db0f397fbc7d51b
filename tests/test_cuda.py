"""The CUDA handler (csrc/cuda) against the lax.scan reference, on an NVIDIA GPU.

Every test here runs on the GPU and is skipped without one (or without the CUDA build); the
suite runs on CPU unless JAX_PLATFORMS says otherwise, so on a GPU machine run it with
``JAX_PLATFORMS=cuda,cpu``. The rest of the suite then also runs on the GPU (the op lowers to
this handler there): test_op.py's flag grid, test_seq_lengths.py, test_transforms.py. The
lowering checks at the end need only the CUDA build, not a GPU.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Optional

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


# Calls with neither a mask nor lengths in wide blocks (H = 100, with lanes past H, and 128):
# their forward steps its source and output offsets instead of taking them from TimesOf, in
# each direction layout (forward, reversed, both). 8 rows run a row a block, 1000 rows groups
# of 4 rows.
@requires_gpu
@pytest.mark.parametrize("rev,bi", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("N", [8, 1000])
@pytest.mark.parametrize("H", [100, 128])
def test_plain_calls_in_wide_blocks(rng, rev, bi, N, H):
    _check(rng, 6, N, 9, H, jnp.float32, dict(activation="tanh", reverse=rev, bidirectional=bi))


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


def _check_vmap_of_gradients(rng, G, T, N, I, H):
    """vmap over the gradient op (G problems sharing R) against the reference."""
    inputs = make_inputs(rng, T, N, I, H, dtype=jnp.float32)
    x = random_array(rng, (G, T, N, I), jnp.float32)
    dy = random_array(rng, (G, T, N, H), jnp.float32)

    def grads(fn, x, dy):
        rest = {k: inputs[k] for k in ("recurrent_weight", "input_weight", "bias", "init_state")}
        _, z = op(x, **rest, training=True, activation="tanh")
        return fn(x, rest["recurrent_weight"], dy, z, rest["input_weight"], rest["bias"],
                  rest["init_state"], activation="tanh")

    got = jax.jit(jax.vmap(lambda x, dy: grads(jax_sgrnn.single_gate_rnn_gradients, x, dy)))
    want = jax.jit(jax.vmap(lambda x, dy: grads(jax_sgrnn.reference_gradients, x, dy)))
    assert_close(got(x, dy), want(x, dy))


@requires_gpu
def test_vmap_of_the_gradient_op_runs_groups(rng):
    _check_vmap_of_gradients(rng, 3, 5, 4, 6, 32)


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


# ------------------------------------------------------------ the grid kernels (SGRNN_CUDA_GRID=1)
# By default the grid kernels (csrc/cuda/grid_steps.h) run from 96 rows where R is too large for
# the block kernels; with SGRNN_CUDA_GRID=1, set before the extension's first question, every
# size of at least 32 rows that the block kernels do not run (H above 512, more than 16 rows an
# SM) runs them. Their tests use small sizes, so they run in a child process with it set
# (test_the_grid_kernels_when_asked_for, which selects them by their marker); in this process
# they are skipped.
GRID = os.environ.get("SGRNN_CUDA_GRID") == "1"


def requires_grid(test):
    """Marks a test of the grid kernels at small sizes: run only by the child process."""
    skip = pytest.mark.skipif(
        not (ON_GPU and GRID), reason="needs a GPU and SGRNN_CUDA_GRID=1 (the child process of "
                                      "test_the_grid_kernels_when_asked_for runs these)")
    return pytest.mark.grid_kernels(skip(test))


@requires_grid
@pytest.mark.parametrize("T,N,H,bi", [(6, 40, 700, True), (5, 3000, 64, True),
                                      (4, 40, 1024, False)])
def test_grid_sizes_run_the_handler(rng, T, N, H, bi):
    """The sizes of the tests below lower to the handler's calls, not the decomposition (its
    grid kernels: the block kernels do not run these sizes)."""
    inputs = make_inputs(rng, T, N, 4, H, bidirectional=bi, dtype=jnp.float32)

    def loss(x, R, W):
        return jnp.sum(op(x, R, W, activation="tanh", bidirectional=bi))

    text = lowered_text(jax.grad(loss, argnums=(0, 1, 2)), inputs["source"],
                        inputs["recurrent_weight"], inputs["input_weight"], platform="cuda")
    assert "jax_sgrnn_cuda_forward" in text and "jax_sgrnn_cuda_gradients" in text


@requires_grid
@pytest.mark.parametrize("act,rev,bi", _grid_flags())
def test_grid_flag_grid(rng, act, rev, bi):
    """H = 700, which no block or cluster holds: 40 rows, one row tile of 22 unit tiles."""
    _check(rng, 6, 40, 7, 700, jnp.float32, dict(activation=act, reverse=rev, bidirectional=bi),
           mask="float" if rev else "bool")


@requires_grid
def test_grid_many_rows_with_lengths(rng):
    """(5,3000,8,64), both directions: 24 rows an SM for the block kernels, so 47 x 2 tiles of
    64 x 32 here, with lengths (0 to T) and a mask."""
    lengths = jnp.asarray(rng.integers(0, 6, size=3000), jnp.int32)
    _check(rng, 5, 3000, 8, 64, jnp.float32, dict(activation="tanh", bidirectional=True),
           mask="float", lengths=lengths)


@requires_grid
@pytest.mark.parametrize("pattern", [(False, False, False), (True, True, True)])
def test_grid_h1024_optional_inputs(rng, pattern):
    """H = 1024 (16 chunks, more than the stages in flight), 40 rows, reversed."""
    _check(rng, 4, 40, 9, 1024, jnp.float32, dict(activation="relu", reverse=True),
           pattern=pattern)


@requires_grid
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_grid_half_precisions(rng, dtype):
    _check(rng, 5, 40, 8, 700, dtype, dict(activation="tanh"))


@requires_grid
def test_grid_empty_sequence(rng):
    _check(rng, 0, 40, 3, 700, jnp.float32, dict(activation="relu"))


@requires_grid
def test_grid_vmap_of_the_gradient_op(rng):
    """G = 2 problems at H = 700, one after another in one workspace."""
    _check_vmap_of_gradients(rng, 2, 4, 40, 6, 700)


@requires_grid
def test_grid_jvp(rng):
    """Forward mode at H = 700: the tangent's call runs activation none with a mask of act'(z)."""
    inputs = make_inputs(rng, 5, 40, 6, 700, mask="float", dtype=jnp.float32)
    flags = dict(activation="sigmoid", bidirectional=False, training=True)
    primals = {n: inputs[n] for n in ("source", "recurrent_weight", "init_state")}
    tangents = {n: random_array(rng, a.shape, a.dtype) for n, a in primals.items()}

    def jvp(fn):
        return jax.jit(lambda p, t: jax.jvp(lambda p: fn(**{**inputs, **p}, **flags), (p,),
                                            (t,)))(primals, tangents)

    assert_close(jvp(op), jvp(ref))


def _child(*args: str, grid: Optional[str] = "1") -> subprocess.CompletedProcess:
    """Runs python in the repository's root, with SGRNN_CUDA_GRID set to ``grid`` or unset. -P:
    the installed package, not the source folder, is the one imported. On a GPU this process
    holds most of its memory (XLA preallocates 75%), so the child allocates as it goes."""
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    env.pop("SGRNN_CUDA_GRID", None)
    if grid is not None:
        env["SGRNN_CUDA_GRID"] = grid
    return subprocess.run([sys.executable, "-P", *args], env=env,
                          cwd=Path(__file__).resolve().parent.parent, capture_output=True,
                          text=True, timeout=3600)


@requires_gpu
@pytest.mark.skipif(GRID, reason="the child process itself")
def test_the_grid_kernels_when_asked_for():
    """The tests marked by requires_grid above, in a child process with SGRNN_CUDA_GRID=1."""
    run = _child("-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_cuda.py", "-m",
                 "grid_kernels")
    assert run.returncode == 0, run.stdout[-5000:] + run.stderr[-5000:]
    assert " passed" in run.stdout and " skipped" not in run.stdout, run.stdout[-2000:]


@requires_gpu
@pytest.mark.skipif("SGRNN_CUDA_GRID" in os.environ, reason="the default's test (SGRNN_CUDA_GRID "
                                                           "is set in this process)")
def test_default_takes_the_grid_kernels_from_96_rows(rng):
    """Without SGRNN_CUDA_GRID, 96 rows at H = 600 (no block or cluster holds R) lower to the
    handler (its grid kernels) and match the reference, both directions."""
    flags = dict(activation="tanh", bidirectional=True)
    inputs = make_inputs(rng, 3, 96, 5, 600, bidirectional=True, dtype=jnp.float32)
    text = lowered_text(lambda x, R, W: op(x, R, W, **flags), inputs["source"],
                        inputs["recurrent_weight"], inputs["input_weight"], platform="cuda")
    assert "jax_sgrnn_cuda_forward" in text
    _check(rng, 3, 96, 5, 600, jnp.float32, flags, mask="bool")


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


def _lower_for_cuda_in_child(N: int, grid: Optional[str]) -> subprocess.CompletedProcess:
    """(LOOP_T,N,1024,1024) lowered for cuda (no GPU needed) in a child process, whose stdout is
    the program's text: SGRNN_CUDA_GRID is read once a process."""
    code = ("import jax, jax.numpy as jnp, jax_sgrnn\n"
            f"x = jax.ShapeDtypeStruct(({LOOP_T}, {N}, 1024), jnp.float32)\n"
            "R = jax.ShapeDtypeStruct((1024, 1024), jnp.float32)\n"
            "f = lambda x, R: jax_sgrnn.single_gate_rnn(x, R, activation='tanh')\n"
            "print(jax.jit(f).trace(x, R).lower(lowering_platforms=('cuda',)).as_text())\n")
    return _child("-c", code, grid=grid)


@requires_cuda_build
@pytest.mark.parametrize("N,grid,runs", [(256, None, True), (96, None, True), (95, None, False),
                                         (256, "0", False), (32, "1", True), (31, "1", False)])
def test_lowering_for_cuda_takes_the_grid_kernels_where_they_pay_or_are_asked_for(N, grid, runs):
    """By default the handler's calls (the grid kernels) from 96 rows and the decomposition
    below; none with SGRNN_CUDA_GRID=0; from 32 rows with SGRNN_CUDA_GRID=1."""
    run = _lower_for_cuda_in_child(N, grid)
    assert run.returncode == 0, run.stderr[-3000:]
    assert ("jax_sgrnn_cuda_forward" in run.stdout) == runs
    assert ("stablehlo.while" in run.stdout) != runs


@requires_cuda_build
@pytest.mark.parametrize("grid", ["2", "yes", " 1"])
def test_lowering_for_cuda_refuses_other_grid_settings(grid):
    """Any SGRNN_CUDA_GRID but unset, 0 or 1 is a ValueError naming it, not the default."""
    run = _lower_for_cuda_in_child(256, grid)
    assert run.returncode != 0
    assert f"ValueError: SGRNN_CUDA_GRID is '{grid}'; it must be unset, 0" in run.stderr, \
        run.stderr[-3000:]


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
