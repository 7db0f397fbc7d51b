"""Public ops: ``single_gate_rnn`` and ``single_gate_rnn_gradients`` (MPSGraph's pair).

Inputs are validated here, at trace time, then bound to the primitives (``_primitives.py``,
differentiated by the rules in ``_autodiff.py``).
"""

from __future__ import annotations

from typing import Optional, Union

import jax
from jax import lax

from . import _lowering  # noqa: F401  (registers the lowerings)
from ._autodiff import bind_gradients
from ._backends import backends_for
from ._primitives import OpConfig, forward_p
from ._spec import (OPTIONAL_NAMES, Activation, SingleGateRNNDescriptor, as_arrays,
                    compute_dtype, resolve_descriptor, seq_lengths_operand, validate)
from .reference import without_padding

ArrayLike = jax.typing.ArrayLike


def _normalise(source, recurrent_weight, input_weight, bias, init_state, mask, seq_lengths,
               desc, state_arrays=()):
    """Validates the user's inputs; returns the op's config (training off; the forward binds
    set it), x, R, the optional inputs (in ``OPTIONAL_NAMES`` order, None where absent; the
    mask normalised: rank 3, compute dtype, no gradient; the lengths int32 in [0, T]) and the
    state arrays."""
    (x, R, W, b, h0, m, *states), lengths = as_arrays(
        source, recurrent_weight, input_weight, bias, init_state, mask,
        *(a for _, a in state_arrays), seq_lengths=seq_lengths)
    state_arrays = list(zip((n for n, _ in state_arrays), states))
    dtype, dims = validate(x, R, W, b, h0, m, desc.bidirectional, state_arrays, lengths)
    if m is not None:
        # Converted once, straight to the dtype the computation runs in (the spec's rule).
        m = lax.stop_gradient(m.astype(compute_dtype(dtype)).reshape((1,) * (3 - m.ndim) + m.shape))
    if lengths is not None:
        lengths = seq_lengths_operand(lengths, dims.T)
        # Padding content reaches no path (the handlers' dW takes dz^T x over all steps).
        x, h0, m = without_padding(lengths, dims.T, x, h0, m)
    optionals = (W, b, h0, m, lengths)
    config = OpConfig.of(desc.replace(training=False),
                         backends_for(dtype, seq_lengths=lengths is not None),
                         **dict(zip(OPTIONAL_NAMES, optionals)))
    return config, x, R, optionals, [a for _, a in state_arrays]


def _varying_axes(a) -> frozenset:
    """The ``shard_map`` mesh axes ``a`` varies over (none outside a checked shard_map)."""
    aval = jax.typeof(a)
    manual = getattr(aval, "manual_axis_type", None)  # jax >= 0.10; `vma` before
    return manual.varying if manual is not None else getattr(aval, "vma", frozenset())


def _vary_alike(*arrays) -> list:
    """Inside a ``shard_map`` with ``check_vma``, makes every operand vary over the union of
    the mesh axes any of them varies over, as a primitive's operands must. The transpose of that
    cast sums an invariant input's gradient (the weights') over the devices, exactly as for
    JAX's own ops."""
    axes = frozenset().union(*(_varying_axes(a) for a in arrays if a is not None))
    if not axes:
        return list(arrays)
    return [a if a is None or _varying_axes(a) == axes
            else lax.pcast(a, tuple(sorted(axes - _varying_axes(a))), to="varying")
            for a in arrays]


def _bind_forward(config, training, x, R, *optionals):
    return forward_p.bind(x, R, *(a for a in optionals if a is not None),
                          config=config.with_training(training))


