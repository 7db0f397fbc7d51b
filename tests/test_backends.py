"""The table of backends, the choice of the cpu handler, and what each choice lowers to.

Lowering needs no device, so the MPSGraph path's lowering is checked here on any OS: only the
FFI target names change, the operands and attributes are the native handler's.
"""

import importlib
import os
import re
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sgrnn
from jax_sgrnn import _backends
from conftest import (LOOP_T, custom_calls, diff_inputs, lowered_text, make_inputs, random_array,
                      requires_native)

TABLE = jax_sgrnn.backends()
MPS_RUNS_HERE = TABLE["mps"].available


def _forward_and_grad(inputs, flags):
    y_shape = jax.eval_shape(lambda i: jax_sgrnn.reference(**i, **flags), inputs).shape
    c = random_array(np.random.default_rng(1), y_shape, inputs["source"].dtype)

    def loss(diff):
        y = jax_sgrnn.single_gate_rnn(**{**inputs, **diff}, **flags)
        return jnp.sum(y.astype(jnp.float32) * c.astype(jnp.float32))

    return lowered_text(jax.grad(loss), diff_inputs(inputs))


def _child(code: str, **env) -> subprocess.CompletedProcess:
    # cwd: away from the repository root, whose uninstalled jax_sgrnn/ would shadow the package.
    clean = {k: v for k, v in os.environ.items() if k != "JAX_SGRNN_CPU_BACKEND"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=os.path.dirname(__file__),
                          env=dict(clean, JAX_PLATFORMS="cpu", **env))


# ------------------------------------------------------------------------------ the table


def test_every_backend_is_described():
    assert set(TABLE) == {"native", "mps", "cuda"}
    for name, b in TABLE.items():
        assert b.name == name and b.platform == ("cuda" if name == "cuda" else "cpu")
        assert set(b.targets) == {"forward", "gradients"}
        assert b.available == (b.reason is None), b
        assert not set(b.native_dtypes) & set(b.widened_dtypes)
        for dtype, other in b.handoff.items():
            assert dtype not in b.native_dtypes + b.widened_dtypes
            assert other in TABLE


def test_target_names_are_distinct_and_come_from_the_extension():
    names = [t for b in TABLE.values() for t in b.targets.values()]
    assert len(set(names)) == len(names)
    if TABLE["native"].available:
        from jax_sgrnn import _sgrnn_cpu

        assert {n: dict(t) for n, t in _sgrnn_cpu.target_names().items()} == {
            n: dict(b.targets) for n, b in TABLE.items()}


@pytest.mark.parametrize("name", [n for n, b in TABLE.items() if b.available])
def test_registrations_match_the_table(name):
    module = importlib.import_module(f"jax_sgrnn.{TABLE[name].module}")
    assert set(module.registrations()) == set(TABLE[name].targets.values())


@requires_native
@pytest.mark.parametrize("name", [n for n, b in TABLE.items()
                                  if b.available and b.platform == "cpu"])
def test_lowered_targets_are_the_tables(name, rng):
    inputs = make_inputs(rng, dtype=jnp.float32)
    with jax_sgrnn.cpu_backend(name):
        text = _forward_and_grad(inputs, dict(activation="tanh"))
    targets = {re.search(r"@(\w+)", c).group(1) for c in custom_calls(text)}
    assert targets == set(TABLE[name].targets.values())


def test_unavailable_backends_say_why():
    for b in TABLE.values():
        if not b.available:
            assert b.reason and len(b.reason) > 10
    if sys.platform != "darwin":
        assert not TABLE["mps"].available
        assert "macOS" in TABLE["mps"].reason


def test_backends_returns_a_copy():
    jax_sgrnn.backends().clear()
    assert set(jax_sgrnn.backends()) == {"native", "mps", "cuda"}


@pytest.mark.parametrize("name,dtype,expected", [
    ("native", "float32", "float32"), ("native", "float64", "float64"),
    ("native", "float16", "float32"), ("native", "bfloat16", "float32"),
    ("mps", "float32", "float32"), ("mps", "float16", "float16"),
    ("mps", "bfloat16", "float32"),
])
def test_compute_dtype_policy(name, dtype, expected):
    assert TABLE[name].compute_dtype(jnp.dtype(dtype)) == np.dtype(jnp.dtype(expected))


def test_compute_dtype_refuses_what_a_backend_hands_off():
    with pytest.raises(ValueError, match="mps.*float64"):
        TABLE["mps"].compute_dtype(np.float64)


