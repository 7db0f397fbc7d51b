"""Runs the op's jitted forward and forward+backward (gradients for x, R, W, b and h0) on one
shape, after warm-up. Without flags, once each, so that a profiler (ncu, nsys) sees exactly
those kernels:

    ncu --clock-control none -k regex:Kernel --launch-skip 4 --launch-count 2 \\
        python benchmarks/profile_cuda.py 1000,8,128,128

With --timeline, K calls of each back to back under jax.profiler, and prints the GPU timeline
of one call: every kernel with its duration and the idle time before it, and per call the span
from the first kernel's start to the last's end, the time kernels ran and the idle rest.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import pathlib
import sys
import tempfile

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_cpu import problem  # noqa: E402  (the same data as the benchmarks)

import jax_sgrnn  # noqa: E402


def gpu_events(trace_dir: str) -> list[dict]:
    """The busiest GPU stream's events of the perfetto trace in trace_dir, in time order."""
    path = glob.glob(f"{trace_dir}/**/*perfetto_trace.json.gz", recursive=True)[0]
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    process = {e["pid"]: e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "process_name"}
    on_gpu = [e for e in events if e.get("ph") == "X" and "GPU" in process.get(e["pid"], "")]
    if not on_gpu:
        raise SystemExit("the trace has no GPU events (no GPU, or no CUPTI)")
    busiest = collections.Counter((e["pid"], e["tid"]) for e in on_gpu).most_common(1)[0][0]
    return sorted((e for e in on_gpu if (e["pid"], e["tid"]) == busiest), key=lambda e: e["ts"])


def print_timeline(name: str, fn, args, calls: int) -> None:
    for _ in range(5):
        jax.block_until_ready(fn(*args))
    trace_dir = tempfile.mkdtemp()
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        jax.block_until_ready([fn(*args) for _ in range(calls)])
    events = gpu_events(trace_dir)
    per_call = len(events) // calls
    span = (events[-1]["ts"] + events[-1]["dur"] - events[0]["ts"]) / calls
    busy = sum(e["dur"] for e in events) / calls
    print(f"{name}: {per_call} kernels a call; per call {span:.1f} us from first start to last "
          f"end, kernels {busy:.1f}, idle {span - busy:.1f}")
    previous_end = None
    for e in events[-per_call:]:  # the last call
        idle = "" if previous_end is None else f"{e['ts'] - previous_end:6.1f}"
        print(f"  {e['dur']:8.1f} us  idle before {idle:>6}  {e['name'][:100]}")
        previous_end = e["ts"] + e["dur"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", nargs="?", default="1000,8,128,128", help="T,N,I,H")
    parser.add_argument("--timeline", action="store_true",
                        help="print the GPU timeline of back-to-back calls (jax.profiler)")
    parser.add_argument("--calls", type=int, default=10, help="with --timeline: K")
    args = parser.parse_args()
    T, N, I, H = map(int, args.shape.split(","))
    x, R, W, b, h0, c = problem(T, N, I, H)
    operands = (x, R, W, b, h0)
    fwd = jax.jit(lambda *a: jax_sgrnn.single_gate_rnn(*a, activation="tanh"))
    grad = jax.jit(jax.grad(
        lambda *a: jnp.sum(jax_sgrnn.single_gate_rnn(*a, activation="tanh") * c),
        argnums=(0, 1, 2, 3, 4)))
    if args.timeline:
        print_timeline("fwd", fwd, operands, args.calls)
        print_timeline("fwd+bwd", grad, operands, args.calls)
        return
    for _ in range(3):  # warm-up: 2 kernel launches per forward+backward, 1 per forward
        fwd(*operands).block_until_ready()
        jax.block_until_ready(grad(*operands))
    fwd(*operands).block_until_ready()
    jax.block_until_ready(grad(*operands))


if __name__ == "__main__":
    main()
