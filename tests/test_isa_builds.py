"""Every instruction-set build of the CPU kernels against the reference, and the build picked
at load time against the CPU's level.

The process picks one build at load time (the best the CPU runs); SGRNN_CPU_ISA selects
another, so each build is checked in a subprocess of its own.
"""

import os
import platform
import subprocess
import sys
import textwrap

import pytest

import jax_sgrnn

CHECK = textwrap.dedent("""
    import itertools, sys
    import jax, jax.numpy as jnp, numpy as np
    jax.config.update("jax_enable_x64", True)
    import jax_sgrnn
    from jax_sgrnn import _sgrnn_cpu
    assert _sgrnn_cpu.selected_isa() == sys.argv[1], _sgrnn_cpu.selected_isa()
    rng = np.random.default_rng(0)
    T, N, I, H = 9, 5, 3, 40  # large enough for the parallel pieces
    # Each activation in each dtype, the (bidirectional, reverse) pairs cycling with it: what a
    # build compiles differently is its vector code, the same for every time order.
    pairs = list(itertools.product([False, True], [False, True]))
    for dtype, tol in ((np.float64, 1e-10), (np.float32, 2e-5)):
        for i, act in enumerate(["none", "relu", "tanh", "sigmoid", "hard_sigmoid"]):
            bidi, rev = pairs[(i + (dtype == np.float32)) % len(pairs)]
            D = 2 if bidi else 1
            a = lambda *s, scale=1.0: jnp.asarray(rng.normal(size=s) * scale, dtype)
            args = (a(T, N, I), a(*((2, H, H) if bidi else (H, H)), scale=0.3 / H ** 0.5),
                    a(D * H, I), a(D * H), a(N, D * H), rng.random((T, 1, D * H)) > 0.3)
            kw = dict(activation=act, bidirectional=bidi, reverse=rev)
            loss = lambda f: lambda *p: jnp.sum(jnp.sin(f(*p, **kw)))
            for got, want in zip(jax.grad(loss(jax_sgrnn.single_gate_rnn), argnums=(0, 1, 2, 3, 4))(*args),
                                 jax.grad(loss(jax_sgrnn.reference), argnums=(0, 1, 2, 3, 4))(*args)):
                np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=str((dtype, kw)))
    # The packed per-step product's tiles: 1-8 rows (one or two panels per tile, by build) and
    # panel counts even and odd, last panel partial (H = 70, 100 against 16- and 32-column panels);
    # N = 70: bands of 35 rows (at H = 100 the steps split across threads), several blocks a step.
    for N, H in itertools.product([1, 2, 3, 8, 70], [70, 100]):
        a = lambda *s, scale=1.0: jnp.asarray(rng.normal(size=s) * scale, np.float32)
        args = (a(3, N, 4), a(H, H, scale=0.5 / H ** 0.5), a(H, 4), a(H), a(N, H))
        loss = lambda f: lambda *p: jnp.sum(jnp.sin(f(*p, activation="tanh")))
        for got, want in zip(jax.grad(loss(jax_sgrnn.single_gate_rnn), argnums=(0, 1, 2))(*args),
                             jax.grad(loss(jax_sgrnn.reference), argnums=(0, 1, 2))(*args)):
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5, err_msg=str((N, H)))
    # The packed projection x W^T and input gradient dz W: K != columns, neither a multiple of
    # a panel, rows split across threads (over 2^20 multiply-adds), both directions' columns.
    # dW and dR sum 1,200 rows of O(1) terms into entries of up to ~100, so float32's 1e-5 is
    # taken relative to each gradient's largest entry (a near-zero entry is a cancellation).
    for bidi in [False, True]:
        D, H, I = (2 if bidi else 1), 70, 45
        a = lambda *s, scale=1.0: jnp.asarray(rng.normal(size=s) * scale, np.float32)
        args = (a(40, 30, I), a(*((2, H, H) if bidi else (H, H)), scale=0.5 / H ** 0.5),
                a(D * H, I, scale=I ** -0.5), a(D * H), a(30, D * H))
        loss = lambda f: lambda *p: jnp.sum(jnp.sin(f(*p, activation="tanh", bidirectional=bidi)))
        for got, want in zip(jax.grad(loss(jax_sgrnn.single_gate_rnn), argnums=(0, 1, 2, 3, 4))(*args),
                             jax.grad(loss(jax_sgrnn.reference), argnums=(0, 1, 2, 3, 4))(*args)):
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max(),
                                       err_msg=str(bidi))
    # Saturation and NaN, where the builds' rational tanh differs most.
    x = jnp.asarray([[[1e30]], [[-1e30]], [[jnp.nan]]], jnp.float32)
    for act in ["tanh", "sigmoid", "relu", "hard_sigmoid"]:
        R = jnp.zeros((1, 1), jnp.float32)
        np.testing.assert_array_equal(jax_sgrnn.single_gate_rnn(x, R, activation=act),
                                      jax_sgrnn.reference(x, R, activation=act))
    print("ok")
""")


