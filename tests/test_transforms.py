"""JAX transformations of the op (jit, vmap in many forms, grad of vmap, vmap of grad),
each compared with the same transformation applied to the lax.scan reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sgrnn
from conftest import (DIFF_NAMES, OPTIONAL_PATTERNS, assert_close, diff_inputs, make_inputs,
                      out_shape, pattern_id, random_array, ref_jit)

op = jax_sgrnn.single_gate_rnn
ref = jax_sgrnn.reference
ALL_NAMES = DIFF_NAMES + ("mask",)
B = 2  # vmapped batch size


def batched_inputs(rng, mapped, B=B, **kw):
    """make_inputs with the ``mapped`` entries stacked over a leading axis of size B (one
    independent draw per example); the others are single draws."""
    draws = [make_inputs(rng, **kw) for _ in range(B)]
    return {n: (jnp.stack([d[n] for d in draws]) if n in mapped and draws[0][n] is not None
                else draws[0][n]) for n in ALL_NAMES}


def in_axes_for(inputs, mapped):
    return {n: (0 if n in mapped and inputs[n] is not None else None) for n in ALL_NAMES}


def both(transform, *args, pair=(op, ref)):
    """transform(fn) applied to the op (jitted) and to the reference (fast-compiled jit)."""
    return jax.jit(transform(pair[0]))(*args), ref_jit(transform(pair[1]))(*args)


# ------------------------------------------------------------------------------ jit


def test_jit_matches_eager_and_reference(rng):
    inputs = make_inputs(rng, bidirectional=True, mask="float")
    flags = dict(activation="tanh", bidirectional=True)
    eager = op(**inputs, **flags)
    jitted = jax.jit(lambda i: op(**i, **flags))(inputs)
    assert_close(jitted, eager)
    assert_close(jitted, ref_jit(lambda i: ref(**i, **flags))(inputs))


def test_jit_with_static_flags(rng):
    inputs = make_inputs(rng, mask="bool")
    f = jax.jit(op, static_argnames=("activation", "reverse"))
    assert_close(f(**inputs, activation="sigmoid", reverse=True),
                 ref_jit(lambda i: ref(**i, activation="sigmoid", reverse=True))(inputs))


def test_jit_with_transposed_and_strided_operands(rng):
    """Operands produced inside the jit as transposes and strided slices (XLA may give them
    non-row-major layouts) reach the custom call correctly."""
    big = make_inputs(rng, 8, 3, 6, 5, mask="float")
    flags = dict(activation="tanh", reverse=True)

    def f(fn):
        def run(i):
            x = jnp.transpose(i["source"][::2], (1, 0, 2)).transpose(1, 0, 2)[..., ::2]
            R = i["recurrent_weight"].T
            W = i["input_weight"][:, ::2]
            h0 = i["init_state"][::-1]
            m = jnp.swapaxes(i["mask"], 0, 1)[:, ::2].swapaxes(0, 1)
            return fn(x, R, W, i["bias"], h0, m, **flags), jax.grad(
                lambda x: jnp.sum(fn(x, R, W, i["bias"], h0, m, **flags) ** 2))(x)

        return run

    got, want = both(f, big)
    assert got[0].shape == (4, 3, 5) and got[1].shape == (4, 3, 3)
    assert_close(got, want)


def test_numpy_and_python_inputs(rng):
    inputs = make_inputs(rng, mask="bool")
    as_numpy = {k: (None if v is None else np.asarray(v)) for k, v in inputs.items()}
    assert_close(op(**as_numpy, activation="tanh"), op(**inputs, activation="tanh"))
    small = make_inputs(rng, 2, 1, 5, 5, input_weight=False, bias=False, init_state=False)
    as_lists = [np.asarray(small[n]).tolist() for n in ("source", "recurrent_weight")]
    assert_close(op(*as_lists), op(small["source"], small["recurrent_weight"]))


# ----------------------------------------------------------------------------- vmap


@pytest.mark.parametrize("pattern", OPTIONAL_PATTERNS, ids=pattern_id)
def test_vmap_over_source_only(rng, pattern):
    """Only x carries the mapped axis; every optional-input pattern (the batching rule folds
    the mapped axis into N and must find each operand's slot)."""
    w, b, h = pattern
    bi = sum(pattern) % 2 == 1
    mask = ("float", None, "bool")[sum(pattern) % 3]
    kw = dict(bidirectional=bi, input_weight=w, bias=b, init_state=h, mask=mask)
    inputs = batched_inputs(rng, {"source"}, **kw)
    flags = dict(activation="tanh", reverse=True, bidirectional=bi)
    axes = in_axes_for(inputs, {"source"})
    got, want = both(lambda fn: jax.vmap(lambda i: fn(**i, **flags), in_axes=(axes,)), inputs)
    assert got.shape == (B, *out_shape(make_inputs(rng, **kw), bi))
    assert_close(got, want)


@pytest.mark.parametrize("bi", [False, True], ids=["uni", "bi"])
@pytest.mark.parametrize("pattern", [(True, True, True), (False, True, True)],
                         ids=pattern_id)
def test_vmap_over_all_inputs(cpu_backend, rng, bi, pattern):
    """x, R, W, b, h0 and the mask all mapped (per-example weights)."""
    w, b, h = pattern
    inputs = batched_inputs(rng, set(ALL_NAMES), bidirectional=bi, input_weight=w, bias=b,
                            init_state=h, mask="float")
    flags = dict(activation="sigmoid", bidirectional=bi)
    axes = in_axes_for(inputs, set(ALL_NAMES))
    got, want = both(lambda fn: jax.vmap(lambda i: fn(**i, **flags, training=True),
                                         in_axes=(axes,)), inputs)
    assert_close(got, want)


@pytest.mark.parametrize("mapped,w", [
    pytest.param(mapped, w, id=f"{'+'.join(mapped)}-{'W' if w else 'noW'}")
    for mapped in [("init_state",), ("mask",), ("source", "mask"), ("bias",),
                   ("input_weight",), ("recurrent_weight",), ("source", "init_state")]
    for w in (True, False) if w or "input_weight" not in mapped])
def test_vmap_over_some_inputs(rng, mapped, w):
    """Mapped subsets, including x unmapped (the batching rule broadcasts it)."""
    inputs = batched_inputs(rng, set(mapped), input_weight=w, mask="float")
    flags = dict(activation="tanh")
    axes = in_axes_for(inputs, set(mapped))
    got, want = both(lambda fn: jax.vmap(lambda i: fn(**i, **flags), in_axes=(axes,)), inputs)
    assert got.shape[0] == B
    assert_close(got, want)


@pytest.mark.parametrize("mask_shape", [(4, 1, 1), (1, 3, 1), (5,)], ids=str)
def test_vmap_with_mapped_broadcast_mask(rng, mask_shape):
    """A mapped mask of a broadcast shape (per example [T,1,1], [1,N,1], [H])."""
    inputs = batched_inputs(rng, {"source", "mask"}, mask="float", mask_shape=mask_shape)
    axes = in_axes_for(inputs, {"source", "mask"})
    got, want = both(lambda fn: jax.vmap(lambda i: fn(**i, activation="tanh"),
                                         in_axes=(axes,)), inputs)
    assert_close(got, want)


def test_vmap_source_on_axis_2(rng):
    """x mapped on its axis 2 ([T, N, B, I]); output mapped on axis 0 and, with out_axes, 1."""
    inputs = make_inputs(rng, mask="bool")
    xs = random_array(rng, (4, 3, B, 3), jnp.float64)
    rest = {n: v for n, v in inputs.items() if n != "source"}
    for out_axes in (0, 1):
        def transform(fn, out_axes=out_axes):
            return jax.vmap(lambda x: fn(x, **rest, activation="relu", reverse=True),
                            in_axes=2, out_axes=out_axes)

        got, want = both(transform, xs)
        assert got.shape == ((B, 4, 3, 5) if out_axes == 0 else (4, B, 3, 5))
        assert_close(got, want)


def test_vmap_init_state_on_axis_1(rng):
    inputs = make_inputs(rng)
    h0s = random_array(rng, (3, B, 5), jnp.float64)
    rest = {n: v for n, v in inputs.items() if n != "init_state"}
    got, want = both(lambda fn: jax.vmap(lambda h: fn(**rest, init_state=h, activation="tanh"),
                                         in_axes=1), h0s)
    assert_close(got, want)


@pytest.mark.parametrize("bi", [False, True], ids=["uni", "bi"])
def test_nested_vmap(rng, bi):
    """vmap of vmap over x ([B1, B2, T, N, I]); the outer one also maps h0."""
    inputs = make_inputs(rng, bidirectional=bi, mask="float")
    xs = random_array(rng, (3, B, 4, 3, 3), jnp.float64)
    h0s = random_array(rng, (3, 3, (2 if bi else 1) * 5), jnp.float64)
    rest = {n: v for n, v in inputs.items() if n not in ("source", "init_state")}
    flags = dict(activation="tanh", bidirectional=bi, reverse=True)

    def transform(fn):
        inner = lambda x, h: fn(x, **rest, init_state=h, **flags)
        return jax.vmap(jax.vmap(inner, in_axes=(0, None)), in_axes=(0, 0))

    got, want = both(transform, xs, h0s)
    assert got.shape == (3, B, 4, 3, (2 if bi else 1) * 5)
    assert_close(got, want)

    def x_only(fn):
        return jax.vmap(jax.vmap(lambda x: fn(x, **rest, init_state=inputs["init_state"],
                                              **flags)))

    got, want = both(x_only, xs)
    assert_close(got, want)


@pytest.mark.parametrize("bi", [False, True], ids=["uni", "bi"])
def test_nested_vmap_inner_maps_mask_outer_does_not(rng, bi):
    """The inner vmap folds a mapped mask into the batch; the outer vmap (x and h0 mapped,
    mask not) must then broadcast that already-folded mask: forward and per-example
    gradients (the gradient op's group axis grows twice)."""
    D = 2 if bi else 1
    inputs = make_inputs(rng, bidirectional=bi)
    B1, B2 = 3, B
    xs = random_array(rng, (B1, B2, 4, 3, 3), jnp.float64)
    h0s = random_array(rng, (B1, B2, 3, D * 5), jnp.float64)
    masks = jnp.asarray(rng.random(size=(B2, 4, 3, D * 5)) * 1.5)
    c = random_array(rng, (4, 3, D * 5), jnp.float64)
    shared = {n: inputs[n] for n in ("recurrent_weight", "input_weight", "bias")}
    flags = dict(activation="tanh", bidirectional=bi, reverse=True)

    def forward(fn):
        inner = lambda x, h, m: fn(x, **shared, init_state=h, mask=m, **flags)
        return jax.vmap(jax.vmap(inner, in_axes=(0, 0, 0)), in_axes=(0, 0, None))

    got, want = both(forward, xs, h0s, masks)
    assert got.shape == (B1, B2, 4, 3, D * 5)
    assert_close(got, want)

    def per_example_grads(fn):
        def loss(x, w, h, m):
            return jnp.sum(fn(x, **w, init_state=h, mask=m, **flags) * c)

        g = jax.grad(loss, argnums=(0, 1, 2))
        return jax.vmap(jax.vmap(g, in_axes=(0, None, 0, 0)), in_axes=(0, None, 0, None))

    got, want = both(lambda fn: lambda *a: per_example_grads(fn)(*a), xs, shared, h0s, masks)
    assert got[1]["recurrent_weight"].shape == (B1, B2, *shared["recurrent_weight"].shape)
    assert_close(got, want)


def test_vmap_training_returns_y_and_z(rng):
    inputs = batched_inputs(rng, {"source", "init_state"}, bidirectional=True)
    axes = in_axes_for(inputs, {"source", "init_state"})
    flags = dict(activation="hard_sigmoid", bidirectional=True, training=True)
    got, want = both(lambda fn: jax.vmap(lambda i: fn(**i, **flags), in_axes=(axes,)), inputs)
    assert isinstance(got, tuple) and len(got) == 2
    assert_close(got, want)


# ---------------------------------------------------------- grad of vmap, vmap of grad


MAPPED_SETS = {
    "x": {"source"},
    "x_h0": {"source", "init_state"},
    "x_h0_mask": {"source", "init_state", "mask"},
    "all": set(ALL_NAMES),
}
# (mapped set, optional pattern): each mapped set with the full pattern and a sparse one
# (bias without input weight shifts every later operand's slot in the batching rule).
GRAD_CASES = [
    pytest.param(mapped, pattern, id=f"{mapped}-{pattern_id(pattern)}")
    for mapped, pattern in [
        ("x", (True, True, True)), ("x", (False, True, False)),
        ("x_h0", (True, True, True)), ("x_h0", (False, True, True)),
        ("x_h0_mask", (True, False, True)), ("x_h0_mask", (False, False, True)),
        ("all", (True, True, True)), ("all", (False, True, False)),
    ]]


@pytest.mark.parametrize("mapped,pattern", GRAD_CASES)
def test_grad_of_vmap(rng, mapped, pattern):
    """jax.grad of the sum over examples of per-example losses, w.r.t. every input."""
    w, b, h = pattern
    bi = mapped in ("x_h0", "all")
    inputs = batched_inputs(rng, MAPPED_SETS[mapped], bidirectional=bi, input_weight=w,
                            bias=b, init_state=h, mask="float")
    axes = in_axes_for(inputs, MAPPED_SETS[mapped])
    c = random_array(rng, (B, *out_shape(make_inputs(rng, bidirectional=bi, input_weight=w),
                                         bi)), jnp.float64)
    flags = dict(activation="tanh", reverse=True, bidirectional=bi)

    def transform(fn):
        def loss(diff, inputs, c):
            ys = jax.vmap(lambda i: fn(**i, **flags), in_axes=(axes,))({**inputs, **diff})
            return jnp.sum(ys * c)

        return lambda inputs, c: jax.grad(loss)(diff_inputs(inputs), inputs, c)

    got, want = both(transform, inputs, c)
    assert set(got) == set(diff_inputs(inputs))
    for n, g in got.items():
        assert g.shape == inputs[n].shape, n
    assert_close(got, want)


@pytest.mark.parametrize("mapped,pattern", GRAD_CASES)
def test_vmap_of_grad_per_example_gradients(cpu_backend, rng, mapped, pattern):
    """Per-example gradients w.r.t. every input (shared weights get one gradient per
    example), for x only / x and h0 / x, h0 and mask / all inputs mapped."""
    w, b, h = pattern
    bi = mapped in ("x", "all")
    inputs = batched_inputs(rng, MAPPED_SETS[mapped], bidirectional=bi, input_weight=w,
                            bias=b, init_state=h, mask="bool")
    axes = in_axes_for(inputs, MAPPED_SETS[mapped])
    c = random_array(rng, (B, *out_shape(make_inputs(rng, bidirectional=bi, input_weight=w),
                                         bi)), jnp.float64)
    flags = dict(activation="sigmoid", bidirectional=bi)

    def transform(fn):
        def loss(diff, inputs, c):
            return jnp.sum(fn(**{**inputs, **diff}, **flags) * c)

        def per_example(inputs, c):
            return jax.grad(loss)(diff_inputs(inputs), inputs, c)

        return jax.vmap(per_example, in_axes=(axes, 0))

    got, want = both(transform, inputs, c)
    for n, g in got.items():
        per = inputs[n].shape[1:] if axes[n] == 0 else inputs[n].shape
        assert g.shape == (B, *per), (n, g.shape)
    assert_close(got, want)


# -------------------------------------------------------------- vmap of gradients op


@pytest.mark.parametrize("mapped", [
    ("source", "source_gradient", "z_state"),
    ("source_gradient",),
    ("source", "source_gradient", "z_state", "init_state", "mask"),
    ("source", "recurrent_weight", "source_gradient", "z_state", "input_weight", "bias",
     "init_state", "mask"),
], ids=["x_dy_z", "dy", "x_dy_z_h0_mask", "all"])
@pytest.mark.parametrize("w", [True, False], ids=["W", "noW"])
def test_vmap_of_gradients_op(cpu_backend, rng, mapped, w):
    """vmap of single_gate_rnn_gradients against vmap of reference_gradients."""
    bi = len(mapped) > 2
    draws = []
    for _ in range(B):
        i = make_inputs(rng, bidirectional=bi, input_weight=w, mask="float")
        _, z = ref_jit(lambda i: ref(**i, activation="tanh", bidirectional=bi,
                                     training=True))(i)
        draws.append({**i, "z_state": z,
                      "source_gradient": random_array(rng, z.shape, jnp.float64)})
    names = ("source", "recurrent_weight", "source_gradient", "z_state", "input_weight",
             "bias", "init_state", "mask")
    args = {n: (jnp.stack([d[n] for d in draws]) if n in mapped and draws[0][n] is not None
                else draws[0][n]) for n in names}
    axes = {n: (0 if n in mapped and args[n] is not None else None) for n in names}
    flags = dict(activation="tanh", bidirectional=bi)

    def transform(fn):
        return jax.vmap(lambda a: fn(*(a[n] for n in names), **flags), in_axes=(axes,))

    got, want = both(transform, args, pair=(jax_sgrnn.single_gate_rnn_gradients,
                                            jax_sgrnn.reference_gradients))
    assert isinstance(got, list) and len(got) == len(want)
    for g in got:
        assert g.shape[0] == B
    assert_close(got, want)
