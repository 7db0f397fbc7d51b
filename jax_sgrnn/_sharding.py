"""Partitioning of the custom calls over the batch axis, for programs on several devices.

XLA cannot see inside a custom call, so by default it gathers every operand onto every device
and runs the whole problem on each. Rows of the batch axis ``N`` are independent problems that
share the weights, so each device can run the custom call on its own rows instead; only the
weight gradients (sums over ``N``) need communication, one ``psum``. The gradient primitive's
group axis ``G`` holds independent problems too, weight gradients included, and partitions with
no communication at all.

This is done with ``jax.experimental.custom_partitioning`` inside the lowering rule (it has no
batching or JVP rules, so it cannot wrap the primitives themselves): Shardy propagates
shardings through the ``sharding_rule`` built from each operand's ``batch_axis`` (the operand
table, ``_spec.INPUTS``), and at partitioning time
:func:`_partition` asks for each operand sharded along ``G`` and ``N`` as the source is and
replicated along every other axis; XLA reshards whatever arrives otherwise (a time-sharded
source, sharded weights), so every sharding gives correct results.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import jax
from jax._src import dispatch  # prim_requires_devices_during_lowering: see below
from jax._src import sharding_impls
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from ._primitives import OpConfig, forward_p, gradients_p
from ._spec import OPERANDS

# The lowering of custom_partitioning needs the program's devices (to build the mesh its
# partitioning callback sees); JAX provides them only for programs holding a primitive in this
# registry, as custom_partitioning's own primitive is, but ours hide it inside their lowering.
dispatch.prim_requires_devices_during_lowering.update((forward_p, gradients_p))

#: The roles an axis can have: the group axis, the batch axis, or neither (None).
GROUP, BATCH = "g", "n"
Roles = tuple[Optional[str], ...]


def partitioned(ctx, custom_call: Callable, config: OpConfig) -> Callable:
    """``custom_call`` (a function of the primitive's operands, as ``mlir.lower_fun`` takes
    it), partitioned over the batch when the program being lowered spans several devices.

    Single-device programs, ``shard_map`` bodies (each device's shard is a whole problem
    there) and ``pmap`` get ``custom_call`` itself, so their HLO is what it was without this.
    """
    axis_context = ctx.module_context.axis_context
    if not (isinstance(axis_context, sharding_impls.ShardingContext)
            and axis_context.num_devices > 1):
        return custom_call
    grouped = ctx.primitive is gradients_p
    operands, results = _layout_names(grouped, config)

    def roles(avals) -> tuple[list[Roles], list[Roles]]:
        """The role of every axis of every operand and result, from their shapes."""
        shapes = [tuple(a.shape) for a in avals]
        return _roles(grouped, operands, results, shapes[:len(operands)],
                      shapes[len(operands):])

    def sharding_rule(mesh, operand_types, result_types):
        del mesh  # the rule is the same on any mesh
        return _sdy_rule(*roles([*operand_types, *result_types]))  # MLIR types have .shape

    def partition(mesh, arg_shapes, result_shape):
        operand_roles, result_roles = roles([*arg_shapes, *result_shape])
        return _partition(custom_call, mesh, arg_shapes, operand_roles, result_roles)

    def infer_sharding_from_operands(mesh, arg_shapes, result_shape):  # GSPMD (not Shardy)
        return partition(mesh, arg_shapes, result_shape)[2]

    # Positional operands only: custom_partitioning binds its function's signature.
    call = custom_partitioning(lambda *operands: custom_call(*operands))
    call.def_partition(partition, infer_sharding_from_operands=infer_sharding_from_operands,
                       sharding_rule=sharding_rule)
    return call


def _layout_names(grouped: bool, config: OpConfig) -> tuple[list[str], list[str]]:
    """The operand-table entry (``_spec.OPERANDS``) whose layout each operand and each result
    of the primitive has: results are gradients laid out as their inputs, or y and z, laid out
    as the gradient op's ``z_state``."""
    if not grouped:
        outputs = 2 if config.descriptor.training else 1
        return config.operand_names(gradients=False), ["z_state"] * outputs
    return config.operand_names(gradients=True), config.gradient_names()