@pytest.mark.parametrize("isa", ["baseline", "x86-64-v3", "x86-64-v4"])
def test_instruction_set_build_matches_reference(isa):
    if "cpu" not in jax_sgrnn.NATIVE_PLATFORMS:
        pytest.fail("the CPU handler did not load")
    env = dict(os.environ, SGRNN_CPU_ISA=isa, JAX_PLATFORMS="cpu")
    # cwd: away from the repository root, whose uninstalled jax_sgrnn/ would shadow the
    # installed package in a `python -c` child.
    here = os.path.dirname(__file__)
    probe = subprocess.run(
        [sys.executable, "-c", "from jax_sgrnn import _sgrnn_cpu as m; "
                               "print(m.selected_isa())"],
        env=env, capture_output=True, text=True, check=True, cwd=here)
    if probe.stdout.strip() != isa:
        pytest.skip(f"this CPU does not run the {isa} build")
    result = subprocess.run([sys.executable, "-c", CHECK, isa], env=env, capture_output=True,
                            text=True, cwd=here)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")


# The psABI's levels by the Linux kernel's names for the CPUID flags (pni: SSE3, abm: LZCNT,
# xsave: the OS uses XSAVE). The kernel lists the AVX flags only where it saves their registers.
X86_64_V2_FLAGS = {"pni", "ssse3", "sse4_1", "sse4_2", "popcnt", "cx16", "lahf_lm"}
X86_64_V3_FLAGS = {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
X86_64_V4_FLAGS = {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


def test_load_time_choice_matches_cpuinfo():
    """The build picked with SGRNN_CPU_ISA unset is the best this CPU runs, by /proc/cpuinfo: a
    build whose CPU detection answers "baseline" everywhere (as __builtin_cpu_supports does
    under zig's clang) fails here."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        pytest.skip("the level is read from /proc/cpuinfo on Linux x86-64 only")
    if "cpu" not in jax_sgrnn.NATIVE_PLATFORMS:
        pytest.fail("the CPU handler did not load")
    with open("/proc/cpuinfo") as cpuinfo:
        flags = next(set(line.split(":", 1)[1].split()) for line in cpuinfo
                     if line.startswith("flags"))
    want = "baseline"
    if (X86_64_V2_FLAGS | X86_64_V3_FLAGS) <= flags:
        want = "x86-64-v4" if X86_64_V4_FLAGS <= flags else "x86-64-v3"
    env = {k: v for k, v in os.environ.items() if k != "SGRNN_CPU_ISA"}
    env["JAX_PLATFORMS"] = "cpu"
    probe = subprocess.run(  # cwd: as in the test above
        [sys.executable, "-c", "from jax_sgrnn import _sgrnn_cpu as m; print(m.selected_isa())"],
        env=env, capture_output=True, text=True, check=True, cwd=os.path.dirname(__file__))
    assert probe.stdout.strip() == want, f"/proc/cpuinfo shows {want}"
