"""Autodiff of the op, the way ``lax`` primitives do it: a JVP rule and a linear primitive.

The forward primitive's JVP runs the forward (with z) and binds ``tangent_p``, which is linear
in the inputs' tangents; ``tangent_p``'s transpose is the gradient op. So ``jax.grad`` lowers to
the forward and the gradient op, and ``jax.jvp``, ``jax.jacfwd``, ``jax.linearize`` and their
compositions with reverse mode and ``vmap`` go through the op too.

The tangent recurrence is itself a single-gate recurrence, which the forward primitive runs.
Per direction, in processing order, with ``s[k] = act'(z[k])``::

    dz[k] = u[k] + (dh[k-1] * m[k]) R^T,    dh[k] = s[k] * dz[k],    dh[-1] = d h0

where ``u[k] = dx'[t(k)] + (h[k-1] * m[k]) dR^T`` and ``dx'`` is the projected source's tangent
(``dx W^T + x dW^T + db``). Carrying dz instead of dh moves ``s[k-1]`` into the mask::

    dz[k] = u[k] + (dz[k-1] * m'[k]) R^T,   m'[k] = s[k-1] * m[k],   m'[0] = m[0]

which is the forward op with activation ``none``, source ``u``, mask ``m'`` and initial state
``d h0``. So every backend that runs the forward runs the tangent natively: one call of its
forward handler, whose input projection computes ``u`` (``[dx | x | h m] [W | dW | dR]^T`` and
``db`` as the bias), with XLA's elementwise passes for ``h m`` and ``m'`` around it; then
``dy = s * dz``.

Derivatives of the gradient op (forward over reverse), and of the tangent itself (reverse over
forward, forward over forward) where they reach its mask ``m'``, use JAX's autodiff of the
``lax.scan`` decomposition: exact, at the decomposition's speed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.scipy.linalg import block_diag
from jax.interpreters import ad, batching, mlir

from ._primitives import (OpConfig, eager_impl, forward_p, forward_reference, gradients_p,
                          gradients_reference)
from ._spec import INPUTS, OPERANDS, OPTIONAL_NAMES, Activation, compute_dtype
from .reference import (activate_grad, direction_layout, flip_rows, halves, matmul_t,
                        recurrent_inputs, reference, valid_steps)


def bind_gradients(config: OpConfig, x, R, dy, z, *optionals) -> list:
    """The gradient primitive for one problem (a group axis of size 1 added to the operands
    that have one, and removed from the results); ``optionals`` in ``OPTIONAL_NAMES`` order,
    None where absent."""
    operands = [x, R, dy, z, *(a for a in optionals if a is not None)]
    out = gradients_p.bind(*(a[None] if OPERANDS[n].grouped else a
                             for n, a in zip(config.operand_names(gradients=True), operands)),
                           config=config)
    return [g[0] for g in out]


# ------------------------------------------------------------------- the tangent primitive

tangent_p = Primitive("sgrnn_tangent")
tangent_p.multiple_results = True


def _split(operands, config: OpConfig, tangents: tuple[str, ...]):
    """``tangent_p``'s operands: (tangents by name, the forward's inputs by name, z)."""
    n = len(tangents)
    inputs = dict(zip(config.operand_names(gradients=False), operands[n:-1]))
    return dict(zip(tangents, operands[:n])), inputs, operands[-1]


def _tangent_abstract_eval(*operands, config: OpConfig, tangents: tuple[str, ...]):
    z = operands[-1]
    return [z, z] if config.descriptor.training else [z]


def tangent(*operands, config: OpConfig, tangents: tuple[str, ...]) -> list:
    """``tangent_p`` as JAX code around one forward call (the module docstring's equations):
    ``[dy]``, or ``[dy, dz]`` for a training forward. Operands: the tangents named in
    ``tangents`` (the differentiable inputs whose tangent is not zero), then the forward's
    operands, then its z."""
    t, inputs, z = _split(operands, config, tangents)
    desc = config.descriptor
    x, R = inputs["source"], inputs["recurrent_weight"]
    dtype, cdt = x.dtype, compute_dtype(x.dtype)
    cast = lambda a: None if a is None else a.astype(cdt)
    t = {n: cast(a) for n, a in t.items()}
    x, R, z = cast(x), cast(R), cast(z)
    W, h0, mask = cast(inputs.get("input_weight")), inputs.get("init_state"), inputs.get("mask")
    lengths = inputs.get("seq_lengths")
    T, D, H = x.shape[0], desc.directions, R.shape[-1]
    valid = None if lengths is None else valid_steps(lengths, T)

    # The tangent of the projected source, u, is one product [dx | x | h m] [W | dW | dR]^T
    # (the parts whose tangent is given), which the forward call computes as its own input
    # projection with its BLAS, plus db as its bias. New arrays are made from z's slices
    # (zeros_like, ones_like): under explicit sharding they share its batch split.
    parts = []  # (source part [T, N, *], its weight [D*H, *])
    if "source" in t and W is not None:
        parts.append((t["source"], W))
    if "input_weight" in t:
        parts.append((x, t["input_weight"]))

    h0 = jnp.zeros_like(z[0]) if h0 is None else cast(h0)
    masks = [None] * D if mask is None else halves(jnp.broadcast_to(mask, z.shape), D)
    scale = activate_grad(desc.activation, z)  # s = act'(z), laid out as z
    hm_parts, scaled_masks = [], []
    for d, (z_d, s_d, h0_d, m_d) in enumerate(zip(halves(z, D), halves(scale, D),
                                                  halves(h0, D), masks)):
        read_reversed, store_flipped = direction_layout(desc, d)
        if store_flipped:  # to processing order
            z_d, s_d = flip_rows(z_d, lengths), flip_rows(s_d, lengths)
        if "recurrent_weight" in t:  # h[k-1] m[k], read by step k at source time t(k)
            hm = recurrent_inputs(desc.activation, z_d, h0_d, m_d, valid)
            hm_parts.append(flip_rows(hm, lengths) if read_reversed else hm)
        if desc.activation != Activation.NONE:
            s_prev = jnp.concatenate([jnp.ones_like(s_d[:1]), s_d[:-1]])
            m_d = s_prev if m_d is None else s_prev * m_d
        scaled_masks.append(m_d)

    if hm_parts:  # dR as one [D*H, D*H] weight: block diagonal over the directions
        dR = t["recurrent_weight"].reshape(D, H, H)
        parts.append((jnp.concatenate(hm_parts, axis=-1), block_diag(*dR)))
    if "source" in t and W is None:  # dx enters unprojected: XLA sums the parts
        source, weight = t["source"] + sum(matmul_t(s, w) for s, w in parts), None
    elif parts:
        source = jnp.concatenate([s for s, _ in parts], axis=-1)
        weight = jnp.concatenate([w for _, w in parts], axis=-1)
    else:
        source, weight = jnp.zeros_like(z), None
    scaled_mask = None if scaled_masks[0] is None else jnp.concatenate(scaled_masks, axis=-1)
    linear = dict(input_weight=weight, bias=t.get("bias"), init_state=t.get("init_state"),
                  mask=scaled_mask, seq_lengths=lengths)
    linear_config = OpConfig.of(desc.replace(activation=Activation.NONE, training=False),
                                config.backends, **linear)
    dz = forward_p.bind(source, R, *(a for a in linear.values() if a is not None),
                        config=linear_config)[0]
    dy = scale * dz  # dz is zero at padded steps, as y is
    return [dy.astype(dtype), dz.astype(dtype)] if desc.training else [dy.astype(dtype)]


def _tangent_transpose(cotangents, *operands, config: OpConfig, tangents: tuple[str, ...]):
    """The cotangents of the tangents from those of ``[dy]`` (or ``[dy, dz]``): the gradient
    op. A cotangent for z, which MPSGraph's gradient op does not take, goes through the
    reference's autodiff instead (exact, slower)."""
    n = len(tangents)
    if any(ad.is_undefined_primal(a) for a in operands[n:]):
        raise NotImplementedError("sgrnn_tangent is linear only in its tangent operands")
    _, inputs, z = _split(operands, config, tangents)
    dy, dz = cotangents if len(cotangents) == 2 else (cotangents[0], None)
    opt = {name: inputs.get(name) for name in OPTIONAL_NAMES}
    x, R = inputs["source"], inputs["recurrent_weight"]
    if dz is None or type(dz) is ad.Zero:
        if type(dy) is ad.Zero:
            return [None] * len(operands)
        grads = bind_gradients(config.with_training(False), x, R, dy, z, *opt.values())
        by_name = dict(zip(config.gradient_names(), grads))
    else:
        dy = ad.instantiate_zeros(dy)
        names = [o.name for o in INPUTS if o.differentiable]
        desc = config.descriptor.replace(training=True)
        _, vjp = jax.vjp(lambda *a: reference(*a, mask=opt["mask"], seq_lengths=opt["seq_lengths"],
                                              descriptor=desc),
                         x, R, opt["input_weight"], opt["bias"], opt["init_state"])
        by_name = dict(zip(names, vjp((dy, dz))))
    return ([by_name[name] if ad.is_undefined_primal(a) else None
             for name, a in zip(tangents, operands[:n])] + [None] * (len(operands) - n))


def _tangent_batch(args, dims, *, config: OpConfig, tangents: tuple[str, ...]):
    """vmap of the tangent's JAX code: its forward call folds the mapped axis into N (the
    forward primitive's batching rule), so ``jax.jacfwd`` is one call of the recurrence."""
    fn = functools.partial(tangent, config=config, tangents=tangents)
    out = jax.vmap(fn, in_axes=dims)(*args)
    return out, [0] * len(out)


def _tangent_jvp(primals, tangents_in, *, config: OpConfig, tangents: tuple[str, ...]):
    fn = functools.partial(tangent, config=config, tangents=tangents)
    return jax.jvp(fn, tuple(primals), tuple(ad.instantiate_zeros(t) for t in tangents_in))


tangent_p.def_abstract_eval(_tangent_abstract_eval)
tangent_p.def_impl(eager_impl(tangent_p))
mlir.register_lowering(tangent_p, mlir.lower_fun(tangent, multiple_results=True))
ad.primitive_transposes[tangent_p] = _tangent_transpose
ad.primitive_jvps[tangent_p] = _tangent_jvp
batching.primitive_batchers[tangent_p] = _tangent_batch


# --------------------------------------------------------------------- the forward's JVP

def _forward_jvp(primals, tangents_in, *, config: OpConfig):
    names = config.operand_names(gradients=False)
    given = {n: t for n, t in zip(names, tangents_in) if type(t) is not ad.Zero}
    if "mask" in given:
        # The public op's mask is a constant; only the tangent's own forward call, under a
        # further derivative, has a mask that varies (m' holds act'(z)): the decomposition.
        return _decomposition_jvp(forward_reference, primals, tangents_in, config=config)
    given = {n: t for n, t in given.items() if OPERANDS[n].differentiable}
    y, z = forward_p.bind(*primals, config=config.with_training(True))
    primal_out = [y, z] if config.descriptor.training else [y]
    if not given:
        return primal_out, [ad.Zero(jax.typeof(a).to_tangent_aval()) for a in primal_out]
    tangent_out = tangent_p.bind(*given.values(), *primals, z, config=config,
                                 tangents=tuple(given))
    return primal_out, tangent_out


def _decomposition_jvp(decomposition, primals, tangents_in, *, config: OpConfig):
    """A primitive's derivative by JAX's autodiff of its ``lax.scan`` decomposition: exact, at
    the decomposition's speed."""
    tangents_in = tuple(ad.instantiate_zeros(t) for t in tangents_in)
    return jax.jvp(functools.partial(decomposition, config=config), tuple(primals), tangents_in)


ad.primitive_jvps[forward_p] = _forward_jvp
# The gradient op's own derivative (second derivatives through reverse mode).
ad.primitive_jvps[gradients_p] = functools.partial(_decomposition_jvp, gradients_reference)
