"""Bad input raises clear ValueError/TypeError at trace time, naming the argument (and, for
shapes, the expected and received shape). Nothing here may crash the process."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sgrnn
from conftest import make_inputs

op, ref = jax_sgrnn.single_gate_rnn, jax_sgrnn.reference
T, N, I, H = 4, 3, 3, 5
f32, f64 = jnp.float32, jnp.float64


def _base(bidirectional=False, dtype=f64):
    return make_inputs(np.random.default_rng(0), T, N, I, H, bidirectional=bidirectional,
                       mask="float", dtype=dtype)


def _z(shape=(T, N, H), dtype=f64):
    return jnp.ones(shape, dtype)


FORWARD_BAD = {
    # name: (changes to the inputs, flags, exception, argument named in the message)
    "source_rank2": (dict(source=jnp.ones((T, N))), {}, ValueError, "source"),
    "source_rank4": (dict(source=jnp.ones((1, T, N, I))), {}, ValueError, "source"),
    "source_rank1": (dict(source=jnp.ones((I,))), {}, ValueError, "source"),
    "input_weight_cols": (dict(input_weight=jnp.ones((H, I + 1))), {}, ValueError,
                          "input_weight"),
    "input_weight_rows": (dict(input_weight=jnp.ones((H + 1, I))), {}, ValueError,
                          "input_weight"),
    "input_weight_rank1": (dict(input_weight=jnp.ones((H,))), {}, ValueError, "input_weight"),
    "input_weight_uni_in_bi": (dict(input_weight=jnp.ones((H, I))), dict(bidirectional=True),
                               ValueError, "input_weight"),
    "bias_len": (dict(bias=jnp.ones((H + 1,))), {}, ValueError, "bias"),
    "bias_rank2": (dict(bias=jnp.ones((1, H))), {}, ValueError, "bias"),
    "bias_uni_in_bi": (dict(bias=jnp.ones((H,))), dict(bidirectional=True), ValueError,
                       "bias"),
    "init_state_batch": (dict(init_state=jnp.ones((N + 1, H))), {}, ValueError, "init_state"),
    "init_state_rank1": (dict(init_state=jnp.ones((H,))), {}, ValueError, "init_state"),
    "init_state_rank3": (dict(init_state=jnp.ones((1, N, H))), {}, ValueError, "init_state"),
    "init_state_uni_in_bi": (dict(init_state=jnp.ones((N, H))), dict(bidirectional=True),
                             ValueError, "init_state"),
    "mask_batch": (dict(mask=jnp.ones((T, N + 1, H))), {}, ValueError, "mask"),
    "mask_time": (dict(mask=jnp.ones((T + 1, 1, 1))), {}, ValueError, "mask"),
    "mask_features": (dict(mask=jnp.ones((H + 1,))), {}, ValueError, "mask"),
    "mask_rank4": (dict(mask=jnp.ones((1, T, N, H))), {}, ValueError, "mask"),
    "mask_uni_in_bi": (dict(mask=jnp.ones((T, N, H))), dict(bidirectional=True), ValueError,
                       "mask"),
    "mask_int": (dict(mask=jnp.ones((T, N, H), jnp.int32)), {}, TypeError, "mask"),
    "source_int": (dict(source=jnp.ones((T, N, I), jnp.int32)), {}, TypeError, "source"),
    "source_complex": (dict(source=jnp.ones((T, N, I), jnp.complex64)), {}, TypeError,
                       "source"),
    "recurrent_weight_int": (dict(recurrent_weight=jnp.ones((H, H), jnp.int32)), {},
                             TypeError, "recurrent_weight"),
    "dtype_recurrent_weight": (dict(recurrent_weight=jnp.ones((H, H), f32)), {}, TypeError,
                               "recurrent_weight"),
    "dtype_input_weight": (dict(input_weight=jnp.ones((H, I), f32)), {}, TypeError,
                           "input_weight"),
    "dtype_bias": (dict(bias=jnp.ones((H,), f32)), {}, TypeError, "bias"),
    "dtype_init_state": (dict(init_state=jnp.ones((N, H), f32)), {}, TypeError,
                         "init_state"),
    "dtype_bf16_bias": (dict(bias=jnp.ones((H,), jnp.bfloat16)), {}, TypeError, "bias"),
    "I_zero": (dict(source=jnp.ones((T, N, 0)), input_weight=jnp.ones((H, 0))), {},
               ValueError, "source"),
    "H_zero": (dict(recurrent_weight=jnp.ones((0, 0)), input_weight=jnp.ones((0, I)),
                    bias=None, init_state=None, mask=None), {}, ValueError,
               "recurrent_weight"),
    "R_nonsquare": (dict(recurrent_weight=jnp.ones((H, H + 1))), {}, ValueError,
                    "recurrent_weight"),
    "R_rank1": (dict(recurrent_weight=jnp.ones((H,))), {}, ValueError, "recurrent_weight"),
    "R_HH_in_bi": (dict(recurrent_weight=jnp.ones((H, H))), dict(bidirectional=True),
                   ValueError, "recurrent_weight"),
    "R_3HH_in_bi": (dict(recurrent_weight=jnp.ones((3, H, H))), dict(bidirectional=True),
                    ValueError, "recurrent_weight"),
    "R_1HH_in_bi": (dict(recurrent_weight=jnp.ones((1, H, H))), dict(bidirectional=True),
                    ValueError, "recurrent_weight"),
    "R_2HH_in_uni": (dict(recurrent_weight=jnp.ones((2, H, H))), {}, ValueError,
                     "recurrent_weight"),
    "no_W_source_features": (dict(input_weight=None, source=jnp.ones((T, N, H + 1))), {},
                             ValueError, "source"),
    "no_W_source_features_bi": (dict(input_weight=None, source=jnp.ones((T, N, H))),
                                dict(bidirectional=True), ValueError, "source"),
    "activation_gelu": ({}, dict(activation="gelu"), ValueError, "activation"),
    "activation_7": ({}, dict(activation=7), ValueError, "activation"),
    "activation_minus1": ({}, dict(activation=-1), ValueError, "activation"),
    "activation_float": ({}, dict(activation=2.0), ValueError, "activation"),
    "activation_bool": ({}, dict(activation=True), ValueError, "activation"),
    "reverse_not_bool": ({}, dict(reverse=1), TypeError, "reverse"),
    "bidirectional_not_bool": ({}, dict(bidirectional="yes"), TypeError, "bidirectional"),
    "training_not_bool": ({}, dict(training=0), TypeError, "training"),
    "descriptor_type": ({}, dict(descriptor="relu"), TypeError, "descriptor"),
}


def _bidirectional_base_for(flags):
    """Inputs that are right for the flags (so only the change is wrong)."""
    return _base(bidirectional=flags.get("bidirectional") is True)


@pytest.mark.parametrize("case", list(FORWARD_BAD))
@pytest.mark.parametrize("fn", [jax_sgrnn.single_gate_rnn, jax_sgrnn.reference],
                         ids=["op", "reference"])
def test_forward_rejects_bad_input(case, fn):
    changes, flags, exc, name = FORWARD_BAD[case]
    inputs = {**_bidirectional_base_for(flags), **changes}
    with pytest.raises(exc, match=rf"\b{name}\b"):
        fn(**inputs, **flags)


@pytest.mark.parametrize("case", ["source_rank2", "bias_len", "mask_batch", "dtype_bias",
                                  "R_HH_in_bi", "activation_gelu", "no_W_source_features"])
def test_forward_rejects_at_trace_time_under_jit_and_vmap(case):
    """The same errors come from tracing (jit, vmap, grad), before anything runs."""
    changes, flags, exc, name = FORWARD_BAD[case]
    inputs = {**_bidirectional_base_for(flags), **changes}
    with pytest.raises(exc, match=rf"\b{name}\b"):
        jax.jit(lambda i: op(**i, **flags)).trace(inputs)
    with pytest.raises(exc, match=rf"\b{name}\b"):
        jax.jit(jax.grad(lambda i: jnp.sum(op(**i, **flags)))).trace(inputs)
    batched = {k: (None if v is None else jnp.stack([v, v])) for k, v in inputs.items()}
    with pytest.raises(exc, match=rf"\b{name}\b"):
        jax.vmap(lambda i: op(**i, **flags))(batched)


@pytest.mark.parametrize("changes,expected,got", [
    (dict(bias=jnp.ones((H + 1,))), f"[{H}]", f"({H + 1},)"),
    (dict(init_state=jnp.ones((N + 1, H))), f"[{N}, {H}]", f"({N + 1}, {H})"),
    (dict(input_weight=jnp.ones((H, I + 1))), f"[{H}, {I}]", f"({H}, {I + 1})"),
    (dict(source=jnp.ones((T, N))), "[T, N, I]", f"({T}, {N})"),
    (dict(mask=jnp.ones((T, N + 1, H))), f"[{T}, {N}, {H}]", f"({T}, {N + 1}, {H})"),
], ids=["bias", "init_state", "input_weight", "source", "mask"])
def test_shape_error_messages_give_expected_and_received_shapes(changes, expected, got):
    inputs = {**_base(), **changes}
    with pytest.raises(ValueError) as info:
        op(**inputs)
    message = str(info.value)
    assert expected in message and got in message, message


def test_dtype_error_message_names_both_dtypes():
    inputs = {**_base(), "bias": jnp.ones((H,), f32)}
    with pytest.raises(TypeError, match=r"bias.*float32.*float64"):
        op(**inputs)


def test_activation_error_lists_the_choices():
    with pytest.raises(ValueError, match=r"activation.*'relu'.*'gelu'") as info:
        op(**_base(), activation="gelu")
    assert "hard_sigmoid" in str(info.value)


@pytest.mark.parametrize("fn", [op, jax_sgrnn.reference], ids=["op", "reference"])
def test_a_traced_activation_says_it_must_be_static(fn):
    inputs = _base()
    with pytest.raises(TypeError, match=r"activation: must be static .*traced value.*"
                                        r"static_argnames"):
        jax.jit(lambda a: fn(**inputs, activation=a))(jnp.int32(2))
    # As a static argument it works.
    run = jax.jit(lambda a: fn(**inputs, activation=a), static_argnames="a")
    np.testing.assert_allclose(run(a=2), fn(**inputs, activation="tanh"), rtol=1e-12)


# ----------------------------------------------------------------- the gradients op


def _gradients_call(changes=(), **flags):
    bi = flags.get("bidirectional", False)
    D = 2 if bi else 1
    args = dict(_base(bidirectional=bi), source_gradient=_z((T, N, D * H)),
                z_state=_z((T, N, D * H)))
    args.update(dict(changes))
    return jax_sgrnn.single_gate_rnn_gradients(
        args["source"], args["recurrent_weight"], args["source_gradient"], args["z_state"],
        args["input_weight"], args["bias"], args["init_state"], args["mask"], **flags)


GRADIENTS_BAD = {
    "source_gradient_features": (dict(source_gradient=_z((T, N, H + 1))), {}, ValueError,
                                 "source_gradient"),
    "source_gradient_time": (dict(source_gradient=_z((T + 1, N, H))), {}, ValueError,
                             "source_gradient"),
    "source_gradient_rank2": (dict(source_gradient=_z((T, N * H))), {}, ValueError,
                              "source_gradient"),
    "source_gradient_uni_in_bi": (dict(source_gradient=_z((T, N, H))),
                                  dict(bidirectional=True), ValueError, "source_gradient"),
    "z_state_batch": (dict(z_state=_z((T, N + 1, H))), {}, ValueError, "z_state"),
    "z_state_rank4": (dict(z_state=_z((1, T, N, H))), {}, ValueError, "z_state"),
    "z_state_uni_in_bi": (dict(z_state=_z((T, N, H))), dict(bidirectional=True), ValueError,
                          "z_state"),
    "source_gradient_dtype": (dict(source_gradient=_z(dtype=f32)), {}, TypeError,
                              "source_gradient"),
    "z_state_dtype": (dict(z_state=_z(dtype=f32)), {}, TypeError, "z_state"),
    "z_state_int": (dict(z_state=jnp.ones((T, N, H), jnp.int32)), {}, TypeError, "z_state"),
    "source_rank2": (dict(source=jnp.ones((T, N))), {}, ValueError, "source"),
    "bias_len": (dict(bias=jnp.ones((H + 1,))), {}, ValueError, "bias"),
    "init_state_batch": (dict(init_state=jnp.ones((N + 1, H))), {}, ValueError,
                         "init_state"),
    "mask_batch": (dict(mask=jnp.ones((T, N + 1, H))), {}, ValueError, "mask"),
    "R_HH_in_bi": (dict(recurrent_weight=jnp.ones((H, H))), dict(bidirectional=True),
                   ValueError, "recurrent_weight"),
    "activation_7": ({}, dict(activation=7), ValueError, "activation"),
}


@pytest.mark.parametrize("case", list(GRADIENTS_BAD))
def test_gradients_op_rejects_bad_input(case):
    changes, flags, exc, name = GRADIENTS_BAD[case]
    with pytest.raises(exc, match=rf"\b{name}\b"):
        _gradients_call(changes, **flags)


@pytest.mark.parametrize("case", ["source_gradient_features", "z_state_batch",
                                  "z_state_dtype"])
def test_reference_gradients_rejects_bad_input(case):
    changes, flags, exc, name = GRADIENTS_BAD[case]
    bi = flags.get("bidirectional", False)
    args = dict(_base(bidirectional=bi), source_gradient=_z(), z_state=_z())
    args.update(changes)
    with pytest.raises(exc, match=rf"\b{name}\b"):
        jax_sgrnn.reference_gradients(
            args["source"], args["recurrent_weight"], args["source_gradient"],
            args["z_state"], args["input_weight"], args["bias"], args["init_state"],
            args["mask"], **flags)


def test_process_still_works_after_errors():
    """After all the rejected calls the op still runs (nothing left in a bad state)."""
    for case in ("bias_len", "mask_rank4", "R_3HH_in_bi", "activation_gelu"):
        changes, flags, exc, _ = FORWARD_BAD[case]
        with pytest.raises(exc):
            op(**{**_bidirectional_base_for(flags), **changes}, **flags)
    inputs = _base()
    np.testing.assert_allclose(np.asarray(op(**inputs)),
                               np.asarray(jax_sgrnn.reference(**inputs)), rtol=1e-10)


# ----------------------------------------------------- None for a required argument


@pytest.mark.parametrize("position,name", [(0, "source"), (1, "recurrent_weight")])
@pytest.mark.parametrize("fn", [op, ref], ids=["op", "reference"])
def test_none_for_a_required_forward_argument(rng, fn, position, name):
    inputs = make_inputs(rng)
    args = [inputs["source"], inputs["recurrent_weight"]]
    args[position] = None
    with pytest.raises(TypeError, match=f"^{name}: expected an array, got None"):
        fn(*args)


@pytest.mark.parametrize("position,name", [(0, "source"), (1, "recurrent_weight"),
                                           (2, "source_gradient"), (3, "z_state")])
@pytest.mark.parametrize("fn", [jax_sgrnn.single_gate_rnn_gradients,
                                jax_sgrnn.reference_gradients], ids=["op", "reference"])
def test_none_for_a_required_gradient_argument(rng, fn, position, name):
    inputs = make_inputs(rng)
    y = ref(**inputs)
    args = [inputs["source"], inputs["recurrent_weight"], y, y]
    args[position] = None
    with pytest.raises(TypeError, match=f"^{name}: expected an array, got None"):
        fn(*args)
