"""Lowering of the primitives: one rule per platform, parameterised by the backend entry.

The backend a call uses is in its static config (``OpConfig.backends``, chosen in ``ops.py``).
On a platform where that names a backend, the primitive lowers to the backend's FFI custom
call, with the inputs in the backend's compute dtype (``Backend.compute_dtype``) and the
results cast back; everywhere else (ROCm, TPUs, Apple's jax-metal, which cannot run custom
calls), and for sizes the backend's handler does not run (``Backend.runs``), to the
``lax.scan`` decomposition.

A ``recurrence_only`` backend (CUDA) runs the sequential part alone: XLA applies the input
weight and bias before its forward call (one large matrix product over all steps), and
computes dW, dR, db and dx from the dz its gradient call returns.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import sharding_impls  # ShardingContext: what the program spans
from jax.interpreters import mlir

from ._backends import Backend, backend_for_platform, platforms
from ._primitives import OpConfig, forward_p, forward_reference, gradients_p
from ._primitives import gradients_reference
from .reference import recurrent_weight_gradient
from ._sharding import partitioned
from ._spec import OPERANDS, OPTIONAL_NAMES, known_sizes


def _ffi_operands(opt: dict, dtype) -> list:
    """Optional operands in schema order (csrc/sgrnn/ffi_schema.h's BindForward and
    BindGradients follow OPTIONAL_NAMES), in the compute dtype (the lengths in int32); absent
    ones as empty [0] placeholders."""
    dtypes = {n: jnp.int32 if OPERANDS[n].kind == "lengths" else dtype for n in OPTIONAL_NAMES}
    return [jnp.zeros((0,), dtypes[n]) if opt[n] is None else opt[n].astype(dtypes[n])
            for n in OPTIONAL_NAMES]


def _recurrence_only(config: OpConfig) -> OpConfig:
    """The config of a recurrence-only backend's custom call: no input weight or bias."""
    return config.without("input_weight", "bias")


def _project(x, W, b):
    """x W^T + b over the last axis of x (either may be absent), at full precision."""
    if W is not None:
        x = jnp.einsum("...i,hi->...h", x, W, precision=lax.Precision.HIGHEST)
    return x if b is None else x + b


def _ffi_forward(x, R, *rest, config: OpConfig, backend: Backend) -> list:
    dtype, cdt = x.dtype, backend.compute_dtype(x.dtype)
    training = config.descriptor.training
    D, H = config.descriptor.directions, R.shape[-1]
    state = jax.ShapeDtypeStruct((x.shape[0], x.shape[1], D * H), cdt)
    z_result = state if training else jax.ShapeDtypeStruct((0,), cdt)
    opt = {n: None if v is None else v.astype(cdt) for n, v in config.optionals(rest).items()}
    x = x.astype(cdt)
    if backend.recurrence_only:
        x = _project(x, opt["input_weight"], opt["bias"])
        opt["input_weight"] = opt["bias"] = None
        config = _recurrence_only(config)
    y, z = jax.ffi.ffi_call(backend.targets["forward"], (state, z_result))(
        x, R.astype(cdt).reshape(D, H, H), *_ffi_operands(opt, cdt), **config.ffi_attributes())
    return [y.astype(dtype), z.astype(dtype)] if training else [y.astype(dtype)]


def _ffi_gradients(x, R, dy, z, *rest, config: OpConfig, backend: Backend) -> list:
    dtype, cdt = x.dtype, backend.compute_dtype(x.dtype)
    G, T, N, I = x.shape
    D, H = config.descriptor.directions, R.shape[-1]

    def result(shape, present=True):
        return jax.ShapeDtypeStruct(shape if present else (0,), cdt)

    opt = {n: None if v is None else v.astype(cdt) for n, v in config.optionals(rest).items()}
    if backend.recurrence_only:
        return _recurrence_only_gradients(x, R, dy, z, opt, config=config, backend=backend)
    x, dy = x.astype(cdt), dy.astype(cdt)
    results = (result((G, T, N, I)), result((G, D, H, H)),
               result((G, D * H, I), config.has("input_weight")),
               result((G, D * H), config.has("bias")),
               result((G, N, D * H), config.has("init_state")))
    dx, dR, dW, db, dh0 = jax.ffi.ffi_call(backend.targets["gradients"], results)(
        x, R.astype(cdt).reshape(D, H, H), dy, z.astype(cdt), *_ffi_operands(opt, cdt),
        **config.ffi_attributes())
    grads = dict(source=dx, recurrent_weight=dR.reshape(G, *R.shape), input_weight=dW, bias=db,
                 init_state=dh0)  # the schema's results: each differentiable input's gradient
    return [grads[n].astype(dtype) for n in config.gradient_names()]


