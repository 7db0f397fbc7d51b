"""The CPU kernels' phase counters that benchmarks/bench_cpu.py reads: off by default, every
phase counted when on, reset by reading."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from conftest import make_inputs, requires_native

pytestmark = requires_native


def test_phase_counters(native_backend, rng):
    from jax_sgrnn import _sgrnn_cpu, single_gate_rnn

    inputs = make_inputs(rng, 20, 4, 3, 8, dtype=jnp.float32)
    grad = jax.jit(jax.grad(lambda x: jnp.sum(single_gate_rnn(**{**inputs, "source": x}))))
    grad(inputs["source"]).block_until_ready()
    _sgrnn_cpu.take_phase_times()
    grad(inputs["source"]).block_until_ready()
    assert set(_sgrnn_cpu.take_phase_times().values()) == {0.0}, "counting while off"

    _sgrnn_cpu.set_phase_timing(True)
    try:
        grad(inputs["source"]).block_until_ready()
        times = _sgrnn_cpu.take_phase_times()
    finally:
        _sgrnn_cpu.set_phase_timing(False)
    assert set(times) == {"projection", "recurrence", "backward_recurrence", "weight_gradients",
                          "input_gradient"}
    assert all(t > 0 for t in times.values()), times
    assert all(t == 0 for t in _sgrnn_cpu.take_phase_times().values()), "reading resets"


@pytest.mark.parametrize("on", [True, False])
def test_phase_timing_leaves_results_alone(native_backend, rng, on):
    from jax_sgrnn import _sgrnn_cpu, reference, single_gate_rnn

    inputs = make_inputs(rng, 6, 3, 2, 5)
    _sgrnn_cpu.set_phase_timing(on)
    try:
        y = single_gate_rnn(**inputs, activation="tanh")
    finally:
        _sgrnn_cpu.set_phase_timing(False)
    assert jnp.allclose(y, reference(**inputs, activation="tanh"), rtol=1e-10, atol=1e-12)
