"""Metal benchmark: the MPSGraph handler (mps backend) vs the native CPU handler vs lax.scan.

All three run in this one process on bench_cpu.py's shapes: tanh, with input weight, bias and
initial state, float32. Forward, and forward+backward (jax.grad for every input). Each cell is
the median of at least --repeats timed runs (fast ones: runs continue until 0.5 s have been
timed) after warm-up, bench_cpu.py's `median_seconds`. Before timing a shape, the script checks
that the mps program's lowered HLO calls the mps FFI targets (not the native ones) and that its
results agree with the native handler's.

Prints the machine (OS, chip, Metal device, jax version, date), the verdict of MPSGraph's
self-check per fact (``jax_sgrnn.mps_self_check``), then a markdown table: times in
ms, the mps handler's GFLOP/s, and the ratios "vs native" (native time / mps time) and
"vs scan" (scan time / mps time): above 1 means MPSGraph is faster. A progress bar (tqdm, on
stderr) counts the measurements.

Without a usable mps backend (not macOS, the MPSGraph extension not built, or no Metal device
visible, e.g. on GitHub's hosted macOS runners) it prints why and exits with status 0 having
run nothing; with --require-mps it exits with status 1 instead (the self-hosted Metal CI job
uses this, so a runner that lost its GPU does not pass silently).

    python benchmarks/bench_metal.py                     # bench_cpu.py's five shapes
    python benchmarks/bench_metal.py --shapes 100,16,64,64 --repeats 50 --json metal.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_sgrnn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_cpu import DEFAULT_SHAPES, median_seconds, problem  # noqa: E402  (same shapes, same timing)

#: Columns: (label, cpu backend chosen while it runs, the function timed).
IMPLS = (("mps", "mps", jax_sgrnn.single_gate_rnn),
         ("native", "native", jax_sgrnn.single_gate_rnn),
         ("scan", "native", jax_sgrnn.reference))


def mps_unavailable_reason() -> str | None:
    """Why this machine cannot run the benchmark, or None."""
    for name in ("mps", "native"):
        backend = jax_sgrnn.backends()[name]
        if not backend.available:
            return f"the {name} backend is not available here: {backend.reason}"
    return None


def chip_name() -> str:
    if sys.platform == "darwin":
        try:
            return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"],
                                  capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor() or platform.machine()


def machine_info(args) -> dict:
    import jaxlib

    return dict(
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        platform=platform.platform(), chip=chip_name(), cpu_count=os.cpu_count(),
        metal_device=jax_sgrnn.backends()["mps"].device,
        python=platform.python_version(), jax=jax.__version__, jaxlib=jaxlib.__version__,
        jax_sgrnn=getattr(jax_sgrnn, "__version__", "?"),
        method=f"float32, tanh, with W, b, h0; median of >= {args.repeats} runs "
               f"(>= 0.5 s timed) after warm-up")


def custom_call_targets(hlo_text: str) -> set:
    import re

    return {m.group(1) for line in hlo_text.splitlines() if "custom_call" in line
            for m in re.finditer(r"@([\w.$-]+)\(", line)}


def programs(rnn, c):
    """(forward, forward+backward) jitted functions of (x, R, W, b, h0)."""
    fwd = jax.jit(lambda x, R, W, b, h0: rnn(x, R, W, b, h0, activation="tanh"))
    loss = lambda *a: jnp.sum(rnn(*a, activation="tanh") * c)
    return fwd, jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))


def check_mps_programs(mps_fns, native_fns, args) -> None:
    """The mps programs call MPSGraph's targets only and agree with the native handler."""
    b = jax_sgrnn.backends()
    mps_targets, native_targets = set(b["mps"].targets.values()), set(b["native"].targets.values())
    for name, f_mps, f_native in zip(("forward", "forward+backward"), mps_fns, native_fns):
        with jax_sgrnn.cpu_backend("mps"):
            calls = custom_call_targets(f_mps.lower(*args).as_text())
            got = jax.block_until_ready(f_mps(*args))
        if not calls or not calls <= mps_targets or calls & (native_targets - mps_targets):
            raise SystemExit(f"{name}: the mps program calls {sorted(calls)}, not the mps "
                             f"targets {sorted(mps_targets)}: the timings would not be MPSGraph's")
        with jax_sgrnn.cpu_backend("native"):
            want = jax.block_until_ready(f_native(*args))
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            w = np.asarray(w, np.float64)
            err = float(np.max(np.abs(np.asarray(g, np.float64) - w))) if w.size else 0.0
            if err > 1e-3 * max(1.0, float(np.max(np.abs(w)))):
                raise SystemExit(f"{name}: mps and native results differ by {err:.3g}: "
                                 "not benchmarking a wrong result")


