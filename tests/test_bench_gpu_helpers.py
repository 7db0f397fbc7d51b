"""benchmarks/bench_gpu.py's own logic, checked on any machine: its hand-written peer computes
the op's function in every sweep configuration (so a ratio compares like with like), and its
census of an optimised program counts what the program launches."""

from __future__ import annotations

import pathlib
import sys

import numpy as np
import pytest

from conftest import requires_native

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_gpu  # noqa: E402

import jax_sgrnn  # noqa: E402


@pytest.mark.parametrize("D", [1, 2])
@pytest.mark.parametrize("activation", ["tanh", "relu"])
def test_plain_scan_is_the_op(D, activation):
    case = bench_gpu.Case(7, 3, 5, 4, D, activation)
    x, R, W, b, h0, _ = bench_gpu.problem(case)
    want = jax_sgrnn.reference(x, R, W, b, h0, activation=activation, bidirectional=D == 2)
    got = bench_gpu.plain_scan(x, R, W, b, h0, activation, bidirectional=D == 2)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_sweep_spans_the_grid():
    cases = bench_gpu.sweep_cases()
    assert {c.D for c in cases} == {1, 2} and {c.activation for c in cases} == {"tanh", "relu"}
    assert min(c.T for c in cases) == 50 and max(c.T for c in cases) >= 2000
    assert min(c.N for c in cases) == 1 and max(c.N for c in cases) == 1024
    assert min(c.H for c in cases) == 64 and max(c.H for c in cases) == 2048
    assert any(c.H % 32 for c in cases)


@pytest.mark.parametrize("spec, case", [
    ("100,32,256,256", bench_gpu.Case(100, 32, 256, 256)),
    ("50,32,1024,1024,relu", bench_gpu.Case(50, 32, 1024, 1024, 1, "relu")),
    ("50,1024,256,256,2,relu", bench_gpu.Case(50, 1024, 256, 256, 2, "relu")),
    ("50,1024,256,256,2", bench_gpu.Case(50, 1024, 256, 256, 2)),
])
def test_shapes_name_directions_and_activation(spec, case):
    assert bench_gpu.Case.parse(spec) == case


@pytest.mark.parametrize("spec", ["100,32,256", "50,32,64,64,3", "50,32,64,64,sigmoid",
                                  "50,32,64,64,2,relu,1", "50,-1,64,64"])
def test_bad_shapes_are_refused(spec):
    with pytest.raises(ValueError, match="T,N,I,H"):
        bench_gpu.Case.parse(spec)


def test_command_line_cases():
    given = bench_gpu.Case(50, 1024, 2048, 2048)
    assert bench_gpu.chosen_cases(["50,1024,2048,2048"], True, None) == [given]
    assert bench_gpu.chosen_cases(["50,1024,2048,2048"], False, None) == [given]
    assert bench_gpu.chosen_cases(None, True, None) == bench_gpu.sweep_cases()
    assert {c.H for c in bench_gpu.chosen_cases(None, True, [700])} == {700}
    assert len(bench_gpu.chosen_cases(None, False, None)) == 5
    for shapes, sweep, hidden in ((None, False, [700]), (["50,1024,2048,2048"], True, [700])):
        with pytest.raises(ValueError, match="--sweep-hidden"):
            bench_gpu.chosen_cases(shapes, sweep, hidden)


@requires_native
def test_census_counts_launches():
    case = bench_gpu.Case(6, 2, 3, 4)
    with jax_sgrnn.cpu_backend("native"):
        timed = bench_gpu.contenders(case, ("fwd", "fwd+bwd"), False, False)
    op, plain = timed["op"].compiled, timed["plain"].compiled
    assert bench_gpu.census(op["fwd"].as_text()) == {"custom-call jax_sgrnn_forward": 1}
    grad = bench_gpu.census(op["fwd+bwd"].as_text())
    assert grad["custom-call jax_sgrnn_forward"] == grad["custom-call jax_sgrnn_gradients"] == 1
    assert bench_gpu.census(plain["fwd"].as_text())["while"] == 1


def test_census_descends_into_called_computations():
    hlo = """HloModule m

%buffer (p: f32[2]) -> f32[2] {
  %p = f32[2]{0} parameter(0)
  ROOT %f = f32[2]{0} fusion(%p), kind=kLoop, calls=%fused
}

ENTRY %main (a: f32[2]) -> f32[2] {
  %a = f32[2]{0} parameter(0)
  %c = f32[2]{0} call(%a), to_apply=%buffer
  %g = (f32[2]{0}, s8[4]{0}) custom-call(%c), custom_call_target="__cublas$gemm"
  %e = f32[2]{0} get-tuple-element(%g), index=0
  ROOT %t = f32[2]{0} copy(%e)
}
"""
    assert bench_gpu.census(hlo) == {"fusion": 1, "custom-call __cublas$gemm": 1, "copy": 1}


def test_back_to_back_waits_once_for_the_last_call():
    calls, waits = [], []
    contender = bench_gpu.Contender({"fwd": lambda: calls.append(1) or len(calls)}, waits.append)
    contender.timer("fwd", "b2b", 5)()
    contender.timer("fwd", "waited", 5)()
    assert len(calls) == 6 and waits == [5, 6]
    assert contender.timer("jvp", "b2b", 5) is None


def test_sweep_hidden_keeps_exactly_those_points():
    grid = bench_gpu.sweep_cases()
    kept = bench_gpu.sweep_cases([2048, 700])
    assert kept == [c for c in grid if c.H in (700, 2048)] and len(kept) == 8
    assert bench_gpu.sweep_cases(None) == grid
    with pytest.raises(ValueError, match=r"\[512\] not in the sweep's grid"):
        bench_gpu.sweep_cases([700, 512])


@pytest.mark.parametrize("argv, error", [
    (["--sweep", "--sweep-hidden", "512"], "error: hidden size(s) [512] not in the sweep's grid"),
    (["--sweep-hidden", "700"], "error: --sweep-hidden needs --sweep"),
])
def test_sweep_hidden_is_checked_before_anything_runs(argv, error, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench_gpu.main(argv)
    assert exit_.value.code == 2 and error in capsys.readouterr().err
