"""The op's contract in one place: descriptor, activations, dtypes and shape rules.

Every entry point validates through :func:`check_shapes` (the public ops and the reference via
:func:`validate`, the primitives' abstract eval directly), so an error message reads the same
wherever it is raised.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

Shape = tuple[int, ...]


class Activation(enum.IntEnum):
    """MPSGraphRNNActivation, with MPSGraph's numbering (also the FFI attribute's value)."""

    NONE = 0
    RELU = 1
    TANH = 2
    SIGMOID = 3
    HARD_SIGMOID = 4

    @classmethod
    def parse(cls, value: Union["Activation", str, int]) -> "Activation":
        """Accepts an Activation, its lower-case name (``"tanh"``) or its MPSGraph number."""
        if isinstance(value, cls):
            return value
        if isinstance(value, jax.core.Tracer):
            raise TypeError(f"activation: must be static (an Activation, its name or its number, "
                            f"known when the function is traced), got the traced value {value!r}; "
                            f"pass it to jax.jit as a static argument (static_argnames)")
        if isinstance(value, str):
            try:
                return cls[value.upper()]
            except KeyError:
                pass
        elif _is_integer_scalar(value):
            try:
                return cls(int(value))
            except ValueError:
                pass
        names = ", ".join(repr(a.name.lower()) for a in cls)
        raise ValueError(f"activation: expected one of {names} (or 0..4), got {value!r}")


def _is_integer_scalar(value) -> bool:
    """A Python, NumPy or JAX integer scalar (not a bool)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, (int, np.integer)):
        return True
    dtype = getattr(value, "dtype", None)
    return (getattr(value, "shape", None) == () and dtype is not None
            and jnp.issubdtype(dtype, jnp.integer))


@dataclasses.dataclass(frozen=True)
class SingleGateRNNDescriptor:
    """Mirror of ``MPSGraphSingleGateRNNDescriptor``: frozen and hashable.

    Attributes:
      reverse: process time backwards (ignored when ``bidirectional``).
      bidirectional: run a forward and a backward direction and concatenate them on the
        feature axis (``[..., :H]`` forward, ``[..., H:]`` backward).
      training: also return ``z``, the pre-activation state the gradient op needs.
      activation: one of :class:`Activation`; defaults to ``relu`` as
        ``[MPSGraphSingleGateRNNDescriptor descriptor]`` does.
    """

    reverse: bool = False
    bidirectional: bool = False
    training: bool = False
    activation: Activation = Activation.RELU

    def __post_init__(self):
        object.__setattr__(self, "activation", Activation.parse(self.activation))
        for name in ("reverse", "bidirectional", "training"):
            value = getattr(self, name)
            if not isinstance(value, (bool, np.bool_)):
                raise TypeError(f"{name}: expected a bool, got {value!r}")
            object.__setattr__(self, name, bool(value))

    @property
    def directions(self) -> int:
        return 2 if self.bidirectional else 1

    def replace(self, **overrides) -> "SingleGateRNNDescriptor":
        """A copy with the given fields replaced; ``None`` values are ignored."""
        return dataclasses.replace(self, **{k: v for k, v in overrides.items() if v is not None})


def resolve_descriptor(
    descriptor: Optional[SingleGateRNNDescriptor], **overrides
) -> SingleGateRNNDescriptor:
    """The descriptor to use: ``descriptor`` (or the default) with keyword flags applied."""
    if descriptor is None:
        descriptor = SingleGateRNNDescriptor()
    elif not isinstance(descriptor, SingleGateRNNDescriptor):
        raise TypeError(f"descriptor: expected a SingleGateRNNDescriptor, got {descriptor!r}")
    return descriptor.replace(**overrides)


@dataclasses.dataclass(frozen=True)
class Dims:
    """Problem sizes: T steps, N batch, I source features, H hidden, D directions."""

    T: int
    N: int
    I: int
    H: int
    D: int

    @property
    def state_shape(self) -> Shape:  # y, z, dy
        return (self.T, self.N, self.D * self.H)


def known_sizes(*sizes) -> bool:
    """Whether every size is a known integer, not a symbolic dimension (shape-polymorphic
    export): choices that depend on a size's value take a default for a symbolic one."""
    return all(isinstance(s, (int, np.integer)) for s in sizes)


FLOAT_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)


def compute_dtype(dtype):
    """The reference's rule: float16 and bfloat16 are computed in float32 and stored back in
    their own dtype. (Each native backend states its own rule: ``_backends.Backend``.)"""
    return jnp.float32 if jnp.dtype(dtype).itemsize < 4 else dtype


