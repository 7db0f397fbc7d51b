"""Shared helpers for the jax_sgrnn test suite.

Everything runs on CPU (unless JAX_PLATFORMS says otherwise). float64 is enabled globally so
the op can be compared with the ``lax.scan`` reference to ~1e-10; float32/float16/bfloat16
are exercised by explicit dtype.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Optional

import jax

jax.config.update("jax_enable_x64", True)
if not os.environ.get("JAX_PLATFORMS"):
    jax.config.update("jax_platforms", "cpu")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import jax_sgrnn  # noqa: E402
from jax_sgrnn import _lowering  # noqa: E402

ACTIVATIONS = ("none", "relu", "tanh", "sigmoid", "hard_sigmoid")
#: The inputs a gradient is taken for (the mask is a constant: no gradient).
DIFF_NAMES = ("source", "recurrent_weight", "input_weight", "bias", "init_state")
#: (input_weight, bias, init_state) present/absent: all 8 patterns.
OPTIONAL_PATTERNS = tuple(itertools.product((False, True), repeat=3))
#: Mask variants: absent, a full-shape bool mask, a full-shape float mask.
MASK_KINDS = (None, "bool", "float")

requires_native = pytest.mark.skipif(
    not jax_sgrnn.backends()["native"].available,
    reason="jax_sgrnn's native CPU handler did not load "
           f"({jax_sgrnn.backends()['native'].reason}), so no custom call is emitted")

# The suites test the native handler unless a test selects another (the cpu_backend fixture,
# test_mps.py, test_backends.py): on a Mac, "auto" would pick MPSGraph for all of them.
if jax_sgrnn.backends()["native"].available:
    jax_sgrnn.set_cpu_backend("native")

#: The cpu backends the comparison suites run against: every native one available here, then
#: the lax.scan decomposition ("scan", what platforms without a handler run).
CPU_BACKENDS = tuple(n for n, b in jax_sgrnn.backends().items()
                     if b.available and b.platform == "cpu") + ("scan",)


@pytest.fixture(params=CPU_BACKENDS)
def cpu_backend(request) -> str:
    """Runs the test once per available cpu backend, that backend selected."""
    with jax_sgrnn.cpu_backend(request.param):
        yield request.param


@pytest.fixture
def native_backend() -> str:
    """The native C++ handler selected (on a Mac, "auto" would pick MPSGraph)."""
    with jax_sgrnn.cpu_backend("native"):
        yield "native"


# Tolerances (rtol, atol) per dtype for op-vs-reference comparisons; atol is scaled by the
# magnitude of the expected value in assert_close.
TOLERANCES = {
    np.dtype(np.float64): (1e-10, 1e-12),
    np.dtype(np.float32): (1e-5, 1e-5),
    np.dtype(jnp.float16): (1e-2, 1e-2),
    np.dtype(jnp.bfloat16): (5e-2, 5e-2),
}


def grid_every_pattern(shapes) -> list:
    """reverse x bidirectional x optional pattern x mask kind in full (96 cases); the
    activation and the shape (from ``shapes``) cycle with the index, which still puts every
    activation with every (reverse, bidirectional) pair, every pattern and every mask kind."""
    return [_grid_case(ACTIVATIONS[i % len(ACTIVATIONS)], rev, bi, pattern, mask,
                       shapes[i % len(shapes)])
            for i, (rev, bi, pattern, mask) in enumerate(itertools.product(
                (False, True), (False, True), OPTIONAL_PATTERNS, MASK_KINDS))]


def backends_over(full: list, reduced: list) -> list:
    """Cases for a test parametrized on ``cpu_backend`` (indirectly) and a grid's fields: each
    native CPU backend over the ``full`` grid, the ``lax.scan`` decomposition over ``reduced``
    (it is the reference's own code, which test_reference.py checks over its grids)."""
    return [pytest.param(backend, *case.values, id=f"{backend}-{case.id}")
            for backend in CPU_BACKENDS for case in (reduced if backend == "scan" else full)]


def grid_every_activation(shapes) -> list:
    """activation x reverse x bidirectional (20 cases); patterns, masks and shapes cycle."""
    return [_grid_case(act, rev, bi, OPTIONAL_PATTERNS[(3 * i + 7) % len(OPTIONAL_PATTERNS)],
                       MASK_KINDS[i % len(MASK_KINDS)], shapes[(i + 2) % len(shapes)])
            for i, (act, rev, bi) in enumerate(itertools.product(
                ACTIVATIONS, (False, True), (False, True)))]


def _grid_case(act, rev, bi, pattern, mask, shape):
    """One case of a grid: shape is (T, N, H) or (T, N, I, H)."""
    sizes = "".join(f"{k}{v}" for k, v in zip("TNH" if len(shape) == 3 else "TNIH", shape))
    return pytest.param(act, rev, bi, pattern, mask, shape,
                        id=f"{flags_id(act, rev, bi)}-{pattern_id(pattern)}-mask_{mask}-{sizes}")


def pattern_id(pattern) -> str:
    w, b, h = pattern
    return "".join(s for s, here in (("W", w), ("b", b), ("h0", h)) if here) or "bare"


def flags_id(activation, reverse, bidirectional) -> str:
    return f"{activation}-{'rev' if reverse else 'fwd'}-{'bi' if bidirectional else 'uni'}"


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A generator seeded from the test's id: fresh data per test, reproducible per run."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def random_array(rng, shape, dtype, scale=1.0):
    """Normal(0, scale) data, never all zeros."""
    a = rng.normal(size=shape) * scale
    return jnp.asarray(a.astype(np.float64)).astype(dtype)


def make_mask(rng, shape, kind, dtype):
    """A mask of ``shape``: ``"bool"`` (about 70% True) or ``"float"`` (values in [0, 1.5))."""
    if kind == "bool":
        return jnp.asarray(rng.random(size=shape) < 0.7)
    if kind == "float":
        return jnp.asarray(rng.random(size=shape) * 1.5).astype(dtype)
    raise ValueError(kind)


#: Steps for tests that look for the decomposition's while loop: more than the steps it runs
#: per iteration (a scan no longer than that is unrolled whole and has no loop), and not a
#: multiple of them.
LOOP_T = 2 * _lowering.DECOMPOSITION_UNROLL + 1


def make_inputs(rng, T=4, N=3, I=3, H=5, *, bidirectional=False, input_weight=True,
                bias=True, init_state=True, mask=None, mask_shape=None,
                dtype=jnp.float64) -> dict:
    """The op's inputs as a dict of keyword arguments (absent optionals are ``None``).

    Without ``input_weight`` the source has D*H features (as the op requires). ``mask`` is
    None, ``"bool"`` or ``"float"``; ``mask_shape`` defaults to the full [T, N, D*H].
    R is scaled by 0.5/sqrt(H) so states stay O(1).
    """
    D = 2 if bidirectional else 1
    feat = I if input_weight else D * H
    r_shape = (2, H, H) if bidirectional else (H, H)
    out = dict(
        source=random_array(rng, (T, N, feat), dtype),
        recurrent_weight=random_array(rng, r_shape, dtype, 0.5 / np.sqrt(H)),
        input_weight=random_array(rng, (D * H, I), dtype, 1.0 / np.sqrt(I))
        if input_weight else None,
        bias=random_array(rng, (D * H,), dtype, 0.5) if bias else None,
        init_state=random_array(rng, (N, D * H), dtype) if init_state else None,
        mask=None,
    )
    if mask is not None:
        out["mask"] = make_mask(rng, mask_shape or (T, N, D * H), mask, dtype)
    return out


def out_shape(inputs: dict, bidirectional: bool) -> tuple:
    T, N, _ = inputs["source"].shape
    H = inputs["recurrent_weight"].shape[-1]
    return (T, N, (2 if bidirectional else 1) * H)


def diff_inputs(inputs: dict) -> dict:
    """The present differentiable inputs."""
    return {n: inputs[n] for n in DIFF_NAMES if inputs[n] is not None}


def _fast_compile_options() -> dict:
    """XLA options that make the *oracle's* jits (lax.scan reference) compile ~3x faster.

    Only used for the reference side of comparisons, never for the op under test. Falls back
    to the defaults if this XLA does not know the options."""
    options = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}
    try:
        jax.jit(lambda a: a + 1, compiler_options=options)(jnp.zeros(2)).block_until_ready()
    except Exception:  # noqa: BLE001 - unknown option names: use the defaults
        return {}
    return options


