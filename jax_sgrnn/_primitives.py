"""The two primitives (forward, gradients): abstract evaluation and batching rules (their
autodiff rules are in ``_autodiff.py``).

Operands are ``x, R`` (plus ``dy, z`` for the gradients) followed by the optional inputs that
are present, in the order of ``_spec.INPUTS`` (the operand table every rule here derives from);
:class:`OpConfig` says which. The mask arrives normalised: rank 3 (``[Tm, Nm, Hm]``, each 1 or
full) in the compute dtype (``_spec.compute_dtype``); the lengths as int32 in [0, T]. The
gradient primitive carries a leading axis ``G`` of independent problems that share the weights
(``G = 1`` from the public op; vmap grows it), so per-example weight gradients come from one
call.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import batching
from jax.sharding import PartitionSpec

from ._spec import (INPUTS, OPERANDS, OPTIONAL_NAMES, REQUIRED_NAMES, STATE_INPUTS, Dims,
                    SingleGateRNNDescriptor, check_shapes, shape_of, spec_of)
from .reference import reference_gradients, scan_forward


@dataclasses.dataclass(frozen=True)
class OpConfig:
    """Static parameters of both primitives: the descriptor, which optional inputs are given,
    and the backends the call lowers to (``_backends.backends_for``; none: the decomposition).

    ``descriptor.training`` says whether the forward primitive returns z; the gradient
    primitive's config always has it False (the gradient op takes no such flag).
    """

    descriptor: SingleGateRNNDescriptor
    given: tuple[str, ...] = ()  # the optional inputs present, in OPTIONAL_NAMES order
    backends: tuple[str, ...] = ()

    @classmethod
    def of(cls, descriptor: SingleGateRNNDescriptor, backends: tuple[str, ...] = (),
           **optionals) -> "OpConfig":
        """The config of a call with these optional inputs (None: absent)."""
        return cls(descriptor=descriptor,
                   given=tuple(n for n in OPTIONAL_NAMES if optionals.get(n) is not None),
                   backends=backends)

    def has(self, name: str) -> bool:
        """Whether the operand ``name`` (any of ``_spec.OPERANDS``) is part of the call."""
        return OPERANDS[name].required or name in self.given

    def without(self, *names: str) -> "OpConfig":
        return dataclasses.replace(self, given=tuple(n for n in self.given if n not in names))

    def operand_names(self, gradients: bool) -> list[str]:
        """The primitive's operands: ``source, recurrent_weight`` (then the gradient op's
        ``source_gradient, z_state``), then the optional inputs given."""
        state = [o.name for o in STATE_INPUTS] if gradients else []
        return [*REQUIRED_NAMES, *state, *self.given]

    def gradient_names(self) -> list[str]:
        """The inputs the gradient primitive returns gradients of, in its result order."""
        return [o.name for o in INPUTS if o.differentiable and self.has(o.name)]

    def optionals(self, operands: Sequence) -> dict:
        """The present optional operands (the tail of ``operands``) by name, None for the rest."""
        by_name = dict(zip(self.given, operands))
        return {name: by_name.get(name) for name in OPTIONAL_NAMES}

    def with_training(self, training: bool) -> "OpConfig":
        return dataclasses.replace(self, descriptor=self.descriptor.replace(training=training))

    def ffi_attributes(self) -> dict:
        """The typed FFI attributes (csrc/sgrnn/ffi_schema.h's ``Config``)."""
        d = self.descriptor
        return dict(activation=np.int32(d.activation), reverse=np.bool_(d.reverse),
                    bidirectional=np.bool_(d.bidirectional), training=np.bool_(d.training),
                    **{f"has_{n}": np.bool_(n in self.given) for n in OPTIONAL_NAMES})


def _result_aval(x, shape, spec=None) -> jax.core.ShapedArray:
    """A result of ``shape`` in ``x``'s dtype with ``x``'s other type attributes: inside a
    ``shard_map``, the mesh axes it varies over (``ops.py`` makes every operand vary alike, as
    JAX's own primitives require) and its mesh; its own axes sharded as ``spec`` says (under
    explicit sharding each result keeps its input's sharding, as the partitioned custom calls
    leave it; elsewhere specs are empty), unsharded without one."""
    spec = PartitionSpec(*(spec if spec is not None else [None] * len(shape)))
    return x.update(shape=shape, weak_type=False, sharding=x.sharding.update(spec=spec))


def eager_impl(primitive: Primitive):
    """Eager evaluation compiles the primitive (once per shape and parameters) and runs it."""
    jitted = jax.jit(lambda *args, **params: primitive.bind(*args, **params),
                     static_argnames=("config", "tangents"))

    def impl(*args, **params):
        # Under jax.disable_jit() the jitted function would call this impl again, forever; a
        # primitive has no Python to run in its place, so it is compiled regardless (as JAX's
        # own primitives are).
        with jax.disable_jit(False):
            return jitted(*args, **params)

    return impl


# ----------------------------------------------------------------------------- forward

forward_p = Primitive("sgrnn_forward")
forward_p.multiple_results = True


def _forward_abstract_eval(x, R, *rest, config: OpConfig):
    opt = {name: shape_of(a) for name, a in config.optionals(rest).items()}
    dims = check_shapes(x.shape, R.shape, opt["input_weight"], opt["bias"], opt["init_state"],
                        opt["mask"], config.descriptor.bidirectional,
                        seq_lengths=opt["seq_lengths"])
    out = _result_aval(x, dims.state_shape, (None, spec_of(x)[1], None))  # y, z: x's N
    return [out, out] if config.descriptor.training else [out]


forward_p.def_abstract_eval(_forward_abstract_eval)
forward_p.def_impl(eager_impl(forward_p))


def forward_reference(x, R, *rest, config: OpConfig, unroll: int = 1,
                      gpu_form: bool = False) -> list:
    """The forward primitive computed by the ``lax.scan`` reference (the portable lowering,
    with ``unroll`` steps per loop iteration, in the loops GPUs run faster where ``gpu_form``:
    :func:`~jax_sgrnn.reference`)."""
    opt = config.optionals(rest)
    out = scan_forward(x, R, opt["input_weight"], opt["bias"], opt["init_state"], opt["mask"],
                       opt["seq_lengths"], config.descriptor, unroll, gpu_form)
    return list(out) if config.descriptor.training else [out]


def _fold(a, bdim: Optional[int], size: int, axis: int, full: int, mapped_major: bool):
    """Folds the mapped axis of ``a`` into its axis ``axis``, as the major or the minor part of
    the merged axis, broadcasting an unmapped operand, and a size-1 (broadcast) ``axis``, to
    ``full`` first."""
    a = (jnp.broadcast_to(a[None], (size, *a.shape)) if bdim is None
         else jnp.moveaxis(a, bdim, 0))
    a = jnp.broadcast_to(a, (size, *a.shape[1:axis + 1], full, *a.shape[axis + 2:]))
    a = jnp.moveaxis(a, 0, axis if mapped_major else axis + 1)
    return a.reshape(*a.shape[:axis], size * full, *a.shape[axis + 2:])


def _batch_rule(primitive: Primitive, decomposition, gradients: bool):
    """The batching rule of either primitive.

    The mapped axis folds into every operand that tells problems apart (``_spec.Operand``'s
    ``grouped``): for the forward into its batch axis ``N``, for the gradients into the
    group axis ``G``; a mask broadcast along that axis stays broadcast. So the batch stays one
    call of the same kernel (per-example weight gradients included). Mapped shared operands
    (the weights) cannot join one call: those get a batched scan of the decomposition.
    """
    def rule(args, dims, *, config: OpConfig):
        size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
        operands = [OPERANDS[n] for n in config.operand_names(gradients)]
        if any(d is not None and not o.grouped for o, d in zip(operands, dims)):
            out = jax.vmap(functools.partial(decomposition, config=config), in_axes=dims)(*args)
            return out, [0] * len(out)
        axis = 0 if gradients else OPERANDS["source"].batch_axis  # the results' folded axis
        x, xd = args[0], dims[0]
        x_axis = axis + (xd is not None and xd <= axis)
        full = x.shape[x_axis]  # x's unmapped size at `axis`
        # The mapped axis is the major part of the merged one (each problem's rows contiguous,
        # and where the mapped axis is split across devices, so is the merged one), except
        # where explicit sharding splits x's own axis: a merged axis keeps a split only on its
        # major part.
        mapped_major = spec_of(jax.typeof(x))[x_axis] is None
        folded = []
        for o, a, d in zip(operands, args, dims):
            at = 0 if gradients else o.batch_axis
            if o.grouped and not (o.kind == "mask" and d is None and a.shape[at] == 1):
                a = _fold(a, d, size, at, full, mapped_major)
            folded.append(a)
        out = primitive.bind(*folded, config=config)
        split = (size, full) if mapped_major else (full, size)
        return ([o.reshape(*o.shape[:axis], *split, *o.shape[axis + 1:]) for o in out],
                [axis if mapped_major else axis + 1] * len(out))
    return rule


batching.primitive_batchers[forward_p] = _batch_rule(forward_p, forward_reference,
                                                     gradients=False)

# --------------------------------------------------------------------------- gradients

gradients_p = Primitive("sgrnn_gradients")
gradients_p.multiple_results = True


def gradient_dims(operands: dict, config: OpConfig) -> tuple[int, Dims]:
    """Validates the grouped gradient operands (by name); returns (G, problem sizes)."""
    x, R = operands["source"], operands["recurrent_weight"]
    dy, z = operands["source_gradient"], operands["z_state"]
    G = x.shape[0] if len(x.shape) == 4 else None
    for name, a in operands.items():
        if not OPERANDS[name].grouped:
            continue
        if OPERANDS[name].kind == "mask":
            if a.shape[0] not in (1, G):
                raise ValueError(f"{name}: expected a leading group axis of size 1 or {G}")
        elif len(a.shape) < 1 or a.shape[0] != G:
            raise ValueError(f"{name}: expected a leading group axis of size {G}, got "
                             f"{tuple(a.shape)}")
    strip = lambda a: None if a is None else tuple(a.shape[1:])
    opt = {n: operands.get(n) for n in OPTIONAL_NAMES}
    dims = check_shapes(strip(x), R.shape, shape_of(opt["input_weight"]), shape_of(opt["bias"]),
                        strip(opt["init_state"]), strip(opt["mask"]),
                        config.descriptor.bidirectional,
                        [("source_gradient", strip(dy)), ("z_state", strip(z))],
                        strip(opt["seq_lengths"]))
    return G, dims


def _gradients_abstract_eval(x, R, dy, z, *rest, config: OpConfig):
    operands = dict(zip(config.operand_names(gradients=True), (x, R, dy, z, *rest)))
    G, _ = gradient_dims(operands, config)
    return _gradient_avals(G, operands, config)


def _gradient_avals(G, operands: dict, config: OpConfig) -> list:
    """The gradient of each differentiable input given (``OpConfig.gradient_names``), typed
    like its input with a leading G axis (grouped inputs have theirs already) sharded as the
    source's."""
    x = operands["source"]
    group = spec_of(x)[0]
    avals = []
    for name in config.gradient_names():
        a, skip = operands[name], int(OPERANDS[name].grouped)
        avals.append(_result_aval(x, (G, *a.shape[skip:]), (group, *spec_of(a)[skip:])))
    return avals


gradients_p.def_abstract_eval(_gradients_abstract_eval)
gradients_p.def_impl(eager_impl(gradients_p))


def gradients_reference(x, R, dy, z, *rest, config: OpConfig, unroll: int = 1,
                        gpu_form: bool = False) -> list:
    """The gradient primitive by explicit BPTT in ``lax.scan`` (the portable lowering, with
    ``unroll`` steps per loop iteration, in the loops GPUs run faster where ``gpu_form``:
    :func:`~jax_sgrnn.reference`)."""
    opt = config.optionals(rest)
    axes = {n: 0 if OPERANDS[n].grouped else None for n in OPTIONAL_NAMES}
    if opt["mask"] is not None and opt["mask"].shape[0] == 1:  # one mask for every group
        axes["mask"], opt["mask"] = None, opt["mask"][0]

    def one(x, dy, z, opt):
        return reference_gradients(x, R, dy, z, descriptor=config.descriptor, unroll=unroll,
                                   gpu_form=gpu_form, **opt)

    if x.shape[0] == 1:  # the usual case: no vmap, whose [1, N, H] carries are slower on GPUs
        take = lambda a, axis: a if a is None or axis is None else a[0]
        return [g[None] for g in one(x[0], dy[0], z[0],
                                     {k: take(a, axes[k]) for k, a in opt.items()})]
    return jax.vmap(one, in_axes=(0, 0, 0, axes))(x, dy, z, opt)


batching.primitive_batchers[gradients_p] = _batch_rule(gradients_p, gradients_reference,
                                                       gradients=True)
