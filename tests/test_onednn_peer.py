"""benchmarks/onednn_rnn.py, the oneDNN peer of bench_cpu.py, computes the op's function: its
states and every gradient match the reference, so a ratio against it compares like with like.
Skipped where no oneDNN library is found (`pip install onednn`, or $ONEDNN_LIBRARY)."""

from __future__ import annotations

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import onednn_rnn  # noqa: E402

import jax_sgrnn  # noqa: E402

LIBRARY = onednn_rnn.library_path()
pytestmark = pytest.mark.skipif(LIBRARY is None, reason="no oneDNN library found")


@pytest.mark.parametrize("activation", ["tanh", "relu"])
@pytest.mark.parametrize("T,N,I,H", [(7, 3, 5, 4), (12, 4, 16, 33)])
def test_onednn_peer_is_the_op(T, N, I, H, activation):
    rng = np.random.default_rng(T * N + H)
    f32 = lambda *s: rng.uniform(-0.5, 0.5, s).astype(np.float32)
    x, R, W, b, h0, c = f32(T, N, I), f32(H, H), f32(H, I), f32(H), f32(N, H), f32(T, N, H)
    peer = onednn_rnn.OneDnnRnn(onednn_rnn.load_library(LIBRARY), x, R, W, b, h0, c,
                                activation=activation)
    peer.forward()
    np.testing.assert_allclose(
        peer.y(), jax_sgrnn.reference(x, R, W, b, h0, activation=activation),
        rtol=1e-5, atol=1e-6)
    peer.forward_backward()
    loss = lambda *a: jnp.sum(jax_sgrnn.reference(*a, activation=activation) * c)
    want = jax.grad(loss, argnums=(0, 1, 2, 3, 4))(x, R, W, b, h0)
    for name, got, w in zip(("dx", "dR", "dW", "db", "dh0"), peer.gradients(), want):
        np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-5, err_msg=name)