FAST_COMPILE_OPTIONS = _fast_compile_options()


def custom_calls(text: str, target: Optional[str] = None) -> list[str]:
    """The custom-call lines of lowered StableHLO ``text`` (those calling ``target``, if given)."""
    return [line.strip() for line in text.splitlines() if "stablehlo.custom_call" in line
            and (target is None or f"@{target}" in line)]


def lowered_text(fn, *args, platform: str = "cpu") -> str:
    """The StableHLO of jax.jit(fn) lowered for `platform`, whatever the default device is
    (the HLO tests check one platform's lowering; on a GPU machine the default is the GPU)."""
    return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def ref_jit(f, **kw):
    """jax.jit for oracle (reference) computations: fast, unoptimised compilation."""
    return jax.jit(f, compiler_options=FAST_COMPILE_OPTIONS, **kw)


def is_reference(fn) -> bool:
    return fn in (jax_sgrnn.reference, jax_sgrnn.reference_gradients)


def value_and_grads(fn, inputs: dict, cotangent, flags: dict, jit=True):
    """``(y, grads)`` where grads = d/d(inputs) of ``sum(fn(**inputs) * cotangent)`` for every
    present differentiable input (a dict keyed by argument name)."""

    def run(inputs, cotangent):
        def loss(diff):
            y = fn(**{**inputs, **diff}, **flags)
            return jnp.sum(y.astype(cotangent.dtype) * cotangent), y

        (_, y), grads = jax.value_and_grad(loss, has_aux=True)(diff_inputs(inputs))
        return y, grads

    if not jit:
        return run(inputs, cotangent)
    return (ref_jit(run) if is_reference(fn) else jax.jit(run))(inputs, cotangent)


