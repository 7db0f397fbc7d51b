"""Per-platform lowering of the primitives.

CPU: the FFI custom calls of ``csrc/cpu``. Every other platform (GPUs, TPUs, Apple's
jax-metal, which cannot run custom calls): the ``lax.scan`` decomposition. float16 and
bfloat16 are widened to float32 around the custom call, so handlers see float32 or float64.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.interpreters import mlir

from . import _native
from ._primitives import OpConfig, forward_p, forward_reference, gradients_p
from ._primitives import gradients_reference
from ._spec import OPTIONAL_NAMES
from .reference import compute_dtype


def _ffi_operands(opt: dict, dtype) -> list:
    """Optional operands in schema order; absent ones as empty [0] placeholders."""
    return [jnp.zeros((0,), dtype) if opt[n] is None else opt[n].astype(dtype)
            for n in OPTIONAL_NAMES]


def _ffi_forward(x, R, *rest, config: OpConfig) -> list:
    dtype, cdt = x.dtype, compute_dtype(x.dtype)
    training = config.descriptor.training
    D, H = config.descriptor.directions, R.shape[-1]
    state = jax.ShapeDtypeStruct((x.shape[0], x.shape[1], D * H), cdt)
    z_result = state if training else jax.ShapeDtypeStruct((0,), cdt)
    y, z = jax.ffi.ffi_call(_native.FORWARD_TARGET, (state, z_result))(
        x.astype(cdt), R.astype(cdt).reshape(D, H, H),
        *_ffi_operands(config.optionals(rest), cdt), **config.ffi_attributes(training))
    return [y.astype(dtype), z.astype(dtype)] if training else [y.astype(dtype)]


def _ffi_gradients(x, R, dy, z, *rest, config: OpConfig) -> list:
    dtype, cdt = x.dtype, compute_dtype(x.dtype)
    opt = config.optionals(rest)
    G, T, N, I = x.shape
    D, H = config.descriptor.directions, R.shape[-1]
    result = lambda shape, present=True: jax.ShapeDtypeStruct(shape if present else (0,), cdt)
    results = (result((G, T, N, I)), result((G, D, H, H)),
               result((G, D * H, I), config.has_input_weight), result((G, D * H), config.has_bias),
               result((G, N, D * H), config.has_init_state))
    dx, dR, dW, db, dh0 = jax.ffi.ffi_call(_native.GRADIENTS_TARGET, results)(
        x.astype(cdt), R.astype(cdt).reshape(D, H, H), dy.astype(cdt), z.astype(cdt),
        *_ffi_operands(opt, cdt), **config.ffi_attributes(training=False))
    grads = [dx, dR.reshape(G, *R.shape)]
    grads += [g for g, here in zip((dW, db, dh0), config.present[:3]) if here]
    return [g.astype(dtype) for g in grads]


mlir.register_lowering(forward_p, mlir.lower_fun(forward_reference, multiple_results=True))
mlir.register_lowering(gradients_p, mlir.lower_fun(gradients_reference, multiple_results=True))
if "cpu" in _native.NATIVE_PLATFORMS:
    mlir.register_lowering(forward_p, mlir.lower_fun(_ffi_forward, multiple_results=True),
                           platform="cpu")
    mlir.register_lowering(gradients_p, mlir.lower_fun(_ffi_gradients, multiple_results=True),
                           platform="cpu")
