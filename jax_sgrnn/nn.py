"""Flax NNX modules around :func:`jax_sgrnn.single_gate_rnn` (optional extra ``[flax]``).

``import jax_sgrnn`` never imports Flax; ``import jax_sgrnn.nn`` does.

* :class:`SingleGateRNN` is one (optionally bidirectional) single-gate RNN layer.
* :class:`StackedSingleGateRNN` stacks several, with optional dropout between layers
  (``nnx.Dropout`` on each layer's input) and optional variational "recurrent dropout",
  which goes through the op's ``mask`` (one Bernoulli mask per sequence and layer, the same at
  every time step, multiplying the recurrent input ``h[k-1]``).

Both take ``impl="op"`` (the custom call, native on CPU) or ``impl="reference"`` (the pure
``lax.scan`` decomposition), so the two can be compared on the same model. Parameters use the
op's layout (``input_weight`` ``[D*H, I]``, ``recurrent_weight`` ``[H, H]`` or ``[2, H, H]``,
``bias`` ``[D*H]``) and are initialised, by default, like PyTorch's ``nn.RNN``: uniform in
``(-1/sqrt(H), 1/sqrt(H))``.
"""

from __future__ import annotations

import math
from typing import Literal, Optional, Sequence, TypedDict, Union, Unpack

import jax
import jax.numpy as jnp
from flax import nnx
from jax.nn.initializers import Initializer

from ._spec import Activation, SingleGateRNNDescriptor, check_shapes, shape_of
from .ops import single_gate_rnn
from .reference import reference

__all__ = ["LayerOptions", "SingleGateRNN", "StackedSingleGateRNN", "final_state",
           "symmetric_uniform"]

Impl = Literal["op", "reference"]
# What a call takes for an array, as the functional ops do (they call jnp.asarray).
ArrayLike = Union[jax.typing.ArrayLike, Sequence]
_IMPLS = {"op": single_gate_rnn, "reference": reference}


class LayerOptions(TypedDict, total=False):
    """The keyword options of :class:`SingleGateRNN` that :class:`StackedSingleGateRNN` applies
    to each of its layers (their defaults and meaning: :class:`SingleGateRNN`)."""

    activation: Union[Activation, str, int]
    bidirectional: bool
    use_bias: bool
    use_input_weight: bool
    time_major: bool
    impl: Impl
    dtype: Optional[jnp.dtype]
    param_dtype: jnp.dtype
    input_weight_init: Optional[Initializer]
    recurrent_weight_init: Optional[Initializer]
    bias_init: Optional[Initializer]


def symmetric_uniform(bound: float) -> Initializer:
    """An initialiser drawing uniformly from ``(-bound, bound)``."""

    def init(key: jax.Array, shape, dtype=jnp.float32) -> jax.Array:
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    return init


