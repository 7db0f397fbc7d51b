"""The MPSGraph backend (macOS, Apple GPU) against the lax.scan reference and the spec.

Runs only on macOS with a Metal device and jax_sgrnn's MPSGraph extension loaded
(``jax_sgrnn.backends()["mps"].available``); everywhere else the whole module is skipped, with
the backend's own reason. ``SGRNN_REQUIRE_MPS=1`` turns that skip into a collection error, so
the self-hosted Metal CI job cannot pass by skipping (pytest has no "fail on skip" flag).

Every computation of the op under test is lowered, its StableHLO checked for the mps custom-call
targets (and for the absence of the native ones), then that very lowering is compiled and run
(``run_on_mps``): a passing comparison proves MPSGraph produced the numbers, not the native CPU
handler or the ``lax.scan`` decomposition. Target names come from
``jax_sgrnn.backends()[name].targets``.

The ``test_mpsgraph_fact_*`` tests check, one each, the facts that ``docs/semantics.md`` marks
[impl]: read off the shipped framework, never yet confirmed on Apple hardware. A failure names
the fact MPSGraph contradicts. Each compares with ``spec_numpy_forward`` (plain numpy loops,
independent of jax_sgrnn) or the reference on fresh random data, and first checks that the
data tell the spec's reading apart from the contrary one.

Tolerances (rtol; atol = the same value times max|expected|, see ``conftest.assert_close``):

- float32, activations none / relu / hard_sigmoid: 1e-5, against a float32 reference run on
  the CPU at HIGHEST matmul precision. These need only multiplies and adds; Apple GPUs
  multiply-add in full float32 (no TF32-like mode), so the GPU differs only in summation order,
  a few ulp on these small shapes (K <= 9 per product, <= 35 terms per gradient sum).
- float32, tanh / sigmoid: 1e-4. MPSGraph does not document whether its kernels are compiled
  with Metal's fast math (``MTLCompileOptions.fastMathEnabled`` defaults to YES), in which
  transcendentals have looser error bounds than the precise ones and the compiler may
  re-associate; a few-ulp-per-step difference in tanh / exp is then carried through the
  recurrence and summed into the weight gradients. 1e-4 still catches every semantic error
  (a wrong time index, mask or activation moves results by O(1), checked per fact below).
- float16: 1e-2 (the GPU may round intermediate products to half; the reference widens to
  float32 and rounds once). bfloat16 (widened to float32 around the call): 5e-2, as the CPU
  suite.
- T = 2000: 1e-4 against a float64 reference of the same float32 values: the weight gradients
  are float32 sums of T*N = 8000 products, whose rounding error grows like sqrt(T*N) ulp.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import textwrap
import threading
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sgrnn
from conftest import (ACTIVATIONS, assert_close, diff_inputs, full_results, grid_every_activation,
                      grid_every_pattern, make_inputs, out_shape, random_array, ref_jit,
                      spec_numpy_forward, value_and_grads)

#: ``SGRNN_REQUIRE_MPS=1``: fail (at collection) instead of skipping when mps is unavailable.
REQUIRE_MPS = os.environ.get("SGRNN_REQUIRE_MPS", "").strip().lower() not in ("", "0", "false",
                                                                             "no")


def _mps_unavailable_reason() -> str | None:
    """None when the MPSGraph backend can run here, else why not (with the backend's reason)."""
    backends = getattr(jax_sgrnn, "backends", None)
    if backends is None:
        backend_reason = "this jax_sgrnn has no backends() (built without an MPSGraph backend)"
        available = False
    else:
        mps = backends().get("mps")
        available = mps is not None and mps.available
        backend_reason = ("jax_sgrnn.backends() has no 'mps' entry" if mps is None else
                          f"jax_sgrnn.backends()['mps'] is not available: {mps.reason}")
    if sys.platform != "darwin":
        return (f"the MPSGraph backend runs only on macOS (sys.platform is {sys.platform!r}); "
                + backend_reason)
    return None if available else backend_reason


_UNAVAILABLE = _mps_unavailable_reason()
if _UNAVAILABLE is not None:
    if REQUIRE_MPS:
        pytest.fail(f"SGRNN_REQUIRE_MPS is set, but {_UNAVAILABLE}", pytrace=False)
    pytest.skip(_UNAVAILABLE, allow_module_level=True)

MPS = jax_sgrnn.backends()["mps"]
NATIVE = jax_sgrnn.backends()["native"]

op = jax_sgrnn.single_gate_rnn
grads_op = jax_sgrnn.single_gate_rnn_gradients
ref = jax_sgrnn.reference
ref_grads = jax_sgrnn.reference_gradients

F32_TOL = 1e-5
F32_TRANSCENDENTAL_TOL = 1e-4
F16_TOL = 1e-2
BF16_TOL = 5e-2
LARGE_T_TOL = 1e-4


def tolerance(dtype, activation) -> float:
    dtype = np.dtype(dtype)
    if dtype == np.dtype(jnp.float16):
        return F16_TOL
    if dtype == np.dtype(jnp.bfloat16):
        return BF16_TOL
    if dtype == np.dtype(np.float64):
        return 1e-10  # the native handler (float64 never goes to the GPU)
    return F32_TRANSCENDENTAL_TOL if activation in ("tanh", "sigmoid") else F32_TOL


def close(actual, expected, tol, err_msg=""):
    assert_close(actual, expected, rtol=tol, atol=tol, err_msg=err_msg)


@pytest.fixture(autouse=True)
def mps_backend():
    """Every test runs with the mps backend selected for the cpu platform; the previous choice
    is restored afterwards (cpu_backend's context manager)."""
    with jax_sgrnn.cpu_backend("mps"):
        assert jax_sgrnn.get_cpu_backend() == "mps"
        yield MPS


@contextlib.contextmanager
def highest_precision():
    with jax.default_matmul_precision("highest"):
        yield


# ------------------------------------------------------------------------------ helpers


def custom_call_targets(hlo_text: str) -> list[str]:
    """The targets of every custom call in a lowered module, in order."""
    return [m.group(1) for line in hlo_text.splitlines() if "custom_call" in line
            for m in re.finditer(r"@([\w.$-]+)\(", line)]


def native_only_targets() -> set:
    return set(NATIVE.targets.values()) - set(MPS.targets.values())


def run_on_mps(fn, *args, expect=("forward",)):
    """jit(fn) lowered, checked to call MPSGraph's targets (each of ``expect``: "forward",
    "gradients") and no native one, then that lowering compiled and run on ``args``."""
    lowered = jax.jit(fn).lower(*args)
    text = lowered.as_text()
    calls = custom_call_targets(text)
    for kind in expect:
        assert MPS.targets[kind] in calls, (
            f"no custom call to {MPS.targets[kind]!r} (mps {kind}) with the mps backend "
            f"selected; custom calls: {calls}")
    stray = native_only_targets() & set(calls)
    assert not stray, f"native targets {stray} called with the mps backend selected"
    assert "stablehlo.while" not in text, "the op fell back to its lax.scan decomposition"
    return lowered.compile()(*args)


def gradients_args(inputs, dy, z):
    return (inputs["source"], inputs["recurrent_weight"], dy, z, inputs["input_weight"],
            inputs["bias"], inputs["init_state"], inputs["mask"])


def present_grad_names(inputs) -> list:
    return ["source", "recurrent_weight"] + [
        n for n in ("input_weight", "bias", "init_state") if inputs[n] is not None]


def op_results(inputs, cotangent, flags) -> dict:
    """The op's y (inference), y and z (training=True) and jax.grad of sum(y * cotangent),
    from one program that must run on MPSGraph (conftest.full_results' keys)."""
    flags = {k: v for k, v in flags.items() if k != "training"}

    def run(inputs, cotangent):
        def loss(diff):
            y = op(**{**inputs, **diff}, **flags)
            return jnp.sum(y.astype(cotangent.dtype) * cotangent), y

        (_, y), grads = jax.value_and_grad(loss, has_aux=True)(diff_inputs(inputs))
        y_train, z = op(**inputs, **flags, training=True)
        return dict(y=y, y_train=y_train, z=z, grads=grads)

    return run_on_mps(run, inputs, cotangent, expect=("forward", "gradients"))


def op_gradients(inputs, dy, z, flags) -> list:
    """single_gate_rnn_gradients called directly, on MPSGraph."""
    return run_on_mps(lambda i, dy, z: grads_op(*gradients_args(i, dy, z), **flags),
                      inputs, dy, z, expect=("gradients",))


def reference_results(inputs, cotangent, flags) -> dict:
    with highest_precision():
        return full_results(ref, inputs, cotangent, flags)


def reference_gradients(inputs, dy, z, flags) -> list:
    with highest_precision():
        return ref_jit(lambda i, dy, z: ref_grads(*gradients_args(i, dy, z), **flags))(
            inputs, dy, z)


def as_float64(inputs: dict) -> dict:
    """The same values in float64 (bool masks stay bool): a float64 oracle for float32 data."""
    return {k: (None if v is None else v if v.dtype == jnp.bool_ else v.astype(jnp.float64))
            for k, v in inputs.items()}


def check_against_reference(inputs, flags, dtype, tol, rng):
    """y, y (training), z and every jax.grad gradient, then the gradient op's list, against
    the reference: shapes, dtypes, values."""
    bi = flags.get("bidirectional", False)
    c = random_array(rng, out_shape(inputs, bi), dtype)
    want = reference_results(inputs, c, flags)
    got = op_results(inputs, c, flags)
    shape = out_shape(inputs, bi)
    for key in ("y", "y_train", "z"):
        assert got[key].shape == shape and got[key].dtype == dtype, (
            key, got[key].shape, got[key].dtype)
    assert set(got["grads"]) == set(diff_inputs(inputs))
    for name, g in got["grads"].items():
        assert g.shape == inputs[name].shape and g.dtype == dtype, (name, g.shape, g.dtype)
    for key in ("y", "y_train", "z"):
        close(got[key], want[key], tol, err_msg=key)
    for name in got["grads"]:
        close(got["grads"][name], want["grads"][name], tol, err_msg=f"jax.grad d{name}")

    # The gradient op itself, fed the reference's z (the same input on both sides).
    got_list = op_gradients(inputs, c, want["z"], flags)
    want_list = reference_gradients(inputs, c, want["z"], flags)
    names = present_grad_names(inputs)
    assert isinstance(got_list, list) and len(got_list) == len(names), (len(got_list), names)
    for g, w, name in zip(got_list, want_list, names):
        assert g.shape == inputs[name].shape and g.dtype == dtype, (name, g.shape, g.dtype)
        close(g, w, tol, err_msg=f"single_gate_rnn_gradients d{name}")


def distinguishable(expected, alternative, tol, what):
    """The test data tell the spec's reading from the contrary one by far more than tol."""
    e, a = np.asarray(expected, np.float64), np.asarray(alternative, np.float64)
    scale = max(1.0, float(np.max(np.abs(e))))
    gap = float(np.max(np.abs(e - a)))
    assert gap > 100 * tol * scale, (
        f"test data too weak: the spec's result and {what} differ by only {gap:.3g}")


# ------------------------------------------------------------------------ backend choice


def test_backend_record_describes_a_usable_metal_device():
    assert MPS.name == "mps" and MPS.platform == "cpu"
    assert MPS.available and MPS.reason is None
    assert isinstance(MPS.device, str) and MPS.device, MPS.device
    assert set(MPS.targets) == {"forward", "gradients"}
    assert set(MPS.targets.values()).isdisjoint(NATIVE.targets.values())


def test_self_check_passes_on_this_machine():
    """MPSGraph agrees with the semantics on every fact of the self-check (a failure here is
    the same finding as a failed test_mpsgraph_fact_* below, named by the check itself), and
    the check is cheap enough to run at the first call."""
    report = jax_sgrnn.mps_self_check(rerun=True)
    failed = {name: fact for name, fact in report["facts"].items() if fact["status"] != "passed"}
    assert report["passed"] and not failed, failed
    assert report["seconds"] < 1.0, report["seconds"]
    assert jax_sgrnn.backends()["mps"].self_check.startswith("passed")


def test_cpu_backend_block_and_set_cpu_backend_call(rng):
    """cpu_backend chooses inside a block and restores the previous choice, set_cpu_backend
    chooses process-wide; each choice shows in the lowered HLO of a fresh function."""
    inputs = make_inputs(rng, dtype=jnp.float32)

    def targets_now():
        return custom_call_targets(
            jax.jit(lambda i: op(**i, activation="tanh")).lower(inputs).as_text())

    assert MPS.targets["forward"] in targets_now()
    with jax_sgrnn.cpu_backend("native"):
        assert jax_sgrnn.get_cpu_backend() == "native"
        assert targets_now() == [NATIVE.targets["forward"]]
    assert jax_sgrnn.get_cpu_backend() == "mps"
    assert targets_now() == [MPS.targets["forward"]]
    jax_sgrnn.set_cpu_backend("native")  # plain call, not entered
    try:
        assert jax_sgrnn.get_cpu_backend() == "native"
        assert targets_now() == [NATIVE.targets["forward"]]
    finally:
        jax_sgrnn.set_cpu_backend("mps")
    assert targets_now() == [MPS.targets["forward"]]
    with jax_sgrnn.cpu_backend("auto"):  # auto: mps, as its extension and a device exist
        assert targets_now() == [MPS.targets["forward"]]


@pytest.mark.parametrize("choice", ["mps", "native", "auto"])
def test_environment_variable_selects_backend(tmp_path, choice):
    """JAX_SGRNN_CPU_BACKEND, read at import (a fresh process, away from the repo root)."""
    script = textwrap.dedent("""
        import jax, jax.numpy as jnp, jax_sgrnn
        x = jnp.ones((3, 2, 4), jnp.float32); R = jnp.eye(5, dtype=jnp.float32) * 0.5
        W = jnp.ones((5, 4), jnp.float32) * 0.1
        text = jax.jit(lambda x: jax_sgrnn.single_gate_rnn(x, R, W)).lower(x).as_text()
        print(jax_sgrnn.get_cpu_backend())
        print(text)
    """)
    env = dict(os.environ, JAX_SGRNN_CPU_BACKEND=choice, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    first, _, hlo = out.stdout.partition("\n")
    assert first.strip() == choice
    expected = NATIVE if choice == "native" else MPS
    assert custom_call_targets(hlo) == [expected.targets["forward"]], hlo


# ----------------------------------------------------------------------- lowered HLO


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16],
                         ids=["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("bi", [False, True], ids=["uni", "bi"])
def test_hlo_uses_mps_targets(rng, dtype, bi):
    """Inference: one mps forward call (training = false), no gradient call; jax.grad: the mps
    forward (training = true) and the mps gradient op; no native target, no scan. bfloat16 is
    widened to float32 around the same mps calls. Values agree with the reference."""
    inputs = make_inputs(rng, bidirectional=bi, mask="bool", dtype=dtype)
    flags = dict(activation="tanh", bidirectional=bi)
    text = jax.jit(lambda i: op(**i, **flags)).lower(inputs).as_text()
    calls = custom_call_targets(text)
    assert calls == [MPS.targets["forward"]], calls
    assert "training = false" in [l for l in text.splitlines() if "custom_call" in l][0]

    c = random_array(rng, out_shape(inputs, bi), dtype)
    grad_fn = jax.grad(lambda d: jnp.sum(op(**{**inputs, **d}, **flags).astype(jnp.float32)
                                         * c.astype(jnp.float32)))
    text = jax.jit(grad_fn).lower(diff_inputs(inputs)).as_text()
    calls = custom_call_targets(text)
    assert sorted(calls) == sorted([MPS.targets["forward"], MPS.targets["gradients"]]), calls
    fwd_line = [l for l in text.splitlines() if f"@{MPS.targets['forward']}(" in l][0]
    assert "training = true" in fwd_line
    assert "stablehlo.while" not in text
    check_against_reference(inputs, flags, dtype, tolerance(dtype, "tanh"), rng)


def test_float64_goes_to_the_native_handler(rng):
    """float64 is refused by MPS: with mps selected it lowers to the native targets and gives
    the reference's float64 results."""
    inputs = make_inputs(rng, bidirectional=True, mask="float", dtype=jnp.float64)
    flags = dict(activation="sigmoid", bidirectional=True)
    c = random_array(rng, out_shape(inputs, True), jnp.float64)
    run = lambda i, c: value_and_grads(op, i, c, flags, jit=False)
    text = jax.jit(run).lower(inputs, c).as_text()
    calls = set(custom_call_targets(text))
    assert calls == set(NATIVE.targets.values()), calls
    got = jax.jit(run)(inputs, c)
    assert_close(got, value_and_grads(ref, inputs, c, flags))


# ------------------------------------------------------- the flag grid vs the reference


# (T, N, I, H) cycled through the grid: I != H, sizes 1, and some not multiples of 4.
SHAPES = ((4, 3, 3, 5), (1, 1, 3, 5), (4, 1, 2, 1), (1, 3, 3, 5), (4, 3, 3, 1), (7, 5, 6, 9),
          (1, 3, 3, 1))


def _grid_check(rng, act, rev, bi, pattern, mask, shape, dtype):
    T, N, I, H = shape
    w, b, h = pattern
    inputs = make_inputs(rng, T, N, I, H, bidirectional=bi, input_weight=w, bias=b,
                         init_state=h, mask=mask, dtype=dtype)
    flags = dict(activation=act, reverse=rev, bidirectional=bi)
    check_against_reference(inputs, flags, dtype, tolerance(dtype, act), rng)


@pytest.mark.parametrize("act,rev,bi,pattern,mask,shape", grid_every_pattern(SHAPES))
def test_mps_matches_reference_float32(rng, act, rev, bi, pattern, mask, shape):
    _grid_check(rng, act, rev, bi, pattern, mask, shape, jnp.float32)


@pytest.mark.parametrize("act,rev,bi,pattern,mask,shape", grid_every_activation(SHAPES))
def test_mps_matches_reference_float16(rng, act, rev, bi, pattern, mask, shape):
    _grid_check(rng, act, rev, bi, pattern, mask, shape, jnp.float16)


# --------------------------------------------------------------------------- vmap


@pytest.mark.parametrize("mapped", [
    ("source", "source_gradient", "z_state"),
    ("source_gradient",),
    ("source", "source_gradient", "z_state", "init_state", "mask"),
], ids=["x_dy_z", "dy", "x_dy_z_h0_mask"])
@pytest.mark.parametrize("w", [True, False], ids=["W", "noW"])
@pytest.mark.parametrize("bi", [False, True], ids=["uni", "bi"])
def test_vmap_of_gradients_op_groups_on_mps(rng, mapped, w, bi):
    """vmap of single_gate_rnn_gradients (one grouped call, G = 3) on MPSGraph against vmap of
    reference_gradients. (Mapped weights R, W or b are batched by the lax.scan decomposition,
    not the handler, so they are not an MPSGraph test.)"""
    G = 3
    flags = dict(activation="sigmoid", bidirectional=bi, reverse=True)
    draws = []
    for _ in range(G):
        i = make_inputs(rng, bidirectional=bi, input_weight=w, mask="float",
                        dtype=jnp.float32)
        with highest_precision():
            _, z = ref_jit(lambda i: ref(**i, **flags, training=True))(i)
        draws.append({**i, "z_state": z,
                      "source_gradient": random_array(rng, z.shape, jnp.float32)})
    names = ("source", "recurrent_weight", "source_gradient", "z_state", "input_weight",
             "bias", "init_state", "mask")
    args = {n: (jnp.stack([d[n] for d in draws]) if n in mapped and draws[0][n] is not None
                else draws[0][n]) for n in names}
    axes = {n: (0 if n in mapped and args[n] is not None else None) for n in names}

    def batched(fn):
        return jax.vmap(lambda a: fn(*(a[n] for n in names), **flags), in_axes=(axes,))

    got = run_on_mps(batched(grads_op), args, expect=("gradients",))
    with highest_precision():
        want = ref_jit(batched(ref_grads))(args)
    assert isinstance(got, list) and len(got) == len(want) == len(present_grad_names(draws[0]))
    for g, wnt in zip(got, want):
        assert g.shape[0] == G and g.shape == wnt.shape
    close(got, want, F32_TRANSCENDENTAL_TOL, err_msg="vmapped gradient op")


@pytest.mark.parametrize("bi", [False, True], ids=["uni", "bi"])
def test_vmap_of_grad_per_example_gradients_on_mps(rng, bi):
    """Per-example gradients (vmap of jax.grad) with x, h0 and the mask mapped: the mapped
    axis is folded into N for the forward and into G for the gradient op."""
    B = 3
    draws = [make_inputs(rng, bidirectional=bi, mask="bool", dtype=jnp.float32)
             for _ in range(B)]
    mapped = ("source", "init_state", "mask")
    inputs = {n: (jnp.stack([d[n] for d in draws]) if n in mapped else draws[0][n])
              for n in draws[0]}
    axes = {n: (0 if n in mapped else None) for n in inputs}
    c = random_array(rng, (B, *out_shape(draws[0], bi)), jnp.float32)
    flags = dict(activation="relu", bidirectional=bi, reverse=True)

    def per_example(fn):
        def loss(diff, inputs, c):
            return jnp.sum(fn(**{**inputs, **diff}, **flags) * c)

        return jax.vmap(lambda i, c: jax.grad(loss)(diff_inputs(i), i, c), in_axes=(axes, 0))

    got = run_on_mps(per_example(op), inputs, c, expect=("forward", "gradients"))
    with highest_precision():
        want = ref_jit(per_example(ref))(inputs, c)
    close(got, want, F32_TOL, err_msg="per-example gradients")


# ------------------------------------------------------ unaligned and offset buffers


@pytest.mark.parametrize("shape", [(7, 5, 3, 9), (16, 16, 16, 16), (33, 1, 1, 1)],
                         ids=["odd", "16KiB_source", "tiny"])
@pytest.mark.parametrize("bi", [False, True], ids=["uni", "bi"])
def test_sliced_operands_of_odd_sizes(rng, shape, bi):
    """Operands cut out of larger arrays (x = big[1:T+1, :, 3:3+I] and the like) before the
    call: byte sizes that are not multiples of the 16 KiB page (the staged-copy path), and a
    16 KiB source that may be page-aligned (the no-copy path)."""
    T, N, I, H = shape
    D = 2 if bi else 1
    big = make_inputs(rng, T + 3, N + 2, I + 5, H + 4, bidirectional=bi, mask="float",
                      dtype=jnp.float32)
    Rb = big["recurrent_weight"]
    inputs = dict(
        source=big["source"][1:T + 1, 1:N + 1, 3:3 + I],
        recurrent_weight=(Rb[:, 1:H + 1, 2:H + 2] if bi else Rb[1:H + 1, 2:H + 2]),
        input_weight=random_array(rng, (D * H + 3, I + 1), jnp.float32, 0.5)[2:D * H + 2, 1:],
        bias=big["bias"][1:D * H + 1],
        init_state=big["init_state"][2:N + 2, 1:D * H + 1],
        mask=big["mask"][2:T + 2, 1:N + 1, 3:D * H + 3],
    )
    flags = dict(activation="tanh", reverse=True, bidirectional=bi)
    check_against_reference(inputs, flags, jnp.float32, F32_TRANSCENDENTAL_TOL, rng)


@pytest.mark.parametrize("bi", [False, True], ids=["uni", "bi"])
def test_operands_and_results_at_offsets_inside_jit(rng, bi):
    """Operands computed inside the jit from slices of larger parameters, results consumed
    by further computation: XLA packs such temporaries into one allocation, so the handler
    sees buffers that start at offsets inside it (MPSGraphTensorData takes no offset)."""
    T, N, I, H = 9, 3, 5, 7
    D = 2 if bi else 1
    big = make_inputs(rng, T + 4, N + 3, I + 6, H + 5, bidirectional=bi, mask="float",
                      dtype=jnp.float32)
    W_big = random_array(rng, (D * H + 5, I + 3), jnp.float32, 0.5)
    c = random_array(rng, (T, N, D * H), jnp.float32)
    flags = dict(activation="sigmoid", bidirectional=bi)

    def program(fn):
        def run(big, W_big, c):
            x = big["source"][1:T + 1, 2:N + 2, 3:3 + I] * 1.5 + 0.25
            Rb = big["recurrent_weight"]
            R = (Rb[:, 1:H + 1, 2:H + 2] if bi else Rb[1:H + 1, 2:H + 2]) * 0.9
            W = W_big[3:D * H + 3, 1:I + 1] - 0.1
            b = big["bias"][2:D * H + 2] * 2.0
            h0 = big["init_state"][1:N + 1, 3:D * H + 3] + 0.5
            m = big["mask"][3:T + 3, 1:N + 1, 2:D * H + 2]

            def loss(x, R, W, b, h0):
                y, z = fn(x, R, W, b, h0, m, **flags, training=True)
                # z only as an output: a loss of z would send the backward to the reference.
                return jnp.sum(jnp.tanh(y) * c), (y, z)

            (_, (y, z)), g = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)(
                x, R, W, b, h0)
            return jnp.concatenate([y, z], axis=-1)[1:] * 2.0, [gi * 3.0 for gi in g]

        return run

    got = run_on_mps(program(op), big, W_big, c, expect=("forward", "gradients"))
    with highest_precision():
        want = ref_jit(program(ref))(big, W_big, c)
    close(got, want, F32_TRANSCENDENTAL_TOL)


# ------------------------------------------------------------------------ threads


def _thread_jobs(rng):
    """(name, compiled executable, args, dtype tolerance): compiled in this thread, with the
    mps backend selected, each checked to call MPSGraph (float64: the native handler)."""
    jobs = []

    def add(name, fn, args, tol, expect):
        lowered = jax.jit(fn).lower(*args)
        calls = custom_call_targets(lowered.as_text())
        backend = NATIVE if expect is None else MPS
        for kind in expect or ("forward",):
            assert backend.targets[kind] in calls, (name, calls)
        jobs.append((name, lowered.compile(), args, tol))

    for k, (T, N, I, H, bi, act) in enumerate([(5, 3, 4, 6, False, "tanh"),
                                               (7, 2, 3, 5, True, "relu"),
                                               (3, 8, 16, 32, False, "hard_sigmoid"),
                                               (50, 16, 64, 64, True, "sigmoid")]):
        i = make_inputs(rng, T, N, I, H, bidirectional=bi, mask="float", dtype=jnp.float32)
        c = random_array(rng, out_shape(i, bi), jnp.float32)
        flags = dict(activation=act, bidirectional=bi, reverse=k % 2 == 1)
        add(f"grad-{k}", lambda i, c, flags=flags: value_and_grads(op, i, c, flags, jit=False),
            (i, c), tolerance(jnp.float32, act), ("forward", "gradients"))
    i = make_inputs(rng, 6, 4, 3, 5, init_state=False, dtype=jnp.float16)
    dy, z = (random_array(rng, (6, 4, 5), jnp.float16) for _ in range(2))
    add("gradop-f16", lambda i, dy, z: grads_op(*gradients_args(i, dy, z), activation="tanh"),
        (i, dy, z), F16_TOL, ("gradients",))
    i = make_inputs(rng, 4, 3, 3, 5, bidirectional=True, mask="bool", dtype=jnp.float64)
    add("fwd-f64-native", lambda i: op(**i, activation="tanh", bidirectional=True), (i,),
        1e-10, None)
    return jobs


def _run_concurrently(work_items, repeats):
    """Each (executable, args) in its own thread, all started together, each run `repeats`
    times while the others run."""
    barrier = threading.Barrier(len(work_items))

    def work(fn, args):
        barrier.wait()
        return [jax.block_until_ready(fn(*args)) for _ in range(repeats)]

    with ThreadPoolExecutor(max_workers=len(work_items)) as pool:
        futures = [pool.submit(work, fn, args) for fn, args in work_items]
        return [f.result(timeout=600) for f in futures]


def test_different_programs_and_shapes_from_threads_at_once(rng):
    """Several compiled programs (different shapes, flags, dtypes; forward, jax.grad, the
    gradient op; one float64 program on the native handler) run together from their own
    threads, each several times: every run equals that program's sequential result."""
    jobs = _thread_jobs(rng)
    sequential = [jax.block_until_ready(fn(*args)) for _, fn, args, _ in jobs]
    results = _run_concurrently([(fn, args) for _, fn, args, _ in jobs], repeats=4)
    for (name, _, _, tol), want, runs in zip(jobs, sequential, results):
        for k, got in enumerate(runs):
            close(got, want, tol, err_msg=f"{name} run {k}")


def test_one_program_from_many_threads(rng):
    """One compiled program (MPSGraph forward and gradients) called from 6 threads at once
    (the handler's graph cache and staging buffers are shared by these calls)."""
    name, fn, args, tol = _thread_jobs(rng)[3]
    want = jax.block_until_ready(fn(*args))
    for runs in _run_concurrently([(fn, args)] * 6, repeats=3):
        for k, got in enumerate(runs):
            close(got, want, tol, err_msg=f"{name} run {k}")


# ------------------------------------------------------------------------ large T


@pytest.mark.parametrize("act,rev,bi,mask", [("tanh", True, False, "float"),
                                             ("sigmoid", False, True, "bool")],
                         ids=["tanh-rev-uni-mask_float", "sigmoid-bi-mask_bool"])
def test_large_T(rng, act, rev, bi, mask):
    """T = 2000 steps: forward, z and every gradient against a float64 reference of the same
    float32 values (smooth activations only: at T*N*H = 128k states, a relu kink within
    rounding distance of z = 0 would flip one derivative and is not an error)."""
    T, N, I, H = 2000, 4, 8, 16
    inputs = make_inputs(rng, T, N, I, H, bidirectional=bi, mask=mask, dtype=jnp.float32)
    flags = dict(activation=act, reverse=rev, bidirectional=bi)
    c = random_array(rng, out_shape(inputs, bi), jnp.float32)
    got = op_results(inputs, c, flags)
    want = full_results(ref, as_float64(inputs), c.astype(jnp.float64), flags)
    for key in ("y", "y_train", "z", "grads"):
        close(got[key], want[key], LARGE_T_TOL, err_msg=key)
    got_list = op_gradients(inputs, c, got["z"], flags)
    names = present_grad_names(inputs)
    assert len(got_list) == len(names)
    for g, name in zip(got_list, names):
        close(g, want["grads"][name], LARGE_T_TOL, err_msg=f"gradient op d{name}")


# ---------------------------------------------------------------- empty T or N


def test_empty_time_or_batch_in_a_subprocess(tmp_path):
    """T = 0 or N = 0: empty outputs and zero gradients, without reaching MPSGraph's shape
    inference (which aborts the process on bad shapes: hence the subprocess)."""
    script = textwrap.dedent("""
        import jax, jax.numpy as jnp, numpy as np, jax_sgrnn
        jax_sgrnn.set_cpu_backend("mps")
        for T, N in ((0, 3), (4, 0)):
            x = jnp.ones((T, N, 3), jnp.float32); R = jnp.eye(5, dtype=jnp.float32) * 0.5
            W = jnp.ones((5, 3), jnp.float32); b = jnp.ones(5, jnp.float32)
            h0 = jnp.ones((N, 5), jnp.float32)
            f = lambda x, R, W, b, h0: jax_sgrnn.single_gate_rnn(x, R, W, b, h0,
                                                                 activation="tanh")
            y = jax.jit(f)(x, R, W, b, h0)
            assert y.shape == (T, N, 5), y.shape
            g = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a)), argnums=(0, 1, 2, 3, 4)))(
                x, R, W, b, h0)
            for gi, a in zip(g, (x, R, W, b, h0)):
                assert gi.shape == a.shape and not np.any(np.asarray(gi)), gi
        print("ok")
    """)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), (
        f"rc {out.returncode}\n{out.stdout}\n{out.stderr}")


