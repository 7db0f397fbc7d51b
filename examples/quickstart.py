"""Quickstart: the single-gate RNN through the C++ custom call and through lax.scan.

Builds a small tanh RNN problem, runs the forward pass and jax.grad both ways, prints how
closely they agree and how much faster the custom call is.

    python examples/quickstart.py
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_sgrnn


def median_ms(fn, min_runs: int = 30, min_seconds: float = 0.5) -> float:
    """Median time of `fn` over at least `min_runs` runs and `min_seconds`, after warm-up."""
    for _ in range(3):
        jax.block_until_ready(fn())  # compile and warm up
    times = []
    while len(times) < min_runs or sum(times) < min_seconds:
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    T, N, I, H = 100, 16, 64, 64
    keys = jax.random.split(jax.random.key(0), 6)
    bound = 1 / np.sqrt(H)
    uniform = lambda k, shape: jax.random.uniform(k, shape, jnp.float32, -bound, bound)
    params = dict(recurrent_weight=uniform(keys[0], (H, H)), input_weight=uniform(keys[1], (H, I)),
                  bias=uniform(keys[2], (H,)))
    x = jax.random.normal(keys[3], (T, N, I))
    h0 = jax.random.normal(keys[4], (N, H))
    target = jax.random.normal(keys[5], (T, N, H))
    print(f"single-gate RNN, tanh: T={T} N={N} I={I} H={H}, float32; "
          f"native platforms: {jax_sgrnn.NATIVE_PLATFORMS or 'none'}")

    def loss(params, rnn):
        y = rnn(x, params["recurrent_weight"], params["input_weight"], params["bias"], h0,
                activation="tanh")
        return jnp.mean((y - target) ** 2)

    results = {}
    for name, rnn in (("custom call", jax_sgrnn.single_gate_rnn), ("lax.scan", jax_sgrnn.reference)):
        forward = jax.jit(lambda p, rnn=rnn: loss(p, rnn))
        grad = jax.jit(jax.grad(lambda p, rnn=rnn: loss(p, rnn)))
        results[name] = dict(loss=forward(params), grads=grad(params),
                             fwd_ms=median_ms(lambda: forward(params)),
                             grad_ms=median_ms(lambda: grad(params)))

    op, ref = results["custom call"], results["lax.scan"]
    print(f"loss: custom call {float(op['loss']):.7f}, lax.scan {float(ref['loss']):.7f}")
    for k in params:
        a, b = op["grads"][k], ref["grads"][k]
        rel = float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
        print(f"d loss / d {k:<17} relative difference {rel:.1e}")
        assert rel < 1e-4, f"custom call and reference disagree on {k}"
    print("custom call and lax.scan agree")
    for label, key in (("forward", "fwd_ms"), ("forward+backward", "grad_ms")):
        print(f"{label:>17}: custom call {op[key]:.3f} ms, lax.scan {ref[key]:.3f} ms "
              f"-> {ref[key] / op[key]:.2f}x")


if __name__ == "__main__":
    main()
