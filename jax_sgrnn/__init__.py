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
