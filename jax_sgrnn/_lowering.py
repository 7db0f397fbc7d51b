"""Lowering of the primitives: one rule per platform, parameterised by the backend entry.

The backend a call uses is in its static config (``OpConfig.backends``, chosen in ``ops.py``).
On a platform where that names a backend, the primitive lowers to the backend's FFI custom
call, with the inputs in the backend's compute dtype (``Backend.compute_dtype``) and the
results cast back; everywhere else (GPUs, TPUs, Apple's jax-metal, which cannot run custom
calls) to the ``lax.scan`` decomposition.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.interpreters import mlir

from ._backends import Backend, backend_for_platform, platforms
from ._primitives import OpConfig, forward_p, forward_reference, gradients_p
from ._primitives import gradients_reference
from ._sharding import partitioned
from ._spec import OPTIONAL_NAMES


def _ffi_operands(opt: dict, dtype) -> list:
    """Optional operands in schema order (csrc/sgrnn/ffi_schema.h's BindForward and
    BindGradients follow OPTIONAL_NAMES), in the compute dtype (the lengths in int32); absent
    ones as empty [0] placeholders."""
    dtypes = {name: jnp.int32 if name == "seq_lengths" else dtype for name in OPTIONAL_NAMES}
    return [jnp.zeros((0,), dtypes[n]) if opt[n] is None else opt[n].astype(dtypes[n])
            for n in OPTIONAL_NAMES]


def _ffi_forward(x, R, *rest, config: OpConfig, backend: Backend) -> list:
    dtype, cdt = x.dtype, backend.compute_dtype(x.dtype)
    training = config.descriptor.training
    D, H = config.descriptor.directions, R.shape[-1]
    state = jax.ShapeDtypeStruct((x.shape[0], x.shape[1], D * H), cdt)
    z_result = state if training else jax.ShapeDtypeStruct((0,), cdt)
    y, z = jax.ffi.ffi_call(backend.targets["forward"], (state, z_result))(
        x.astype(cdt), R.astype(cdt).reshape(D, H, H),
        *_ffi_operands(config.optionals(rest), cdt), **config.ffi_attributes())
    return [y.astype(dtype), z.astype(dtype)] if training else [y.astype(dtype)]


def _ffi_gradients(x, R, dy, z, *rest, config: OpConfig, backend: Backend) -> list:
    dtype, cdt = x.dtype, backend.compute_dtype(x.dtype)
    G, T, N, I = x.shape
    D, H = config.descriptor.directions, R.shape[-1]

    def result(shape, present=True):
        return jax.ShapeDtypeStruct(shape if present else (0,), cdt)

    results = (result((G, T, N, I)), result((G, D, H, H)),
               result((G, D * H, I), config.has_input_weight), result((G, D * H), config.has_bias),
               result((G, N, D * H), config.has_init_state))
    dx, dR, dW, db, dh0 = jax.ffi.ffi_call(backend.targets["gradients"], results)(
        x.astype(cdt), R.astype(cdt).reshape(D, H, H), dy.astype(cdt), z.astype(cdt),
        *_ffi_operands(config.optionals(rest), cdt), **config.ffi_attributes())
    grads = [dx, dR.reshape(G, *R.shape)]
    grads += [g for g, here in zip((dW, db, dh0), config.present[:3]) if here]
    return [g.astype(dtype) for g in grads]


def _lower(ctx, *args, config: OpConfig, platform: str, custom_call, decomposition):
    backend = backend_for_platform(config.backends, platform)
    if backend is None:  # XLA partitions the decomposition like any JAX code
        fn = functools.partial(decomposition, config=config)
    else:
        fn = partitioned(ctx, functools.partial(custom_call, backend=backend, config=config),
                         config)
    return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)


for _primitive, _custom_call, _decomposition in ((forward_p, _ffi_forward, forward_reference),
                                                 (gradients_p, _ffi_gradients,
                                                  gradients_reference)):
    mlir.register_lowering(_primitive, mlir.lower_fun(_decomposition, multiple_results=True))
    for _platform in platforms():
        mlir.register_lowering(
            _primitive, functools.partial(_lower, platform=_platform, custom_call=_custom_call,
                                          decomposition=_decomposition), platform=_platform)
