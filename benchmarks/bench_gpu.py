"""GPU benchmark: jax_sgrnn's op vs a plain hand-written ``lax.scan`` RNN vs PyTorch ``nn.RNN``
(cuDNN), in one process on one GPU.

Forward, forward+backward (gradients for x, R, W, b and h0) and jvp (a tangent for each of
them; JAX contenders only); with input weight, bias and initial state. Every contender is timed
two ways, by the same host clock and the same rule (median of repeated runs after warm-up):

- **waited**: one call, then a wait for its results (``block_until_ready`` for JAX,
  ``torch.cuda.synchronize`` for PyTorch): what a loop that reads every result pays, the
  runtime's fixed cost per call included;
- **b2b**: K calls back to back and one wait at the end, per call: what a training loop that
  does not read its results every step pays, the dispatch overlapping the GPU's work.

Two tables: float32 with TF32 off for all three (``jax_default_matmul_precision="highest"``,
PyTorch's ``allow_tf32`` flags off), then TF32 allowed. "op" is the op through its CUDA handler
(where the package was built with it); "decomp" is the same op with the handler off
(``jax_sgrnn.cuda_handler(False)``): its ``lax.scan`` decomposition, what ROCm, TPU and
jax-metal users get; "plain" is the minimal scan a user would write (projection outside,
``h = act(x'_t + h R^T)`` inside). best/op compares the op with the faster of plain and cuDNN
(the target: >= 1.5x), decomp/plain the decomposition with plain (target: <= 1).

``--sweep`` times op, plain and cuDNN (both modes, forward and forward+backward) over a grid of
its own (T 50-3000, N 1-1024, H 64-2048 with sizes that are not multiples of 32, one and two
directions, tanh and relu), or over the ``--shapes`` given, and prints each point's best/op
and the worst. ``--census`` prints what one call of each jitted JAX contender runs: the
operations left in XLA's optimised program (each fusion, copy, product or custom call is at
least one kernel launch).

    python benchmarks/bench_gpu.py --tables float32       # the five issue shapes
    python benchmarks/bench_gpu.py --shapes 100,32,256,256 --json gpu.json
    python benchmarks/bench_gpu.py --shapes 50,1024,1024,1024,2,relu   # D = 2, relu
    python benchmarks/bench_gpu.py --sweep --tables float32
    python benchmarks/bench_gpu.py --sweep --sweep-hidden 700 1024 2048   # part of the grid
    python benchmarks/bench_gpu.py --sweep --shapes 50,1024,2048,2048      # points of your own
    python benchmarks/bench_gpu.py --census --shapes 100,32,256,256
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import pathlib
import re
import sys
import time
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_cpu import interleaved_stats  # noqa: E402  (the same timing rule)

import jax_sgrnn  # noqa: E402

DEFAULT_SHAPES = ["100,32,256,256", "200,64,512,512", "100,256,1024,1024", "1000,8,128,128",
                  "50,1024,256,256"]
PASSES = ("fwd", "fwd+bwd", "jvp")
MODES = ("waited", "b2b")
ACTIVATIONS = ("tanh", "relu")


@dataclasses.dataclass(frozen=True)
class Case:
    """One problem: sizes, directions (1 or 2) and activation."""
    T: int
    N: int
    I: int
    H: int
    D: int = 1
    activation: str = "tanh"

    @classmethod
    def parse(cls, spec: str) -> "Case":
        """'T,N,I,H[,D][,tanh|relu]', e.g. '50,32,1024,1024,relu' or '50,1024,256,256,2,relu'."""
        fields = spec.split(",")
        activation = fields.pop() if fields[-1] in ACTIVATIONS else "tanh"
        if len(fields) < 4 or not all(f.isdigit() for f in fields) or fields[4:] not in (
                [], ["1"], ["2"]):
            raise ValueError(f"shape {spec!r} is not T,N,I,H[,D][,tanh|relu] with D 1 or 2")
        return cls(*map(int, fields), activation=activation)

    def __str__(self) -> str:
        tail = ("" if self.D == 1 else " bi") + ("" if self.activation == "tanh" else " relu")
        return f"{self.T},{self.N},{self.I},{self.H}{tail}"


def problem(case: Case) -> tuple:
    """float32 inputs (x, R, W, b, h0) and a cotangent c for y at PyTorch's initialisation
    scale (bench_cpu's data for one direction): the same data for every contender."""
    T, N, I, H, D = case.T, case.N, case.I, case.H, case.D
    rng = np.random.default_rng(0)
    bound = 1 / np.sqrt(H)

    def f32(*shape, scale=1.0):
        return jnp.asarray(rng.uniform(-scale, scale, shape), jnp.float32)

    x, c = f32(T, N, I), f32(T, N, D * H)
    R = f32(H, H, scale=bound) if D == 1 else f32(D, H, H, scale=bound)
    return x, R, f32(D * H, I, scale=bound), f32(D * H, scale=bound), f32(N, D * H), c


def plain_scan(x, R, W, b, h0, activation="tanh", bidirectional=False):
    """The RNN as a user would write it with lax.scan (one scan per direction)."""
    act = jnp.tanh if activation == "tanh" else jax.nn.relu
    xp = x @ W.T + b

    def run(xp, R, h0):
        def step(h, x_t):
            h = act(x_t + h @ R.T)
            return h, h

        return lax.scan(step, h0, xp)[1]

    if not bidirectional:
        return run(xp, R, h0)
    H = R.shape[-1]
    backward = run(xp[::-1, :, H:], R[1], h0[:, H:])[::-1]
    return jnp.concatenate([run(xp[..., :H], R[0], h0[:, :H]), backward], axis=-1)


@dataclasses.dataclass
class Contender:
    """Per pass, a callable that enqueues one call and returns its results (None where the
    contender does not run that pass), and how to wait for results."""
    calls: dict
    wait: Callable[[object], None]
    compiled: Optional[dict] = None  # JAX: per pass, the compiled program (for --census)

    def timer(self, pass_: str, mode: str, k: int) -> Optional[Callable[[], None]]:
        """A callable running one timed unit of `mode`: a waited-for call, or k calls back to
        back and one wait (the caller divides by k)."""
        call = self.calls.get(pass_)
        if call is None:
            return None
        if mode == "waited":
            return lambda: self.wait(call())

        def back_to_back():
            for _ in range(k - 1):
                call()
            self.wait(call())  # one stream: the last call's results come after all the others

        return back_to_back


def jax_contender(rnn, args, c, case: Case, passes) -> Contender:
    """The jitted passes of `rnn`, compiled now (under the settings in force now, e.g.
    ``cuda_handler``); the jvp perturbs every input."""
    def f(*a):
        return rnn(*a, activation=case.activation, bidirectional=case.D == 2)

    tangents = tuple(0.5 * a for a in args)
    programs = {
        "fwd": (jax.jit(f), args),
        "fwd+bwd": (jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * c), argnums=(0, 1, 2, 3, 4))),
                    args),
        "jvp": (jax.jit(lambda p, t: jax.jvp(f, p, t)), (args, tangents)),
    }
    compiled = {p: fn.lower(*a).compile() for p, (fn, a) in programs.items() if p in passes}
    calls = {p: (lambda p=p: compiled[p](*programs[p][1])) for p in compiled}
    return Contender(calls, jax.block_until_ready, compiled)


