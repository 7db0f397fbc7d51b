"""SingleGateRNNDescriptor and Activation: frozen/hashable, defaults, parsing, and keyword
flags overriding the descriptor's fields."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sgrnn
from jax_sgrnn import Activation, SingleGateRNNDescriptor
from conftest import ACTIVATIONS, assert_close, make_inputs

op = jax_sgrnn.single_gate_rnn


def test_activation_numbering_matches_mpsgraph():
    assert [(a.name, int(a)) for a in Activation] == [
        ("NONE", 0), ("RELU", 1), ("TANH", 2), ("SIGMOID", 3), ("HARD_SIGMOID", 4)]


def test_descriptor_defaults():
    d = SingleGateRNNDescriptor()
    assert (d.reverse, d.bidirectional, d.training) == (False, False, False)
    assert d.activation is Activation.RELU


def test_descriptor_is_frozen():
    d = SingleGateRNNDescriptor()
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.reverse = True
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.activation = Activation.TANH


def test_descriptor_is_hashable_and_compares_by_value():
    a = SingleGateRNNDescriptor(reverse=True, activation="tanh")
    b = SingleGateRNNDescriptor(reverse=True, activation=Activation.TANH)
    c = SingleGateRNNDescriptor(reverse=True, activation=2)
    assert a == b == c and hash(a) == hash(b) == hash(c)
    assert a != SingleGateRNNDescriptor(reverse=True, activation="sigmoid")
    assert len({a, b, c, SingleGateRNNDescriptor()}) == 2


def test_descriptor_as_static_jit_argument(rng):
    inputs = make_inputs(rng)
    f = jax.jit(lambda i, d: op(**i, descriptor=d), static_argnums=1)
    d = SingleGateRNNDescriptor(activation="tanh", reverse=True)
    assert_close(f(inputs, d), jax_sgrnn.reference(**inputs, descriptor=d))
    # An equal descriptor hits the cache (same hash); a different one retraces correctly.
    assert_close(f(inputs, SingleGateRNNDescriptor(activation=2, reverse=True)), f(inputs, d))
    assert_close(f(inputs, SingleGateRNNDescriptor()), jax_sgrnn.reference(**inputs))


@pytest.mark.parametrize("value", ["tanh", "TANH", Activation.TANH, 2, np.int32(2),
                                   np.int64(2)], ids=repr)
def test_activation_spellings(value):
    assert SingleGateRNNDescriptor(activation=value).activation is Activation.TANH
    assert Activation.parse(value) is Activation.TANH


@pytest.mark.parametrize("name,number", [("none", 0), ("relu", 1), ("tanh", 2),
                                         ("sigmoid", 3), ("hard_sigmoid", 4)])
def test_activation_names_and_numbers(name, number):
    assert Activation.parse(name) is Activation.parse(number) is Activation(number)


def test_op_activation_spellings_agree(rng):
    inputs = make_inputs(rng, mask="float")
    results = [op(**inputs, activation=v) for v in ("tanh", Activation.TANH, 2)]
    results.append(op(**inputs, descriptor=SingleGateRNNDescriptor(activation="tanh")))
    for r in results[1:]:
        assert_close(r, results[0])


def test_op_default_activation_is_relu(rng):
    inputs = make_inputs(rng)
    y = op(**inputs)
    assert_close(y, op(**inputs, activation="relu"))
    assert_close(y, jax_sgrnn.reference(**inputs, activation="relu"))
    assert float(jnp.min(y)) == 0.0  # relu clips: some of the random outputs are zero
    assert not np.allclose(np.asarray(y), np.asarray(op(**inputs, activation="tanh")))


def test_descriptor_replace_ignores_none():
    d = SingleGateRNNDescriptor(reverse=True, activation="sigmoid")
    assert d.replace(reverse=None, activation=None) == d
    assert d.replace(reverse=False) == SingleGateRNNDescriptor(activation="sigmoid")


def test_descriptor_accepts_numpy_bools():
    d = SingleGateRNNDescriptor(reverse=np.bool_(True))
    assert d.reverse is True
    assert hash(d) == hash(SingleGateRNNDescriptor(reverse=True))


def test_descriptor_directions():
    assert SingleGateRNNDescriptor().directions == 1
    assert SingleGateRNNDescriptor(bidirectional=True).directions == 2


def test_keyword_flags_override_descriptor(rng):
    desc = SingleGateRNNDescriptor(reverse=True, bidirectional=False, training=True,
                                   activation="tanh")
    inputs = make_inputs(rng, mask="float")
    ref = jax_sgrnn.reference

    # activation overridden, the rest from the descriptor (training=True: a pair).
    y, z = op(**inputs, descriptor=desc, activation="sigmoid")
    y_ref, z_ref = ref(**inputs, reverse=True, training=True, activation="sigmoid")
    assert_close((y, z), (y_ref, z_ref))

    # reverse and training overridden.
    y = op(**inputs, descriptor=desc, reverse=False, training=False)
    assert isinstance(y, jax.Array)
    assert_close(y, ref(**inputs, activation="tanh"))

    # bidirectional overridden (needs bidirectional-shaped inputs).
    bi_inputs = make_inputs(rng, bidirectional=True)
    y, z = op(**bi_inputs, descriptor=desc, bidirectional=True)
    assert y.shape == (4, 3, 10)
    assert_close((y, z), ref(**bi_inputs, bidirectional=True, training=True,
                             activation="tanh"))

    # The descriptor itself is unchanged.
    assert desc == SingleGateRNNDescriptor(reverse=True, training=True, activation="tanh")


def test_descriptor_used_by_gradients_and_reference_alike(rng):
    desc = SingleGateRNNDescriptor(activation="hard_sigmoid", reverse=True)
    inputs = make_inputs(rng)
    _, z = op(**inputs, descriptor=desc, training=True)
    dy = jnp.asarray(rng.normal(size=z.shape))
    args = (inputs["source"], inputs["recurrent_weight"], dy, z, inputs["input_weight"],
            inputs["bias"], inputs["init_state"])
    assert_close(jax_sgrnn.single_gate_rnn_gradients(*args, descriptor=desc),
                 jax_sgrnn.reference_gradients(*args, descriptor=desc))


# ------------------------------------------------------ integer scalars as the activation


@pytest.mark.parametrize("make", [int, np.int8, np.int64, np.uint8, jnp.int32, jnp.int8,
                                  lambda v: np.array(v, np.int16), lambda v: jnp.array(v)],
                         ids=["int", "np.int8", "np.int64", "np.uint8", "jnp.int32", "jnp.int8",
                              "np.array", "jnp.array"])
def test_any_concrete_integer_scalar_names_an_activation(rng, make):
    inputs = make_inputs(rng)
    for number, name in enumerate(ACTIVATIONS):
        assert jax_sgrnn.Activation.parse(make(number)) == jax_sgrnn.Activation.parse(name)
    np.testing.assert_array_equal(op(**inputs, activation=make(2)),
                                  op(**inputs, activation="tanh"))


@pytest.mark.parametrize("value", [True, np.bool_(True), 2.0, jnp.float32(2), jnp.array([2]),
                                   np.int32(7)], ids=str)
def test_non_integer_or_out_of_range_activations_are_rejected(value):
    with pytest.raises(ValueError, match="activation: expected one of"):
        jax_sgrnn.Activation.parse(value)