# ------------------------------------------- the spec's [impl] facts, one test each
#
# docs/semantics.md is the contract.


def _fact_inputs(rng, T=6, N=3, I=4, H=5, **kw):
    return make_inputs(rng, T, N, I, H, dtype=jnp.float32, **kw)


def _forward_on_mps(inputs, flags):
    return run_on_mps(lambda i: op(**i, **flags, training=True), inputs)


def test_mpsgraph_fact_reverse_outputs_stay_in_processing_order(rng):
    """SPEC line 46: "Unidirectional, `reverse=True`: outputs stay in processing order [impl]:
    y[k] is the state after consuming x[T-1-k], so the final state is y[T-1]."

    Contrary reading: outputs flipped back to source time (y[t] = state after x[t])."""
    inputs = _fact_inputs(rng, mask="float")
    flags = dict(activation="tanh", reverse=True)
    y_spec, z_spec = spec_numpy_forward(**inputs, activation="tanh", reverse=True)
    distinguishable(y_spec, y_spec[::-1], F32_TRANSCENDENTAL_TOL, "outputs in source time")
    y, z = _forward_on_mps(inputs, flags)
    close(y, y_spec, F32_TRANSCENDENTAL_TOL, err_msg="y")
    close(z, z_spec, F32_TRANSCENDENTAL_TOL, err_msg="z")
    # The final state, after consuming x[0], is the last row.
    np.testing.assert_allclose(np.asarray(y[-1]), y_spec[-1], rtol=1e-4, atol=1e-4)
    # Gradients follow the same order.
    check_against_reference(inputs, flags, jnp.float32, F32_TRANSCENDENTAL_TOL, rng)