def single_gate_rnn(
    source: ArrayLike,
    recurrent_weight: ArrayLike,
    input_weight: Optional[ArrayLike] = None,
    bias: Optional[ArrayLike] = None,
    init_state: Optional[ArrayLike] = None,
    mask: Optional[ArrayLike] = None,
    descriptor: Optional[SingleGateRNNDescriptor] = None,
    *,
    seq_lengths: Optional[ArrayLike] = None,
    reverse: Optional[bool] = None,
    bidirectional: Optional[bool] = None,
    training: Optional[bool] = None,
    activation: Union[Activation, str, int, None] = None,
):
    """MPSGraph's ``singleGateRNN``: ``z[k] = x'[t(k)] + (h[k-1] * m[k]) R^T``, ``h = act(z)``.

    Args:
      source: ``x``, ``[T, N, I]`` (``[T, N, D*H]`` without ``input_weight``).
      recurrent_weight: ``R``, ``[H, H]``, or ``[2, H, H]`` when bidirectional.
      input_weight: ``W``, ``[D*H, I]``; missing means no input projection at all.
      bias: ``b``, ``[D*H]``; missing means zeros.
      init_state: ``h0``, ``[N, D*H]``; missing means zeros.
      mask: broadcastable to ``[T, N, D*H]``, multiplies the recurrent input ``h[k-1]``;
        indexed by processing step; a constant (no gradient flows to it). Bool or float.
      descriptor: a :class:`SingleGateRNNDescriptor`; the keyword flags override its fields.
      seq_lengths: integer ``[N]``, each row's number of valid steps (padding at the end, as
        cuDNN's padded layout and Flax's ``nn.RNN(seq_lengths=...)``). Steps at and past a
        row's length leave its state unchanged and give zeros in ``y`` and ``z``; a reversed
        direction starts at the row's own last valid step, so the valid part of ``y`` equals
        the op run on the unpadded row. Concrete lengths outside ``[0, T]`` raise
        ``ValueError``; traced ones are clamped to it. Not differentiable (integers).

    Returns:
      ``y`` of shape ``[T, N, D*H]``, or ``(y, z)`` when ``training`` (``z`` is the
      pre-activation "zState" that :func:`single_gate_rnn_gradients` takes).

    Differentiable in reverse mode (``jax.grad``, ``jax.vjp``: the backward is the gradient
    op) and forward mode (``jax.jvp``, ``jax.jacfwd``, ``jax.linearize``: the tangent runs as
    one more call of the forward recurrence), and batchable with ``jax.vmap``. Raises
    ``ValueError``/``TypeError`` on bad shapes or dtypes.
    """
    desc = resolve_descriptor(descriptor, reverse=reverse, bidirectional=bidirectional,
                              training=training, activation=activation)
    config, x, R, optionals, _ = _normalise(source, recurrent_weight, input_weight, bias,
                                            init_state, mask, seq_lengths, desc)
    x, R, *optionals = _vary_alike(x, R, *optionals)
    out = _bind_forward(config, desc.training, x, R, *optionals)
    return tuple(out) if desc.training else out[0]


def single_gate_rnn_gradients(
    source: ArrayLike,
    recurrent_weight: ArrayLike,
    source_gradient: ArrayLike,
    z_state: ArrayLike,
    input_weight: Optional[ArrayLike] = None,
    bias: Optional[ArrayLike] = None,
    init_state: Optional[ArrayLike] = None,
    mask: Optional[ArrayLike] = None,
    descriptor: Optional[SingleGateRNNDescriptor] = None,
    *,
    seq_lengths: Optional[ArrayLike] = None,
    reverse: Optional[bool] = None,
    bidirectional: Optional[bool] = None,
    training: Optional[bool] = None,
    activation: Union[Activation, str, int, None] = None,
) -> list:
    """MPSGraph's ``singleGateRNNGradients``.

    Args:
      source, recurrent_weight, input_weight, bias, init_state, mask, descriptor, seq_lengths:
        as given to :func:`single_gate_rnn`. ``training`` (keyword or descriptor field) is accepted so that
        the forward's descriptor can be passed as it is, and has no effect here.
      source_gradient: ``dL/dy``, laid out like ``y``.
      z_state: the ``z`` returned by :func:`single_gate_rnn` with ``training=True``.

    Returns:
      ``[d source, d recurrent_weight]`` followed by ``d input_weight``, ``d bias`` and
      ``d init_state`` for those given, in that order (MPSGraph's list). No gradient is
      returned for the mask or the lengths. ``d bias`` has the bias's shape. With
      ``seq_lengths``, ``source_gradient`` and ``z_state`` at padded steps are ignored and
      ``d source`` is zero there.
    """
    desc = resolve_descriptor(descriptor, reverse=reverse, bidirectional=bidirectional,
                              training=training, activation=activation)
    config, x, R, optionals, (dy, z) = _normalise(
        source, recurrent_weight, input_weight, bias, init_state, mask, seq_lengths, desc,
        state_arrays=(("source_gradient", source_gradient), ("z_state", z_state)))
    x, R, dy, z, *optionals = _vary_alike(x, R, dy, z, *optionals)
    return bind_gradients(config, x, R, dy, z, *optionals)
