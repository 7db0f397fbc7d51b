"""The mask's rules beyond the grid: a non-finite mask where an input is absent propagates as in
the reference (the handlers' skipped products must not hide it), and a float mask of any dtype
goes straight to the dtype the computation runs in (docs/semantics.md, "JAX-level rules")."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sgrnn
from conftest import assert_close, make_inputs, random_array, requires_native

op, ref = jax_sgrnn.single_gate_rnn, jax_sgrnn.reference


# ------------------------------------------- non-finite masks where an input is absent


@requires_native
@pytest.mark.parametrize("value", [np.inf, -np.inf, np.nan], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("step", [0, 2])
@pytest.mark.parametrize("has_h0,has_w,bi,rev", list(itertools.product(
    (False, True), (False, True), (False, True), (False, True))))
def test_non_finite_mask_propagates_like_the_reference(rng, value, step, has_h0, has_w, bi, rev):
    """A non-finite mask entry multiplies whatever state it meets, the zero state of a missing
    init_state included: forward, every gradient of the gradient op, NaN where the reference
    has NaN and equal values elsewhere."""
    inputs = make_inputs(rng, T=3, N=2, I=2, H=3, bidirectional=bi, input_weight=has_w,
                         init_state=has_h0, mask="float")
    mask = np.array(inputs["mask"])
    mask[step, 1, :] = value
    inputs["mask"] = jnp.asarray(mask)
    flags = dict(activation="sigmoid", bidirectional=bi, reverse=rev)
    y, z = op(**inputs, **flags, training=True)
    want_y, want_z = ref(**inputs, **flags, training=True)
    for got, want in ((y, want_y), (z, want_z)):
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    dy = random_array(rng, y.shape, jnp.float64)
    args = (inputs["source"], inputs["recurrent_weight"], dy, want_z, inputs["input_weight"],
            inputs["bias"], inputs["init_state"], inputs["mask"])
    got = jax_sgrnn.single_gate_rnn_gradients(*args, **flags)
    want = jax_sgrnn.reference_gradients(*args, **flags)
    for i, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w), err_msg=f"gradient {i}")
        finite = np.isfinite(w)
        np.testing.assert_allclose(np.asarray(g)[finite], np.asarray(w)[finite], rtol=1e-9,
                                   atol=1e-9, err_msg=f"gradient {i}")


# ----------------------------------------------------------------- the mask's dtype


@requires_native
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("mask_value", [1 / 0.9, 1e5, 3e-8])
def test_half_inputs_with_a_float32_mask_follow_the_one_rule(rng, dtype, mask_value):
    """The mask is converted once, straight to the dtype the computation runs in (float32 for
    half inputs), by the op and the reference alike: no overflow of 1e5 in float16, no early
    rounding of 1/0.9 to bfloat16."""
    inputs = make_inputs(rng, T=5, N=4, I=3, H=6, dtype=dtype)
    if mask_value > 1e3:  # keep h * m * R in range: the point is the mask itself, not overflow
        inputs["recurrent_weight"] = inputs["recurrent_weight"] * 1e-5
    inputs["mask"] = jnp.where(jnp.asarray(rng.random((5, 4, 6)) < 0.8), mask_value,
                               0.0).astype(jnp.float32)
    flags = dict(activation="tanh")
    got_y, got_z = op(**inputs, **flags, training=True)
    want_y, want_z = ref(**inputs, **flags, training=True)
    for got, want in ((got_y, want_y), (got_z, want_z)):
        assert got.dtype == dtype
        np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
        assert_close(got, want, dtype=dtype)
    text = jax.jit(lambda i: op(**i, **flags)).lower(inputs).as_text()
    call = next(line for line in text.splitlines() if "stablehlo.custom_call" in line)
    assert "tensor<5x4x6xf32>" in call.split("->")[0], call  # the mask operand: float32


def test_the_mask_reaches_the_primitive_in_the_compute_dtype(rng):
    inputs = make_inputs(rng, dtype=jnp.bfloat16, mask="float")
    inputs["mask"] = inputs["mask"].astype(jnp.float32)
    jaxpr = jax.make_jaxpr(lambda i: op(**i))(inputs).jaxpr
    (eqn,) = [e for e in jaxpr.eqns if e.primitive.name == "sgrnn_forward"]
    assert eqn.invars[0].aval.dtype == jnp.bfloat16
    assert eqn.invars[-1].aval.dtype == jnp.float32
