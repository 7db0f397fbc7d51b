"""The examples run in-process with small flags: the loss goes down, the outputs are written,
and ``--impl op`` and ``--impl reference`` follow the same loss trajectory."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys
from types import ModuleType

import jax
import numpy as np
import pytest

for module in ("flax", "optax", "tqdm", "matplotlib", "sklearn"):
    pytest.importorskip(module)

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"

CHAR_FLAGS = ["--steps", "40", "--batch", "8", "--seq-len", "32", "--embed", "16",
              "--hidden", "32", "--layers", "2", "--dropout", "0.1", "--val-every", "20",
              "--sample-length", "20", "--quiet"]
DIGITS_FLAGS = ["--epochs", "4", "--hidden", "16", "--quiet"]


def load_example(name: str) -> ModuleType:
    """Imports ``examples/<name>.py`` (the examples are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def char_rnn_logs(tmp_path_factory) -> dict:
    """The char-RNN example's log and output directory for each implementation."""
    example = load_example("train_char_rnn")
    runs = {}
    for impl in ("op", "reference"):
        out = tmp_path_factory.mktemp(f"char_rnn_{impl}")
        runs[impl] = (example.main([*CHAR_FLAGS, "--impl", impl, "--out-dir", str(out)]), out)
    return runs


@pytest.fixture(scope="module", params=["fixed", "variable"],
                ids=["fixed-length", "variable-length"])
def digits_logs(request, tmp_path_factory) -> dict:
    """The digits example's log and output directory for each implementation, on whole images
    or (``--variable-length``) on images cut to 4-8 rows and padded, with seq_lengths."""
    example = load_example("classify_digits")
    extra = ["--variable-length"] if request.param == "variable" else []
    runs = {}
    for impl in ("op", "reference"):
        out = tmp_path_factory.mktemp(f"digits_{impl}")
        runs[impl] = (example.main([*DIGITS_FLAGS, *extra, "--impl", impl, "--out-dir",
                                    str(out)]), out)
    return runs


def test_char_rnn_learns_and_writes_its_outputs(char_rnn_logs):
    log, out = char_rnn_logs["op"]
    bits = np.asarray(log["train_bits"])
    assert len(bits) == 40 and np.isfinite(bits).all()
    assert bits[-10:].mean() < bits[:10].mean() - 0.5
    assert [v["step"] for v in log["val"]] == [20, 40]
    assert log["val"][1]["bits"] < log["val"][0]["bits"]
    assert log["vocab_size"] > 90 and log["text_chars"] > 100_000
    assert 4.0 < log["unigram_entropy_bits"] < 5.5
    assert log["chars_per_sec"] > 0
    assert log["sample"].startswith("The ") and len(log["sample"]) == len("The ") + 20
    assert json.loads((out / "char_rnn_log.json").read_text())["train_bits"] == log["train_bits"]
    assert (out / "char_rnn_loss.png").read_bytes().startswith(b"\x89PNG")


def test_char_rnn_op_and_reference_follow_the_same_trajectory(char_rnn_logs):
    op, ref = (char_rnn_logs[impl][0] for impl in ("op", "reference"))
    np.testing.assert_allclose(op["train_bits"], ref["train_bits"], rtol=1e-4)
    np.testing.assert_allclose([v["bits"] for v in op["val"]],
                               [v["bits"] for v in ref["val"]], rtol=1e-4)


def test_char_rnn_on_two_devices_follows_the_one_device_trajectory(char_rnn_logs, tmp_path):
    """``--devices 2`` (data-parallel over two host devices, in a subprocess: the device
    count is fixed when JAX starts) trains like one device: same batches, same sums."""
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               JAX_ENABLE_X64=str(int(jax.config.jax_enable_x64)),  # as in this process
               XLA_FLAGS=os.environ.get("XLA_FLAGS", "")
               + " --xla_force_host_platform_device_count=2")
    run = subprocess.run([sys.executable, str(EXAMPLES / "train_char_rnn.py"), *CHAR_FLAGS,
                          "--impl", "op", "--devices", "2", "--out-dir", str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    two = json.loads((tmp_path / "char_rnn_log.json").read_text())
    one = char_rnn_logs["op"][0]
    np.testing.assert_allclose(two["train_bits"], one["train_bits"], rtol=1e-4)
    np.testing.assert_allclose([v["bits"] for v in two["val"]],
                               [v["bits"] for v in one["val"]], rtol=1e-4)


def test_char_rnn_refuses_more_devices_than_there_are(capsys):
    with pytest.raises(SystemExit):
        load_example("train_char_rnn").parse_args(["--devices", "1000"])
    assert "--devices 1000" in capsys.readouterr().err


def test_digits_learns_and_writes_its_outputs(digits_logs):
    log, out = digits_logs["op"]
    epochs = log["epoch_losses"]
    assert len(epochs) == 4 and epochs[-1] < 0.7 * epochs[0]
    assert log["test_accuracy"] > 0.5  # 4 small epochs; the default run is above 95%
    matrix = np.asarray(log["confusion_matrix"])
    assert matrix.shape == (10, 10) and matrix.sum() == log["test_size"]
    assert np.trace(matrix) == round(log["test_accuracy"] * log["test_size"])
    assert (out / "digits_confusion.png").read_bytes().startswith(b"\x89PNG")
    assert json.loads((out / "digits_log.json").read_text())["losses"] == log["losses"]


def test_digits_op_and_reference_follow_the_same_trajectory(digits_logs):
    op, ref = (digits_logs[impl][0] for impl in ("op", "reference"))
    np.testing.assert_allclose(op["losses"], ref["losses"], rtol=1e-4)
    assert op["test_accuracy"] == pytest.approx(ref["test_accuracy"], abs=1 / op["test_size"])
