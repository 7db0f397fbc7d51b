"""XLA's dot algorithms on the products the CUDA lowering runs around its kernels.

The lowering applies the input weight and computes dx, dW and dR with XLA's products at
``Precision.HIGHEST`` (float32 on the FMA lanes). This times each product shape of the
benchmark's large rows alone under each of ``lax.DotAlgorithmPreset``'s float32 algorithms
(runs of 20 jitted calls back to back and one wait, the algorithms of a product interleaved
by bench_cpu.py's ``interleaved_stats``, as bench_gpu.py times its contenders; the median
run) and prints its error against the same product in float64: the relative norm, and the
largest error over the sum of |a||b| of its entry (docs/performance.md, "Tried and not kept").
Needs an NVIDIA GPU.

    python benchmarks/dot_algorithms.py
"""

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_cpu import interleaved_stats  # noqa: E402  (the benchmarks' timing rule)

jax.config.update("jax_enable_x64", True)

ALGORITHMS = {
    "HIGHEST": lax.Precision.HIGHEST,
    "TF32_X3": lax.DotAlgorithmPreset.TF32_TF32_F32_X3,
    "BF16_X6": lax.DotAlgorithmPreset.BF16_BF16_F32_X6,
    "BF16_X9": lax.DotAlgorithmPreset.BF16_BF16_F32_X9,
    "TF32": lax.DotAlgorithmPreset.TF32_TF32_F32,
}
# (name, einsum, left operand, right operand): "mi,hi->mh" is a projection or dx (M x K by
# N x K), "mh,mi->hi" a weight gradient (contracting the T N rows).
PRODUCTS = [
    ("projection 100x256, 1024 -> 1024", "mi,hi->mh", (25600, 1024), (1024, 1024)),
    ("dW 1024 x 25600 x 1024", "mh,mi->hi", (25600, 1024), (25600, 1024)),
    ("projection 50x1024, 256 -> 256", "mi,hi->mh", (51200, 256), (256, 256)),
    ("dW 256 x 51200 x 256", "mh,mi->hi", (51200, 256), (51200, 256)),
    ("projection 200x64, 512 -> 512", "mi,hi->mh", (12800, 512), (512, 512)),
    ("one step 256 x 1024 x 1024", "mi,hi->mh", (256, 1024), (1024, 1024)),
]


CALLS = 20  # back to back in each timed run
RUNS = 7


def back_to_back(product, a, b):
    """CALLS calls of ``product`` and one wait for the last."""
    def run():
        for _ in range(CALLS):
            out = product(a, b)
        out.block_until_ready()
    return run


def main() -> None:
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
    for name, spec, a_shape, b_shape in PRODUCTS:
        a = jax.random.normal(jax.random.PRNGKey(0), a_shape, jnp.float32)
        b = jax.random.normal(jax.random.PRNGKey(1), b_shape, jnp.float32)
        a64, b64 = a.astype(jnp.float64), b.astype(jnp.float64)
        exact = jnp.einsum(spec, a64, b64, precision=lax.Precision.HIGHEST)
        scale = jnp.einsum(spec, jnp.abs(a64), jnp.abs(b64), precision=lax.Precision.HIGHEST)
        flops = 2 * np.prod(a_shape) * (b_shape[0] if spec.startswith("mi,hi") else b_shape[1])
        runs, errors = {}, {}
        for label, algorithm in ALGORITHMS.items():
            product = jax.jit(lambda a, b, algorithm=algorithm: jnp.einsum(
                spec, a, b, precision=algorithm, preferred_element_type=jnp.float32))
            try:
                errors[label] = product(a, b).astype(jnp.float64) - exact
            except Exception as err:  # an algorithm this XLA or GPU does not run
                print(f"{name:34s} {label:8s} not run: {str(err).splitlines()[0][:100]}")
                continue
            runs[label] = back_to_back(product, a, b)
        stats = interleaved_stats(runs, RUNS, warmup=1, min_total=0.0, pause=0.0)
        for label, error in errors.items():
            relative = float(jnp.linalg.norm(error) / jnp.linalg.norm(exact))
            largest = float(jnp.max(jnp.abs(error) / scale))
            ms = 1e3 * stats[label]["median"] / CALLS
            print(f"{name:34s} {label:8s} {ms:8.3f} ms {flops / ms / 1e9:6.1f} TFLOP/s  "
                  f"relative norm {relative:.1e}  largest {largest:.1e}")


if __name__ == "__main__":
    main()
