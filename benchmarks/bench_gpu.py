"""GPU benchmark: jax_sgrnn's op vs a plain hand-written ``lax.scan`` RNN vs PyTorch ``nn.RNN``
(cuDNN), in one process on one GPU.

Forward, forward+backward (gradients for x, R, W, b and h0) and jvp (a tangent for each of
them; JAX contenders only); tanh, with input weight, bias and initial state. Median of repeated runs after warm-up (``block_until_ready`` for JAX,
``torch.cuda.synchronize`` for PyTorch). Two tables: float32 with TF32 off for all three
(``jax_default_matmul_precision="highest"``, PyTorch's ``allow_tf32`` flags off), then TF32
allowed. "op" is the op through its CUDA handler (where the package was built with it);
"decomp" is the same op with the handler off (``jax_sgrnn.use_cuda_handler(False)``): its
``lax.scan`` decomposition, what ROCm, TPU and jax-metal users get; "plain" is the minimal scan
a user would write (projection outside, ``h = tanh(x'_t + h R^T)`` inside). The ratios compare
the op with the faster of plain and cuDNN (the issue's target: >= 1.5x), and the decomposition
with plain (target: <= 1).

    python benchmarks/bench_gpu.py               # the five issue shapes
    python benchmarks/bench_gpu.py --shapes 100,32,256,256 --json gpu.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
from jax import lax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_cpu import problem, time_stats  # noqa: E402  (same data, same timing rule)

import jax_sgrnn  # noqa: E402

DEFAULT_SHAPES = ["100,32,256,256", "200,64,512,512", "100,256,1024,1024", "1000,8,128,128",
                  "50,1024,256,256"]


def plain_scan(x, R, W, b, h0, activation="tanh"):
    """The RNN as a user would write it with lax.scan."""
    del activation  # tanh, as the op is called here
    xp = x @ W.T + b

    def step(h, x_t):
        h = jnp.tanh(x_t + h @ R.T)
        return h, h

    return lax.scan(step, h0, xp)[1]


def jax_timers(rnn, args, c):
    """(forward, forward+backward, jvp) callables that block until done, compiled now (under
    the settings in force now, e.g. ``use_cuda_handler``); the jvp perturbs every input."""
    fwd = jax.jit(lambda *a: rnn(*a, activation="tanh")).lower(*args).compile()
    grad = jax.jit(jax.grad(lambda *a: jnp.sum(rnn(*a, activation="tanh") * c),
                            argnums=(0, 1, 2, 3, 4))).lower(*args).compile()
    tangents = tuple(0.5 * a for a in args)
    jvp = jax.jit(lambda p, t: jax.jvp(lambda *a: rnn(*a, activation="tanh"), p, t)).lower(
        args, tangents).compile()
    return (lambda: fwd(*args).block_until_ready(),
            lambda: jax.block_until_ready(grad(*args)),
            lambda: jax.block_until_ready(jvp(args, tangents)))


def torch_timers(args, c):
    import numpy as np
    import torch

    x, R, W, b, h0 = (torch.from_numpy(np.array(a)).cuda() for a in args)
    rnn = torch.nn.RNN(x.shape[2], R.shape[0], nonlinearity="tanh").cuda()
    with torch.no_grad():
        rnn.weight_ih_l0.copy_(W), rnn.weight_hh_l0.copy_(R), rnn.bias_ih_l0.copy_(b)
        rnn.bias_hh_l0.zero_()
    x.requires_grad_(True)
    h0 = h0[None].requires_grad_(True)
    ct = torch.from_numpy(np.array(c)).cuda()

    def fwd():
        with torch.no_grad():
            rnn(x, h0)
        torch.cuda.synchronize()

    def fwd_bwd():
        rnn.zero_grad(set_to_none=True)
        x.grad = h0.grad = None
        y, _ = rnn(x, h0)
        y.backward(ct)
        torch.cuda.synchronize()

    return fwd, fwd_bwd, None  # the jvp is timed for the JAX contenders only


def set_tf32(allowed: bool) -> None:
    jax.config.update("jax_default_matmul_precision", None if allowed else "highest")
    try:
        import torch

        torch.backends.cuda.matmul.allow_tf32 = allowed
        torch.backends.cudnn.allow_tf32 = allowed
    except ImportError:
        pass


def run_table(shapes, repeats: int, have_torch: bool, title: str) -> list[dict]:
    print(f"\n{title}")
    print(f"{'T,N,I,H':>18} {'pass':>8} {'op ms':>8} {'decomp':>8} {'plain':>8} {'torch':>8} "
          f"{'best/op':>8} {'decomp/plain':>12}")
    rows = []
    for spec in shapes:
        T, N, I, H = map(int, spec.split(","))
        x, R, W, b, h0, c = problem(T, N, I, H)
        args = (x, R, W, b, h0)
        timers = {"op": jax_timers(jax_sgrnn.single_gate_rnn, args, c),
                  "plain": jax_timers(plain_scan, args, c)}
        with jax_sgrnn.cuda_handler(False):
            timers["decomp"] = jax_timers(jax_sgrnn.single_gate_rnn, args, c)
        if have_torch:
            timers["torch"] = torch_timers(args, c)
        for i, name in enumerate(("fwd", "fwd+bwd", "jvp")):
            ms = {k: 1e3 * time_stats(v[i], repeats)["median"] for k, v in timers.items()
                  if v[i]}
            row = dict(shape=[T, N, I, H], pass_=name, **{f"{k}_ms": v for k, v in ms.items()})
            rows.append(row)
            best = min(ms["plain"], ms.get("torch", float("inf")))
            torch_ms = f"{ms['torch']:8.2f}" if "torch" in ms else f"{'-':>8}"
            print(f"{spec:>18} {name:>8} {ms['op']:8.2f} {ms['decomp']:8.2f} {ms['plain']:8.2f} "
                  f"{torch_ms} {best / ms['op']:7.2f}x {ms['decomp'] / ms['plain']:11.2f}x",
                  flush=True)
    return rows


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, help="T,N,I,H ...")
    parser.add_argument("--repeats", type=int, default=20, help="minimum timed runs")
    parser.add_argument("--tables", nargs="+", default=["float32", "tf32"],
                        choices=["float32", "tf32"], help="which tables to measure")
    parser.add_argument("--json", help="also write the tables to this file")
    args = parser.parse_args(argv)
    if jax.default_backend() != "gpu":
        raise SystemExit(f"no GPU: jax's default backend is {jax.default_backend()!r}")
    try:
        import torch

        have_torch = torch.cuda.is_available()
        versions = f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}"
    except ImportError:
        have_torch, versions = False, "no torch"
    device = jax.devices()[0].device_kind
    print(f"{time.strftime('%Y-%m-%d')}; {device}; jax {jax.__version__}; {versions}; "
          f"median of >= {args.repeats} runs after warm-up; best/op > 1 means the op is faster "
          f"than both plain scan and cuDNN")
    out = dict(device=device, jax=jax.__version__, versions=versions,
               date=time.strftime("%Y-%m-%d"))
    for key in args.tables:
        tf32 = key == "tf32"
        set_tf32(tf32)
        out[key] = run_table(args.shapes, args.repeats, have_torch,
                             "float32, TF32 allowed" if tf32 else "float32, TF32 off")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
