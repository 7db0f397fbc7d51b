"""The op on several devices: batch-sharded inputs partition the custom calls (no gather of the
sequences, one all-reduce for the weight gradients), other shardings still give correct
results, and the op works inside a user's shard_map.

The checks run in one subprocess (``sharding_checks.py``) with four host CPU devices, which
must be requested before JAX starts; each test here asserts on its check's report.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

import jax_sgrnn

CHECKS_SCRIPT = pathlib.Path(__file__).resolve().parent / "sharding_checks.py"
PACKAGE_ROOT = str(pathlib.Path(jax_sgrnn.__file__).resolve().parent.parent)


@pytest.fixture(scope="module")
def reports() -> dict:
    """Every check's report: its HLO facts, or ``{"error": traceback}``."""
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join(filter(None, [PACKAGE_ROOT,
                                                        os.environ.get("PYTHONPATH")])))
    run = subprocess.run([sys.executable, str(CHECKS_SCRIPT)], env=env, capture_output=True,
                         text=True, timeout=600)
    if run.returncode != 0:
        pytest.fail(f"sharding_checks.py exited with {run.returncode}:\n{run.stderr[-4000:]}")
    out = json.loads(run.stdout.strip().splitlines()[-1])
    if "skip" in out:
        pytest.skip(f"the subprocess could not run the checks: {out['skip']}")
    return out


def report(reports: dict, name: str) -> dict:
    facts = reports[name]
    if "error" in facts:
        pytest.fail(facts["error"])
    return facts


def assert_partitioned(facts: dict, forward_calls: int, gradient_calls: int) -> None:
    """The custom calls run on each device's batch rows: nothing is gathered or shuffled."""
    assert facts["forward_calls"] == forward_calls, facts
    assert facts["gradient_calls"] == gradient_calls, facts
    assert facts["all_gather"] == facts["all_to_all"] == facts["collective_permute"] == 0, facts


def assert_one_weight_gradient_all_reduce(facts: dict, weight_gradients: list[str]) -> None:
    """Exactly one all-reduce, XLA's combination of the three weight gradients' psums (dR,
    dW, db; each with the group axis G = 1), and nothing else."""
    assert facts["all_reduce"] == 1, facts
    reduced = facts["all_reduce_types"][0]
    assert sorted(reduced.strip("()").split(", ")) == sorted(weight_gradients), reduced


UNI = ["f64[1,4,4]{2,1,0}", "f64[1,4,3]{2,1,0}", "f64[1,4]{1,0}"]
BI = ["f64[1,2,4,4]{3,2,1,0}", "f64[1,8,3]{2,1,0}", "f64[1,8]{1,0}"]


def test_forward_keeps_the_batch_split(reports):
    facts = report(reports, "forward_1d")
    assert_partitioned(facts, 1, 0)
    assert facts["all_reduce"] == 0


def test_training_forward_returns_y_and_z_split(reports):
    facts = report(reports, "training_forward_1d")
    assert_partitioned(facts, 1, 0)
    assert facts["all_reduce"] == 0


@pytest.mark.parametrize("check, weight_gradients", [
    ("grad_1d", UNI),
    ("grad_1d_float32", [t.replace("f64", "f32") for t in UNI]),
    ("grad_bidirectional_masked_1d", BI),
    ("grad_reverse_batch_broadcast_mask_1d", UNI),
    ("grad_2x2_batch_over_both_axes", UNI),
    ("grad_2x2_batch_over_one_axis", BI),
    ("grad_with_seq_lengths_1d", BI),
    ("grad_1d_gspmd", UNI),
])
def test_grad_with_the_batch_split(reports, check, weight_gradients):
    facts = report(reports, check)
    if "skipped" in facts:
        pytest.skip(facts["skipped"])
    assert_partitioned(facts, 1, 1)
    assert_one_weight_gradient_all_reduce(facts, weight_gradients)


def test_gradient_op_called_directly(reports):
    facts = report(reports, "gradient_op_direct")
    assert_partitioned(facts, 0, 1)
    assert_one_weight_gradient_all_reduce(facts, BI)


def test_vmap_of_grad_splits_the_group_axis_without_communication(reports):
    facts = report(reports, "vmap_per_example_grads")
    assert_partitioned(facts, 1, 1)
    assert facts["all_reduce"] == 0  # per-example weight gradients: nothing to sum


@pytest.mark.parametrize("check", ["grad_time_sharded", "grad_time_and_batch_sharded_2x2"])
def test_unsupported_shardings_are_resharded_and_correct(reports, check):
    facts = report(reports, check)
    assert facts["forward_calls"] == facts["gradient_calls"] == 1
    assert facts["all_gather"] > 0  # the time split is undone before the custom calls


@pytest.mark.parametrize("vma", ["checked", "unchecked"])
def test_inside_a_user_shard_map(reports, vma):
    """With check_vma JAX sums the unvarying weights' gradients; without, the user does: one
    all-reduce of the public op's gradients (no group axis) either way."""
    facts = report(reports, "inside_shard_map")[vma]
    assert_partitioned(facts, 1, 1)
    assert_one_weight_gradient_all_reduce(
        facts, ["f64[4,4]{1,0}", "f64[4,3]{1,0}", "f64[4]{0}"])


@pytest.mark.parametrize("name", ["explicit_batch_sharded",
                                  "explicit_batch_sharded_bidirectional_scan",
                                  "explicit_batch_sharded_gpu_form"])
def test_explicit_sharding_gives_the_one_device_results_sharded_by_batch(reports, name):
    """AxisType.Explicit meshes and jax.set_mesh: forward, jax.grad of the op and of the
    reference, and a Hessian (the reference's GPU loops: its forward and gradient op), each
    equal to one device's; y keeps the batch sharding."""
    facts = report(reports, name)
    assert facts["y_spec"] == [None, "batch", None], facts


def test_explicit_sharding_of_the_time_axis(reports):
    """A time-sharded source under explicit sharding: the same results (the steps are gathered
    for the recurrence); y is not sharded along time."""
    facts = report(reports, "explicit_time_sharded")
    assert facts["source_spec"] == ["batch", None, None], facts
    assert facts["y_spec"] == [None, None, None], facts


def test_export_of_a_program_on_several_devices(reports):
    """jax.export of a sharded program serialises and runs: custom_partitioning's callback
    cannot be serialised, so there the op lowers to its decomposition, which XLA partitions."""
    facts = report(reports, "export_several_devices")
    assert facts == {"devices": 4, "custom_calls": 0}, facts
