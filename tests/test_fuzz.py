"""Property-based tests: random problems through every native path, against the reference.

Hypothesis draws the shapes (T and N from 0, I and H from 1), every descriptor flag, every
optional input (a mask of any broadcastable shape, bool or float), the dtype (float64,
float32, float16, bfloat16) and the data's scale, then compares the op with
``jax_sgrnn.reference`` / ``reference_gradients``:

- the forward (``y``; ``y`` and ``z`` with ``training=True``), jitted or eager;
- the explicit gradient op against ``reference_gradients`` on the same ``dy`` and ``z``;
- ``jax.grad`` through the op against ``jax.grad`` through the reference;
- ``vmap`` (the mapped axis folded into the batch / group axis: one custom call) and
  per-example weight gradients ``vmap(grad)``, against ``vmap`` of the reference.

On this machine the native path is the CPU FFI handler (float32 and float64 buffers; float16
and bfloat16 are widened to float32 around it) and the instruction-set build that
``csrc/cpu/dispatch.cc`` picks for this CPU.

Profiles (``SGRNN_HYPOTHESIS_PROFILE``): ``default`` runs 30 examples per test (15 for the
vmap one), derandomised so CI is reproducible; ``long`` runs 1000 random examples per test::

    SGRNN_HYPOTHESIS_PROFILE=long python -m pytest tests/test_fuzz.py -q
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import conftest
import jax_sgrnn
from conftest import DIFF_NAMES, assert_close, random_array

#: jit for the oracle side (conftest's fast-compiling jit when it has one).
ref_jit = getattr(conftest, "ref_jit", jax.jit)

_COMMON = dict(deadline=None, database=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("sgrnn-default", max_examples=30, derandomize=True, **_COMMON)
settings.register_profile("sgrnn-long", max_examples=1000, **_COMMON)
PROFILE = os.environ.get("SGRNN_HYPOTHESIS_PROFILE", "default")
if PROFILE not in ("default", "long"):
    raise ValueError(f"SGRNN_HYPOTHESIS_PROFILE: expected 'default' or 'long', got {PROFILE!r}")
FUZZ = settings.get_profile(f"sgrnn-{PROFILE}")
FUZZ_VMAP = settings(FUZZ, max_examples=max(15, FUZZ.max_examples // 3))

DTYPES = (jnp.float64, jnp.float32, jnp.float16, jnp.bfloat16)
ACTIVATIONS = ("none", "relu", "tanh", "sigmoid", "hard_sigmoid")
OPTIONAL = ("input_weight", "bias", "init_state")

op, op_grads = jax_sgrnn.single_gate_rnn, jax_sgrnn.single_gate_rnn_gradients
ref, ref_grads = jax_sgrnn.reference, jax_sgrnn.reference_gradients


@st.composite
def problems(draw, max_T=6, max_N=4):
    """One random problem: sizes, flags, present inputs, mask layout, dtype, data seed."""
    T = draw(st.integers(0, max_T))
    N = draw(st.integers(0, max_N))
    I = draw(st.integers(1, 5))
    H = draw(st.integers(1, 5))
    bi = draw(st.booleans())
    D = 2 if bi else 1
    p = dict(T=T, N=N, I=I, H=H, bidirectional=bi, reverse=draw(st.booleans()),
             activation=draw(st.sampled_from(ACTIVATIONS)),
             dtype=draw(st.sampled_from(DTYPES)),
             present={n: draw(st.booleans()) for n in OPTIONAL},
             mask=draw(st.sampled_from((None, "bool", "float"))),
             r_scale=draw(st.sampled_from((0.3, 1.0, 1.5))),
             seed=draw(st.integers(0, 2**32 - 1)))
    full = (T, N, D * H)
    rank = draw(st.integers(0, 3))
    p["mask_shape"] = tuple(f if draw(st.booleans()) else 1 for f in full[3 - rank:])
    return p


def make_problem(p) -> dict:
    """The op's keyword inputs for a drawn problem (absent optionals are None)."""
    rng = np.random.default_rng(p["seed"])
    T, N, I, H, dtype = p["T"], p["N"], p["I"], p["H"], p["dtype"]
    D = 2 if p["bidirectional"] else 1
    W = p["present"]["input_weight"]
    inputs = dict(
        source=random_array(rng, (T, N, I if W else D * H), dtype),
        recurrent_weight=random_array(rng, (2, H, H) if D == 2 else (H, H), dtype,
                                      p["r_scale"] / np.sqrt(H)),
        input_weight=random_array(rng, (D * H, I), dtype, 1 / np.sqrt(I)) if W else None,
        bias=random_array(rng, (D * H,), dtype, 0.5) if p["present"]["bias"] else None,
        init_state=random_array(rng, (N, D * H), dtype) if p["present"]["init_state"]
        else None,
        mask=None)
    if p["mask"] == "bool":
        inputs["mask"] = jnp.asarray(rng.random(p["mask_shape"]) < 0.7)
    elif p["mask"] == "float":
        inputs["mask"] = jnp.asarray(rng.random(p["mask_shape"]) * 1.5).astype(dtype)
    return inputs


def _flags(p) -> dict:
    return dict(activation=p["activation"], reverse=p["reverse"],
                bidirectional=p["bidirectional"])


def _diff(inputs) -> dict:
    return {n: inputs[n] for n in DIFF_NAMES if inputs[n] is not None}


