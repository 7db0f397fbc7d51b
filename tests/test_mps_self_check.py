"""MPSGraph's self-check: its C++ (every fact detected, on any machine) and how the package acts
on its verdict: "auto" trusts MPSGraph only when it passed, an explicit "mps" warns, and
JAX_SGRNN_MPS_SELF_CHECK=0 turns it off.

No Metal device runs here, so the Python tests inject the check's report in place of the
extension's (``_backends._run_mps_self_check``) and mark the mps backend available; lowering
needs no device, so what each choice lowers to is checked for real.
"""

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sgrnn
from jax_sgrnn import _backends
from conftest import (assert_close, blas_flags, lowered_text, make_inputs, requires_native,
                      run_cpp_unit_test)

FACTS = ("activation", "optional_inputs", "reverse_time_order", "bidirectional_layout",
         "mask_not_flipped", "bias_gradient")


def test_self_check_unit_tests(tmp_path):
    """Every fact passes with the native kernels; each deliberately wrong runner fails exactly
    its own fact (tests/cpp/test_self_check.cc)."""
    log = run_cpp_unit_test(tmp_path, "tests/cpp/test_self_check.cc", "csrc/metal/self_check.cc",
                            "csrc/metal/mps_plan.cc", "csrc/cpu/kernels.cc",
                            "csrc/cpu/dispatch.cc", flags=("-O1", *blas_flags()))
    assert "relu where tanh was asked:\nactivation: failed" in log, log


def _report(failed_fact=None) -> dict:
    """A report as the extension returns it: every fact passed, or `failed_fact` failed and the
    facts that build on it not checked."""
    facts = {}
    for name in FACTS:
        facts[name] = dict(status="passed", statement=f"the statement of {name}",
                           worst_error=1e-6, tolerance=1e-4, where="tanh: y[0, 0, 0]",
                           comparisons=10)
    if failed_fact is not None:
        facts[failed_fact].update(status="failed", worst_error=0.75,
                                  where="reverse: y[3, 1, 2] = 0.5, expected -0.25")
    return dict(passed=failed_fact is None, failed_fact=failed_fact, problems=16,
                seconds=0.05, facts=facts)


@pytest.fixture
def fake_mps(monkeypatch):
    """Makes the mps backend available with a self-check that returns the report given to
    ``fake_mps(report)``; returns the list of the check's runs."""
    runs = []
    monkeypatch.delenv("JAX_SGRNN_MPS_SELF_CHECK", raising=False)
    monkeypatch.setitem(_backends._TABLE, "mps",
                        dataclasses.replace(_backends._TABLE["mps"], available=True, reason=None,
                                            device="Fake Metal GPU", self_check="not run"))
    monkeypatch.setattr(_backends, "_self_check_report", None)
    monkeypatch.setattr(_backends, "_self_check_warned", set())

    def install(report):
        def run():
            runs.append(report)
            return report
        monkeypatch.setattr(_backends, "_run_mps_self_check", run)
        return runs

    return install


def _cpu_choice(dtype=np.float32, seq_lengths=False):
    return _backends._cpu_backend_for(dtype, seq_lengths)


@requires_native
def test_auto_trusts_mps_after_a_passing_self_check(fake_mps):
    runs = fake_mps(_report())
    assert jax_sgrnn.backends()["mps"].self_check == "not run"
    with jax_sgrnn.cpu_backend("auto"), warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _cpu_choice() == ("mps",)
        assert _cpu_choice(np.float16) == ("mps",)
    assert len(runs) == 1  # once per process
    assert jax_sgrnn.backends()["mps"].self_check.startswith("passed (16 problems")


@requires_native
@pytest.mark.parametrize("fact", FACTS)
def test_auto_falls_back_to_native_and_warns_once_naming_the_fact(fake_mps, fact):
    runs = fake_mps(_report(fact))
    with jax_sgrnn.cpu_backend("auto"):
        with pytest.warns(RuntimeWarning) as caught:
            assert _cpu_choice() == ("native",)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # not again
            assert _cpu_choice(np.float16) == ("native",)
    assert len(runs) == 1
    (warning,) = caught
    text = str(warning.message)
    assert f"fact {fact!r} failed" in text and f"the statement of {fact}" in text
    assert "worst error 0.75 against a tolerance of 0.0001" in text
    assert "reverse: y[3, 1, 2] = 0.5, expected -0.25" in text
    assert "uses the native C++ handler instead" in text
    assert "jax_sgrnn.mps_self_check()" in text and "report it" in text
    verdict = jax_sgrnn.backends()["mps"].self_check
    assert verdict.startswith(f"failed: {fact} (worst error 0.75, tolerance 0.0001")