def _recurrence_only_gradients(x, R, dy, z, opt: dict, *, config: OpConfig,
                               backend: Backend) -> list:
    """The gradient op on a recurrence-only backend: its custom call returns dz (the gradient
    of the projected source) and dh0; XLA computes dx, dW, dR and db from dz, each one product
    (or sum) over all steps. The call does not read its source operand, and gets dy there,
    which has the shape it checks."""
    dtype, cdt = x.dtype, backend.compute_dtype(x.dtype)
    G, T, N, _ = x.shape
    D, H = config.descriptor.directions, R.shape[-1]
    has_h0 = config.has("init_state")
    empty = jax.ShapeDtypeStruct((0,), cdt)
    results = (jax.ShapeDtypeStruct((G, T, N, D * H), cdt), empty, empty, empty,
               jax.ShapeDtypeStruct((G, N, D * H) if has_h0 else (0,), cdt))
    W, x, dy, z = opt["input_weight"], x.astype(cdt), dy.astype(cdt), z.astype(cdt)
    h0, mask, lengths = opt["init_state"], opt["mask"], opt["seq_lengths"]
    opt = dict(opt, input_weight=None, bias=None)
    dz, _, _, _, dh0 = jax.ffi.ffi_call(backend.targets["gradients"], results)(
        dy, R.astype(cdt).reshape(D, H, H), dy, z, *_ffi_operands(opt, cdt),
        **_recurrence_only(config).ffi_attributes())
    dR = jax.vmap(functools.partial(recurrent_weight_gradient, descriptor=config.descriptor))(
        dz, z, jnp.zeros((G, N, D * H), cdt) if h0 is None else h0,
        None if mask is None else jnp.broadcast_to(mask, (G, T, N, D * H)),
        None if lengths is None else lengths.astype(jnp.int32))
    hi = lax.Precision.HIGHEST
    grads = [dz if W is None else jnp.einsum("gtnh,hi->gtni", dz, W, precision=hi),
             dR.reshape(G, *R.shape)]
    if W is not None:
        dz_dw = lax.optimization_barrier(dz) if _products_apart(G * T * N) else dz
        grads.append(jnp.einsum("gtnh,gtni->ghi", dz_dw, x, precision=hi))
    if config.has("bias"):
        grads.append(dz.sum(axis=(1, 2)))
    if has_h0:
        grads.append(dh0)
    return [g.astype(dtype) for g in grads]


# Rows (G T N) from which dW's and dR's products run apart. XLA merges the two (they share dz)
# into one product over [h_prev | x], which a fusion copies together first. On an H200 apart
# was faster from 12,800 rows (the fewest measured to gain) and slower at 8,000 and 3,200,
# where the merged product fills the GPU better (docs/performance.md, "What one call runs").
PRODUCTS_APART_ROWS = 12800


def _products_apart(rows) -> bool:
    """Whether dW's product is kept from merging with dR's (a symbolic size keeps XLA's
    choice)."""
    return known_sizes(rows) and rows >= PRODUCTS_APART_ROWS


# Steps per iteration of the decomposition's scans. XLA on GPUs runs each iteration's kernels
# as launches from the host, or as one CUDA graph where the body has enough of them (the lean
# forward step alone had too few), and evaluates the loop's condition once per iteration, so
# several steps per iteration cut the per-step overhead. 4 measured fastest over the benchmark
# shapes on an H200; 8 and 16 were slower at the large ones (docs/performance.md, "Unrolled
# scans"). Read at lowering time.
DECOMPOSITION_UNROLL = 4

