"""The MPSGraph backend's extension module (csrc/metal/module.cc; built on macOS only)."""

from typing import Any

def registrations() -> dict[str, Any]:
    """FFI target name -> handler capsule, for jax.ffi.register_ffi_target."""

def device_name() -> str:
    """The default Metal device's name, or "" when this process sees none."""

def self_check() -> dict[str, Any]:
    """Runs the self-check's problems through the MPSGraph handler; returns the report that
    jax_sgrnn.mps_self_check documents."""