def final_state(y: jax.Array, descriptor: SingleGateRNNDescriptor,
                seq_lengths: Optional[jax.Array] = None,
                init_state: Optional[jax.Array] = None) -> jax.Array:
    """The last state of each direction, ``[N, D*H]``, from a time-major output ``y``.

    Forward direction (and unidirectional ``reverse``, whose outputs stay in processing
    order): ``y[L-1]``, with ``L`` the row's length (``T`` without ``seq_lengths``). Backward
    half of a bidirectional RNN: ``y[0, :, H:]``. A row with no steps keeps ``init_state``
    (zeros when missing), as Flax's ``nn.RNN`` does.
    """
    T, N, DH = y.shape
    lengths = (jnp.full((N,), T) if seq_lengths is None
               else jnp.clip(jnp.asarray(seq_lengths), 0, T))
    if T == 0:
        last = jnp.zeros((N, DH), y.dtype)
    else:
        last = y[jnp.maximum(lengths - 1, 0), jnp.arange(N)]
        if descriptor.bidirectional:
            last = jnp.concatenate([last[:, :DH // 2], y[0, :, DH // 2:]], axis=-1)
    start = jnp.zeros((N, DH), y.dtype) if init_state is None else init_state.astype(y.dtype)
    return jnp.where((lengths > 0)[:, None], last, start)


def _asarray(name: str, value) -> jax.Array:
    """``value`` (an array, a numpy array or a nested list or tuple) as a jax array, as the
    functional ops take it."""
    try:
        return jnp.asarray(value)
    except (TypeError, ValueError) as error:  # e.g. ragged: name the argument, not the list
        raise ValueError(f"{name}: expected an array or a nested sequence of one shape; "
                         f"{error}") from None


def _layout(time_major: bool) -> tuple[str, str]:
    """The user's layout as messages name it: its name and its two leading axes."""
    return ("time-major", "T, N") if time_major else ("batch-first", "N, T")


def _swap_leading(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A ``[T, N, ...]`` shape as ``[N, T, ...]`` and back."""
    return (shape[1], shape[0], *shape[2:])


def _time_major_mask(mask: jax.Array) -> jax.Array:
    """A batch-first mask (broadcastable to ``[N, T, D*H]``) as a time-major one."""
    return jnp.swapaxes(mask.reshape((1,) * (3 - mask.ndim) + mask.shape), 0, 1)


class SingleGateRNN(nnx.Module):
    """One single-gate (Elman) RNN layer: ``h[k] = act(x[t(k)] W^T + b + (h[k-1] * m[k]) R^T)``.

    Semantics are MPSGraph's (see the project's spec): with ``reverse`` the layer reads the
    sequence backwards and keeps its outputs in processing order (``y[k]`` is the state after
    reading ``x[T-1-k]``); when ``bidirectional`` the output's features are
    ``[forward H, backward H]`` and the backward half is stored in original time order.

    Args:
      in_features: ``I``, the input's feature size.
      hidden_features: ``H``, the hidden size (per direction).
      activation: ``"tanh"`` (default, as PyTorch's ``nn.RNN``), ``"relu"``, ``"sigmoid"``,
        ``"hard_sigmoid"`` or ``"none"``; or an :class:`~jax_sgrnn.Activation`.
      bidirectional: run a forward and a backward direction (output features ``2H``).
      reverse: read the sequence backwards (unidirectional only; ignored when bidirectional).
      use_bias: add a learned bias ``[D*H]``.
      use_input_weight: learn an input projection ``W`` ``[D*H, I]``; without it the input is
        used as is and ``in_features`` must equal ``D*H``.
      time_major: inputs and outputs are ``[T, N, ...]``; by default they are batch-first,
        ``[N, T, ...]``.
      impl: ``"op"`` (:func:`jax_sgrnn.single_gate_rnn`) or ``"reference"``
        (:func:`jax_sgrnn.reference`, plain ``lax.scan``).
      dtype: the computation dtype; by default the promotion of the input's and the
        parameters' dtypes.
      param_dtype: the parameters' dtype.
      input_weight_init, recurrent_weight_init, bias_init: initialisers ``(key, shape, dtype)``;
        the default for each is :func:`symmetric_uniform` with bound ``1/sqrt(H)``.
      rngs: the ``params`` stream initialises the parameters.
    """

    def __init__(
        self,
        in_features: int,
        hidden_features: int,
        *,
        activation: Union[Activation, str, int] = "tanh",
        bidirectional: bool = False,
        reverse: bool = False,
        use_bias: bool = True,
        use_input_weight: bool = True,
        time_major: bool = False,
        impl: Impl = "op",
        dtype: Optional[jnp.dtype] = None,
        param_dtype: jnp.dtype = jnp.float32,
        input_weight_init: Optional[Initializer] = None,
        recurrent_weight_init: Optional[Initializer] = None,
        bias_init: Optional[Initializer] = None,
        rngs: nnx.Rngs,
    ):
        if impl not in _IMPLS:
            raise ValueError(f"impl: expected 'op' or 'reference', got {impl!r}")
        if in_features < 1 or hidden_features < 1:
            raise ValueError(f"in_features and hidden_features must be >= 1, got "
                             f"{in_features} and {hidden_features}")
        self.descriptor = SingleGateRNNDescriptor(reverse=reverse, bidirectional=bidirectional,
                                                  activation=activation)
        D, H = self.descriptor.directions, hidden_features
        if not use_input_weight and in_features != D * H:
            raise ValueError(f"use_input_weight=False needs in_features == {D}*hidden_features "
                             f"= {D * H}, got {in_features}")
        self.in_features = in_features
        self.hidden_features = hidden_features
        self.time_major = time_major
        self.impl = impl
        self.dtype = dtype
        self.param_dtype = param_dtype

        default = symmetric_uniform(1.0 / math.sqrt(H))
        make = lambda init, shape: nnx.Param((init or default)(rngs.params(), shape, param_dtype))
        self.recurrent_weight = make(recurrent_weight_init, (2, H, H) if bidirectional else (H, H))
        self.input_weight = (make(input_weight_init, (D * H, in_features))
                             if use_input_weight else None)
        self.bias = make(bias_init, (D * H,)) if use_bias else None

    @property
    def out_features(self) -> int:
        """Output features: ``D*H``."""
        return self.descriptor.directions * self.hidden_features

    def _check_shapes(self, x: jax.Array, h0: Optional[jax.Array], mask: Optional[jax.Array],
                      seq_lengths: Optional[jax.Array] = None) -> None:
        """Checks a call's shapes in the user's layout, before anything is transposed.

        The rules are the op's (:func:`~jax_sgrnn._spec.check_shapes`, given the time-major
        shapes); only the messages about what the layer transposes are its own, so that they
        show the user's layout and shapes rather than the op's.
        """
        name, axes = _layout(self.time_major)
        if x.ndim != 3 or x.shape[-1] != self.in_features:
            raise ValueError(f"inputs: expected shape [{axes}, {self.in_features}] ({name}), "
                             f"got {x.shape}")
        to_op = (lambda s: s) if self.time_major else _swap_leading
        mask_shape = None if mask is None else to_op((1,) * (3 - mask.ndim) + mask.shape)
        try:
            check_shapes(to_op(x.shape), self.recurrent_weight.shape,
                         shape_of(self.input_weight), shape_of(self.bias), shape_of(h0),
                         mask_shape, self.descriptor.bidirectional,
                         seq_lengths=shape_of(seq_lengths))
        except ValueError as error:
            # Messages start with the argument's name; init_state and the parameters are not
            # transposed, so theirs already read in the user's terms.
            if not str(error).startswith("mask:"):
                raise
            expected = [*x.shape[:2], self.out_features]
            raise ValueError(f"mask: expected a shape broadcastable to {expected} ({name} "
                             f"[{axes}, D*H]), got {mask.shape}") from None

    def __call__(
        self,
        inputs: ArrayLike,
        init_state: Optional[ArrayLike] = None,
        mask: Optional[ArrayLike] = None,
        *,
        seq_lengths: Optional[ArrayLike] = None,
        return_state: bool = False,
    ) -> Union[jax.Array, tuple[jax.Array, jax.Array]]:
        """Runs the layer.

        Arrays may be given as array-likes (numpy arrays, nested lists or tuples), as for
        :func:`jax_sgrnn.single_gate_rnn`. Shape errors name the argument and show the
        expected and received shapes in the layer's layout.

        Args:
          inputs: ``[N, T, I]`` (``[T, N, I]`` when ``time_major``).
          init_state: ``h0``, ``[N, D*H]``; zeros when missing.
          mask: broadcastable to ``[N, T, D*H]`` (``[T, N, D*H]`` when ``time_major``),
            bool or float; multiplies the recurrent input ``h[k-1]`` at processing step ``k``
            (not flipped for reversed directions). A constant: no gradient flows to it.
          seq_lengths: integer ``[N]``, each sequence's length, padding at the end (as
            ``flax.nnx.RNN(seq_lengths=...)``): see :func:`jax_sgrnn.single_gate_rnn`. Outputs
            at padded steps are zeros; the final state is each row's last valid one.
          return_state: also return the final state of each direction.

        Returns:
          ``y``, ``[N, T, D*H]`` (``[T, N, D*H]`` when ``time_major``), or ``(y, h_n)`` with
          ``h_n`` ``[N, D*H]`` (see :func:`final_state`) when ``return_state``.
        """
        x = _asarray("inputs", inputs)
        h0 = None if init_state is None else _asarray("init_state", init_state)
        mask = None if mask is None else _asarray("mask", mask)
        lengths = None if seq_lengths is None else _asarray("seq_lengths", seq_lengths)
        self._check_shapes(x, h0, mask, lengths)
        params = [p if p is None else p[...]
                  for p in (self.recurrent_weight, self.input_weight, self.bias)]
        dtype = jnp.result_type(x, params[0]) if self.dtype is None else self.dtype
        R, W, b = (p if p is None else jnp.asarray(p, dtype) for p in params)
        x = x.astype(dtype)
        h0 = None if h0 is None else h0.astype(dtype)
        if not self.time_major:
            x = jnp.swapaxes(x, 0, 1)
            mask = None if mask is None else _time_major_mask(mask)
        y = _IMPLS[self.impl](x, R, W, b, h0, mask, self.descriptor, seq_lengths=lengths)
        out = y if self.time_major else jnp.swapaxes(y, 0, 1)
        if not return_state:
            return out
        return out, final_state(y, self.descriptor, lengths, h0)


class StackedSingleGateRNN(nnx.Module):
    """``num_layers`` :class:`SingleGateRNN` layers, each reading the previous one's output.

    Regularisation, both off by default and both active only in training mode (``model.train()``;
    ``model.eval()`` or ``nnx.view(model, deterministic=True)`` turns them off):

    * ``dropout``: ``nnx.Dropout`` on the input of every layer but the first (PyTorch's
      ``nn.RNN(dropout=...)``): an independent mask per element and time step.
    * ``recurrent_dropout``: variational dropout of the recurrent input, through the op's
      ``mask``: per layer, one mask ``[N, D*H]`` per sequence, scaled by ``1/(1-p)`` and reused
      at every time step (Gal and Ghahramani, 2016). It is multiplied into the ``mask`` given
      at call time, if any.

    There is no ``reverse`` flag: a reversed layer keeps its outputs in processing order, so
    stacking reversed layers would flip time at every layer. Use ``bidirectional`` instead.

    Args:
      in_features: the first layer's input features.
      hidden_features: ``H`` of every layer; layers after the first read ``D*H`` features.
      num_layers: the number of layers (>= 1).
      dropout: dropout rate on the inputs of layers 2..L.
      recurrent_dropout: variational dropout rate on the recurrent input (via the mask).
      layer_options: :class:`LayerOptions` (``activation``, ``bidirectional``, ``use_bias``,
        ``use_input_weight``, ``time_major``, ``impl``, ``dtype``, ``param_dtype``,
        ``input_weight_init``, ``recurrent_weight_init``, ``bias_init``): as for
        :class:`SingleGateRNN`, applied to every layer.
      rngs: ``params`` initialises the layers; ``dropout`` (or the default stream) draws the
        dropout masks.
    """

    def __init__(
        self,
        in_features: int,
        hidden_features: int,
        num_layers: int,
        *,
        dropout: float = 0.0,
        recurrent_dropout: float = 0.0,
        rngs: nnx.Rngs,
        **layer_options: Unpack[LayerOptions],
    ):
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        for name, rate in (("dropout", dropout), ("recurrent_dropout", recurrent_dropout)):
            if not 0.0 <= rate < 1.0:
                raise ValueError(f"{name}: expected a rate in [0, 1), got {rate}")
        unknown = sorted(set(layer_options) - set(LayerOptions.__annotations__))
        if unknown:  # reverse among them: reversed layers would flip time at every layer
            raise TypeError(f"StackedSingleGateRNN.__init__() got unexpected keyword "
                            f"argument(s) {', '.join(map(repr, unknown))}")
        first = SingleGateRNN(in_features, hidden_features, rngs=rngs, **layer_options)
        self.time_major = first.time_major
        self.layers = nnx.List([first] + [
            SingleGateRNN(first.out_features, hidden_features, rngs=rngs, **layer_options)
            for _ in range(num_layers - 1)])
        self.dropout = nnx.Dropout(dropout, rngs=rngs)
        self.recurrent_dropout = nnx.Dropout(recurrent_dropout, rngs=rngs)

    @property
    def out_features(self) -> int:
        """Output features of the last layer: ``D*H``."""
        return self.layers[-1].out_features

    def __call__(
        self,
        inputs: ArrayLike,
        init_state: Optional[ArrayLike] = None,
        mask: Optional[ArrayLike] = None,
        *,
        seq_lengths: Optional[ArrayLike] = None,
        return_state: bool = False,
    ) -> Union[jax.Array, tuple[jax.Array, jax.Array]]:
        """Runs the stack.

        Args:
          inputs: ``[N, T, I]`` (``[T, N, I]`` when ``time_major``); as for
            :class:`SingleGateRNN`, arrays may be given as array-likes.
          init_state: ``[L, N, D*H]``, one initial state per layer (an array, or a sequence of
            ``L`` states ``[N, D*H]``); zeros when missing.
          mask: as for :class:`SingleGateRNN`, applied in every layer.
          seq_lengths: as for :class:`SingleGateRNN`, the same in every layer.
          return_state: also return every layer's final state.

        Returns:
          The last layer's output ``y``, or ``(y, h_n)`` with ``h_n`` ``[L, N, D*H]`` when
          ``return_state``.
        """
        x = _asarray("inputs", inputs)
        mask = None if mask is None else _asarray("mask", mask)
        lengths = None if seq_lengths is None else _asarray("seq_lengths", seq_lengths)
        # Before dropout and recurrent dropout reshape anything, so errors show the user's shapes.
        self.layers[0]._check_shapes(x, None, mask, lengths)
        batch_axis = 1 if self.time_major else 0
        if init_state is not None:
            init_state = _asarray("init_state", init_state)
            expected = (len(self.layers), x.shape[batch_axis], self.out_features)
            if init_state.shape != expected:
                raise ValueError(f"init_state: expected shape {list(expected)} ([L, N, D*H], "
                                 f"one state per layer), got {init_state.shape}")
        states = []
        for i, layer in enumerate(self.layers):
            if i > 0:
                x = self.dropout(x)
            layer_mask = mask
            if self.recurrent_dropout.rate > 0:
                shape = [1, 1, layer.out_features]
                shape[batch_axis] = x.shape[batch_axis]
                keep = self.recurrent_dropout(jnp.ones(shape, layer.param_dtype))
                if mask is not None:
                    # One explicit dtype, so that a bool or half mask also works under strict
                    # dtype promotion (the product's dtype is the standard promotion's).
                    with jax.numpy_dtype_promotion("standard"):
                        common = jnp.promote_types(keep.dtype, mask.dtype)
                    keep = keep.astype(common) * mask.astype(common)
                layer_mask = keep
            h0 = None if init_state is None else init_state[i]
            x, h_n = layer(x, h0, layer_mask, seq_lengths=lengths, return_state=True)
            states.append(h_n)
        return (x, jnp.stack(states)) if return_state else x
