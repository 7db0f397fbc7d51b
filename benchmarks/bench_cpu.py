"""CPU benchmark: jax_sgrnn's custom call vs the jitted lax.scan reference, PyTorch nn.RNN and
oneDNN's vanilla RNN primitive.

All run in this one process on the same shapes: tanh, with input weight, bias and
initial state, float32. Forward, forward+backward (gradients for every input) and jvp (a
tangent for every input; JAX contenders only). PyTorch and oneDNN are optional: each is timed
where it is found (oneDNN: `pip install onednn`, or $ONEDNN_LIBRARY, see onednn_rnn.py), after
a check that it computes what the op computes. --threads K pins the process to K cores
before any runtime starts its threads, so every contender runs on K. Reports
the median of --repeats timed runs after warm-up (and the op's and the scan's min-max, their
spread), timed in rounds that interleave the contenders and a large GEMM (so that a slow
stretch of the machine falls on all alike), the op's GFLOP/s and its fraction of the large
GEMM's rate in the same rounds, and the op's speedup ratios; then, per shape, where the op's
forward+backward time goes (the kernels' phase counters). The header names the CPU and the
kernels' instruction-set build; --json writes the machine, the GEMM rates and the rows, so
runs on different machines compare. Column "xlaproj" times the alternative design (XLA does
the input projection and its gradients around a recurrence-only custom call), which
docs/design.md weighs.

    python benchmarks/bench_cpu.py               # the issue's five shapes
    python benchmarks/bench_cpu.py --shapes 100,16,64,64 --repeats 50
    python benchmarks/bench_cpu.py --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_sgrnn

DEFAULT_SHAPES = ["100,32,256,256", "200,64,512,512", "1000,8,128,128", "50,256,256,256",
                  "100,16,64,64"]


def problem(T: int, N: int, I: int, H: int) -> tuple:
    """The benchmark's float32 inputs (x, R, W, b, h0) and a cotangent c for y, PyTorch's
    uniform initialisation scale; the same data for every implementation timed."""
    rng = np.random.default_rng(0)
    bound = 1 / np.sqrt(H)

    def f32(*shape, scale=1.0):
        return jnp.asarray(rng.uniform(-scale, scale, shape), jnp.float32)

    x, c = f32(T, N, I), f32(T, N, H)
    return x, f32(H, H, scale=bound), f32(H, I, scale=bound), f32(H, scale=bound), f32(N, H), c


ROUNDS = 5


def interleaved_stats(fns: dict, repeats: int, rounds: int = ROUNDS, warmup: int = 3,
                      min_total: float = 0.5, pause: float = 0.2) -> dict:
    """min / median / max seconds of each callable, timed in `rounds` rounds after `warmup`
    untimed calls each: in each round every callable runs a block of at least
    repeats/rounds calls (and min_total/rounds seconds), in an order that rotates from round
    to round. This VM's speed drifts (a large GEMM's rate moved 1.7x within one session), so
    timing the contenders one after another charged a slow stretch to whichever ran in it;
    spread over rounds it falls on all alike.
    Blocks, not single calls in turn, each after a pause and one untimed call: each
    runtime's thread pool spins for a while after its calls, and a contender timed right
    after another shares the cores with those threads and starts with cold caches (`pause`
    seconds before each block; a GPU's contenders need none)."""
    names = list(fns)
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {k: [] for k in names}
    for r in range(rounds):
        for k in names[r % len(names):] + names[:r % len(names)]:
            time.sleep(pause)  # let the last contender's pool threads go idle
            fns[k]()
            block = []
            while len(block) < -(-repeats // rounds) or sum(block) < min_total / rounds:
                start = time.perf_counter()
                fns[k]()
                block.append(time.perf_counter() - start)
            times[k] += block
    return {k: dict(min=min(v), median=statistics.median(v), max=max(v))
            for k, v in times.items()}


def time_stats(fn, repeats: int, warmup: int = 3, min_total: float = 0.5) -> dict:
    """min / median / max seconds of at least `repeats` timed runs, and of more for fast
    functions (runs continue until `min_total` seconds have been timed), after `warmup`
    untimed ones: :func:`interleaved_stats` for one callable in one round."""
    return interleaved_stats({"fn": fn}, repeats, 1, warmup, min_total)["fn"]


def median_seconds(fn, repeats: int, warmup: int = 3, min_total: float = 0.5) -> float:
    """The median of :func:`time_stats`."""
    return time_stats(fn, repeats, warmup, min_total)["median"]


GEMM_SIZE = 2048


def large_gemm_timer(n: int = GEMM_SIZE):
    """One large square float32 product (XLA's, all cores), blocking: its rate is the ceiling
    the op's GFLOP/s are compared with (2 n^3 flops a call)."""
    a = jnp.asarray(np.random.default_rng(1).standard_normal((n, n)), jnp.float32)
    dot = jax.jit(lambda a: a @ a)
    return lambda: dot(a).block_until_ready()


def large_gemm_gflops(n: int = GEMM_SIZE, repeats: int = 10) -> float:
    """This machine's large-GEMM rate (:func:`large_gemm_timer`), GFLOP/s."""
    return 2.0 * n ** 3 / median_seconds(large_gemm_timer(n), repeats) / 1e9


def cpu_name() -> str:
    """The CPU's model name (it varies between this project's machines)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def recurrence_only(x, R, W, b, h0, activation):
    """The design not taken: XLA computes x W^T + b (and dW, db, dx), the custom call runs
    only the recurrence (the op without input_weight/bias)."""
    return jax_sgrnn.single_gate_rnn(x @ W.T + b, R, init_state=h0, activation=activation)


def jax_timers(rnn, x, R, W, b, h0, c):
    """(forward, forward+backward, jvp) callables that block until done; the jvp perturbs
    every input (the tangents are the cotangent-sized data reused)."""
    fwd = jax.jit(lambda x, R, W, b, h0: rnn(x, R, W, b, h0, activation="tanh"))
    loss = lambda *a: jnp.sum(rnn(*a, activation="tanh") * c)
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
    jvp = jax.jit(lambda p, t: jax.jvp(lambda *a: rnn(*a, activation="tanh"), p, t))
    args = (x, R, W, b, h0)
    tangents = tuple(0.5 * a for a in args)
    return (lambda: fwd(*args).block_until_ready(),
            lambda: jax.block_until_ready(grad(*args)),
            lambda: jax.block_until_ready(jvp(args, tangents)))


def torch_timers(x, R, W, b, h0, c):
    import torch

    T, N, I = x.shape
    H = R.shape[0]
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    rnn = torch.nn.RNN(I, H, nonlinearity="tanh")
    with torch.no_grad():
        rnn.weight_ih_l0.copy_(torch.from_numpy(np.asarray(W)))
        rnn.weight_hh_l0.copy_(torch.from_numpy(np.asarray(R)))
        rnn.bias_ih_l0.copy_(torch.from_numpy(np.asarray(b)))
        rnn.bias_hh_l0.zero_()
    xt = torch.from_numpy(np.asarray(x)).requires_grad_(True)
    h0t = torch.from_numpy(np.asarray(h0))[None].requires_grad_(True)
    ct = torch.from_numpy(np.asarray(c))

    def fwd():
        with torch.no_grad():
            rnn(xt, h0t)

    def fwd_bwd():
        rnn.zero_grad(set_to_none=True)
        xt.grad = h0t.grad = None
        y, _ = rnn(xt, h0t)
        y.backward(ct)

    # The jvp is timed for the JAX contenders only.
    return fwd, fwd_bwd, None, f"{torch.__version__}, {torch.get_num_threads()} threads"


def onednn_library():
    """oneDNN's library, loaded, or None (with a message) where none is found."""
    import onednn_rnn

    path = onednn_rnn.library_path()
    if path is None:
        print("oneDNN not timed: no libdnnl found (pip install onednn, or set ONEDNN_LIBRARY)")
        return None
    lib = onednn_rnn.load_library(path)
    print(f"oneDNN {onednn_rnn.version(lib)} from {path}")
    return lib


def onednn_timers(lib, x, R, W, b, h0, c):
    """oneDNN's (forward, forward+backward) callables and its version and implementations.
    Refuses a oneDNN whose results differ from the op's."""
    import onednn_rnn

    args = tuple(np.asarray(a) for a in (x, R, W, b, h0, c))
    peer = onednn_rnn.OneDnnRnn(lib, *args)
    peer.forward()
    want_y = jax_sgrnn.single_gate_rnn(x, R, W, b, h0, activation="tanh")
    loss = lambda *a: jnp.sum(jax_sgrnn.single_gate_rnn(*a, activation="tanh") * c)
    want_grads = jax.grad(loss, argnums=(0, 1, 2, 3, 4))(x, R, W, b, h0)
    peer.forward_backward()
    for name, got, want in zip(("y", "dx", "dR", "dW", "db", "dh0"),
                               (peer.y(), *peer.gradients()), (want_y, *want_grads)):
        want = np.asarray(want)
        error = np.max(np.abs(got - want)) / np.max(np.abs(want))
        if not error < 1e-3:  # float32 sums in another order, far below a wrong formula's
            raise SystemExit(f"oneDNN's {name} differs from the op's (max error {error:.1e} of "
                             "the largest value): not timed")
    impl = ", ".join(f"{k} {v}" for k, v in peer.impl.items())
    return peer.forward, peer.forward_backward, None, f"oneDNN {onednn_rnn.version(lib)}; {impl}"


PHASES = ("projection", "recurrence", "backward_recurrence", "weight_gradients",
          "input_gradient")


def phase_ms(fwd_bwd, repeats: int) -> dict:
    """Milliseconds per forward+backward call in each kernel phase (the extension's phase
    counters, averaged over `repeats` calls), and "other": the call's mean time less the
    phases (XLA's own work around the custom calls, dispatch)."""
    from jax_sgrnn import _sgrnn_cpu

    fwd_bwd()
    _sgrnn_cpu.set_phase_timing(True)
    _sgrnn_cpu.take_phase_times()  # reset
    try:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fwd_bwd()
            times.append(time.perf_counter() - start)
        seconds = _sgrnn_cpu.take_phase_times()
    finally:
        _sgrnn_cpu.set_phase_timing(False)
    out = {k: 1e3 * seconds[k] / repeats for k in PHASES}
    out["total"] = 1e3 * statistics.mean(times)  # the phases are means too
    out["other"] = out["total"] - sum(out[k] for k in PHASES)
    return out


def print_phases(phases: dict) -> None:
    print("\nwhere the op's forward+backward goes, ms per call (kernel phase counters):")
    names = ("projection", "recurrence", "backward_recurrence", "weight_gradients",
             "input_gradient", "other", "total")
    heads = ("proj", "recur", "back recur", "weight grads", "input grad", "other", "total")
    print(f"{'T,N,I,H':>16} " + " ".join(f"{h:>12}" for h in heads))
    for spec, ms in phases.items():
        print(f"{spec:>16} " + " ".join(f"{ms[k]:12.2f}" for k in names))


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, help="T,N,I,H ...")
    parser.add_argument("--repeats", type=int, default=10,
                        help="minimum timed runs per measurement (fast ones run for 0.5 s)")
    parser.add_argument("--no-torch", action="store_true", help="skip PyTorch")
    parser.add_argument("--no-onednn", action="store_true", help="skip oneDNN")
    parser.add_argument("--threads", type=int,
                        help="run every contender on this many cores (default: all)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    if args.threads:
        # Before XLA, PyTorch's OpenMP or oneDNN's runtime size their pools from this mask.
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:args.threads])
    if "cpu" not in jax_sgrnn.NATIVE_PLATFORMS:
        raise SystemExit("jax_sgrnn's CPU handler did not load: nothing native to measure")
    try:
        if args.no_torch:
            raise ImportError
        import torch  # noqa: F401
        have_torch = True
    except ImportError:
        have_torch = False
    onednn = None if args.no_onednn else onednn_library()

    from jax_sgrnn import _sgrnn_cpu

    gemm_timer = large_gemm_timer()
    gemm = large_gemm_gflops()
    machine = dict(cpu=cpu_name(), cores=len(os.sched_getaffinity(0)),
                   isa=_sgrnn_cpu.selected_isa(),
                   jax=jax.__version__, date=time.strftime("%Y-%m-%d"), gemm_gflops=gemm)
    print(f"{machine['date']}; {machine['cpu']}, {machine['cores']} cores; kernels "
          f"{machine['isa']}; jax {jax.__version__}; float32; large GEMM {gemm:.0f} GFLOP/s "
          "at the start")
    print(f"median of >= {args.repeats} runs (>= 0.5 s) after warm-up, in {ROUNDS} rounds that "
          "interleave the contenders and the large GEMM; 'spread' is min-max; 'gemm' is the "
          "large GEMM's GFLOP/s in the row's rounds, '% gemm' the op's GFLOP/s over it")
    rows, phases = [], {}
    peers = ("torch", "onednn")
    header = (f"{'T,N,I,H':>16} {'pass':>8} {'op ms':>8} {'op spread':>13} {'scan ms':>8} "
              f"{'scan spread':>13} {'torch ms':>8} {'onednn':>8} {'xlaproj':>8} "
              f"{'op GF/s':>8} {'gemm':>6} {'% gemm':>7} {'vs scan':>8} {'vs torch':>8} "
              f"{'vs onednn':>9}")
    print(header)
    notes = {}
    for spec in args.shapes:
        T, N, I, H = map(int, spec.split(","))
        x, R, W, b, h0, c = problem(T, N, I, H)
        flops_fwd = 2.0 * T * N * H * (I + H)
        timers = {
            "op": jax_timers(jax_sgrnn.single_gate_rnn, x, R, W, b, h0, c),
            "scan": jax_timers(jax_sgrnn.reference, x, R, W, b, h0, c),
            "xla_proj": jax_timers(recurrence_only, x, R, W, b, h0, c),
        }
        if have_torch:
            *timers["torch"], notes["torch"] = torch_timers(x, R, W, b, h0, c)
        if onednn is not None:
            *timers["onednn"], notes[f"onednn {spec}"] = onednn_timers(onednn, x, R, W, b, h0, c)
        # The jvp's tangent adds dx W^T, x dW^T and (h m) dR^T to one more recurrence.
        passes = (("fwd", flops_fwd), ("fwd+bwd", 3 * flops_fwd), ("jvp", 3 * flops_fwd))
        for i, (name, flops) in enumerate(passes):
            stats = interleaved_stats({**{k: v[i] for k, v in timers.items() if v[i]},
                                       "gemm": gemm_timer}, args.repeats)
            row_gemm = 2.0 * GEMM_SIZE ** 3 / stats.pop("gemm")["median"] / 1e9
            t = {k: st["median"] for k, st in stats.items()}
            row = dict(shape=[T, N, I, H], pass_=name, **{f"{k}_ms": 1e3 * s for k, s in t.items()},
                       **{f"{k}_{m}_ms": 1e3 * st[m] for k, st in stats.items()
                          for m in ("min", "max")},
                       op_gflops=flops / t["op"] / 1e9, speedup_vs_scan=t["scan"] / t["op"])
            row["gemm_gflops"] = row_gemm
            row["op_fraction_of_gemm"] = row["op_gflops"] / row_gemm
            row.update({f"speedup_vs_{k}": t[k] / t["op"] for k in peers if k in t})
            rows.append(row)
            peer_ms = " ".join(f"{row[f'{k}_ms']:8.2f}" if k in t else f"{'-':>8}"
                               for k in peers)
            vs_peer = " ".join(f"{row[f'speedup_vs_{k}']:{w}.2f}x" if k in t else f"{'-':>{w + 1}}"
                               for k, w in zip(peers, (7, 8)))
            spread = lambda k: f"{row[f'{k}_min_ms']:.2f}-{row[f'{k}_max_ms']:.2f}"
            print(f"{spec:>16} {name:>8} {row['op_ms']:8.2f} {spread('op'):>13} "
                  f"{row['scan_ms']:8.2f} {spread('scan'):>13} {peer_ms} "
                  f"{row['xla_proj_ms']:8.2f} {row['op_gflops']:8.1f} {row_gemm:6.0f} "
                  f"{100 * row['op_fraction_of_gemm']:6.0f}% {row['speedup_vs_scan']:7.2f}x "
                  f"{vs_peer}", flush=True)
        fwd_ms, jvp_ms = (r["op_ms"] for r in rows[-3::2])
        print(f"{'':>16} jvp/fwd {jvp_ms / fwd_ms:8.2f} (the op's jvp over its forward)")
        phases[spec] = phase_ms(timers["op"][1], args.repeats)
    if "torch" in notes:
        print(f"torch {notes.pop('torch')}")
    for spec, note in notes.items():
        print(f"{spec}: {note}")
    print_phases(phases)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(machine=machine, rows=rows, phases_ms=phases), f, indent=1)
    return rows


if __name__ == "__main__":
    main()