def _roles(grouped: bool, operands: Sequence[str], results: Sequence[str],
           operand_shapes: Sequence[tuple], result_shapes: Sequence[tuple]
           ) -> tuple[list[Roles], list[Roles]]:
    """Which axis of each operand and result is ``G``, which ``N`` (the source's sizes)."""
    source = operand_shapes[0]
    group_size = source[0] if grouped else None
    batch_size = source[2 if grouped else 1]

    def one(name: str, shape: tuple, has_group: bool) -> Roles:
        roles: list[Optional[str]] = [None] * len(shape)
        if has_group and shape[0] == group_size:
            roles[0] = GROUP
        batch = OPERANDS[name].batch_axis
        if batch is not None and shape[batch + has_group] == batch_size:
            roles[batch + has_group] = BATCH
        return tuple(roles)

    return ([one(n, s, grouped and OPERANDS[n].grouped)
             for n, s in zip(operands, operand_shapes)],
            [one(n, s, grouped) for n, s in zip(results, result_shapes)])


def _sdy_rule(operand_roles: Sequence[Roles], result_roles: Sequence[Roles]) -> tuple:
    """Shardy's rule, einsum-like: ``G`` and ``N`` are factors shared by every array that has
    them; every other axis is a factor of its own that must stay replicated."""
    own: list[str] = []

    def spell(prefix: str, index: int, roles: Roles) -> str:
        factors = []
        for axis, role in enumerate(roles):
            if role is None:
                own.append(f"{prefix}{index}_{axis}")
            factors.append(role or own[-1])
        return " ".join(factors)

    rule = (", ".join(spell("a", i, r) for i, r in enumerate(operand_roles)) + " -> "
            + ", ".join(spell("r", i, r) for i, r in enumerate(result_roles)))
    return rule, dict(need_replication_factors=tuple(own))


def _partition(custom_call: Callable, mesh, arg_shapes, operand_roles: Sequence[Roles],
               result_roles: Sequence[Roles]):
    """custom_partitioning's ``partition``: every operand and result sharded along ``G`` and
    ``N`` as the source is, replicated elsewhere; a result without ``N`` (a weight gradient)
    is summed over the devices that split ``N``."""
    source = arg_shapes[0]
    mesh_axes = _mesh_axes_of_roles(source, operand_roles[0])

    def sharding(roles: Roles) -> NamedSharding:
        return NamedSharding(mesh, PartitionSpec(*(mesh_axes.get(r) for r in roles)))

    batch_axes = mesh_axes.get(BATCH)

    def per_device(*operands):
        results = custom_call(*operands)
        return [jax.lax.psum(r, batch_axes) if batch_axes and BATCH not in roles else r
                for r, roles in zip(results, result_roles)]

    return (mesh, per_device, [sharding(r) for r in result_roles],
            tuple(sharding(r) for r in operand_roles))


def _mesh_axes_of_roles(source, source_roles: Roles) -> dict[str, tuple[str, ...]]:
    """The mesh axes that split the source's ``G`` and ``N`` axes: its own sharding where that
    divides the axis evenly (padding rows would enter the weight gradients' sums), else none.
    A sharding that is not on a named mesh gets none (everything replicated: correct, slower).
    """
    if not isinstance(source.sharding, NamedSharding):
        return {}
    mesh, spec = source.sharding.mesh, source.sharding.spec
    found = {}
    for axis, role in enumerate(source_roles):
        entry = spec[axis] if axis < len(spec) else None
        if role is None or entry is None:
            continue
        names = (entry,) if isinstance(entry, str) else tuple(entry)
        if source.shape[axis] % math.prod(mesh.shape[n] for n in names) == 0:
            found[role] = names
    return found