# From this many elements in a step's output (rows, of all batched calls, times D*H), a scan
# whose steps DECOMPOSITION_UNROLL does not divide runs the most steps an iteration that do.
# lax.scan runs the steps left over as a loop of their own, slicing its inputs in two and
# concatenating the two loops' outputs: copies of the whole sequence, which outweigh the
# iterations saved where a step's output is large. On an H100 the (50,1024,700,700) forward
# took 3.54 ms at 4 steps an iteration and 3.30 at 2; at (50,32,1024,1024), 32,768 elements,
# the two ran level (docs/performance.md, "Unrolled scans").
WHOLE_ITERATIONS_FROM_ELEMENTS = 32768


def steps_per_iteration(steps, step_elements) -> int:
    """The decomposition's scans' steps per loop iteration for ``steps`` steps whose outputs
    hold ``step_elements`` elements each. A symbolic number of steps (shape-polymorphic export)
    takes one: lax.scan cannot unroll a length it does not know."""
    if not known_sizes(steps):
        return 1
    if not known_sizes(step_elements) or step_elements < WHOLE_ITERATIONS_FROM_ELEMENTS:
        return DECOMPOSITION_UNROLL
    return next((n for n in range(DECOMPOSITION_UNROLL, 1, -1) if steps % n == 0),
                DECOMPOSITION_UNROLL)


# Platforms whose decomposition takes the reference's ``gpu_form``: both directions of a
# bidirectional call in one scan, one-row backward products against a transposed R, and a few
# rows' products split along their contraction at H >= 1024 (docs/performance.md, "The
# decomposition"). XLA's CPU runs the first two slower (CPUs run the native handler).
GPU_FORM_PLATFORMS = ("cuda", "rocm")


def _lower_decomposition(ctx, *args, config: OpConfig, decomposition):
    """The ``lax.scan`` decomposition: the rule of platforms without a handler, and of calls
    their handler does not run. XLA partitions it like any JAX code."""
    source, weight = ctx.avals_in[:2]
    rows = math.prod(source.shape[:-3]) * source.shape[-2]
    unroll = steps_per_iteration(source.shape[-3],
                                 rows * config.descriptor.directions * weight.shape[-1])
    gpu_form = all(p in GPU_FORM_PLATFORMS for p in ctx.module_context.platforms)
    fn = functools.partial(decomposition, config=config, unroll=unroll, gpu_form=gpu_form)
    return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)


def _exporting_for_several_devices(ctx) -> bool:
    """Whether ``jax.export`` is lowering a program that spans several devices. Partitioning the
    custom calls there takes a Python callback at compile time (custom_partitioning), which an
    exported program cannot carry; the decomposition, which XLA partitions itself, exports."""
    axis_context = ctx.module_context.axis_context
    return (getattr(ctx.module_context.lowering_parameters, "for_export", False)
            and isinstance(axis_context, sharding_impls.ShardingContext)
            and axis_context.num_devices > 1)


def _lower(ctx, *args, config: OpConfig, platform: str, custom_call, decomposition):
    backend = backend_for_platform(config.backends, platform)
    gradients = custom_call is _ffi_gradients
    source, weight = ctx.avals_in[:2]
    if backend is not None and not backend.runs(source.shape[-3], weight.shape[-1],
                                                source.shape[-2], config.descriptor.directions,
                                                source.dtype, gradients):
        backend = None  # sizes (or GPUs) this handler's kernels do not run, or run slower
    if backend is not None and _exporting_for_several_devices(ctx):
        backend = None
    if backend is None:
        return _lower_decomposition(ctx, *args, config=config, decomposition=decomposition)
    fn = partitioned(ctx, functools.partial(custom_call, backend=backend, config=config), config)
    return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)


for _primitive, _custom_call, _scan in ((forward_p, _ffi_forward, forward_reference),
                                        (gradients_p, _ffi_gradients, gradients_reference)):
    mlir.register_lowering(_primitive, functools.partial(_lower_decomposition,
                                                         decomposition=_scan))
    for _platform in platforms():
        mlir.register_lowering(
            _primitive, functools.partial(_lower, platform=_platform, custom_call=_custom_call,
                                          decomposition=_scan), platform=_platform)