# --------------------------------------------------------------------- choosing a backend


def test_default_choice_is_auto():
    # conftest selects "native" for the suites; a fresh process shows the default.
    out = _child("import jax_sgrnn; print(jax_sgrnn.get_cpu_backend())")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "auto"


def test_auto_resolves_by_availability():
    expected = "mps" if MPS_RUNS_HERE else ("native" if TABLE["native"].available else None)
    gpu = ("cuda",) if TABLE["cuda"].available else ()  # the cuda platform's, whatever the choice
    with jax_sgrnn.cpu_backend("auto"):
        assert _backends.backends_for(np.float32) == ((expected,) if expected else ()) + gpu


@pytest.mark.skipif(MPS_RUNS_HERE, reason="MPSGraph is available here, so auto picks it")
@requires_native
def test_auto_picks_native_when_mps_is_unavailable(rng):
    with jax_sgrnn.cpu_backend("auto"):
        text = _forward_and_grad(make_inputs(rng, dtype=jnp.float32), {})
    assert TABLE["native"].targets["forward"] in text
    assert TABLE["mps"].targets["forward"] not in text


def test_cpu_backend_scopes_a_block_and_set_cpu_backend_sets_the_process():
    before = jax_sgrnn.get_cpu_backend()
    with jax_sgrnn.cpu_backend("scan"):
        assert jax_sgrnn.get_cpu_backend() == "scan"
        with jax_sgrnn.cpu_backend("mps"):
            assert jax_sgrnn.get_cpu_backend() == "mps"
        assert jax_sgrnn.get_cpu_backend() == "scan"
    assert jax_sgrnn.get_cpu_backend() == before
    echoed = jax_sgrnn.set_cpu_backend("auto")  # process-wide: other threads see it too
    try:
        assert repr(echoed) == "<set_cpu_backend('auto'): set process-wide>"
        seen = []
        thread = threading.Thread(target=lambda: seen.append(jax_sgrnn.get_cpu_backend()))
        thread.start()
        thread.join()
        assert jax_sgrnn.get_cpu_backend() == "auto" and seen == ["auto"]
    finally:
        jax_sgrnn.set_cpu_backend(before)


@pytest.mark.parametrize("setter, scoped, value", [("set_cpu_backend", "cpu_backend", "scan"),
                                                    ("use_cuda_handler", "cuda_handler", False)])
def test_a_process_wide_setter_in_a_with_statement_is_refused_and_undone(setter, scoped, value):
    option = _backends._cpu_backend if setter == "set_cpu_backend" else _backends._cuda_handler
    before = option.value
    with pytest.raises(TypeError, match=rf"not a context manager \(it was undone\).*"
                                        rf"jax_sgrnn\.{scoped}\({value!r}\)"):
        with getattr(jax_sgrnn, setter)(value):
            pass
    assert option.value == before


def _in_threads(*bodies):
    """Runs each body in its own thread, all started together; re-raises the first error."""
    errors = []

    def run(body):
        try:
            body()
        except BaseException as e:  # noqa: BLE001  (reported below)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(b,)) for b in bodies]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


@pytest.mark.parametrize("scoped, values, option", [
    ("cpu_backend", ("scan", "mps"), "_cpu_backend"),
    ("cuda_handler", (False, True), "_cuda_handler")])
def test_overlapping_blocks_in_two_threads_see_only_their_own_choice(scoped, values, option):
    """Two threads whose blocks overlap (entered and left in opposite orders) each see their
    own choice inside, the process's outside, and leave the process's choice as it was."""
    state = getattr(_backends, option)
    before = state.value
    first_in, second_in, second_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def first():
        with getattr(jax_sgrnn, scoped)(values[0]):
            first_in.set()
            second_in.wait(5)
            seen["first, both inside"] = state.value
            second_out.wait(5)
            seen["first, after second left"] = state.value
        seen["first, after"] = state.value

    def second():
        first_in.wait(5)
        with getattr(jax_sgrnn, scoped)(values[1]):
            second_in.set()
            seen["second, both inside"] = state.value
        second_out.set()
        seen["second, after"] = state.value

    _in_threads(first, second)
    assert seen == {"first, both inside": values[0], "first, after second left": values[0],
                    "first, after": before, "second, both inside": values[1],
                    "second, after": before}
    assert state.value == before


