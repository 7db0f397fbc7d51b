"""The activations and their derivatives over the whole float range: within 4 ulp of a long
double computation in float32 and float64, in the selected instruction-set build and the
baseline one, and the reference's derivatives keep the tails (docs/semantics.md,
"Activations")."""

import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

import jax_sgrnn
from conftest import requires_native

op = jax_sgrnn.single_gate_rnn


# ------------------------------------------------- sigmoid and tanh over the whole range


def _truth(activation, z):
    """act(z) and act'(z) in long double, from formulas without cancellation."""
    z = z.astype(np.longdouble)
    if activation == "sigmoid":
        e = np.exp(-np.abs(z))
        return np.where(z >= 0, 1 / (1 + e), e / (1 + e)), e / (1 + e) ** 2
    e = np.exp(-2 * np.abs(z))
    return np.tanh(z), 4 * e / (1 + e) ** 2


ACCURACY_CHECK = """
import sys
import numpy as np, jax, jax_sgrnn
jax.config.update("jax_enable_x64", True)
activation, dtype, ulps = sys.argv[1], np.dtype(sys.argv[2]), float(sys.argv[3])
lim = 120 if dtype == np.float32 else 760
z = np.concatenate([np.linspace(-lim, lim, 100001), np.geomspace(1e-8, 1, 1001),
                    -np.geomspace(1e-8, 1, 1001)]).astype(dtype)
x, R = z.reshape(-1, 1, 1), np.zeros((1, 1), dtype)
y, zs = jax_sgrnn.single_gate_rnn(x, R, activation=activation, training=True)
(dx, _) = jax_sgrnn.single_gate_rnn_gradients(x, R, np.ones_like(x), zs, activation=activation)
L = np.longdouble
e = np.exp(-np.abs(z.astype(L)) * (1 if activation == "sigmoid" else 2))
want = ((np.where(z >= 0, 1 / (1 + e), e / (1 + e)), e / (1 + e) ** 2) if activation == "sigmoid"
        else (np.tanh(z.astype(L)), 4 * e / (1 + e) ** 2))
# The gradient op computes h = act(z) again, for dR (on the CPU by a formula of its own, shared
# with act'). With T = 2, R = 0, z[1] = 0 and dy = (0, 1): dR[i, j] = act'(0) h[0, j], and
# act'(0) (1 for tanh, 1/4 for sigmoid) scales exactly.
H = 2048
rows = np.concatenate([z, np.zeros(-len(z) % H, dtype)]).reshape(-1, H)
R2, dy2 = np.zeros((H, H), dtype), np.stack([np.zeros(H, dtype), np.ones(H, dtype)])[:, None]
grad_at_0 = 1.0 if activation == "tanh" else 0.25
h_back = []
for row in rows:
    x2 = np.stack([row, np.zeros(H, dtype)])[:, None]
    _, z2 = jax_sgrnn.single_gate_rnn(x2, R2, activation=activation, training=True)
    _, dR2 = jax_sgrnn.single_gate_rnn_gradients(x2, R2, dy2, z2, activation=activation)
    h_back.append(np.asarray(dR2)[0] / grad_at_0)
h_back = np.concatenate(h_back)[:len(z)]
# XLA's CPU threads flush subnormals, and intermediates of results near the smallest normal
# are subnormal: a few ulp is the claim from 4x the smallest normal up, |error| <= 4x tiny below.
floor = 4 * np.finfo(dtype).tiny
for name, got, truth in (("y", y, want[0]), ("dx", dx, want[1]), ("h in dR", h_back, want[0])):
    got = np.ravel(got).astype(L)
    big = np.abs(truth) >= floor
    err = np.abs(got[big] - truth[big]) / (np.abs(truth[big]) * np.finfo(dtype).eps)
    worst = int(np.argmax(err))
    assert err[worst] <= ulps, (name, float(err[worst]), float(z[big][worst]))
    assert np.all(np.abs(got[~big] - truth[~big]) <= floor), name
print("ok")
"""


def _accuracy_in_subprocess(activation, dtype, isa=None):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    if isa:
        env["SGRNN_CPU_ISA"] = isa
    out = subprocess.run([sys.executable, "-c", ACCURACY_CHECK, activation, dtype, "4"],
                         capture_output=True, text=True, env=env, cwd=os.path.dirname(__file__))
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


@requires_native
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("activation", ["sigmoid", "tanh"])
def test_activation_and_derivative_within_4_ulp_everywhere(activation, dtype):
    """The whole range, both tails included, for the forward's act(z), the gradient's act'(z)
    and the act(z) the gradient op computes again for dR: the handlers' sigmoid lost its
    negative tail (0.5 tanh(z/2) + 0.5 cancels: sigmoid(-16) was 0 in float32), and
    1 - tanh^2 and s (1 - s) cancel to 0 where the derivative is not 0."""
    _accuracy_in_subprocess(activation, dtype)


@requires_native
@pytest.mark.parametrize("activation", ["sigmoid", "tanh"])
def test_activation_accuracy_in_the_baseline_build(activation):
    """The build without FMA rounds differently: the same claim holds there."""
    _accuracy_in_subprocess(activation, "float32", isa="baseline")


def test_reference_derivatives_keep_the_tails():
    from jax_sgrnn.reference import activate_grad

    for activation in (jax_sgrnn.Activation.SIGMOID, jax_sgrnn.Activation.TANH):
        z = np.array([-60.0, -20.0, -3.0, 0.0, 3.0, 20.0, 60.0])
        got = np.asarray(activate_grad(activation, jnp.asarray(z)))
        want = _truth(activation.name.lower(), z)[1]
        np.testing.assert_allclose(got, want.astype(np.float64), rtol=1e-14)
        assert np.all(got > 0)