def torch_contender(args, c, case: Case) -> Contender:
    import torch

    x, R, W, b, h0 = (torch.from_numpy(np.array(a)).cuda() for a in args)
    H = case.H
    rnn = torch.nn.RNN(case.I, H, nonlinearity=case.activation,
                       bidirectional=case.D == 2).cuda()
    with torch.no_grad():
        suffixes = ["", "_reverse"][:case.D]
        for d, sfx in enumerate(suffixes):
            getattr(rnn, f"weight_ih_l0{sfx}").copy_(W[d * H:(d + 1) * H])
            getattr(rnn, f"weight_hh_l0{sfx}").copy_(R if case.D == 1 else R[d])
            getattr(rnn, f"bias_ih_l0{sfx}").copy_(b[d * H:(d + 1) * H])
            getattr(rnn, f"bias_hh_l0{sfx}").zero_()
    x.requires_grad_(True)
    h0 = torch.stack([h0[:, d * H:(d + 1) * H] for d in range(case.D)]).requires_grad_(True)
    ct = torch.from_numpy(np.array(c)).cuda()

    def fwd():
        with torch.no_grad():
            return rnn(x, h0)

    def fwd_bwd():
        rnn.zero_grad(set_to_none=True)
        x.grad = h0.grad = None
        y, _ = rnn(x, h0)
        y.backward(ct)

    return Contender({"fwd": fwd, "fwd+bwd": fwd_bwd}, lambda _: torch.cuda.synchronize())