def progress(total: int, enabled: bool):
    try:
        if not enabled:
            raise ImportError
        from tqdm import tqdm

        return tqdm(total=total, desc="measurements", unit="cell", file=sys.stderr,
                    leave=False)
    except ImportError:
        class Silent:
            def update(self, n=1):
                pass

            def set_postfix_str(self, s):
                pass

            def close(self):
                pass

        return Silent()


def markdown_table(rows: list[dict]) -> str:
    lines = ["| T,N,I,H | pass | mps ms | native ms | scan ms | mps GFLOP/s | mps vs native "
             "| mps vs scan |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {','.join(map(str, r['shape']))} | {r['pass']} | {r['mps_ms']:.2f} | "
                     f"{r['native_ms']:.2f} | {r['scan_ms']:.2f} | {r['mps_gflops']:.1f} | "
                     f"{r['mps_vs_native']:.2f}x | {r['mps_vs_scan']:.2f}x |")
    return "\n".join(lines)


def self_check_table(report: dict) -> str:
    """MPSGraph's self-check (jax_sgrnn.mps_self_check): each fact's verdict and worst error."""
    verdict = "passed" if report["passed"] else f"FAILED: {report['failed_fact']}"
    lines = [f"MPSGraph self-check: {verdict} ({report['problems']} problems, "
             f"{report['seconds']:.3f} s)", "",
             "| fact | status | worst error | tolerance | where |", "|---|---|---:|---:|---|"]
    for name, fact in report["facts"].items():
        lines.append(f"| {name} | {fact['status']} | {fact['worst_error']:.3g} | "
                     f"{fact['tolerance']:.3g} | {fact['where']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, help="T,N,I,H ...")
    parser.add_argument("--repeats", type=int, default=10,
                        help="minimum timed runs per measurement (fast ones run for 0.5 s)")
    parser.add_argument("--json", help="also write the machine info and rows to this file")
    parser.add_argument("--require-mps", action="store_true",
                        help="exit with status 1 (not 0) when the mps backend is unavailable")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)

    why = mps_unavailable_reason()
    if why is not None:
        print(f"bench_metal: nothing to measure: {why}", flush=True)
        return 1 if args.require_mps else 0

    info = machine_info(args)
    print(f"{info['date']}; {info['platform']}; {info['chip']} ({info['cpu_count']} CPUs); "
          f"Metal device: {info['metal_device']}; Python {info['python']}, jax {info['jax']}, "
          f"jaxlib {info['jaxlib']}, jax_sgrnn {info['jax_sgrnn']}")
    print(f"{info['method']}. Ratios: native or scan time / mps time (> 1: MPSGraph faster).",
          flush=True)
    report = jax_sgrnn.mps_self_check()
    info["self_check"] = report
    print(self_check_table(report), flush=True)

    rows = []
    bar = progress(2 * len(IMPLS) * len(args.shapes), not args.no_progress)
    try:
        for spec in args.shapes:
            T, N, I, H = map(int, spec.split(","))
            *data, c = problem(T, N, I, H)
            fns = {label: programs(rnn, c) for label, _, rnn in IMPLS}
            check_mps_programs(fns["mps"], fns["native"], data)
            flops_fwd = 2.0 * T * N * H * (I + H)
            for i, (name, flops) in enumerate((("fwd", flops_fwd),
                                               ("fwd+bwd", 3 * flops_fwd))):
                t = {}
                for label, backend, _ in IMPLS:
                    bar.set_postfix_str(f"{spec} {name} {label}")
                    fn = fns[label][i]
                    # The choice is part of jit's cache key: the warm-up compiles under it.
                    with jax_sgrnn.cpu_backend(backend):
                        t[label] = median_seconds(
                            lambda fn=fn: jax.block_until_ready(fn(*data)), args.repeats)
                    bar.update()
                rows.append(dict(shape=[T, N, I, H], **{"pass": name},
                                 **{f"{k}_ms": 1e3 * s for k, s in t.items()},
                                 mps_gflops=flops / t["mps"] / 1e9,
                                 mps_vs_native=t["native"] / t["mps"],
                                 mps_vs_scan=t["scan"] / t["mps"]))
    finally:
        bar.close()
    print(markdown_table(rows), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(machine=info, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
