"""Loads the compiled handlers and registers their FFI targets with XLA, once, at import."""

from __future__ import annotations

import ctypes
import os
import warnings

import jax
import scipy_openblas32

# The extension links libscipy_openblas; loading it by path first lets the extension find it
# wherever pip put scipy-openblas32 (the extension's rpath covers only a shared site-packages).
ctypes.CDLL(os.path.join(scipy_openblas32.get_lib_dir(), scipy_openblas32.get_library(True)),
            mode=ctypes.RTLD_GLOBAL)

try:
    from . import _sgrnn_cpu
except ImportError as err:  # e.g. running from a source tree that was never built
    _sgrnn_cpu = None
    warnings.warn(f"jax_sgrnn: native CPU handler unavailable ({err}); the op falls back to "
                  "its lax.scan decomposition on CPU", RuntimeWarning, stacklevel=2)

FORWARD_TARGET = "jax_sgrnn_forward"
GRADIENTS_TARGET = "jax_sgrnn_gradients"

#: Platforms on which the op runs a native handler (everywhere else: the decomposition).
NATIVE_PLATFORMS: tuple[str, ...] = ()

if _sgrnn_cpu is not None:
    for _name, _capsule in _sgrnn_cpu.registrations().items():
        jax.ffi.register_ffi_target(_name, _capsule, platform="cpu")
    NATIVE_PLATFORMS += ("cpu",)