def test_mpsgraph_fact_bidirectional_backward_half_stored_in_source_time(rng):
    """SPEC lines 49-51: "Bidirectional (`reverse` is ignored [hdr]): ... the backward half is
    flipped back to original time: y[t, :, H:] is the backward state after consuming x[t]
    (having seen x[T-1..t]), so the backward final state is y[0, :, H:]." (docs/semantics.md
    lists this layout under [impl] with the reversed time order.)

    Contrary reading: the backward half left in processing order."""
    H = 5
    inputs = _fact_inputs(rng, H=H, bidirectional=True, mask="float")
    y_spec, z_spec = spec_numpy_forward(**inputs, activation="tanh", bidirectional=True)
    alt = np.concatenate([y_spec[..., :H], y_spec[::-1, :, H:]], axis=-1)
    distinguishable(y_spec, alt, F32_TRANSCENDENTAL_TOL, "backward half in processing order")
    for reverse in (False, True):  # reverse is ignored when bidirectional
        y, z = _forward_on_mps(inputs, dict(activation="tanh", bidirectional=True,
                                            reverse=reverse))
        close(y, y_spec, F32_TRANSCENDENTAL_TOL, err_msg=f"y (reverse={reverse})")
        close(z, z_spec, F32_TRANSCENDENTAL_TOL, err_msg=f"z (reverse={reverse})")
    check_against_reference(inputs, dict(activation="tanh", bidirectional=True), jnp.float32,
                            F32_TRANSCENDENTAL_TOL, rng)