def full_results(fn, inputs: dict, cotangent, flags: dict) -> dict:
    """y (inference), y and z (training=True) and the gradients of ``sum(y * cotangent)``
    w.r.t. every present differentiable input, from one jit.

    For the op, the inference forward, the training forward and the grad of the inference
    forward are separate computations; for the reference (the oracle) one training forward
    serves all three, to keep compile time down."""
    flags = {k: v for k, v in flags.items() if k != "training"}

    if is_reference(fn):
        def run(inputs, cotangent):
            def loss(diff):
                y, z = fn(**{**inputs, **diff}, **flags, training=True)
                return jnp.sum(y.astype(cotangent.dtype) * cotangent), (y, z)

            (_, (y, z)), grads = jax.value_and_grad(loss, has_aux=True)(diff_inputs(inputs))
            return dict(y=y, y_train=y, z=z, grads=grads)

        return ref_jit(run)(inputs, cotangent)

    def run(inputs, cotangent):
        def loss(diff):
            y = fn(**{**inputs, **diff}, **flags)
            return jnp.sum(y.astype(cotangent.dtype) * cotangent), y

        (_, y), grads = jax.value_and_grad(loss, has_aux=True)(diff_inputs(inputs))
        y_train, z = fn(**inputs, **flags, training=True)
        return dict(y=y, y_train=y_train, z=z, grads=grads)

    return jax.jit(run)(inputs, cotangent)


def _as_f64(a):
    return np.asarray(jnp.asarray(a).astype(jnp.float64))


