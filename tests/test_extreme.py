"""Extreme inputs: very long sequences, huge and tiny values, NaN and Inf, H = 1 and N = 1, and
the edge sizes (T = 0 and N = 0 give empty outputs and zero gradients; T = N = H = 1).

Three of these tests are regression tests for handler bugs they found, since fixed (see
docs/reliability.md, "What the checks found, and the fixes"): NaN mapped to a number by the
clamped activations (test_nan_and_inf_propagate_like_the_reference), a float32 tanh that
saturated short of 1 in the FMA builds (test_huge_values_saturate_exactly_float32), and the
step-0 product skipped when init_state is absent
(test_absent_init_state_with_nonfinite_recurrent_weight).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import conftest
import jax_sgrnn
from conftest import (ACTIVATIONS, assert_close, diff_inputs, full_results, make_inputs, out_shape,
                      random_array, requires_native)

#: jit for the oracle side (conftest's fast-compiling jit when it has one).
ref_jit = getattr(conftest, "ref_jit", jax.jit)

op, ref = jax_sgrnn.single_gate_rnn, jax_sgrnn.reference
DIFF = ("source", "recurrent_weight", "input_weight", "bias", "init_state")
UNDER_ASAN = "libasan" in os.environ.get("LD_PRELOAD", "")


def _value_and_grad(rnn, flags):
    """jit(inputs, dy) -> (y, d/d(inputs) of sum(y * dy)) for the present inputs."""

    def run(inputs, dy):
        diff = {k: inputs[k] for k in DIFF if inputs[k] is not None}
        fixed = {k: v for k, v in inputs.items() if k not in diff}

        def loss(d):
            return jnp.sum(rnn(**fixed, **d, **flags) * dy)

        return jax.value_and_grad(loss)(diff)[1], rnn(**inputs, **flags)

    return ref_jit(run) if rnn is ref else jax.jit(run)


# ------------------------------------------------------------------------ long sequences

LONG_T = 100_000


def test_long_sequence_matches_reference():
    """T = 100000 (N = 2, H = 4, bidirectional, every optional, a [T,1,1] mask): forward and
    gradients agree with the lax.scan reference over the whole sequence."""
    rng = np.random.default_rng(0)
    inputs = make_inputs(rng, LONG_T, 2, 3, 4, bidirectional=True, mask="float",
                         mask_shape=(LONG_T, 1, 1), dtype=jnp.float32)
    dy = random_array(rng, (LONG_T, 2, 8), jnp.float32)
    flags = dict(activation="tanh", bidirectional=True)
    got = _value_and_grad(op, flags)(inputs, dy)
    want = _value_and_grad(ref, flags)(inputs, dy)
    assert_close(got, want, dtype=jnp.float32, atol=2e-5, err_msg="T=100000")


_MEMORY_SCRIPT = textwrap.dedent("""
    import json, resource, sys
    import jax, jax.numpy as jnp
    jax.config.update("jax_platforms", "cpu")
    import jax_sgrnn

    def status_mb(field):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024

    def reset_peak():
        # Linux >= 4.0: writing 5 to clear_refs resets VmHWM (the peak RSS) to the current
        # RSS. Where that is refused, getrusage's lifetime peak is used instead.
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return "VmHWM"
        except OSError:
            return None

    def peak_mb(source):
        if source == "VmHWM":
            return status_mb("VmHWM")
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    def run(T, N=2, I=3, H=4, compile_only=False):
        k = jax.random.split(jax.random.key(0), 4)
        x = jax.random.normal(k[0], (T, N, I))
        R = 0.3 * jax.random.normal(k[1], (H, H))
        W = jax.random.normal(k[2], (H, I))
        dy = jax.random.normal(k[3], (T, N, H))
        def loss(x, R, W):
            return jnp.sum(jax_sgrnn.single_gate_rnn(x, R, W, activation="tanh") * dy)
        fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
        if compile_only:
            return fn.lower(x, R, W).compile()
        out = jax.block_until_ready(fn(x, R, W))
        assert bool(jnp.isfinite(out[0]))

    run(1000)  # brings in XLA's working set
    T = int(sys.argv[1])
    run(T, compile_only=True)  # the compiler's own peak is not the op's
    before = status_mb("VmRSS")
    source = reset_peak()
    if source is None:
        before = peak_mb(None)
    run(T)
    print(json.dumps(dict(before=before, after=peak_mb(source), source=source or "ru_maxrss")))