@pytest.mark.parametrize("bi", [False, True], ids=["reverse-uni", "bi-backward-half"])
def test_mpsgraph_fact_mask_indexed_by_step_not_flipped_for_reversed_directions(rng, bi):
    """SPEC line 41: the mask "is indexed by processing step k and is not flipped for reversed
    directions [impl]": z[k] = x'[t(k)] + (h[k-1] * m[k]) R^T.

    Contrary reading: a reversed direction (unidirectional reverse, or the backward half)
    reads the mask at the source time index, m[T-1-k]. Checked for y, z and the gradients
    (the gradient op must index the mask the same way)."""
    H = 5
    inputs = _fact_inputs(rng, H=H, bidirectional=bi, mask="float")
    flags = dict(activation="tanh", reverse=not bi, bidirectional=bi)
    m = np.asarray(inputs["mask"])
    flipped = m[::-1] if not bi else np.concatenate([m[..., :H], m[::-1, :, H:]], axis=-1)
    spec_flags = dict(activation="tanh", reverse=not bi, bidirectional=bi)
    y_spec, z_spec = spec_numpy_forward(**inputs, **spec_flags)
    y_alt, _ = spec_numpy_forward(**{**inputs, "mask": flipped}, **spec_flags)
    distinguishable(y_spec, y_alt, F32_TRANSCENDENTAL_TOL, "the mask flipped")
    y, z = _forward_on_mps(inputs, flags)
    close(y, y_spec, F32_TRANSCENDENTAL_TOL, err_msg="y")
    close(z, z_spec, F32_TRANSCENDENTAL_TOL, err_msg="z")
    check_against_reference(inputs, flags, jnp.float32, F32_TRANSCENDENTAL_TOL, rng)


