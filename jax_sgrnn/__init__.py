"""jax_sgrnn: Apple MPSGraph's single-gate (Elman) RNN and its gradient op for JAX.

``single_gate_rnn`` / ``single_gate_rnn_gradients`` follow MPSGraph's semantics; on CPU they
run a native XLA FFI handler (C++, or MPSGraph on an Apple GPU: ``set_cpu_backend``),
elsewhere the ``lax.scan`` decomposition (``reference``). ``backends()`` says which handlers
are available here.
"""

from importlib.metadata import PackageNotFoundError, version

from ._backends import (Backend, backends, cpu_backend, cuda_handler, export_safety_checks,
                        get_cpu_backend, mps_self_check, set_cpu_backend, use_cuda_handler)
from ._spec import Activation, SingleGateRNNDescriptor
from .ops import single_gate_rnn, single_gate_rnn_gradients
from .reference import reference, reference_gradients

__all__ = [
    "Activation",
    "Backend",
    "NATIVE_PLATFORMS",
    "SingleGateRNNDescriptor",
    "backends",
    "cpu_backend",
    "cuda_handler",
    "export_safety_checks",
    "get_cpu_backend",
    "mps_self_check",
    "reference",
    "reference_gradients",
    "set_cpu_backend",
    "single_gate_rnn",
    "single_gate_rnn_gradients",
    "use_cuda_handler",
]

#: Platforms for which some native backend's handler is registered, so that programs for them
#: lower to its custom calls (everywhere else: the decomposition). Lowering needs no device: a
#: CUDA build lists "cuda" on a machine without a GPU; ``backends()[name].runs_here`` says
#: whether a handler can also run in this process.
NATIVE_PLATFORMS: tuple[str, ...] = tuple(
    dict.fromkeys(b.platform for b in backends().values() if b.available))

try:  # one source for the version: pyproject.toml, through the installed metadata
    __version__ = version("jax-sgrnn")
except PackageNotFoundError:  # an uninstalled source tree
    __version__ = "0+unknown"


def __getattr__(name: str):
    # jax_sgrnn.nn needs Flax (the [flax] extra): imported on first use, not with the package.
    if name == "nn":
        import importlib

        return importlib.import_module(".nn", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