""")


@requires_native
def test_long_sequence_memory_is_linear():
    """A fresh process runs forward + backward at T = 100000; its peak RSS during that run
    (VmHWM reset just before, after compiling) may exceed the RSS before it by a generous
    multiple of the arrays' size and no more: the handler's scratch is O(T*N*H) and nothing
    grows per step (O(T^2) would be tens of GB). The kernels loop over steps, no recursion,
    so no stack grows with T."""
    N, I, H = 2, 3, 4
    arrays_mb = LONG_T * N * (2 * I + 6 * H) * 4 / 2**20  # x, dx, y, z, dy, dz, scratch
    bound_mb = 16 * arrays_mb + 64
    if UNDER_ASAN:  # ASan's quarantine holds freed memory (up to 256 MB by default)
        bound_mb += 512
    # cwd: away from the repository root, whose uninstalled jax_sgrnn/ would shadow the
    # installed package in a `python -c` child.
    proc = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT, str(LONG_T)],
                          capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(__file__))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rss = json.loads(proc.stdout.strip().splitlines()[-1])
    growth = rss["after"] - rss["before"]
    print(f"T={LONG_T}: RSS {rss['before']:.0f} MB, peak during the run {rss['after']:.0f} MB "
          f"({rss['source']}; +{growth:.1f} MB; arrays ~{arrays_mb:.1f} MB; bound "
          f"{bound_mb:.0f} MB)")
    assert growth < bound_mb, rss


# ------------------------------------------------------------------ huge and tiny values

SCALES = {np.dtype(np.float32): (1e30, 1e-30), np.dtype(np.float64): (1e300, 1e-300)}


def _scaled_inputs(dtype, scale, seed):
    rng = np.random.default_rng(seed)
    inputs = make_inputs(rng, 4, 3, 3, 5, mask="float", dtype=dtype)
    inputs["source"] = inputs["source"] * scale
    inputs["init_state"] = inputs["init_state"] * scale
    dy = random_array(rng, (4, 3, 5), dtype)
    return inputs, dy


@pytest.mark.parametrize("activation", ["none", "relu", "hard_sigmoid"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64], ids=["f32", "f64"])
def test_huge_values(dtype, activation):
    """Source and initial state near the dtype's limit (1e30 in float32, 1e300 in float64):
    no NaN or Inf where the math has none, and the reference's outputs and gradients."""
    _check_huge(dtype, activation)


@pytest.mark.parametrize("activation", ["tanh", "sigmoid"])
def test_huge_values_saturating_float64(activation):
    _check_huge(jnp.float64, activation)


@pytest.mark.parametrize("activation", ["tanh", "sigmoid"])
def test_huge_values_saturate_exactly_float32(activation):
    """Regression test: at 1e30 the float32 outputs and gradients must be the reference's,
    which needs tanh to saturate to exactly +-1 (sigmoid to exactly 0 and 1) so that a
    saturated unit's derivative 1 - h^2 is exactly 0. Guards csrc/sgrnn/core.h FastTanh,
    whose clamped rational form gave 0.99999976 at the clamp in the FMA builds
    (x86-64-v3/v4): tanh' = 4.8e-7 (sigmoid: 1.2e-7), and d input_weight, d recurrent_weight
    of ~1e24 where the reference (and the math) gives 0. Only the build this process selects
    runs here; tests/test_isa_builds.py checks saturation in every build."""
    _check_huge(jnp.float32, activation)


