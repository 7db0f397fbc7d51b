"""jax_sgrnn: Apple MPSGraph's single-gate (Elman) RNN and its gradient op for JAX.

``single_gate_rnn`` / ``single_gate_rnn_gradients`` follow MPSGraph's semantics; on CPU they
run native XLA FFI handlers, elsewhere the ``lax.scan`` decomposition (``reference``).
"""

from ._native import NATIVE_PLATFORMS
from ._spec import Activation, SingleGateRNNDescriptor
from .ops import single_gate_rnn, single_gate_rnn_gradients
from .reference import reference, reference_gradients

__all__ = [
    "Activation",
    "NATIVE_PLATFORMS",
    "SingleGateRNNDescriptor",
    "reference",
    "reference_gradients",
    "single_gate_rnn",
    "single_gate_rnn_gradients",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    # jax_sgrnn.nn needs Flax (the [flax] extra): imported on first use, not with the package.
    if name == "nn":
        import importlib

        return importlib.import_module(".nn", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