@requires_native
def test_auto_fallback_runs_the_native_handler(fake_mps, rng):
    fake_mps(_report("reverse_time_order"))
    inputs = make_inputs(rng, dtype=jnp.float32)
    with jax_sgrnn.cpu_backend("auto"), pytest.warns(RuntimeWarning, match="native"):
        text = lowered_text(lambda i: jax_sgrnn.single_gate_rnn(**i, reverse=True), inputs)
        y = jax.jit(lambda i: jax_sgrnn.single_gate_rnn(**i, reverse=True))(inputs)
    assert jax_sgrnn.backends()["native"].targets["forward"] in text
    assert jax_sgrnn.backends()["mps"].targets["forward"] not in text
    assert_close(y, jax_sgrnn.reference(**inputs, reverse=True), jnp.float32)


@requires_native
def test_explicit_mps_still_runs_mps_but_warns_the_same_words(fake_mps, rng):
    fake_mps(_report("mask_not_flipped"))
    inputs = make_inputs(rng, dtype=jnp.float32)
    with jax_sgrnn.cpu_backend("mps"), pytest.warns(RuntimeWarning) as caught:
        text = lowered_text(lambda i: jax_sgrnn.single_gate_rnn(**i), inputs)
    assert jax_sgrnn.backends()["mps"].targets["forward"] in text
    (warning,) = caught
    message = str(warning.message)
    assert "fact 'mask_not_flipped' failed" in message and "report it" in message
    assert "set_cpu_backend('mps') asked for it, so MPSGraph still runs" in message


@requires_native
def test_the_check_runs_only_when_mps_would_serve_the_call(fake_mps):
    runs = fake_mps(_report("activation"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with jax_sgrnn.cpu_backend("auto"):
            assert _cpu_choice(np.float64) == ("native",)  # handed to native: no check
            assert _cpu_choice(np.float32, seq_lengths=True) == ()  # the decomposition
        with jax_sgrnn.cpu_backend("native"):
            assert _cpu_choice() == ("native",)
    assert runs == []
    assert jax_sgrnn.backends()["mps"].self_check == "not run"


@requires_native
def test_environment_variable_turns_the_check_off(fake_mps, monkeypatch):
    runs = fake_mps(_report("bidirectional_layout"))
    monkeypatch.setenv("JAX_SGRNN_MPS_SELF_CHECK", "0")
    with jax_sgrnn.cpu_backend("auto"), warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _cpu_choice() == ("mps",)
    assert runs == []
    assert jax_sgrnn.backends()["mps"].self_check.startswith("off (JAX_SGRNN_MPS_SELF_CHECK=0")
    # Asked for explicitly, it still runs.
    assert jax_sgrnn.mps_self_check()["failed_fact"] == "bidirectional_layout"
    assert len(runs) == 1


def test_on_demand_check_reruns_and_updates_the_table(fake_mps):
    runs = fake_mps(_report())
    assert jax_sgrnn.mps_self_check()["passed"]
    assert jax_sgrnn.mps_self_check()["passed"]
    assert len(runs) == 1
    fake_mps(_report("bias_gradient"))
    report = jax_sgrnn.mps_self_check(rerun=True)
    assert report["failed_fact"] == "bias_gradient" and len(runs) == 2
    assert jax_sgrnn.backends()["mps"].self_check.startswith("failed: bias_gradient")


@pytest.mark.skipif(_backends._TABLE["mps"].available, reason="MPSGraph is available here")
def test_on_demand_check_without_mps_says_why():
    with pytest.raises(RuntimeError, match="cannot run here.*not available"):
        jax_sgrnn.mps_self_check()
    assert jax_sgrnn.backends()["mps"].self_check == "not run"
    assert jax_sgrnn.backends()["native"].self_check is None


def test_a_bad_off_switch_value_names_the_variable():
    from test_backends import _child

    out = _child("import jax_sgrnn", JAX_SGRNN_MPS_SELF_CHECK="no")
    assert out.returncode != 0
    assert "JAX_SGRNN_MPS_SELF_CHECK" in out.stderr and "'no'" in out.stderr