@requires_native
def test_a_trace_reads_the_choice_of_its_own_thread_and_cache_key(rng):
    """While one thread is inside `cpu_backend("scan")`, another traces and runs a function
    under the process's choice ("native"): it lowers the native custom call, is cached under
    "native", and keeps working afterwards; the first thread's function lowers the scan."""
    inputs = make_inputs(rng, LOOP_T, dtype=jnp.float32)
    f = jax.jit(lambda i: jax_sgrnn.single_gate_rnn(**i, activation="tanh"))
    scoped_in, traced = threading.Event(), threading.Event()
    texts = {}

    def scoped():
        with jax_sgrnn.cpu_backend("scan"):
            scoped_in.set()
            traced.wait(30)
            texts["scan"] = f.lower(inputs).as_text()

    def process_wide():
        scoped_in.wait(30)
        texts["native"] = f.lower(inputs).as_text()
        texts["result"] = f(inputs)
        traced.set()

    _in_threads(scoped, process_wide)
    assert TABLE["native"].targets["forward"] in texts["native"]
    assert not custom_calls(texts["scan"]) and "stablehlo.while" in texts["scan"]
    want = jax_sgrnn.reference(**inputs, activation="tanh")
    np.testing.assert_allclose(texts["result"], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(f(inputs), want, rtol=1e-5, atol=1e-6)  # the cached program


@pytest.mark.parametrize("bad", ["false", "0", "off", 0, 1, None])
def test_cuda_handler_switches_take_bools_only(bad):
    before = _backends._cuda_handler.value
    for switch in (jax_sgrnn.use_cuda_handler, jax_sgrnn.cuda_handler):
        with pytest.raises(TypeError, match=r"expected True or False, got " + re.escape(repr(bad))):
            switch(bad)
    assert _backends._cuda_handler.value == before


def test_set_cpu_backend_rejects_unknown_names():
    before = jax_sgrnn.get_cpu_backend()
    with pytest.raises(ValueError, match="set_cpu_backend: expected one of 'auto', 'native', "
                                         "'mps', 'scan', got 'metal'"):
        jax_sgrnn.set_cpu_backend("metal")
    assert jax_sgrnn.get_cpu_backend() == before


@requires_native
def test_the_choice_is_part_of_the_jit_cache_key(rng):
    """A jitted function is traced again when the choice changes, and runs what was chosen."""
    inputs = make_inputs(rng, LOOP_T, dtype=jnp.float32)
    traces = []

    @jax.jit
    def f(inputs):
        traces.append(jax_sgrnn.get_cpu_backend())
        return jax_sgrnn.single_gate_rnn(**inputs, activation="tanh")

    native = f(inputs)
    with jax_sgrnn.cpu_backend("scan"):
        scan = f(inputs)
        assert "stablehlo.while" in f.lower(inputs).as_text()
    again = f(inputs)
    assert traces[:2] == ["native", "scan"]
    np.testing.assert_allclose(scan, native, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(again, native)


def test_scan_lowers_the_decomposition_on_cpu(rng):
    with jax_sgrnn.cpu_backend("scan"):
        text = _forward_and_grad(make_inputs(rng, LOOP_T, dtype=jnp.float32), {})
    assert not custom_calls(text)
    assert "stablehlo.while" in text


def test_environment_variable_sets_the_default():
    out = _child("import jax_sgrnn; print(jax_sgrnn.get_cpu_backend())",
                 JAX_SGRNN_CPU_BACKEND="scan")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "scan"


def test_environment_variable_with_a_bad_value_names_itself():
    out = _child("import jax_sgrnn", JAX_SGRNN_CPU_BACKEND="gpu")
    assert out.returncode != 0
    assert "JAX_SGRNN_CPU_BACKEND: expected one of 'auto', 'native', 'mps', 'scan', got 'gpu'" \
        in out.stderr


# ------------------------------------------------------- the MPSGraph lowering, on any OS


def _normalised_calls(text: str, backend: str) -> list[str]:
    """The custom calls with the backend's target names replaced by their role."""
    calls = custom_calls(text)
    for role, target in TABLE[backend].targets.items():
        calls = [c.replace(f"@{target}", f"@<{role}>") for c in calls]
    return calls


@requires_native
@pytest.mark.parametrize("bi", [False, True], ids=["uni", "bi"])
@pytest.mark.parametrize("mask", [None, "bool"], ids=["nomask", "mask"])
def test_mps_lowering_has_the_native_operands_and_attributes(rng, bi, mask):
    inputs = make_inputs(rng, bidirectional=bi, mask=mask, dtype=jnp.float32)
    flags = dict(activation="sigmoid", bidirectional=bi, reverse=True)
    texts = {}
    for name in ("native", "mps"):
        with jax_sgrnn.cpu_backend(name):
            texts[name] = _forward_and_grad(inputs, flags)
    mps_calls = _normalised_calls(texts["mps"], "mps")
    assert len(mps_calls) == 2 and all("@<" in c for c in mps_calls), texts["mps"]
    assert mps_calls == _normalised_calls(texts["native"], "native")
    assert texts["native"].replace(TABLE["native"].targets["forward"], "F").replace(
        TABLE["native"].targets["gradients"], "G") == texts["mps"].replace(
        TABLE["mps"].targets["forward"], "F").replace(TABLE["mps"].targets["gradients"], "G")


@requires_native
def test_mps_lowering_of_the_gradients_op(rng):
    inputs = make_inputs(rng, dtype=jnp.float32)
    _, z = jax_sgrnn.reference(**inputs, training=True)

    def grads(i, dy, z):
        return jax_sgrnn.single_gate_rnn_gradients(
            i["source"], i["recurrent_weight"], dy, z, i["input_weight"], i["bias"],
            i["init_state"])

    calls = {}
    for name in ("native", "mps"):
        with jax_sgrnn.cpu_backend(name):
            calls[name] = _normalised_calls(lowered_text(grads, inputs, z, z), name)
    assert len(calls["mps"]) == 1 and "@<gradients>" in calls["mps"][0]
    assert calls["mps"] == calls["native"]


@requires_native
def test_float64_goes_to_native_whatever_is_chosen(rng):
    inputs = make_inputs(rng, dtype=jnp.float64)
    for name in ("auto", "native", "mps"):
        with jax_sgrnn.cpu_backend(name):
            text = _forward_and_grad(inputs, {})
        assert TABLE["native"].targets["forward"] in text, name
        assert TABLE["mps"].targets["forward"] not in text, name


@requires_native
@pytest.mark.parametrize("dtype,operand_type", [("float16", "f16"), ("bfloat16", "f32"),
                                                ("float32", "f32")])
def test_mps_dtype_policy_in_the_lowering(rng, dtype, operand_type):
    """float16 reaches the MPSGraph handler as float16 (Metal runs it); bfloat16 is widened."""
    inputs = make_inputs(rng, dtype=jnp.dtype(dtype))
    with jax_sgrnn.cpu_backend("mps"):
        text = lowered_text(lambda i: jax_sgrnn.single_gate_rnn(**i), inputs)
    (call,) = custom_calls(text)
    assert re.search(rf"tensor<4x3x5x{operand_type}>", call.split("->")[-1]), call


@pytest.mark.skipif(MPS_RUNS_HERE, reason="MPSGraph is available here")
@requires_native
def test_running_an_unavailable_backend_fails_naming_it(rng):
    inputs = make_inputs(rng, dtype=jnp.float32)
    with jax_sgrnn.cpu_backend("mps"):
        with pytest.raises(Exception, match=r"lowered for the 'mps' backend, whose handler is "
                                            r"not available in this process"):
            jax.block_until_ready(jax.jit(lambda i: jax_sgrnn.single_gate_rnn(**i))(inputs))


def _fake_cuda_plugin(tmp_path, monkeypatch, version: str):
    """A jax_sgrnn_cuda13 package of ``version`` without its extension module, importable."""
    package = tmp_path / "jax_sgrnn_cuda13"
    package.mkdir()
    (package / "__init__.py").write_text(f"__version__ = {version!r}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m.startswith("jax_sgrnn_cuda13")]:
        monkeypatch.delitem(sys.modules, name)


def test_a_cuda_plugin_of_another_release_is_refused(tmp_path, monkeypatch):
    _fake_cuda_plugin(tmp_path, monkeypatch, "0.0.1")
    module, reason = _backends._import_cuda_plugin()
    assert module is None
    assert f"0.0.1 does not match jax-sgrnn {jax_sgrnn.__version__}" in reason
    assert f'"jax-sgrnn[cuda13]=={jax_sgrnn.__version__}"' in reason


def test_a_cuda_plugin_without_its_module_says_so(tmp_path, monkeypatch):
    _fake_cuda_plugin(tmp_path, monkeypatch, jax_sgrnn.__version__)
    module, reason = _backends._import_cuda_plugin()
    assert module is None and "the extension module of jax_sgrnn_cuda13 did not import" in reason
