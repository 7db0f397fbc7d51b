"""Public ops: ``single_gate_rnn`` and ``single_gate_rnn_gradients`` (MPSGraph's pair).

Inputs are validated here, at trace time; the primitives and their custom VJP follow.
"""

from __future__ import annotations

from typing import Optional, Union

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero, custom_vjp_primal_tree_values

from . import _lowering  # noqa: F401  (registers the lowerings)
from ._backends import backends_for
from ._primitives import OpConfig, forward_p, gradients_p
from ._spec import (INPUTS, OPERANDS, OPTIONAL_NAMES, Activation, SingleGateRNNDescriptor,
                    as_arrays, compute_dtype, resolve_descriptor, seq_lengths_operand, validate)
from .reference import reference, without_padding

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
    the mesh axes any of them varies over, as a primitive's operands must. Done before the
    custom VJP, so the transpose of that cast sums an invariant input's gradient (the weights')
    over the devices, exactly as for JAX's own ops."""
    axes = frozenset().union(*(_varying_axes(a) for a in arrays if a is not None))
    if not axes:
        return list(arrays)
    return [a if a is None or _varying_axes(a) == axes
            else lax.pcast(a, tuple(sorted(axes - _varying_axes(a))), to="varying")
            for a in arrays]


def _bind_forward(config, training, x, R, *optionals):
    return forward_p.bind(x, R, *(a for a in optionals if a is not None),
                          config=config.with_training(training))


def _bind_gradients(config, x, R, dy, z, *optionals) -> list:
    """The gradient primitive for one problem (a group axis of size 1 added to the operands
    that have one, and removed from the results)."""
    operands = [x, R, dy, z, *(a for a in optionals if a is not None)]
    out = gradients_p.bind(*(a[None] if OPERANDS[n].grouped else a
                             for n, a in zip(config.operand_names(gradients=True), operands)),
                           config=config)
    return [g[0] for g in out]


def _cotangents(config, residuals, dy) -> tuple:
    """Cotangents for every input (``_spec.INPUTS``) from the gradient op, given the forward's
    residuals (its inputs, then z); those that are not differentiable (the mask, the lengths)
    or absent get none."""
    x, R, *optionals, z = residuals
    grads = iter(_bind_gradients(config, x, R, dy, z, *optionals))
    return tuple(next(grads) if o.differentiable and a is not None else None
                 for o, a in zip(INPUTS, (x, R, *optionals)))


# y only: the primal call skips z; under differentiation the forward keeps z as the residual.
def _rnn(config, x, R, *optionals):
    return _bind_forward(config, False, x, R, *optionals)[0]


def _rnn_fwd(config, x, R, *optionals):
    y, z = _bind_forward(config, True, x, R, *optionals)
    return y, (x, R, *optionals, z)


def _rnn_bwd(config, residuals, dy):
    return _cotangents(config, residuals, dy)


_rnn = jax.custom_vjp(_rnn, nondiff_argnums=(0,))
_rnn.defvjp(_rnn_fwd, _rnn_bwd)


# (y, z), for training=True. MPSGraph's gradient op takes no cotangent for z, so when z itself
# is differentiated the backward falls back to the reference's autodiff (exact, slower).
def _rnn_with_z(config, x, R, *optionals):
    return tuple(_bind_forward(config, True, x, R, *optionals))


def _rnn_with_z_fwd(config, *primals):
    x, R, *optionals = custom_vjp_primal_tree_values(primals)
    y, z = _bind_forward(config, True, x, R, *optionals)
    return (y, z), (x, R, *optionals, z)


def _rnn_with_z_bwd(config, residuals, cotangents):
    x, R, W, b, h0, m, lengths, z = residuals
    dy, dz = (jnp.zeros(c.shape, c.dtype) if isinstance(c, SymbolicZero) else c
              for c in cotangents)
    if isinstance(cotangents[1], SymbolicZero):
        return _cotangents(config, residuals, dy)
    desc = config.descriptor.replace(training=True)
    _, vjp = jax.vjp(lambda *a: reference(*a, mask=m, seq_lengths=lengths, descriptor=desc),
                     x, R, W, b, h0)
    return (*vjp((dy, dz)), None, None)


_rnn_with_z = jax.custom_vjp(_rnn_with_z, nondiff_argnums=(0,))
_rnn_with_z.defvjp(_rnn_with_z_fwd, _rnn_with_z_bwd, symbolic_zeros=True)


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

    Differentiable with ``jax.grad`` (the backward is the gradient op) and batchable with
    ``jax.vmap``. Raises ``ValueError``/``TypeError`` on bad shapes or dtypes.
    """
    desc = resolve_descriptor(descriptor, reverse=reverse, bidirectional=bidirectional,
                              training=training, activation=activation)
    config, x, R, optionals, _ = _normalise(source, recurrent_weight, input_weight, bias,
                                            init_state, mask, seq_lengths, desc)
    x, R, *optionals = _vary_alike(x, R, *optionals)
    if desc.training:
        return _rnn_with_z(config, x, R, *optionals)
    return _rnn(config, x, R, *optionals)


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
    return _bind_gradients(config, x, R, dy, z, *optionals)