@dataclasses.dataclass(frozen=True)
class Operand:
    """One operand of the two ops, with the rules every layer derives from it: the optional
    operands' order (the primitives' and the FFI schema's), the presence attributes, the batch
    and group axes (batching, sharding), the gradients and the cotangents, the dtype checks.

    Attributes:
      name: the public API's argument name, so messages match the user's call.
      batch_axis: the axis that is ``N`` in one problem; None for operands every row shares
        (the weights). Operands with a batch axis also lead with the group axis ``G`` in the
        gradient primitive; the others are shared by its groups.
      differentiable: the gradient op returns its gradient (in this table's order).
      kind: ``"float"`` (the source's float dtype), ``"mask"`` (bool or float, converted to
        the compute dtype; each axis 1 or full) or ``"lengths"`` (integer, sent as int32).
      required: the op cannot run without it.
    """

    name: str
    batch_axis: Optional[int]
    differentiable: bool
    kind: str = "float"
    required: bool = False

    @property
    def grouped(self) -> bool:
        return self.batch_axis is not None


#: The inputs of both ops, in the primitives' order: required first, then the optional ones.
#: A new operand is one row here, one in csrc/sgrnn/ffi_schema.h, and the kernels' use of it
#: (docs/design.md, "Adding an operand").
INPUTS = (
    Operand("source", batch_axis=1, differentiable=True, required=True),
    Operand("recurrent_weight", batch_axis=None, differentiable=True, required=True),
    Operand("input_weight", batch_axis=None, differentiable=True),
    Operand("bias", batch_axis=None, differentiable=True),
    Operand("init_state", batch_axis=0, differentiable=True),
    Operand("mask", batch_axis=1, differentiable=False, kind="mask"),
    Operand("seq_lengths", batch_axis=0, differentiable=False, kind="lengths"),
)
#: The gradient op's own inputs, laid out like ``y`` (as are ``y`` and ``z``); in the gradient
#: primitive they follow ``source`` and ``recurrent_weight``.
STATE_INPUTS = (
    Operand("source_gradient", batch_axis=1, differentiable=False, required=True),
    Operand("z_state", batch_axis=1, differentiable=False, required=True),
)
OPERANDS = {o.name: o for o in INPUTS + STATE_INPUTS}
REQUIRED_NAMES = tuple(o.name for o in INPUTS if o.required)
OPTIONAL_NAMES = tuple(o.name for o in INPUTS if not o.required)


def _fail(name: str, expected: str, got) -> None:
    raise ValueError(f"{name}: expected shape {expected}, got {tuple(got)}")


def check_shapes(
    source: Shape,
    recurrent_weight: Shape,
    input_weight: Optional[Shape],
    bias: Optional[Shape],
    init_state: Optional[Shape],
    mask: Optional[Shape],
    bidirectional: bool,
    state_shapes: Sequence[tuple[str, Shape]] = (),
    seq_lengths: Optional[Shape] = None,
) -> Dims:
    """Validates every operand's shape and returns the problem sizes.

    ``state_shapes`` are extra operands laid out like ``y`` (the gradient op's
    ``source_gradient`` and ``z_state``). Raises ``ValueError`` naming the argument, the
    expected shape and the received one.
    """
    D = 2 if bidirectional else 1
    if len(recurrent_weight) != (3 if bidirectional else 2):
        _fail("recurrent_weight", "[2, H, H] (bidirectional)" if bidirectional else "[H, H]",
              recurrent_weight)
    H = recurrent_weight[-1]
    if recurrent_weight[-2] != H or (bidirectional and recurrent_weight[0] != 2):
        _fail("recurrent_weight", f"[2, {H}, {H}]" if bidirectional else f"[{H}, {H}]",
              recurrent_weight)
    if H < 1:
        raise ValueError(f"recurrent_weight: hidden size H must be >= 1, got shape "
                         f"{tuple(recurrent_weight)}")
    if len(source) != 3:
        _fail("source", "[T, N, I]", source)
    T, N, I = source
    if input_weight is None:
        if I != D * H:
            _fail("source", f"[T, N, {D * H}] (no input_weight: features = {D}*H)", source)
    else:
        if I < 1:
            _fail("source", "[T, N, I] with I >= 1", source)
        if tuple(input_weight) != (D * H, I):
            _fail("input_weight", f"[{D * H}, {I}]", input_weight)
    if bias is not None and tuple(bias) != (D * H,):
        _fail("bias", f"[{D * H}]", bias)
    if init_state is not None and tuple(init_state) != (N, D * H):
        _fail("init_state", f"[{N}, {D * H}]", init_state)
    full = (T, N, D * H)
    if mask is not None:
        if len(mask) > 3 or any(m not in (1, f) for m, f in zip(mask[::-1], full[::-1])):
            _fail("mask", f"broadcastable to {list(full)}", mask)
    for name, shape in state_shapes:
        if tuple(shape) != full:
            _fail(name, str(list(full)), shape)
    if seq_lengths is not None and tuple(seq_lengths) != (N,):
        _fail("seq_lengths", f"[{N}] (one length per batch row)", seq_lengths)
    return Dims(T=T, N=N, I=I, H=H, D=D)