def assert_close(actual, expected, dtype=None, rtol=None, atol=None, err_msg=""):
    """allclose on pytrees, with per-dtype default tolerances; atol is scaled by max|expected|."""
    actual_leaves, actual_tree = jax.tree.flatten(actual)
    expected_leaves, expected_tree = jax.tree.flatten(expected)
    assert actual_tree == expected_tree, f"{err_msg}: tree {actual_tree} != {expected_tree}"
    for i, (a, e) in enumerate(zip(actual_leaves, expected_leaves)):
        assert a.shape == e.shape, f"{err_msg}[{i}]: shape {a.shape} != {e.shape}"
        d = np.dtype(dtype if dtype is not None else e.dtype)
        rt, at = TOLERANCES[d]
        rt = rtol if rtol is not None else rt
        at = atol if atol is not None else at
        e64 = _as_f64(e)
        scale = max(1.0, float(np.max(np.abs(e64)))) if e64.size else 1.0
        np.testing.assert_allclose(_as_f64(a), e64, rtol=rt, atol=at * scale,
                                   err_msg=f"{err_msg} leaf {i}")


def spec_numpy_forward(source, recurrent_weight, input_weight=None, bias=None, init_state=None,
                       mask=None, *, activation="relu", reverse=False, bidirectional=False):
    """The spec's forward written as plain numpy loops (float64): an oracle independent of
    jax_sgrnn's code. Returns (y, z)."""
    act = {
        "none": lambda z: z,
        "relu": lambda z: np.maximum(z, 0),
        "tanh": np.tanh,
        "sigmoid": lambda z: 1 / (1 + np.exp(-z)),
        "hard_sigmoid": lambda z: np.clip(0.2 * z + 0.5, 0, 1),
    }[activation]
    x = _as_f64(source)
    T, N, _ = x.shape
    D = 2 if bidirectional else 1
    H = recurrent_weight.shape[-1]
    Rs = _as_f64(recurrent_weight).reshape(D, H, H)
    xp = x if input_weight is None else x @ _as_f64(input_weight).T
    if bias is not None:
        xp = xp + _as_f64(bias)
    h0 = np.zeros((N, D * H)) if init_state is None else _as_f64(init_state)
    m = np.ones((T, N, D * H)) if mask is None else np.broadcast_to(_as_f64(mask),
                                                                        (T, N, D * H))
    y = np.zeros((T, N, D * H))
    z = np.zeros((T, N, D * H))
    for d in range(D):
        cols = slice(d * H, (d + 1) * H)
        backward_half = d == 1
        read_reversed = backward_half or (reverse and not bidirectional)
        h = h0[:, cols]
        for k in range(T):
            t_in = T - 1 - k if read_reversed else k
            zk = xp[t_in, :, cols] + (h * m[k, :, cols]) @ Rs[d].T
            h = act(zk)
            t_out = T - 1 - k if backward_half else k
            z[t_out, :, cols] = zk
            y[t_out, :, cols] = h
    return y, z


def run_cpp_unit_test(tmp_path, *sources: str, flags: tuple[str, ...] = ()) -> str:
    """Builds the C++ unit test ``sources`` (paths from the repository root; the first has
    main()) with the system C++ compiler, ``flags`` after them, and runs it: it prints each
    failed check and "0 of N checks failed" when all pass. Returns what it wrote to stderr.
    Skips where there is no C++ compiler."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler (g++ or c++) on PATH")
    repo = Path(__file__).resolve().parent.parent
    binary = tmp_path / Path(sources[0]).stem
    build = subprocess.run([cxx, "-std=c++20", "-Wall", "-Werror", "-I", str(repo / "csrc"),
                            *(str(repo / s) for s in sources), *flags, "-o", str(binary)],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stdout + build.stderr
    run = subprocess.run([str(binary)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.startswith("0 of "), run.stdout
    return run.stderr


def blas_flags() -> tuple[str, ...]:
    """Compiler flags that build and link csrc/cpu/kernels.cc outside CMake: the BLAS of
    csrc/cpu/blas.h (scipy-openblas32, or Accelerate on macOS), kernels.cc as its baseline
    build."""
    if sys.platform == "darwin":
        return ("-DSGRNN_ISA=baseline", "-framework", "Accelerate")
    import scipy_openblas32

    lib = scipy_openblas32.get_lib_dir()
    return ("-DSGRNN_ISA=baseline", "-I", scipy_openblas32.get_include_dir(), "-L", lib,
            "-lscipy_openblas", f"-Wl,-rpath,{lib}")
