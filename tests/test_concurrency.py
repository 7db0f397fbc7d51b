"""The op from several Python threads at once gives exactly the sequential results.

Each job is a jitted computation with its own shapes and flags (forward, jax.grad through the
op, the explicit gradient op, vmap, float32 and float64), one of them large enough that the
handler splits its products and its steps over XLA's intra-op thread pool (the parallel
paths of csrc/cpu/kernels.cc start at 2**20 multiply-adds). The threads start together and
each runs its job several times while the others run theirs. The handler's work split does
not depend on timing, so results must be bitwise equal to the sequential run. Run under the
sanitizer build (scripts/sanitize.sh) this is also the race / use-after-free check.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sgrnn
from conftest import make_inputs, random_array

op = jax_sgrnn.single_gate_rnn
REPEATS = 4


def _job_forward(rng, T, N, I, H, dtype, **flags):
    inputs = make_inputs(rng, T, N, I, H, bidirectional=flags.get("bidirectional", False),
                         mask="float", dtype=dtype)
    return jax.jit(lambda i: op(**i, **flags)), (inputs,)


def _job_grad(rng, T, N, I, H, dtype, **flags):
    bi = flags.get("bidirectional", False)
    inputs = make_inputs(rng, T, N, I, H, bidirectional=bi, mask="bool", dtype=dtype)
    dy = random_array(rng, (T, N, (2 if bi else 1) * H), dtype)
    diff = {k: v for k, v in inputs.items() if k != "mask" and v is not None}

    def loss(d, mask, dy):
        return jnp.sum(op(**d, mask=mask, **flags) * dy)

    return jax.jit(jax.value_and_grad(loss)), (diff, inputs["mask"], dy)


def _job_gradient_op(rng, T, N, I, H, dtype, **flags):
    inputs = make_inputs(rng, T, N, I, H, init_state=False, dtype=dtype)
    dy = random_array(rng, (T, N, H), dtype)
    z = random_array(rng, (T, N, H), dtype)

    def grads(i, dy, z):
        return jax_sgrnn.single_gate_rnn_gradients(
            i["source"], i["recurrent_weight"], dy, z, i["input_weight"], i["bias"], **flags)

    return jax.jit(grads), (inputs, dy, z)


def _job_vmap_grad(rng, T, N, I, H, dtype, **flags):
    B = 3
    inputs = make_inputs(rng, T, N, I, H, dtype=dtype)
    xs = random_array(rng, (B, T, N, I), dtype)
    rest = {k: v for k, v in inputs.items() if k != "source"}

    def per_example(x, rest):
        return jax.grad(lambda r: jnp.sum(jnp.tanh(op(x, **r, **flags))))(rest)

    return jax.jit(jax.vmap(per_example, in_axes=(0, None))), (xs, rest)


# (id, builder, T, N, I, H, dtype, flags)
JOBS = [
    ("fwd-f32-tanh", _job_forward, 5, 3, 4, 6, jnp.float32, dict(activation="tanh")),
    ("fwd-f64-bi-relu", _job_forward, 7, 2, 3, 5, jnp.float64,
     dict(activation="relu", bidirectional=True)),
    ("grad-f64-rev-sigmoid", _job_grad, 6, 4, 2, 3, jnp.float64,
     dict(activation="sigmoid", reverse=True)),
    ("grad-f32-bi-hard", _job_grad, 4, 5, 3, 4, jnp.float32,
     dict(activation="hard_sigmoid", bidirectional=True)),
    ("gradop-f64-none", _job_gradient_op, 9, 1, 5, 2, jnp.float64, dict(activation="none")),
    ("vmapgrad-f32-tanh", _job_vmap_grad, 3, 2, 3, 3, jnp.float32, dict(activation="tanh")),
    # Large enough for the parallel paths: N*H*H = 2**20 per step, T*N*H*I = 2**21.
    ("grad-f32-parallel", _job_grad, 4, 64, 64, 128, jnp.float32, dict(activation="tanh")),
]


def _build(seed=0):
    rng = np.random.default_rng(seed)
    return [(name, *builder(rng, T, N, I, H, dtype, **flags))
            for name, builder, T, N, I, H, dtype, flags in JOBS]


def _assert_same(got, want, what):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=what)


def _run_concurrently(jobs, repeats=REPEATS):
    """Runs every job `repeats` times, all jobs in their own thread, started together."""
    barrier = threading.Barrier(len(jobs))

    def work(fn, args):
        barrier.wait()
        return [jax.block_until_ready(fn(*args)) for _ in range(repeats)]

    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        futures = [pool.submit(work, fn, args) for _, fn, args in jobs]
        return [f.result(timeout=300) for f in futures]


@pytest.fixture(scope="module")
def sequential():
    """Each job's result, computed alone."""
    return [jax.block_until_ready(fn(*args)) for _, fn, args in _build()]


def test_different_jobs_concurrently(sequential):
    """Compiled beforehand, then all jobs at once, each repeated."""
    jobs = _build()
    for _, fn, args in jobs:  # compile outside the threads
        jax.block_until_ready(fn(*args))
    for (name, _, _), want, runs in zip(jobs, sequential, _run_concurrently(jobs)):
        for i, got in enumerate(runs):
            _assert_same(got, want, f"{name} run {i}")


def test_tracing_and_compiling_concurrently(sequential):
    """Fresh jit wrappers: the threads trace, lower and compile at the same time too."""
    jobs = _build()
    for (name, _, _), want, runs in zip(jobs, sequential, _run_concurrently(jobs, repeats=2)):
        for i, got in enumerate(runs):
            _assert_same(got, want, f"{name} run {i}")


def test_one_executable_from_many_threads(sequential):
    """One compiled program (the one with parallel paths) run from several threads at once:
    the handler's per-call state is per call."""
    name, fn, args = _build()[-1]
    jax.block_until_ready(fn(*args))
    for runs in _run_concurrently([(name, fn, args)] * 4, repeats=2):
        for i, got in enumerate(runs):
            _assert_same(got, sequential[-1], f"{name} run {i}")


def test_eager_calls_concurrently():
    """Eager (un-jitted) op calls, each primitive compiled and dispatched on its own, from
    several threads, against the same calls made sequentially."""
    rng = np.random.default_rng(1)
    cases = [(make_inputs(rng, T, N, 3, H), act)
             for T, N, H, act in ((3, 2, 4, "tanh"), (5, 1, 2, "relu"), (2, 3, 3, "sigmoid"),
                                  (4, 2, 1, "none"))]
    want = [np.asarray(op(**i, activation=a)) for i, a in cases]
    jobs = [(str(k), lambda i, a=a: op(**i, activation=a), (i,))
            for k, (i, a) in enumerate(cases)]
    for w, runs in zip(want, _run_concurrently(jobs, repeats=3)):
        for got in runs:
            np.testing.assert_array_equal(np.asarray(got), w)