def _grad_list_to_dict(inputs, grads) -> dict:
    """The gradient op's list (dx, dR, then dW, db, dh0 for those given) keyed by name."""
    names = ["source", "recurrent_weight"] + [n for n in OPTIONAL if inputs[n] is not None]
    assert len(grads) == len(names), (len(grads), names)
    return dict(zip(names, grads))


def _all_results(rnn, rnn_grads, inputs, dy, z_in, flags, half: bool) -> dict:
    """Everything one implementation computes for a problem, in one traced function.

    For the reference with a half dtype, ``grad`` is the explicit BPTT on the reference's own
    half-precision z: the op's backward receives z stored in the input dtype by design, so at
    hard sigmoid's +-2.5 (or relu's 0) a rounded z may legitimately pick the other side of the
    kink, which JAX's autodiff of the reference (working on the float32 z) never sees."""
    out = dict(y=rnn(**inputs, **flags))
    out["y_train"], out["z"] = rnn(**inputs, **flags, training=True)
    grad_args = {k: v for k, v in inputs.items() if k not in ("source", "recurrent_weight")}
    out["grad_op"] = _grad_list_to_dict(inputs, rnn_grads(
        inputs["source"], inputs["recurrent_weight"], dy, z_in, **grad_args, **flags))

    if half and rnn is ref:
        out["grad"] = _grad_list_to_dict(inputs, ref_grads(
            inputs["source"], inputs["recurrent_weight"], dy, out["z"], **grad_args, **flags))
    else:
        def loss(diff):
            y = rnn(**{**inputs, **diff}, **flags)
            return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32))

        out["grad"] = jax.grad(loss)(_diff(inputs))
    return out


def _check(got, want, inputs, dtype, shape):
    for key in ("y", "y_train", "z"):
        assert got[key].shape == shape and got[key].dtype == dtype, (key, got[key].shape)
    for key in ("grad_op", "grad"):
        for name, g in got[key].items():
            assert g.shape == inputs[name].shape and g.dtype == dtype, (key, name, g.shape)
    for key in ("y", "y_train", "z", "grad_op", "grad"):
        for leaf in jax.tree.leaves(got[key]):
            assert np.all(np.isfinite(np.asarray(leaf, np.float64))), f"{key}: non-finite"
        assert_close(got[key], want[key], dtype=dtype, err_msg=key)


@FUZZ
@given(p=problems(), jit=st.sampled_from((True, True, True, False)))
def test_op_matches_reference(p, jit):
    """Forward, z, the gradient op and jax.grad, through the native handler (jitted, or
    eagerly primitive by primitive) against the lax.scan reference."""
    inputs = make_problem(p)
    flags = _flags(p)
    dtype = np.dtype(p["dtype"])
    half = dtype.itemsize < 4
    rng = np.random.default_rng(p["seed"] + 1)
    shape = (p["T"], p["N"], (2 if p["bidirectional"] else 1) * p["H"])
    dy = random_array(rng, shape, dtype)
    z_in = random_array(rng, shape, dtype, 2.0)  # the gradient op is defined for any z

    def run(rnn, rnn_grads, wrap):
        return wrap(lambda i, dy, z: _all_results(rnn, rnn_grads, i, dy, z, flags, half))(
            inputs, dy, z_in)

    got = run(op, op_grads, jax.jit if jit else (lambda f: f))
    want = run(ref, ref_grads, ref_jit)
    _check(got, want, inputs, dtype, shape)


@FUZZ_VMAP
@given(p=problems(max_T=4, max_N=3), B=st.integers(1, 3), map_h0=st.booleans(),
       map_mask=st.booleans())
def test_vmap_matches_reference(p, B, map_h0, map_mask):
    """vmap over a batch of problems sharing the weights: the forward folds the mapped axis
    into N, vmap(grad) folds it into the gradient op's group axis G (per-example weight
    gradients, one custom call); both against vmap of the reference."""
    inputs = make_problem(p)
    flags = _flags(p)
    dtype = np.dtype(p["dtype"])
    rng = np.random.default_rng(p["seed"] + 2)
    mapped = dict(source=True, init_state=map_h0, mask=map_mask)
    axes = {n: (0 if mapped.get(n) and inputs[n] is not None else None) for n in inputs}

    def another(a):  # a fresh example like a (a bool mask stays bool)
        if a.dtype == jnp.bool_:
            return jnp.asarray(rng.random(a.shape) < 0.7)
        return random_array(rng, a.shape, a.dtype)

    batched = {n: jnp.stack([inputs[n]] + [another(inputs[n]) for _ in range(B - 1)])
               if axes[n] == 0 else inputs[n] for n in inputs}
    shape = (B, p["T"], p["N"], (2 if p["bidirectional"] else 1) * p["H"])
    dy = random_array(rng, shape, dtype)

    half = dtype.itemsize < 4
    grad_args = lambda i: {k: v for k, v in i.items() if k not in ("source", "recurrent_weight")}

    def per_example(rnn):
        def one(i, dy):
            if half and rnn is ref:  # the half-precision z caveat of _all_results
                y, z = ref(**i, **flags, training=True)
                return y, _grad_list_to_dict(i, ref_grads(
                    i["source"], i["recurrent_weight"], dy, z, **grad_args(i), **flags))

            def loss(diff):
                y = rnn(**{**i, **diff}, **flags)
                return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32))

            return rnn(**i, **flags), jax.grad(loss)(_diff(i))

        jit = ref_jit if rnn is ref else jax.jit
        return jit(jax.vmap(one, in_axes=(axes, 0)))(batched, dy)

    got, want = per_example(op), per_example(ref)
    assert_close(got, want, dtype=dtype, err_msg="vmap")