def _check_huge(dtype, activation):
    big, _ = SCALES[np.dtype(dtype)]
    inputs, dy = _scaled_inputs(dtype, big, 1)
    flags = dict(activation=activation)
    got = _value_and_grad(op, flags)(inputs, dy)
    want = _value_and_grad(ref, flags)(inputs, dy)
    for leaf in jax.tree.leaves(want):
        assert np.all(np.isfinite(np.asarray(leaf))), "reference overflowed: bad test data"
    for path, leaf in jax.tree_util.tree_leaves_with_path(got):
        assert np.all(np.isfinite(np.asarray(leaf))), f"non-finite {jax.tree_util.keystr(path)}"
    y = np.asarray(got[1])
    if activation == "tanh":
        assert np.all(np.abs(y) <= 1)
    elif activation in ("sigmoid", "hard_sigmoid"):
        assert np.all((y >= 0) & (y <= 1))
    assert_close(got, want, dtype=dtype, err_msg=f"{activation} at {big:g}")


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64], ids=["f32", "f64"])
def test_tiny_values(dtype, activation):
    """Source and initial state at 1e-30 (float32) / 1e-300 (float64), compared with a
    tolerance relative to each result's own magnitude (not to 1)."""
    _, tiny = SCALES[np.dtype(dtype)]
    inputs, dy = _scaled_inputs(dtype, tiny, 2)
    flags = dict(activation=activation)
    got = _value_and_grad(op, flags)(inputs, dy)
    want = _value_and_grad(ref, flags)(inputs, dy)
    rtol = 1e-5 if dtype == jnp.float32 else 1e-12
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert np.all(np.isfinite(g)), jax.tree_util.keystr(path)
        np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * np.max(np.abs(w)),
                                   err_msg=jax.tree_util.keystr(path))


# ---------------------------------------------------------------------------- NaN and Inf

#: Where a non-finite value is put: (input, index, value).
NONFINITE_PLACES = [
    ("source", (1, 0, 2), np.nan),
    ("source", (0, 1, 0), np.inf),
    ("source", (2, 2, 1), -np.inf),
    ("init_state", (1, 3), np.nan),
    ("mask", (1, 0, 4), np.nan),
    ("input_weight", (2, 1), np.inf),
    ("bias", (0,), np.nan),
]


def _same_nonfinite(got, want, rtol):
    """None when got has want's NaN/+Inf/-Inf pattern and close finite values, else why."""
    g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
    for what, test in (("NaN", np.isnan), ("+Inf", np.isposinf), ("-Inf", np.isneginf)):
        if not np.array_equal(test(g), test(w)):
            return (f"{what} at {int(test(g).sum())} places, reference at "
                    f"{int(test(w).sum())}")
    fin = np.isfinite(w)
    scale = max(1.0, float(np.max(np.abs(w[fin])))) if fin.any() else 1.0
    if not np.allclose(g[fin], w[fin], rtol=rtol, atol=rtol * scale):
        return "finite values differ"
    return None


def _nonfinite_mismatches(dtype, activation):
    rng = np.random.default_rng(3)
    base = make_inputs(rng, 4, 3, 3, 5, mask="float", dtype=dtype)
    flags = dict(activation=activation)
    fwd_op = jax.jit(lambda i: op(**i, **flags, training=True))
    fwd_ref = ref_jit(lambda i: ref(**i, **flags, training=True))
    rtol = 1e-5 if dtype == jnp.float32 else 1e-10
    bad = []
    for name, index, value in NONFINITE_PLACES:
        inputs = dict(base)
        inputs[name] = inputs[name].at[index].set(value)
        for out, g, w in zip(("y", "z"), fwd_op(inputs), fwd_ref(inputs)):
            why = _same_nonfinite(g, w, rtol)
            if why:
                bad.append(f"{name}{list(index)}={value}: {out}: {why}")
    # The gradient op with a non-finite source gradient or z state.
    grads_op = jax.jit(lambda i, dy, z: jax_sgrnn.single_gate_rnn_gradients(
        i["source"], i["recurrent_weight"], dy, z, i["input_weight"], i["bias"],
        i["init_state"], i["mask"], **flags))
    grads_ref = ref_jit(lambda i, dy, z: jax_sgrnn.reference_gradients(
        i["source"], i["recurrent_weight"], dy, z, i["input_weight"], i["bias"],
        i["init_state"], i["mask"], **flags))
    _, z = fwd_ref(base)
    dy = random_array(rng, z.shape, dtype)
    for name, index, value in (("dy", (2, 1, 3), np.nan), ("dy", (1, 1, 1), np.inf),
                               ("z", (3, 0, 2), np.nan), ("z", (1, 2, 0), np.inf)):
        args = dict(dy=dy, z=z)
        args[name] = args[name].at[index].set(value)
        for k, (g, w) in enumerate(zip(grads_op(base, **args), grads_ref(base, **args))):
            why = _same_nonfinite(g, w, rtol)
            if why:
                bad.append(f"{name}{list(index)}={value}: gradient {k}: {why}")
    return bad


