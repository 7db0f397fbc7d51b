"""Pure ``lax.scan`` implementation of the single-gate RNN: the oracle for every backend.

:func:`reference` is differentiable by JAX's own autodiff; :func:`reference_gradients` is the
gradient op written out as backpropagation through time (the spec's equations), which is
also what the op lowers to on platforms without a native handler.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

from ._spec import (Activation, Dims, SingleGateRNNDescriptor, as_arrays, compute_dtype,
                    known_sizes, resolve_descriptor, seq_lengths_operand, spec_of, validate)

_HIGHEST = lax.Precision.HIGHEST

# Hard sigmoid: clamp(slope z + offset, 0, 1), saturated beyond +-edge (MPS's and ONNX's
# defaults); csrc/sgrnn/core.h spells the same three numbers for the handlers.
HARD_SIGMOID_SLOPE, HARD_SIGMOID_OFFSET, HARD_SIGMOID_EDGE = 0.2, 0.5, 2.5


def activate(activation: Activation, z):
    """act(z) for one of the five MPSGraph activations.

    Written with ``where`` so that JAX's autodiff gives the spec's derivative at the kinks
    (relu'(0) = 0, hard sigmoid' = 0 at its edges), as ``activate_grad`` and the handlers do,
    and so that NaN stays NaN.
    """
    if activation == Activation.NONE:
        return z
    if activation == Activation.RELU:
        return jnp.where((z > 0) | jnp.isnan(z), z, 0)
    if activation == Activation.TANH:
        return jnp.tanh(z)
    if activation == Activation.SIGMOID:
        return jax.nn.sigmoid(z)
    edge = HARD_SIGMOID_EDGE
    linear = HARD_SIGMOID_SLOPE * z + HARD_SIGMOID_OFFSET
    return jnp.where(z >= edge, 1, jnp.where(z <= -edge, 0, linear)).astype(z.dtype)


def activate_grad(activation: Activation, z):
    """act'(z), with the spec's choices at the kinks (relu' (0) = 0, hard sigmoid open interval).

    sigmoid' and tanh' come from e^-|z| (e / (1 + e)^2 and 4 e2 / (1 + e2)^2) rather than from
    s (1 - s) and 1 - t^2, which cancel to 0 in the tails where the true value is not 0.
    """
    one, zero = jnp.ones_like(z), jnp.zeros_like(z)
    if activation == Activation.NONE:
        return one
    if activation == Activation.RELU:
        return jnp.where(z > 0, one, zero)
    if activation in (Activation.TANH, Activation.SIGMOID):
        e = jnp.exp((-2 if activation == Activation.TANH else -1) * jnp.abs(z))
        scale = 4 if activation == Activation.TANH else 1
        return scale * e / ((1 + e) * (1 + e))
    edge = HARD_SIGMOID_EDGE
    return jnp.where((z > -edge) & (z < edge), HARD_SIGMOID_SLOPE * one, zero)


def direction_layout(descriptor: SingleGateRNNDescriptor, direction: int) -> tuple[bool, bool]:
    """(consumes source reversed, stores outputs time-flipped) for one direction.

    Forward direction: neither. Unidirectional ``reverse``: reads x[T-1-k] at step k but keeps
    outputs in processing order. Backward half of a bidirectional RNN: reads reversed and
    flips its outputs back to source time.
    """
    if direction == 1:
        return True, True
    return descriptor.reverse and not descriptor.bidirectional, False


def valid_steps(seq_lengths, T: int):
    """``[T, N, 1]`` bool: whether step (or time) k of row n is before the row's length. Padded
    positions are the same set in processing order and in source time."""
    return (jnp.arange(T, dtype=seq_lengths.dtype)[:, None] < seq_lengths[None, :])[..., None]


def without_padding(seq_lengths, T: int, x, init_state, mask, *states) -> list:
    """The inputs with every position that only padding reads set to zero: ``x``, ``mask``
    (where its time and batch axes are full) and the state arrays ``[T, N, *]`` at padded steps,
    ``init_state`` ``[N, *]`` of rows of length 0. Selected before any arithmetic, so that NaN
    or Inf there reaches neither a result nor, through autodiff, a gradient (a select after the
    arithmetic passes a zero cotangent into the NaN branch). Without lengths: unchanged."""
    if seq_lengths is None:
        return [x, init_state, mask, *states]
    valid = valid_steps(seq_lengths, T)
    clean = lambda a: None if a is None else jnp.where(valid, a, jnp.zeros((), a.dtype))
    if init_state is not None:
        init_state = jnp.where((seq_lengths > 0)[:, None], init_state,
                               jnp.zeros((), init_state.dtype))
    if mask is not None and mask.shape[:2] == valid.shape[:2]:
        mask = clean(mask)
    return [clean(x), init_state, mask, *map(clean, states)]


def flip_rows(a, seq_lengths):
    """``a`` ``[T, N, F]`` with each row's first ``seq_lengths[n]`` steps in reverse order and its
    padding in place: a reversed direction starts at the row's own last valid step. Without
    lengths, the whole time axis is reversed."""
    if seq_lengths is None:
        return a[::-1]
    k = jnp.arange(a.shape[0], dtype=seq_lengths.dtype)[:, None]
    index = jnp.where(k < seq_lengths[None, :], seq_lengths[None, :] - 1 - k, k)
    return jnp.take_along_axis(a, index[..., None], axis=0)


def matmul_t(a, w):
    """a @ w^T over the last axis of a, at full precision."""
    return jnp.einsum("...j,hj->...h", a, w, precision=_HIGHEST)


def sum_over_steps_and_rows(spec: str, a, b):
    """``jnp.einsum(spec, a, b)`` contracting the time and batch axes (a weight gradient), at
    full precision. Under explicit sharding with the batch sharded the result is replicated
    (summed across devices): JAX asks to be told where such a result lives."""
    sharded = any(e is not None for arr in (a, b) for e in spec_of(jax.typeof(arr)))
    out_sharding = jax.P(*[None] * len(spec.split("->")[1])) if sharded else None
    return jnp.einsum(spec, a, b, precision=_HIGHEST, out_sharding=out_sharding)


def halves(a, directions: int) -> list:
    """Splits the last axis into the halves of the directions (one, or two)."""
    H = a.shape[-1] // directions
    return [a[..., d * H:(d + 1) * H] for d in range(directions)]


def _scan_directions(step, R, init: list, inputs: dict, merge: bool, **scan_options):
    """Runs the directions' recurrences, ``lax.scan(partial(step, R_d), ...)``: one scan per
    direction, or with ``merge`` one scan of all of them, stacked along an axis after time
    (``R_d`` then ``[D, H, H]``: one batched product a step, half the sequential steps for
    two). ``init`` and each list in ``inputs`` hold one array per direction; other inputs
    (``[T, N, 1]``) are shared. Returns the final carries and the outputs, one per direction.
    A single direction keeps its arrays unstacked (a ``[1, N, H]`` carry is slower on GPUs)."""
    if not merge or len(init) == 1:
        scans = [lax.scan(functools.partial(step, R[d]), init[d],
                          {k: v[d] if isinstance(v, list) else v for k, v in inputs.items()},
                          **scan_options) for d in range(len(init))]
        return [final for final, _ in scans], [out for _, out in scans]
    final, out = lax.scan(functools.partial(step, R), jnp.stack(init),
                          {k: jnp.stack(v, axis=1) if isinstance(v, list) else v
                           for k, v in inputs.items()}, **scan_options)
    return list(final), [out[:, d] for d in range(len(init))]


def contraction_parts(rows: int, directions: int, H: int, gpu_form: bool) -> int:
    """Parts to split each step's product's contraction into in ``gpu_form`` (1: unsplit).

    With a few rows and H >= 1024, XLA's GPU products of one step leave most of the GPU idle;
    S products over H/S-long slices of the contraction, summed, give it S times the work
    items. Measured on an H200 (docs/performance.md, "The decomposition"): both directions
    in one scan ran 1.9x and 2.1x faster split at 4 and 32 rows, one direction 1.5x faster at 4
    rows and 14% slower at 32; one row ran 2x slower split, and slices that are not a multiple
    of 32 long gained nothing; 32 rows ran best in 8 parts, 4 rows in 16. So: 2 to 32 rows with
    two directions, 2 to 8 with one; slices of 64 or more, a multiple of 32; at most 16 parts,
    and at most 256 / rows."""
    if not gpu_form or not known_sizes(rows, H):
        return 1  # symbolic sizes (shape-polymorphic export) keep the unsplit product
    if not 1 < rows <= (32 if directions == 2 else 8) or H < 1024:
        return 1
    most = min(16, 256 // rows)
    return next((s for s in (16, 8, 4, 2) if s <= most and H % s == 0 and (H // s) % 32 == 0
                 and H // s >= 64), 1)


def split_contraction(w, parts: int):
    """``w`` ``[..., K, M]``, the right operand of a step's product ``a @ w``, as ``[..., parts,
    K / parts, M]`` for :func:`split_product`."""
    return w.reshape(*w.shape[:-2], parts, w.shape[-2] // parts, w.shape[-1])


def split_product(a, w_split):
    """``a @ w`` at full precision over ``a``'s last axis, from ``w``'s
    :func:`split_contraction`: one product per part (a batch of them), then their sum."""
    parts, length = w_split.shape[-3:-1]
    partial_sums = jnp.einsum("...nsk,...skm->...snm", a.reshape(*a.shape[:-1], parts, length),
                              w_split, precision=_HIGHEST)
    return partial_sums.sum(axis=-3)


def step_product(R, transpose: bool, dims: Dims, gpu_form: bool):
    """Each scan step's product, ``a @ R^T`` (``transpose``: the forward's) or ``a @ R`` (the
    backward's), as ``(operand, product)``: the scans pass ``operand`` (per direction) and
    a step computes ``product(a, operand_d)``. In ``gpu_form`` the product is split
    (:func:`contraction_parts`), or for one row the backward's runs along the rows of a
    transposed copy of R made once (as the forward's runs along R's): XLA's GPU backends run a
    one-row product along a matrix's rows several times faster than down its columns, while
    XLA's CPU runs the transposed form slower (docs/performance.md, "The decomposition")."""
    parts = contraction_parts(dims.N, dims.D, dims.H, gpu_form)
    if parts > 1:
        return split_contraction(jnp.swapaxes(R, -1, -2) if transpose else R, parts), split_product
    if transpose or (gpu_form and dims.N == 1):  # a @ M^T, M stored: along M's rows
        operand, spec = (R if transpose else jnp.swapaxes(R, -1, -2)), "...nk,...mk->...nm"
    else:
        operand, spec = R, "...nk,...km->...nm"
    return operand, functools.partial(jnp.einsum, spec, precision=_HIGHEST)


def _steps_unsharded(*arrays) -> list:
    """Each ``[T, ...]`` array with its time axis gathered where explicit sharding splits it:
    ``lax.scan`` steps along an axis that every device holds whole."""
    def one(a):
        if a is None:
            return None
        spec = spec_of(jax.typeof(a))
        return a if spec[0] is None else jax.sharding.reshard(a, jax.P(None, *spec[1:]))
    return [one(a) for a in arrays]


def _sharded_like(a, like):
    """``a`` resharded to ``like``'s sharding where explicit sharding gives them different
    ones (a gradient has its input's type)."""
    spec = spec_of(jax.typeof(like))
    return a if spec_of(jax.typeof(a)) == spec else jax.sharding.reshard(a, jax.P(*spec))


def _zero_state(source, dims: Dims, dtype):
    """h0 = 0, ``[N, D*H]``, sharded along N as the source is (under explicit sharding the
    scans' carry must keep one type)."""
    batch = spec_of(jax.typeof(source))[1]
    sharding = None if batch is None else jax.P(batch, None)
    return jnp.zeros((dims.N, dims.D * dims.H), dtype, out_sharding=sharding)


def _in_compute_dtype(source, recurrent_weight, input_weight, bias, init_state, mask,
                      seq_lengths, descriptor, state_shapes=()):
    """Validates; returns (input dtype, sizes, a cast to the compute dtype, then R and h0 cast
    (h0 zeros when missing), the mask cast and broadcast to ``[T, N, D*H]`` (None when
    missing: the scans then skip it), and the lengths as int32)."""
    (source, recurrent_weight, input_weight, bias, init_state, mask, *states), seq_lengths = (
        as_arrays(source, recurrent_weight, input_weight, bias, init_state, mask,
                  *(a for _, a in state_shapes), seq_lengths=seq_lengths))
    state_shapes = list(zip((name for name, _ in state_shapes), states))
    dtype, dims = validate(source, recurrent_weight, input_weight, bias, init_state, mask,
                           descriptor.bidirectional, state_shapes, seq_lengths)
    cdt = compute_dtype(dtype)
    cast = lambda a: None if a is None else jnp.asarray(a).astype(cdt)
    R = cast(recurrent_weight).reshape(dims.D, dims.H, dims.H)
    h0 = (_zero_state(source, dims, cdt) if init_state is None else cast(init_state))
    m = (None if mask is None
         else jnp.broadcast_to(cast(mask), dims.state_shape))
    lengths = None if seq_lengths is None else seq_lengths_operand(seq_lengths, dims.T)
    return dtype, dims, cast, R, h0, m, lengths


def reference(source, recurrent_weight, input_weight=None, bias=None, init_state=None,
              mask=None, descriptor: Optional[SingleGateRNNDescriptor] = None, *,
              seq_lengths=None, reverse: Optional[bool] = None,
              bidirectional: Optional[bool] = None, training: Optional[bool] = None,
              activation=None, unroll: int = 1, gpu_form: bool = False):
    """Single-gate RNN forward with ``lax.scan``; same signature as ``single_gate_rnn``, plus
    ``unroll``, the steps per iteration of the scan's loop (``lax.scan``'s own argument), and
    ``gpu_form``, the loops that GPUs run faster, with the same result: a bidirectional
    call's two directions in one scan, one batched product a step, instead of one scan each;
    for a few rows and H >= 1024, each step's product split along its contraction
    (:func:`contraction_parts`); and in :func:`reference_gradients`, for a batch of one row,
    each step's product with a transposed copy of R (a matrix-vector product along R's rows,
    not down its columns).

    Returns ``y``, or ``(y, z)`` when ``training``. The mask is a constant (no gradient).
    """
    desc = resolve_descriptor(descriptor, reverse=reverse, bidirectional=bidirectional,
                              training=training, activation=activation)
    return scan_forward(source, recurrent_weight, input_weight, bias, init_state,
                        _constant(mask), seq_lengths, desc, unroll, gpu_form)


def _constant(mask):
    return None if mask is None else lax.stop_gradient(jnp.asarray(mask))


def scan_forward(source, recurrent_weight, input_weight, bias, init_state, mask, seq_lengths,
                 desc: SingleGateRNNDescriptor, unroll: int = 1,
                 gpu_form: bool = False):
    """:func:`reference` with every argument given, the mask differentiable like the other
    inputs (the forward primitive's decomposition: the tangent's own recurrence takes a mask
    that depends on z, ``_autodiff.py``)."""
    dtype, dims, cast, R, h0, m, lengths = _in_compute_dtype(
        source, recurrent_weight, input_weight, bias, init_state, mask, seq_lengths, desc)
    valid = None if lengths is None else valid_steps(lengths, dims.T)
    x, h0, m = without_padding(lengths, dims.T, *_steps_unsharded(cast(source)), h0,
                               *_steps_unsharded(m))
    xp = x if input_weight is None else matmul_t(x, cast(input_weight))
    if bias is not None:
        xp = xp + cast(bias)[None, None]  # same rank: works under jax_numpy_rank_promotion=raise

    R_steps, product = step_product(R, True, dims, gpu_form)  # z_k = x_k + (h m) R^T

    # The scans' step bodies stay lean (this is what GPUs and TPUs run): the mask and the
    # lengths enter only when given, and each step emits one sequence: y, or z when training
    # (y then follows from z in one elementwise pass, as the backward needs z anyway).
    def step(R_d, h, inputs):
        z_k = inputs["x"] + product(h if m is None else h * inputs["m"], R_d)
        h_k = activate(desc.activation, z_k)
        out_k = z_k if desc.training else h_k
        if valid is not None:  # a finished row keeps its state and gives zeros
            out_k = jnp.where(inputs["valid"], out_k, 0)
            h_k = jnp.where(inputs["valid"], h_k, h)
        return h_k, out_k

    layouts = [direction_layout(desc, d) for d in range(dims.D)]
    inputs = {"x": [flip_rows(xp_d, lengths) if read_reversed else xp_d
                    for xp_d, (read_reversed, _) in zip(halves(xp, dims.D), layouts)]}
    if m is not None:
        inputs["m"] = halves(m, dims.D)
    if valid is not None:
        inputs["valid"] = valid
    _, outs = _scan_directions(step, R_steps, halves(h0, dims.D), inputs, gpu_form,
                               unroll=unroll)
    outs = [flip_rows(out_d, lengths) if store_flipped else out_d
            for out_d, (_, store_flipped) in zip(outs, layouts)]
    out = outs[0] if dims.D == 1 else jnp.concatenate(outs, axis=-1)
    if not desc.training:
        return out.astype(dtype)
    y = activate(desc.activation, out)
    if valid is not None:
        y = jnp.where(valid, y, 0)
    return y.astype(dtype), out.astype(dtype)


def recurrent_inputs(activation: Activation, z, h0, mask, valid):
    """One direction's ``h[k-1] * m[k]`` ``[T, N, H]`` (what step k multiplies by R^T), from
    its z and h0 in processing order; zero at padded steps, whatever z holds there."""
    hm = jnp.concatenate([h0[None], activate(activation, z)])[:z.shape[0]]
    if mask is not None:
        hm = hm * mask
    if valid is not None:
        hm = jnp.where(valid, hm, 0)
    return hm


def _direction_weight_gradient(activation: Activation, dz, z, h0, mask, valid):
    """One direction's dR ``[H, H]`` from its dz and z in processing order: the sum over steps
    k of ``dz_k^T (h_{k-1} m_k)``, one product over all steps and rows."""
    return sum_over_steps_and_rows("tnh,tnk->hk", dz,
                                   recurrent_inputs(activation, z, h0, mask, valid))


def recurrent_weight_gradient(d_source, z_state, init_state, mask, seq_lengths,
                              descriptor: SingleGateRNNDescriptor):
    """dR ``[D, H, H]`` from the op's own layouts (the CUDA lowering's, after its kernel
    returns dz).

    ``d_source`` is dz, the gradient of the projected source, in source time ``[T, N, D*H]``;
    ``z_state`` the forward's z as the op returns it; ``init_state`` ``[N, D*H]`` (zeros when
    absent), ``mask`` ``[T, N, D*H]`` or None, ``seq_lengths`` int32 ``[N]`` or None.
    """
    T, N, DH = z_state.shape
    dims = Dims(T=T, N=N, I=DH, H=DH // descriptor.directions, D=descriptor.directions)
    valid = None if seq_lengths is None else valid_steps(seq_lengths, T)
    masks = [None] * dims.D if mask is None else halves(mask, dims.D)
    dRs = []
    for d, (dz_d, z_d, h0_d) in enumerate(zip(halves(d_source, dims.D), halves(z_state, dims.D),
                                              halves(init_state, dims.D))):
        read_reversed, store_flipped = direction_layout(descriptor, d)
        if read_reversed:  # both to processing order
            dz_d = flip_rows(dz_d, seq_lengths)
        if store_flipped:
            z_d = flip_rows(z_d, seq_lengths)
        dRs.append(_direction_weight_gradient(descriptor.activation, dz_d, z_d, h0_d, masks[d],
                                              valid))
    return jnp.stack(dRs)


def reference_gradients(source, recurrent_weight, source_gradient, z_state, input_weight=None,
                        bias=None, init_state=None, mask=None,
                        descriptor: Optional[SingleGateRNNDescriptor] = None, *,
                        seq_lengths=None, reverse: Optional[bool] = None,
                        bidirectional: Optional[bool] = None, training: Optional[bool] = None,
                        activation=None, unroll: int = 1,
                        gpu_form: bool = False) -> list:
    """The gradient op as explicit backpropagation through time (spec, "Gradient op");
    ``unroll`` and ``gpu_form`` as in :func:`reference`.

    Returns ``[d source, d recurrent_weight]`` followed by ``d input_weight``, ``d bias`` and
    ``d init_state`` for those given, in that order.
    """
    desc = resolve_descriptor(descriptor, reverse=reverse, bidirectional=bidirectional,
                              training=training, activation=activation)
    dtype, dims, cast, R, h0, m, lengths = _in_compute_dtype(
        source, recurrent_weight, input_weight, bias, init_state, _constant(mask), seq_lengths,
        desc, state_shapes=(("source_gradient", source_gradient), ("z_state", z_state)))
    source = cast(source)
    x, m, g, z = _steps_unsharded(source, m, cast(source_gradient), cast(z_state))
    x, h0, m, g, z = without_padding(lengths, dims.T, x, h0, m, g, z)
    valid = None if lengths is None else valid_steps(lengths, dims.T)

    layouts = [direction_layout(desc, d) for d in range(dims.D)]

    def processing_order(a):  # each direction's part, in the order its scan steps
        return [flip_rows(a_d, lengths) if store_flipped else a_d
                for a_d, (_, store_flipped) in zip(halves(a, dims.D), layouts)]

    gs, zs = processing_order(g), processing_order(z)
    h0s = halves(h0, dims.D)
    ms = [None] * dims.D if m is None else halves(m, dims.D)

    R_steps, product = step_product(R, False, dims, gpu_form)  # carry = dz R

    def step(R_d, carry, inputs):
        dz_k = (inputs["g"] + carry) * activate_grad(desc.activation, inputs["z"])
        if valid is not None:  # a padded step has no gradient
            dz_k = jnp.where(inputs["valid"], dz_k, 0)
        carry_k = product(dz_k, R_d)
        if m is not None:
            carry_k = carry_k * inputs["m"]
        if valid is not None:  # ... and feeds none back
            carry_k = jnp.where(inputs["valid"], carry_k, 0)
        return carry_k, dz_k

    inputs = {"g": gs, "z": zs}
    if m is not None:
        inputs["m"] = ms
    if valid is not None:
        inputs["valid"] = valid
    dh0s, dzs = _scan_directions(step, R_steps, [jnp.zeros_like(h0_d) for h0_d in h0s], inputs,
                                 gpu_form, reverse=True, unroll=unroll)
    dRs = [_direction_weight_gradient(desc.activation, dz_d, z_d, h0_d, m_d, valid)
           for dz_d, z_d, h0_d, m_d in zip(dzs, zs, h0s, ms)]
    dxps = [flip_rows(dz_d, lengths) if read_reversed else dz_d  # to source time
            for dz_d, (read_reversed, _) in zip(dzs, layouts)]
    dxp = dxps[0] if dims.D == 1 else jnp.concatenate(dxps, axis=-1)
    dR = jnp.stack(dRs) if desc.bidirectional else dRs[0]
    if input_weight is None:
        grads = [_sharded_like(dxp, source), dR]
    else:
        dx = jnp.einsum("tnh,hi->tni", dxp, cast(input_weight), precision=_HIGHEST)
        grads = [_sharded_like(dx, source), dR, sum_over_steps_and_rows("tnh,tni->hi", dxp, x)]
    if bias is not None:
        grads.append(dxp.sum(axis=(0, 1)))
    if init_state is not None:
        grads.append(jnp.concatenate(dh0s, axis=-1))
    return [gr.astype(dtype) for gr in grads]
