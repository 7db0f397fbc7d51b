"""The CUDA backend's extension module (csrc/cuda/module.cc; built where nvcc is found)."""

from typing import Any

def registrations() -> dict[str, Any]:
    """FFI target name -> handler capsule, for jax.ffi.register_ffi_target."""

def runs_on_chip(steps: int, hidden: int, batch: int, directions: int, itemsize: int) -> bool:
    """Whether the recurrence kernels run these sizes on every visible GPU and are expected to
    beat the lax.scan decomposition for this batch (csrc/cuda/recurrence_plan.h, RunsOnChip;
    SGRNN_CUDA_GRID=0 or 1 changes where the grid kernels count; any other value of it raises
    ValueError)."""