@pytest.mark.parametrize("dtype,activation", [
    pytest.param(dtype, act,
                 id=f"{np.dtype(dtype).name[:1]}{np.dtype(dtype).itemsize * 8}-{act}")
    for dtype in (jnp.float32, jnp.float64) for act in ACTIVATIONS])
def test_nan_and_inf_propagate_like_the_reference(dtype, activation):
    """NaN/Inf in the source, initial state, mask, input weight, bias, source gradient or z:
    the op's outputs (y, z) and the gradient op's results have the reference's NaN, +Inf and
    -Inf entries and its finite values.

    Regression test for the activations in csrc/sgrnn/core.h, which must keep NaN as NaN:
    FastTanh's former clamp `std::max(-c, std::min(c, x))` turned NaN into +c (tanh(NaN) =
    0.99999976, sigmoid(NaN) = 0.99999988 in float32), and hard sigmoid's
    `std::max(0, std::min(1, v))` gave 1 for NaN (float32 and float64). relu keeps NaN too,
    in the handler and in the reference."""
    bad = _nonfinite_mismatches(dtype, activation)
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("value", [np.inf, np.nan], ids=["inf", "nan"])
def test_absent_init_state_with_nonfinite_recurrent_weight(value):
    """Regression test: with no init_state, step 0 still takes the product of a zero state
    with R, as the reference's z[0] = x' + (0 * m[0]) R^T does, so an Inf or NaN in R gives
    NaN in z[0] (0 * Inf = NaN). Guards csrc/cpu/kernels.cc Forward, which used to skip that
    product when h0 was absent and so returned a finite z[0]."""
    rng = np.random.default_rng(4)
    inputs = make_inputs(rng, 3, 2, 3, 4, init_state=False, dtype=jnp.float64)
    inputs["recurrent_weight"] = inputs["recurrent_weight"].at[1, 2].set(value)
    got = jax.jit(lambda i: op(**i, activation="none", training=True))(inputs)
    want = ref_jit(lambda i: ref(**i, activation="none", training=True))(inputs)
    for out, g, w in zip(("y", "z"), got, want):
        assert _same_nonfinite(g, w, 1e-10) is None, (out, np.asarray(g[0]), np.asarray(w[0]))


# ------------------------------------------------------------------ hidden 1, batch 1

@pytest.mark.parametrize("activation,bidirectional,reverse", [
    ("none", False, False), ("relu", True, False), ("tanh", False, True),
    ("sigmoid", True, True), ("hard_sigmoid", False, False)])
def test_hidden_size_1_and_batch_1(activation, bidirectional, reverse):
    """H = 1, N = 1, I = 1 over T = 37 steps with every optional input and a bool mask,
    float64: forward and gradients against the reference."""
    rng = np.random.default_rng(5)
    inputs = make_inputs(rng, 37, 1, 1, 1, bidirectional=bidirectional, mask="bool")
    dy = random_array(rng, (37, 1, 2 if bidirectional else 1), jnp.float64)
    flags = dict(activation=activation, bidirectional=bidirectional, reverse=reverse)
    got = _value_and_grad(op, flags)(inputs, dy)
    want = _value_and_grad(ref, flags)(inputs, dy)
    assert got[1].shape == (37, 1, 2 if bidirectional else 1)
    assert_close(got, want, err_msg="H=N=I=1")


# ---------------------------------------------------------------- empty and smallest sizes
# T = 0 and N = 0 give empty outputs and zero gradients (not errors); T = N = H = 1 works.


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
