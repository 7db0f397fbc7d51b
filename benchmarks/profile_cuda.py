"""Runs the op's jitted forward and forward+backward once each on one shape, after warm-up, so
that a profiler (ncu, nsys) sees exactly those kernels. For reading the CUDA handler's kernels:

    ncu --clock-control none -k regex:Kernel --launch-skip 4 --launch-count 2 \\
        python benchmarks/profile_cuda.py 1000,8,128,128
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

import jax_sgrnn
from bench_cpu import problem

T, N, I, H = map(int, (sys.argv[1] if len(sys.argv) > 1 else "1000,8,128,128").split(","))
x, R, W, b, h0, c = problem(T, N, I, H)
fwd = jax.jit(lambda *a: jax_sgrnn.single_gate_rnn(*a, activation="tanh"))
grad = jax.jit(jax.grad(lambda *a: jnp.sum(jax_sgrnn.single_gate_rnn(*a, activation="tanh") * c),
                        argnums=(0, 1)))
for _ in range(3):  # warm-up: 2 kernel launches per forward+backward, 1 per forward
    fwd(x, R, W, b, h0).block_until_ready()
    jax.block_until_ready(grad(x, R, W, b, h0))
fwd(x, R, W, b, h0).block_until_ready()
jax.block_until_ready(grad(x, R, W, b, h0))