def check_dtypes(**arrays) -> np.dtype:
    """The one float dtype shared by all given arrays (``None`` entries skipped; the mask and
    the lengths checked by their own kind)."""
    dtype = None
    for name, a in arrays.items():
        if a is None:
            continue
        dt = np.dtype(a.dtype)
        kind = OPERANDS[name].kind
        if kind == "lengths":
            if not jnp.issubdtype(dt, jnp.integer):
                raise TypeError(f"{name}: expected an integer dtype, got {dt}")
            continue
        if kind == "mask":
            if dt != np.bool_ and not jnp.issubdtype(dt, jnp.floating):
                raise TypeError(f"{name}: expected a bool or float dtype, got {dt}")
            continue
        if dt not in [np.dtype(d) for d in FLOAT_DTYPES]:
            raise TypeError(f"{name}: expected float16, bfloat16, float32 or float64, got {dt}")
        if dtype is None:
            dtype = dt
        elif dt != dtype:
            raise TypeError(f"{name}: dtype {dt} does not match source's {dtype}; "
                            "all float inputs must share one dtype")
    return dtype


def as_arrays(*inputs, seq_lengths=None) -> tuple[list, object]:
    """The user's array-likes (lists, scalars, NumPy or JAX arrays) as JAX arrays, None staying
    None; and ``seq_lengths`` as given (a JAX array or tracer kept, anything else as a NumPy
    array), so that concrete lengths are validated before JAX converts them: with x64 off JAX
    would first narrow int64 lengths to int32."""
    arrays = [None if a is None else jnp.asarray(a) for a in inputs]
    if seq_lengths is not None and not isinstance(seq_lengths, (jax.Array, jax.core.Tracer)):
        seq_lengths = np.asarray(seq_lengths)
    return arrays, seq_lengths


def spec_of(a) -> tuple:
    """The entries of an abstract array's sharding spec, one per axis (None: not sharded
    along it; always None outside explicit sharding)."""
    spec = tuple(a.sharding.spec)
    return spec + (None,) * (len(a.shape) - len(spec))


def shape_of(a) -> Optional[Shape]:
    """``a``'s shape, or None for a missing optional input."""
    return None if a is None else tuple(a.shape)


def validate(source, recurrent_weight, input_weight, bias, init_state, mask,
             bidirectional: bool, state_arrays: Sequence[tuple[str, object]] = (),
             seq_lengths=None):
    """Checks the user's arrays (dtypes, then shapes, then concrete sequence lengths); returns
    (their dtype, problem sizes).

    ``state_arrays`` are (name, array) pairs laid out like ``y``.
    """
    for name, a in (("source", source), ("recurrent_weight", recurrent_weight),
                    *state_arrays):
        if a is None:
            raise TypeError(f"{name}: expected an array, got None (only "
                            f"{', '.join(OPTIONAL_NAMES[:-1])} and {OPTIONAL_NAMES[-1]} are "
                            "optional)")
    dtype = check_dtypes(source=source, recurrent_weight=recurrent_weight,
                         input_weight=input_weight, bias=bias, init_state=init_state, mask=mask,
                         **dict(state_arrays), seq_lengths=seq_lengths)
    dims = check_shapes(source.shape, recurrent_weight.shape, shape_of(input_weight),
                        shape_of(bias), shape_of(init_state), shape_of(mask), bidirectional,
                        [(n, a.shape) for n, a in state_arrays], shape_of(seq_lengths))
    if seq_lengths is not None and not isinstance(seq_lengths, jax.core.Tracer):
        values = np.asarray(seq_lengths)
        bad = (values < 0) | (values > dims.T)
        if bad.any():
            raise ValueError(f"seq_lengths: expected lengths in [0, T={dims.T}], got "
                             f"{values[bad][0]} at batch row {int(np.argmax(bad))}")
    return dtype, dims


def seq_lengths_operand(seq_lengths, T: int):
    """The lengths as the primitives take them: int32, clamped to [0, T]. Concrete lengths
    outside that range were refused by :func:`validate`; traced ones are clamped (documented)."""
    return jnp.clip(jnp.asarray(seq_lengths), 0, T).astype(jnp.int32)
