"""Errors against float64 on a GPU: the op (float32, the CUDA handler's path for the shape),
cuDNN (float32, TF32 off) and the plain ``lax.scan`` (float32, highest precision), for the
forward's y and the five gradients of sum(y * c), with bench_gpu.py's data. The reference is
PyTorch's RNN in float64 on the same GPU. Prints, per contender and output, the relative error
norm ||got - f64|| / ||f64|| and the largest absolute error. Unidirectional tanh.

    python benchmarks/accuracy_gpu.py 100,256,1024,1024 1000,8,128,128
"""
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_gpu  # noqa: E402  (the same data and contenders)

import jax_sgrnn  # noqa: E402

OUTPUTS = ["y", "dx", "dR", "dW", "db", "dh0"]


def run_jax(f, args, c) -> list:
    """y and the gradients of sum(y * c) with respect to (x, R, W, b, h0), as float64."""
    y = jax.jit(f)(*args)
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * c), argnums=(0, 1, 2, 3, 4)))(*args)
    return [np.asarray(v, np.float64) for v in (y, *grads)]


def run_torch(case, args, c, dtype) -> list:
    """The same through torch.nn.RNN (cuDNN where it runs) in `dtype`."""
    x, R, W, b, h0 = (torch.from_numpy(np.array(a)).cuda().to(dtype) for a in args)
    rnn = torch.nn.RNN(case.I, case.H, nonlinearity="tanh").cuda().to(dtype)
    with torch.no_grad():
        rnn.weight_ih_l0.copy_(W)
        rnn.weight_hh_l0.copy_(R)
        rnn.bias_ih_l0.copy_(b)
        rnn.bias_hh_l0.zero_()
    x.requires_grad_(True)
    h0 = h0[None].requires_grad_(True)
    y, _ = rnn(x, h0)
    y.backward(torch.from_numpy(np.array(c)).cuda().to(dtype))
    outs = [y, x.grad, rnn.weight_hh_l0.grad, rnn.weight_ih_l0.grad, rnn.bias_ih_l0.grad,
            h0.grad[0]]
    return [v.detach().double().cpu().numpy() for v in outs]


def main(specs) -> None:
    bench_gpu.set_tf32(False)
    for spec in specs:
        case = bench_gpu.Case.parse(spec)
        *args, c = bench_gpu.problem(case)
        reference = run_torch(case, args, c, torch.float64)
        op = lambda *a: jax_sgrnn.single_gate_rnn(*a, activation="tanh")  # noqa: E731
        results = {"op": run_jax(op, args, c),
                   "cuDNN": run_torch(case, args, c, torch.float32),
                   "scan": run_jax(bench_gpu.plain_scan, args, c)}
        print(f"\n{case}: ||got - f64|| / ||f64|| (largest absolute error)")
        print("| contender | " + " | ".join(OUTPUTS) + " |")
        for name, got in results.items():
            cells = [f"{np.linalg.norm(g - r) / np.linalg.norm(r):.2e} ({np.abs(g - r).max():.1e})"
                     for g, r in zip(got, reference)]
            print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:] or ["100,256,1024,1024"])