@pytest.mark.parametrize("bi", [False, True], ids=["uni", "bi"])
def test_mpsgraph_fact_missing_input_weight_is_identity(rng, bi):
    """SPEC line 19 ("input weight W (optional) ... missing = identity (no matmul at all)
    [impl]") and line 35 ("x' = x W^T + b (x' = x when W is missing) [hdr][impl]"): the source
    has D*H features and enters the recurrence as is; dx = dx'.

    Checked against the numpy oracle, against the op given W = identity explicitly, and for
    the gradient list (no dW entry)."""
    D, H = (2 if bi else 1), 5
    inputs = _fact_inputs(rng, H=H, bidirectional=bi, input_weight=False, mask="float")
    assert inputs["source"].shape[-1] == D * H
    flags = dict(activation="sigmoid", bidirectional=bi)
    y_spec, z_spec = spec_numpy_forward(**inputs, **flags)
    y, z = _forward_on_mps(inputs, flags)
    close(y, y_spec, F32_TRANSCENDENTAL_TOL, err_msg="y")
    close(z, z_spec, F32_TRANSCENDENTAL_TOL, err_msg="z")
    with_eye = dict(inputs, input_weight=jnp.eye(D * H, dtype=jnp.float32))
    y_eye, _ = _forward_on_mps(with_eye, flags)
    close(y, y_eye, F32_TRANSCENDENTAL_TOL, err_msg="y vs W = identity")
    check_against_reference(inputs, flags, jnp.float32, F32_TRANSCENDENTAL_TOL, rng)


