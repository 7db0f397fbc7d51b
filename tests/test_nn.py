"""The Flax NNX modules (jax_sgrnn.nn) against the functional op and the lax.scan reference:
outputs, gradients, layouts, initialisation, dropout, nnx.jit, optax and state round trips."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_sgrnn

nnx = pytest.importorskip("flax.nnx")
from jax_sgrnn.nn import (SingleGateRNN, StackedSingleGateRNN, final_state,  # noqa: E402
                          symmetric_uniform)

T, N, I, H = 5, 3, 4, 6
RTOL, ATOL = 1e-5, 1e-6


def assert_allclose(actual, expected, rtol=RTOL, atol=ATOL):
    """allclose over matching pytrees."""
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=atol)


def normal(seed: int, shape, scale: float = 1.0) -> jax.Array:
    return scale * jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def params_of(layer: SingleGateRNN) -> dict:
    """The layer's parameters as the op's keyword arguments."""
    get = lambda p: None if p is None else p[...]
    return dict(recurrent_weight=get(layer.recurrent_weight),
                input_weight=get(layer.input_weight), bias=get(layer.bias))


def test_core_package_does_not_import_flax():
    code = ("import sys, jax_sgrnn; assert 'flax' not in sys.modules, 'flax imported'; "
            "import jax_sgrnn.nn; assert 'flax' in sys.modules")
    # cwd: away from the repository root, whose uninstalled jax_sgrnn/ would shadow the
    # installed package in a `python -c` child.
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(__file__))


# (bidirectional, reverse, use_bias, use_input_weight, with init_state, mask kind, activation)
LAYER_CASES = [
    pytest.param(False, False, True, True, False, None, "tanh", id="uni-fwd"),
    pytest.param(False, True, True, True, True, "float", "relu", id="uni-rev-h0-mask"),
    pytest.param(True, False, True, True, True, "bool", "tanh", id="bi-h0-mask"),
    pytest.param(True, False, False, False, False, "steps", "sigmoid", id="bi-bare-stepmask"),
    pytest.param(False, False, False, True, True, None, "hard_sigmoid", id="uni-nobias-h0"),
]


@pytest.mark.parametrize("bidirectional,reverse,use_bias,use_input_weight,with_h0,mask_kind,"
                         "activation", LAYER_CASES)
@pytest.mark.parametrize("time_major", [False, True], ids=["batch_first", "time_major"])
def test_layer_matches_functional_op_and_reference(bidirectional, reverse, use_bias,
                                                   use_input_weight, with_h0, mask_kind,
                                                   activation, time_major):
    D = 2 if bidirectional else 1
    features = I if use_input_weight else D * H
    layer = SingleGateRNN(features, H, activation=activation, bidirectional=bidirectional,
                          reverse=reverse, use_bias=use_bias, use_input_weight=use_input_weight,
                          time_major=time_major, rngs=nnx.Rngs(0))
    x_tm = normal(1, (T, N, features))  # time-major data; the layer may see it batch-first
    h0 = normal(2, (N, D * H)) if with_h0 else None
    mask_tm = {None: None,
               "float": jax.random.uniform(jax.random.key(3), (T, N, D * H)),
               "bool": jax.random.bernoulli(jax.random.key(3), 0.7, (T, N, D * H)),
               "steps": jnp.array([1.0, 0.0, 1.0, 1.0, 0.5])[:, None, None]}[mask_kind]
    to_layout = (lambda a: a) if time_major else (lambda a: jnp.swapaxes(a, 0, 1))
    x = to_layout(x_tm)
    mask = None if mask_tm is None else to_layout(mask_tm)
    flags = dict(activation=activation, bidirectional=bidirectional, reverse=reverse)

    def module_loss(layer, x, h0):
        y, h_n = layer(x, h0, mask, return_state=True)
        return jnp.sum(jnp.sin(y)) + jnp.sum(h_n ** 2), (y, h_n)

    def functional_loss(fn):
        def loss(params, x_tm, h0):
            y = fn(x_tm, **params, init_state=h0, mask=mask_tm, **flags)
            h_n = final_state(y, layer.descriptor)
            return jnp.sum(jnp.sin(y)) + jnp.sum(h_n ** 2), (to_layout(y), h_n)
        return loss

    (_, out), grads = nnx.jit(nnx.value_and_grad(module_loss, argnums=(0, 1, 2),
                                                 has_aux=True))(layer, x, h0)
    g_params = {name: grad[...] for name, grad in grads[0].items()}  # an nnx.State
    g_x = to_layout(grads[1])  # back to time-major
    for fn in (jax_sgrnn.single_gate_rnn, jax_sgrnn.reference):
        params = {k: v for k, v in params_of(layer).items() if v is not None}
        (_, expected), expected_grads = jax.jit(jax.value_and_grad(
            functional_loss(fn), argnums=(0, 1, 2), has_aux=True))(params, x_tm, h0)
        assert_allclose(out, expected)
        assert_allclose((g_params, g_x, grads[2]), expected_grads)


def test_final_state_layout():
    layer = SingleGateRNN(I, H, bidirectional=True, rngs=nnx.Rngs(0))
    x = normal(1, (N, T, I))
    y, h_n = layer(x, return_state=True)
    assert y.shape == (N, T, 2 * H) and h_n.shape == (N, 2 * H)
    np.testing.assert_array_equal(h_n[:, :H], y[:, -1, :H])  # forward: after the last step
    np.testing.assert_array_equal(h_n[:, H:], y[:, 0, H:])  # backward: after reading x[0]
    # The backward half is a unidirectional reversed RNN with the second set of weights.
    backward = SingleGateRNN(I, H, reverse=True, rngs=nnx.Rngs(1))
    nnx.update(backward, {"recurrent_weight": layer.recurrent_weight[...][1],
                          "input_weight": layer.input_weight[...][H:],
                          "bias": layer.bias[...][H:]})
    y_b, h_b = backward(x, return_state=True)
    assert_allclose(h_b, h_n[:, H:])
    assert_allclose(y_b[:, ::-1], y[:, :, H:])  # reverse keeps processing order


def test_zero_steps_return_the_initial_state():
    layer = SingleGateRNN(I, H, rngs=nnx.Rngs(0))
    h0 = normal(1, (N, H))
    y, h_n = layer(jnp.zeros((N, 0, I)), h0, return_state=True)
    assert y.shape == (N, 0, H)
    np.testing.assert_array_equal(h_n, h0)
    _, h_n = layer(jnp.zeros((N, 0, I)), return_state=True)
    np.testing.assert_array_equal(h_n, jnp.zeros((N, H)))


@pytest.mark.parametrize("bidirectional", [False, True], ids=["uni", "bi"])
def test_default_initialisation_is_pytorch_uniform(bidirectional):
    hidden = 64
    layer = SingleGateRNN(10, hidden, bidirectional=bidirectional, rngs=nnx.Rngs(0))
    D = 2 if bidirectional else 1
    expected = {"recurrent_weight": (2, hidden, hidden) if bidirectional else (hidden, hidden),
                "input_weight": (D * hidden, 10), "bias": (D * hidden,)}
    bound = 1 / np.sqrt(hidden)
    for name, shape in expected.items():
        value = np.asarray(getattr(layer, name)[...])
        assert value.shape == shape and value.dtype == np.float32
        assert np.abs(value).max() < bound
        assert np.abs(value).max() > 0.9 * bound  # spread over the whole interval
        assert abs(value.mean()) < 0.1 * bound


def test_initialisers_and_param_dtype_are_overridable():
    layer = SingleGateRNN(I, H, param_dtype=jnp.float64,
                          input_weight_init=nnx.initializers.orthogonal(),
                          recurrent_weight_init=nnx.initializers.constant(0.25),
                          bias_init=nnx.initializers.zeros_init(), rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(layer.recurrent_weight[...], np.full((H, H), 0.25))
    np.testing.assert_array_equal(layer.bias[...], np.zeros(H))
    W = np.asarray(layer.input_weight[...])
    assert W.dtype == np.float64
    np.testing.assert_allclose(W.T @ W, np.eye(I), atol=1e-12)  # orthonormal columns
    init = symmetric_uniform(0.5)(jax.random.key(0), (1000,))
    assert float(jnp.abs(init).max()) < 0.5


def test_optional_parameters_and_dtype():
    layer = SingleGateRNN(2 * H, H, bidirectional=True, use_bias=False, use_input_weight=False,
                          dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    assert layer.input_weight is None and layer.bias is None
    assert [p.shape for p in jax.tree.leaves(nnx.state(layer, nnx.Param))] == [(2, H, H)]
    y = layer(normal(1, (N, T, 2 * H)))
    assert y.dtype == jnp.bfloat16 and y.shape == (N, T, 2 * H)


def test_bad_configurations_raise():
    with pytest.raises(ValueError, match="use_input_weight=False needs in_features == 2"):
        SingleGateRNN(H, H, bidirectional=True, use_input_weight=False, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="impl"):
        SingleGateRNN(I, H, impl="cuda", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="activation"):
        SingleGateRNN(I, H, activation="gelu", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="num_layers"):
        StackedSingleGateRNN(I, H, 0, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="dropout"):
        StackedSingleGateRNN(I, H, 2, dropout=1.0, rngs=nnx.Rngs(0))
    # A stack has no reverse: reversed layers would flip time at every layer.
    with pytest.raises(TypeError, match="unexpected keyword argument.*'reverse'"):
        StackedSingleGateRNN(I, H, 2, reverse=True, rngs=nnx.Rngs(0))
    layer = SingleGateRNN(I, H, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=rf"inputs: expected shape \[N, T, {I}\]"):
        layer(jnp.zeros((N, T, I + 1)))
    with pytest.raises(ValueError, match="init_state"):
        layer(jnp.zeros((N, T, I)), jnp.zeros((N + 1, H)))


LAYOUTS = pytest.mark.parametrize("time_major", [False, True], ids=["batch_first", "time_major"])


def user_layout(time_major: bool):
    """(name, leading axes, a time-major shape -> the user's shape) for messages and data."""
    if time_major:
        return "time-major", "T, N", lambda shape: tuple(shape)
    return "batch-first", "N, T", lambda shape: (shape[1], shape[0], *shape[2:])


def raises_exactly(message: str):
    """pytest.raises(ValueError) matching ``message`` literally."""
    return pytest.raises(ValueError, match=re.escape(message))


def nested_tuples(a):
    """``a`` as nested tuples of Python scalars."""
    return tuple(nested_tuples(v) for v in np.asarray(a)) if np.ndim(a) else np.asarray(a).item()


# How a test hands an array to a module: the functional ops take all of these.
ARRAY_KINDS = {"jax": jnp.asarray, "numpy": np.asarray,
               "list": lambda a: np.asarray(a).tolist(), "tuple": nested_tuples}
# A stack's init_state may also be a sequence of per-layer states.
STATE_KINDS = {**ARRAY_KINDS, "per_layer_list": lambda a: list(jnp.asarray(a))}


# Wrong init_state shapes for a stack of 3 layers, as functions of D*H.
STACK_STATE_ERRORS = {
    "too_few_layers_1": lambda DH: (1, N, DH),
    "too_few_layers_2": lambda DH: (2, N, DH),
    "too_many_layers_4": lambda DH: (4, N, DH),
    "too_many_layers_5": lambda DH: (5, N, DH),
    "wrong_batch": lambda DH: (3, N + 1, DH),
    "time_for_batch": lambda DH: (3, T, DH),
    "wrong_features": lambda DH: (3, N, DH + 1),
    "one_layers_state": lambda DH: (N, DH),
    "4d": lambda DH: (1, 3, N, DH),
}


@LAYOUTS
@pytest.mark.parametrize("kind", STATE_KINDS)
@pytest.mark.parametrize("bidirectional", [False, True], ids=["uni", "bi"])
@pytest.mark.parametrize("case", STACK_STATE_ERRORS)
def test_stack_rejects_init_state_of_the_wrong_shape(case, bidirectional, kind, time_major):
    _, _, to_user = user_layout(time_major)
    D = 2 if bidirectional else 1
    stack = StackedSingleGateRNN(I, H, 3, bidirectional=bidirectional, time_major=time_major,
                                 rngs=nnx.Rngs(0))
    shape = STACK_STATE_ERRORS[case](D * H)
    with raises_exactly(f"init_state: expected shape [3, {N}, {D * H}] ([L, N, D*H], one state "
                        f"per layer), got {shape}"):
        stack(normal(1, to_user((T, N, I))), STATE_KINDS[kind](normal(2, shape)))


@pytest.mark.parametrize("kind", STATE_KINDS)
def test_stack_takes_init_state_as_array_or_per_layer_sequence(kind):
    stack = StackedSingleGateRNN(I, H, 3, rngs=nnx.Rngs(0))
    x, h0 = normal(1, (N, T, I)), normal(2, (3, N, H))
    assert_allclose(stack(x, STATE_KINDS[kind](h0), return_state=True),
                    stack(x, h0, return_state=True))
    # Each layer starts from its own state.
    assert not np.allclose(stack(x, h0), stack(x, jnp.stack([h0[0]] * 3)))


def test_ragged_sequences_name_the_argument_not_the_list():
    stack = StackedSingleGateRNN(I, H, 3, rngs=nnx.Rngs(0))
    x = normal(1, (N, T, I))
    ragged_states = [jnp.zeros((N, H)), jnp.zeros((N + 1, H)), jnp.zeros((N, H))]
    with pytest.raises(ValueError, match="^init_state: expected an array"):
        stack(x, ragged_states)
    ragged_x = np.asarray(x).tolist()
    ragged_x[0][0] = ragged_x[0][0][:-1]
    for module in (stack, SingleGateRNN(I, H, rngs=nnx.Rngs(0))):
        with pytest.raises(ValueError, match="^inputs: expected an array") as error:
            module(ragged_x)
        assert len(str(error.value)) < 300  # not the whole list


# Wrong masks, in the user's layout (``to_user`` maps a time-major shape to it).
MASK_ERRORS = {
    "wrong_steps": lambda to_user: to_user((T + 1, N, H)),  # batch-first: (3, 6, 6)
    "wrong_batch": lambda to_user: to_user((T, N + 1, H)),
    "wrong_features": lambda to_user: to_user((T, N, H + 1)),
    "4d": lambda to_user: (1, *to_user((T, N, H))),
    "other_layout": lambda to_user: to_user((N, T, H)),  # [T, N, ...] to a batch-first layer
}


@LAYOUTS
@pytest.mark.parametrize("kind", ["jax", "numpy", "list"])
@pytest.mark.parametrize("stacked", [False, True], ids=["layer", "stack"])
@pytest.mark.parametrize("case", MASK_ERRORS)
def test_mask_errors_show_the_users_layout(case, stacked, kind, time_major):
    name, axes, to_user = user_layout(time_major)
    # The stack checks before recurrent dropout multiplies its masks into the user's.
    module = (StackedSingleGateRNN(I, H, 2, recurrent_dropout=0.5, time_major=time_major,
                                   rngs=nnx.Rngs(0)) if stacked else
              SingleGateRNN(I, H, time_major=time_major, rngs=nnx.Rngs(0)))
    mask_shape = MASK_ERRORS[case](to_user)
    with raises_exactly(f"mask: expected a shape broadcastable to {list(to_user((T, N, H)))} "
                        f"({name} [{axes}, D*H]), got {mask_shape}"):
        module(jnp.zeros(to_user((T, N, I))), mask=ARRAY_KINDS[kind](jnp.ones(mask_shape)))


@LAYOUTS
@pytest.mark.parametrize("kind", ["jax", "numpy", "list"])
@pytest.mark.parametrize("stacked", [False, True], ids=["layer", "stack"])
@pytest.mark.parametrize("x_tm", [(T, N, I + 1), (N, I), (1, T, N, I)],
                         ids=["wrong_features", "2d", "4d"])
def test_input_errors_show_the_users_layout(x_tm, stacked, kind, time_major):
    name, axes, to_user = user_layout(time_major)
    module = (StackedSingleGateRNN(I, H, 2, time_major=time_major, rngs=nnx.Rngs(0))
              if stacked else SingleGateRNN(I, H, time_major=time_major, rngs=nnx.Rngs(0)))
    shape = to_user(x_tm) if len(x_tm) == 3 else x_tm
    with raises_exactly(f"inputs: expected shape [{axes}, {I}] ({name}), got {shape}"):
        module(ARRAY_KINDS[kind](jnp.zeros(shape)))


@LAYOUTS
@pytest.mark.parametrize("kind", ["jax", "numpy", "list"])
@pytest.mark.parametrize("h0_shape", [(T, H), (N, H + 1), (1, N, H)],
                         ids=["time_for_batch", "wrong_features", "3d"])
def test_layer_init_state_errors_show_the_users_shapes(h0_shape, kind, time_major):
    _, _, to_user = user_layout(time_major)
    layer = SingleGateRNN(I, H, time_major=time_major, rngs=nnx.Rngs(0))
    x = jnp.zeros(to_user((T, N, I)))
    with raises_exactly(f"init_state: expected shape [{N}, {H}], got {h0_shape}"):
        layer(x, ARRAY_KINDS[kind](jnp.zeros(h0_shape)))


@LAYOUTS
@pytest.mark.parametrize("kind", ["numpy", "list", "tuple"])
@pytest.mark.parametrize("stacked", [False, True], ids=["layer", "stack"])
def test_array_likes_are_accepted_as_by_the_functional_op(stacked, kind, time_major):
    _, _, to_user = user_layout(time_major)
    module = (StackedSingleGateRNN(I, H, 2, recurrent_dropout=0.5, time_major=time_major,
                                   rngs=nnx.Rngs(0)) if stacked else
              SingleGateRNN(I, H, time_major=time_major, rngs=nnx.Rngs(0)))
    x = jnp.asarray(normal(1, (T, N, I)).transpose(*to_user((0, 1, 2))))
    h0 = normal(2, (2, N, H) if stacked else (N, H))
    mask = jnp.asarray(jax.random.bernoulli(jax.random.key(3), 0.7, to_user((T, N, 1))),
                       jnp.float32)
    twin = nnx.clone(module)  # same RNG state: the same recurrent dropout masks
    expected = twin(x, h0, mask, return_state=True)
    convert = ARRAY_KINDS[kind]
    assert_allclose(module(convert(x), convert(h0), convert(mask), return_state=True),
                    expected)


def test_works_under_nnx_jit():
    layer = StackedSingleGateRNN(I, H, 2, bidirectional=True, rngs=nnx.Rngs(0))
    x = normal(1, (N, T, I))
    h0 = normal(2, (2, N, 2 * H))
    call = nnx.jit(lambda m, x, h0: m(x, h0, return_state=True))
    assert_allclose(call(layer, x, h0), layer(x, h0, return_state=True))


@pytest.mark.parametrize("bidirectional", [False, True], ids=["uni", "bi"])
def test_stack_is_the_composition_of_its_layers(bidirectional):
    D = 2 if bidirectional else 1
    stack = StackedSingleGateRNN(I, H, 3, bidirectional=bidirectional, activation="relu",
                                 time_major=True, rngs=nnx.Rngs(0))
    assert [layer.in_features for layer in stack.layers] == [I, D * H, D * H]
    assert all(layer.time_major and layer.descriptor.activation == jax_sgrnn.Activation.RELU
               for layer in stack.layers)
    x = normal(1, (T, N, I))
    h0 = normal(2, (3, N, D * H))
    mask = jax.random.bernoulli(jax.random.key(3), 0.8, (T, N, 1))
    y, h_n = stack(x, h0, mask, return_state=True)
    assert y.shape == (T, N, D * H) and h_n.shape == (3, N, D * H)
    expected, states = x, []
    for i, layer in enumerate(stack.layers):
        flags = dict(activation="relu", bidirectional=bidirectional)
        expected = jax_sgrnn.reference(expected, **params_of(layer), init_state=h0[i],
                                       mask=mask, **flags)
        states.append(final_state(expected, layer.descriptor))
    assert_allclose((y, h_n), (expected, jnp.stack(states)))


def test_stack_gradients_op_equal_reference():
    models = {impl: StackedSingleGateRNN(I, H, 2, bidirectional=True, impl=impl,
                                         rngs=nnx.Rngs(0)) for impl in ("op", "reference")}
    x = normal(1, (N, T, I))
    loss = lambda m, x: jnp.mean(m(x) ** 2)
    grads = {impl: nnx.grad(loss, argnums=(0, 1))(m, x) for impl, m in models.items()}
    assert_allclose(nnx.state(grads["op"][0]), nnx.state(grads["reference"][0]))
    assert_allclose(grads["op"][1], grads["reference"][1])


def test_dropout_only_in_training_mode():
    x = normal(1, (N, T, I))
    plain = StackedSingleGateRNN(I, H, 2, rngs=nnx.Rngs(0))
    dropped = StackedSingleGateRNN(I, H, 2, dropout=0.5, recurrent_dropout=0.5,
                                   rngs=nnx.Rngs(0))
    assert not np.allclose(dropped(x), plain(x))  # modules start in training mode
    assert_allclose(nnx.view(dropped, deterministic=True)(x), plain(x))
    dropped.eval()
    assert_allclose(dropped(x), plain(x))


@pytest.mark.parametrize("time_major", [False, True], ids=["batch_first", "time_major"])
def test_recurrent_dropout_is_one_mask_per_sequence_through_the_op_mask(time_major):
    x = normal(1, (T, N, I) if time_major else (N, T, I))
    stack = StackedSingleGateRNN(I, H, 1, recurrent_dropout=0.5, time_major=time_major,
                                 rngs=nnx.Rngs(0))
    twin = nnx.clone(stack)  # same RNG state: it draws the same mask
    keep = twin.recurrent_dropout(jnp.ones((1, N, H) if time_major else (N, 1, H)))
    assert set(np.unique(np.asarray(keep))) == {0.0, 2.0}
    y = stack(x)
    assert_allclose(y, stack.layers[0](x, mask=keep))
    # h0 = 0, so the first step is untouched; the input is never dropped.
    first_step = (lambda a: a[0]) if time_major else (lambda a: a[:, 0])
    assert_allclose(first_step(y), first_step(stack.layers[0](x)))


def test_trains_with_optax_under_nnx_jit_and_impls_agree():
    x = normal(1, (16, T, I))
    target = jnp.sin(jnp.cumsum(x, axis=1)[..., :1])

    @nnx.jit
    def train_step(model, optimizer):
        def loss_fn(model):
            return jnp.mean((model["readout"](model["rnn"](x)) - target) ** 2)
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    results = {}
    for impl in ("op", "reference"):
        rngs = nnx.Rngs(0)
        model = nnx.Dict(rnn=StackedSingleGateRNN(I, H, 2, impl=impl, rngs=rngs),
                         readout=nnx.Linear(H, 1, rngs=rngs))
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        losses = [float(train_step(model, optimizer)) for _ in range(25)]
        results[impl] = (losses, nnx.state(model, nnx.Param))
    losses = results["op"][0]
    assert losses[-1] < 0.5 * losses[0]
    np.testing.assert_allclose(losses, results["reference"][0], rtol=1e-4)
    assert_allclose(results["op"][1], results["reference"][1], rtol=1e-4, atol=1e-5)


def test_parameters_round_trip_through_state_and_update():
    x = normal(1, (N, T, I))
    source = StackedSingleGateRNN(I, H, 2, bidirectional=True, rngs=nnx.Rngs(0))
    target = StackedSingleGateRNN(I, H, 2, bidirectional=True, rngs=nnx.Rngs(1))
    assert not np.allclose(source(x), target(x))
    state = nnx.state(source, nnx.Param)
    nnx.update(target, state)
    np.testing.assert_array_equal(source(x), target(x))
    assert_allclose(nnx.state(target, nnx.Param), state, rtol=0, atol=0)
    graphdef, state = nnx.split(source)
    np.testing.assert_array_equal(nnx.merge(graphdef, state)(x), source(x))


@pytest.mark.parametrize("mask_dtype", [jnp.bool_, jnp.float16, jnp.float32])
def test_recurrent_dropout_with_a_user_mask_under_strict_promotion(mask_dtype):
    """The stack multiplies its dropout mask by the user's in one explicit dtype: a bool or
    half mask works under strict dtype promotion and equals the same mask given as float32."""
    x = normal(1, (N, T, I))
    user = np.asarray(normal(2, (N, T, H))) > -0.5
    stack = StackedSingleGateRNN(I, H, 2, recurrent_dropout=0.5, rngs=nnx.Rngs(0))
    twin = nnx.clone(stack)
    with jax.numpy_dtype_promotion("strict"):
        y = stack(x, mask=jnp.asarray(user, mask_dtype))
    assert_allclose(y, twin(x, mask=jnp.asarray(user, jnp.float32)))