def set_tf32(allowed: bool) -> None:
    jax.config.update("jax_default_matmul_precision", None if allowed else "highest")
    try:
        import torch

        torch.backends.cuda.matmul.allow_tf32 = allowed
        torch.backends.cudnn.allow_tf32 = allowed
    except ImportError:
        pass


def contenders(case: Case, passes, have_torch: bool, with_decomposition: bool) -> dict:
    x, R, W, b, h0, c = problem(case)
    args = (x, R, W, b, h0)
    out = {"op": jax_contender(jax_sgrnn.single_gate_rnn, args, c, case, passes),
           "plain": jax_contender(plain_scan, args, c, case, passes)}
    if with_decomposition:
        with jax_sgrnn.cuda_handler(False):
            out["decomp"] = jax_contender(jax_sgrnn.single_gate_rnn, args, c, case, passes)
    if have_torch:
        out["torch"] = torch_contender(args, c, case)
    return out


def measure(timed: dict, pass_: str, k: int, repeats: int, min_total: float) -> dict:
    """{mode: {contender: ms per call}} for one pass: all contenders of a mode timed in one
    interleaved run, so that a slow stretch of the machine falls on all alike."""
    out = {}
    for mode in MODES:
        fns = {n: t for n, c in timed.items() if (t := c.timer(pass_, mode, k))}
        per_call = 1 if mode == "waited" else k
        runs = repeats if mode == "waited" else -(-repeats // 4)  # each run is k calls
        stats = interleaved_stats(fns, runs, warmup=2, min_total=min_total, pause=0.0)
        out[mode] = {n: 1e3 * s["median"] / per_call for n, s in stats.items()}
    return out


def best_over_op(ms: dict) -> float:
    return min(ms["plain"], ms.get("torch", float("inf"))) / ms["op"]


def run_table(cases, repeats: int, k: int, have_torch: bool, title: str,
              save: Callable[[list], None]) -> list[dict]:
    print(f"\n{title}")
    print(f"{'T,N,I,H':>18} {'pass':>8} {'mode':>7} {'op ms':>8} {'decomp':>8} {'plain':>8} "
          f"{'torch':>8} {'best/op':>8} {'decomp/plain':>12}")
    rows = []
    for case in cases:
        timed = contenders(case, PASSES, have_torch, with_decomposition=True)
        for pass_ in PASSES:
            for mode, ms in measure(timed, pass_, k, repeats, min_total=0.5).items():
                rows.append(dict(shape=[case.T, case.N, case.I, case.H], pass_=pass_, mode=mode,
                                 **{f"{n}_ms": v for n, v in ms.items()}))
                torch_ms = f"{ms['torch']:8.3f}" if "torch" in ms else f"{'-':>8}"
                print(f"{str(case):>18} {pass_:>8} {mode:>7} {ms['op']:8.3f} "
                      f"{ms['decomp']:8.3f} {ms['plain']:8.3f} {torch_ms} "
                      f"{best_over_op(ms):7.2f}x {ms['decomp'] / ms['plain']:11.2f}x",
                      flush=True)
        save(rows)
    return rows


SWEEP_HIDDEN = (64, 100, 256, 700, 1024, 2048)


def sweep_cases(hidden: Optional[Sequence[int]] = None) -> list[Case]:
    """The sweep's grid: every hidden size against every batch size, with as many steps (50
    to 3000) as keep a call's work modest; directions and activations alternate. `hidden`
    keeps only the points of those hidden sizes (None: all)."""
    unknown = sorted(set(hidden or ()) - set(SWEEP_HIDDEN))
    if unknown:
        raise ValueError(f"hidden size(s) {unknown} not in the sweep's grid {SWEEP_HIDDEN}")
    cases = []
    for i, H in enumerate(SWEEP_HIDDEN):
        if hidden and H not in hidden:
            continue  # after enumerate: a point keeps its directions and activation
        for j, N in enumerate((1, 4, 32, 1024)):
            T = min(3000, max(50, 2 ** 20 // (N * H)))
            D = 1 + (i + j) % 2
            activation = ACTIVATIONS[(i + j // 2) % 2]
            cases.append(Case(T, N, H, H, D, activation))
    return cases


def chosen_cases(shapes: Optional[Sequence[str]], sweep: bool,
                 sweep_hidden: Optional[Sequence[int]]) -> list[Case]:
    """The command line's cases: the shapes given, else the sweep's grid (with `sweep`, only
    its points of `sweep_hidden` where given) or the five issue shapes."""
    if sweep_hidden and not sweep:
        raise ValueError("--sweep-hidden needs --sweep")
    if sweep_hidden and shapes:
        raise ValueError("--sweep-hidden picks points of the sweep's grid; --shapes names "
                         "its own: give one or the other")
    if sweep and not shapes:
        return sweep_cases(sweep_hidden)
    return [Case.parse(s) for s in shapes or DEFAULT_SHAPES]


def progress(total: int):
    """A tqdm bar on stderr where tqdm is installed and stderr is a terminal (a bar's
    carriage returns would run into the table's lines in a log), otherwise nothing."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="sweep", unit="point", file=sys.stderr, leave=False,
                disable=None)


def run_sweep(cases, repeats: int, k: int, have_torch: bool, title: str,
              save: Callable[[list], None]) -> list[dict]:
    print(f"\n{title}: best/op per point (> 1: the op is faster than both plain and cuDNN)")
    print(f"{'T,N,I,H':>24} {'fwd waited':>11} {'fwd b2b':>8} {'f+b waited':>11} "
          f"{'f+b b2b':>8} {'op fwd ms (b2b)':>16}")
    rows, bar = [], progress(len(cases))
    for case in cases:
        timed = contenders(case, ("fwd", "fwd+bwd"), have_torch, with_decomposition=False)
        ratios, row = [], dict(case=dataclasses.asdict(case))
        for pass_ in ("fwd", "fwd+bwd"):
            for mode, ms in measure(timed, pass_, k, repeats, min_total=0.05).items():
                row[f"{pass_} {mode}"] = ms
                ratios.append(best_over_op(ms))
        rows.append(row)
        save(rows)  # a long sweep cut short keeps the points it measured
        if bar is not None:
            bar.update()
        print(f"{str(case):>24} " + " ".join(f"{r:{w}.2f}x" for r, w in
                                              zip(ratios, (10, 7, 10, 7)))
              + f" {row['fwd b2b']['op']:16.3f}", flush=True)
        del timed
    if bar is not None:
        bar.close()
    for i, key in enumerate(("fwd waited", "fwd b2b", "fwd+bwd waited", "fwd+bwd b2b")):
        worst = min(rows, key=lambda r: best_over_op(r[key]))
        print(f"worst {key:>15}: {best_over_op(worst[key]):.2f}x at "
              f"{Case(**worst['case'])}")
    return rows


# Operations of XLA's optimised program that launch nothing.
_NO_LAUNCH = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "call",
              "opt-barrier", "after-all", "add-dependency"}


def census(hlo: str) -> collections.Counter:
    """What XLA's optimised program runs per call, by kind: each fusion, copy, product and
    custom call (by target) of the entry computation and of the computations it calls
    (command buffers); a while loop counts once, its body per iteration is not counted."""
    bodies, name, entry = {}, None, None
    for line in hlo.splitlines():
        header = re.match(r"(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if header and not line.startswith(" "):
            name = header.group(2)
            entry = name if header.group(1) else entry
            bodies[name] = []
        elif name and line.strip() and line.strip() != "}":
            bodies[name].append(line)
    counts = collections.Counter()

    def visit(computation):
        for line in bodies.get(computation, []):
            found = re.search(r"=\s*.*?(?<![\w\[])([a-z][a-z\-]*)\(", line)
            if not found:
                continue
            op = found.group(1)
            if op == "call":
                visit(re.search(r"to_apply=%?([\w.\-]+)", line).group(1))
            elif op == "custom-call":
                target = re.search(r'custom_call_target="([^"]+)"', line)
                counts[f"custom-call {target.group(1) if target else '?'}"] += 1
            elif op not in _NO_LAUNCH:
                counts[op] += 1

    visit(entry)
    return counts


def run_census(cases) -> dict:
    print("\nWhat one call runs (XLA's optimised program; a while loop counts once)")
    out = {}
    for case in cases:
        for name, contender in contenders(case, PASSES, False, True).items():
            for pass_, compiled in contender.compiled.items():
                counts = census(compiled.as_text())
                out[f"{case} {name} {pass_}"] = dict(counts)
                detail = ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
                print(f"{str(case):>18} {name:>6} {pass_:>8}: {sum(counts.values()):3d}  "
                      f"({detail})", flush=True)
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+",
                        help="T,N,I,H[,D][,tanh|relu] ... (default: the five issue shapes)")
    parser.add_argument("--repeats", type=int, help="minimum timed runs (20; sweep: 5)")
    parser.add_argument("--calls", type=int,
                        help="K: calls back to back per timed run in the b2b mode (50; sweep: 10)")
    parser.add_argument("--tables", nargs="+", default=["float32", "tf32"],
                        choices=["float32", "tf32"], help="which tables to measure")
    parser.add_argument("--sweep", action="store_true",
                        help="time the sweep's grid, or the --shapes given, the sweep's way "
                             "(op, plain and cuDNN; forward and forward+backward)")
    parser.add_argument("--sweep-hidden", nargs="+", type=int, metavar="H",
                        help="with --sweep: only the grid's points of these hidden sizes "
                             "(default: all)")
    parser.add_argument("--census", action="store_true",
                        help="print what one call of each JAX contender runs, and time nothing")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    try:
        cases = chosen_cases(args.shapes, args.sweep, args.sweep_hidden)
    except ValueError as e:
        parser.error(str(e))
    if jax.default_backend() != "gpu":
        raise SystemExit(f"no GPU: jax's default backend is {jax.default_backend()!r}")
    repeats = args.repeats or (5 if args.sweep else 20)
    calls = args.calls or (10 if args.sweep else 50)
    device = jax.devices()[0].device_kind
    out = dict(device=device, jax=jax.__version__, date=time.strftime("%Y-%m-%d"))
    if args.census:
        set_tf32(False)
        out["census"] = run_census(cases)
    else:
        try:
            import torch

            have_torch = torch.cuda.is_available()
            versions = f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}"
        except ImportError:
            have_torch, versions = False, "no torch"
        out["versions"] = versions
        print(f"{out['date']}; {device}; jax {jax.__version__}; {versions}; median of >= "
              f"{repeats} runs after warm-up; b2b: {calls} calls back to back, per "
              f"call; best/op > 1 means the op is faster than both plain scan and cuDNN")
        for key in args.tables:
            tf32 = key == "tf32"
            set_tf32(tf32)
            title = "float32, TF32 allowed" if tf32 else "float32, TF32 off"
            run = run_sweep if args.sweep else run_table
            out[key] = run(cases, repeats, calls, have_torch, title,
                           lambda rows, key=key: write_json(args.json, dict(out, **{key: rows})))
    write_json(args.json, out)
    return out


def write_json(path: Optional[str], out: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