@pytest.mark.parametrize("act", ACTIVATIONS)
def test_mpsgraph_fact_alloc_init_activation_is_none_so_handler_sets_it(rng, act):
    """SPEC lines 66-67: "`[MPSGraphSingleGateRNNDescriptor descriptor]` defaults to `relu`
    [hdr]; a plain `alloc/init` gives `none` [impl]. The MPSGraph handler must always set the
    activation explicitly."

    Each activation gives the oracle's values, and (except none itself) values far from the
    linear RNN's, in the forward and in the gradient op (whose descriptor needs it too). The
    source is scaled so relu and hard sigmoid reach their kinks and clamps."""
    inputs = _fact_inputs(rng, T=5, mask="float")
    inputs["source"] = inputs["source"] * 3.0
    y_spec, z_spec = spec_numpy_forward(**inputs, activation=act)
    if act != "none":
        y_none, _ = spec_numpy_forward(**inputs, activation="none")
        distinguishable(y_spec, y_none, tolerance(jnp.float32, act), "activation none")
    y, z = _forward_on_mps(inputs, dict(activation=act))
    close(y, y_spec, tolerance(jnp.float32, act), err_msg="y")
    close(z, z_spec, tolerance(jnp.float32, act), err_msg="z")
    check_against_reference(inputs, dict(activation=act), jnp.float32,
                            tolerance(jnp.float32, act), rng)


