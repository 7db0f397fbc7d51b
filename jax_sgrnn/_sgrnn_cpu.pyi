"""The native CPU backend's extension module (csrc/cpu/module.cc)."""

from typing import Any

def registrations() -> dict[str, Any]:
    """FFI target name -> handler capsule, for jax.ffi.register_ffi_target."""

def target_names() -> dict[str, dict[str, str]]:
    """Backend name -> {"forward": target, "gradients": target}, for every backend."""

def missing_backend_handlers() -> dict[str, tuple[Any, Any]]:
    """Backend name -> (forward, gradients) capsules of handlers that fail with an error naming
    that backend; registered for backends whose module did not load."""

def selected_isa() -> str:
    """The instruction-set build of the CPU kernels in use (SGRNN_CPU_ISA overrides)."""

def set_phase_timing(on: bool) -> None:
    """Turns the kernels' per-phase wall-time counters on or off (off by default)."""

def take_phase_times() -> dict[str, float]:
    """Seconds per kernel phase (projection, recurrence, backward_recurrence,
    weight_gradients, input_gradient) since the last call, which resets them."""