def test_mpsgraph_fact_default_descriptor_activation_is_relu(rng):
    """SPEC line 66 ("`+descriptor` defaults to `relu` [hdr]") with line 67's [impl] rider:
    with no activation given (SingleGateRNNDescriptor's default) the op applies relu, not
    the alloc/init default none."""
    inputs = _fact_inputs(rng, mask="bool")
    inputs["source"] = inputs["source"] * 3.0
    y_relu, _ = spec_numpy_forward(**inputs, activation="relu")
    y_none, _ = spec_numpy_forward(**inputs, activation="none")
    distinguishable(y_relu, y_none, F32_TOL, "activation none")
    y = run_on_mps(lambda i: op(**i), inputs)
    close(y, y_relu, F32_TOL, err_msg="default activation")
    y_desc = run_on_mps(lambda i: op(**i, descriptor=jax_sgrnn.SingleGateRNNDescriptor()),
                        inputs)
    close(y_desc, y_relu, F32_TOL, err_msg="SingleGateRNNDescriptor()")


@pytest.mark.parametrize("bi", [False, True], ids=["uni", "bi"])
def test_mpsgraph_fact_bias_gradient_has_the_bias_shape(rng, bi):
    """SPEC line 89: "d b has the bias's shape ([H] or [2H]); MPSGraph itself returns [1,1,H]
    [impl], which the handler reshapes."

    The gradient op's db (4th entry of [dx, dR, dW, db, dh0]) and jax.grad's have shape
    [D*H], and both halves hold the reference's values (sum over T and N of dz)."""
    D, H = (2 if bi else 1), 5
    inputs = _fact_inputs(rng, H=H, bidirectional=bi, mask="float")
    flags = dict(activation="tanh", bidirectional=bi, reverse=True)
    dy = random_array(rng, out_shape(inputs, bi), jnp.float32)
    with highest_precision():
        _, z = ref_jit(lambda i: ref(**i, **flags, training=True))(inputs)
    got = op_gradients(inputs, dy, z, flags)
    want = reference_gradients(inputs, dy, z, flags)
    assert len(got) == 5
    db = got[3]
    assert db.shape == (D * H,), f"d bias has shape {db.shape}, not the bias's ({D * H},)"
    assert np.abs(np.asarray(want[3])).max() > 1e-2  # the data give a non-trivial db
    close(db, want[3], F32_TRANSCENDENTAL_TOL, err_msg="d bias")
    close(got, want, F32_TRANSCENDENTAL_TOL, err_msg="the whole gradient list")
    got_grad = run_on_mps(
        lambda i: jax.grad(lambda b: jnp.sum(op(**{**i, "bias": b}, **flags) * dy))(i["bias"]),
        inputs, expect=("forward", "gradients"))
    assert got_grad.shape == (D * H,)
    close(got_grad, want[3], F32_TRANSCENDENTAL_TOL, err_msg="jax.grad d bias")
