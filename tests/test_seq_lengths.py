"""Variable-length sequences (``seq_lengths``): every cpu backend against an oracle that runs
each batch row alone on its own unpadded sequence, over the flag grid; the gradient op; errors,
clamping, jit, grad, vmap, second derivatives and the lowered HLO."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sgrnn
from conftest import (LOOP_T, assert_close, backends_over, diff_inputs, full_results,
                      grid_every_activation, grid_every_pattern, lowered_text, make_inputs,
                      out_shape, random_array, ref_jit)

op = jax_sgrnn.single_gate_rnn
ref = jax_sgrnn.reference

# (T, N, H); N >= 2 so that a batch mixes lengths.
SHAPES = ((5, 3, 4), (1, 3, 2), (6, 4, 1), (3, 2, 3))


def mixed_lengths(rng, T: int, N: int) -> np.ndarray:
    """N lengths in [0, T] that include 0 and T (when N allows), in random order."""
    lengths = np.concatenate([[0, T], rng.integers(1, T + 1, size=max(N - 2, 0))])[:N]
    return rng.permutation(lengths).astype(np.int32)


def _row(inputs: dict, n: int, length: int) -> dict:
    """Row n's problem, cut to its first ``length`` steps."""
    T, N, _ = inputs["source"].shape
    row = dict(inputs, source=inputs["source"][:length, n:n + 1])
    if inputs["init_state"] is not None:
        row["init_state"] = inputs["init_state"][n:n + 1]
    if inputs["mask"] is not None:
        mask = jnp.broadcast_to(inputs["mask"], (T, N, inputs["mask"].shape[-1]))
        row["mask"] = mask[:length, n:n + 1]
    return row


def per_row_oracle(inputs: dict, lengths, cotangent, flags: dict) -> dict:
    """What ``full_results`` returns, computed row by row: each row runs the reference on its
    unpadded sequence (lengths are static here), padded with zeros to T steps; the gradients
    are those of ``sum(y * cotangent)`` through every row."""
    shape = out_shape(inputs, flags["bidirectional"])

    def run(inputs, cotangent):
        def loss(diff):
            full = {**inputs, **diff}
            ys, zs = [], []
            for n, length in enumerate(int(v) for v in lengths):
                pad = jnp.zeros((shape[0] - length, 1, shape[2]), cotangent.dtype)
                if length == 0:
                    ys.append(pad), zs.append(pad)
                    continue
                y, z = ref(**_row(full, n, length), **flags, training=True)
                ys.append(jnp.concatenate([y, pad])), zs.append(jnp.concatenate([z, pad]))
            y, z = jnp.concatenate(ys, axis=1), jnp.concatenate(zs, axis=1)
            return jnp.sum(y.astype(cotangent.dtype) * cotangent), (y, z)

        (_, (y, z)), grads = jax.value_and_grad(loss, has_aux=True)(diff_inputs(inputs))
        return dict(y=y, y_train=y, z=z, grads=grads)

    return ref_jit(run)(inputs, cotangent)


def _check_against_oracle(rng, act, rev, bi, pattern, mask, shape, dtype):
    T, N, H = shape
    w, b, h = pattern
    inputs = make_inputs(rng, T, N, 3, H, bidirectional=bi, input_weight=w, bias=b,
                         init_state=h, mask=mask, dtype=dtype)
    lengths = mixed_lengths(rng, T, N)
    flags = dict(activation=act, reverse=rev, bidirectional=bi)
    c = random_array(rng, out_shape(inputs, bi), dtype)
    got = full_results(op, inputs, c, {**flags, "seq_lengths": lengths})
    assert_close(got, per_row_oracle(inputs, lengths, c, flags), err_msg=f"lengths {lengths}")
    padded = np.arange(T)[:, None] >= lengths[None, :]
    for key in ("y", "y_train", "z"):
        assert not np.asarray(got[key])[padded].any(), f"{key} is not zero at padded steps"
    if "source" in got["grads"]:
        assert not np.asarray(got["grads"]["source"])[padded].any(), "dx at padded steps"


@pytest.mark.parametrize("cpu_backend,act,rev,bi,pattern,mask,shape",
                         backends_over(grid_every_pattern(SHAPES), grid_every_activation(SHAPES)),
                         indirect=["cpu_backend"])
def test_matches_per_row_oracle_float64(cpu_backend, rng, act, rev, bi, pattern, mask, shape):
    _check_against_oracle(rng, act, rev, bi, pattern, mask, shape, jnp.float64)


@pytest.mark.parametrize("act,rev,bi,pattern,mask,shape", grid_every_activation(SHAPES))
def test_matches_per_row_oracle_float32(cpu_backend, rng, act, rev, bi, pattern, mask, shape):
    _check_against_oracle(rng, act, rev, bi, pattern, mask, shape, jnp.float32)


@pytest.mark.parametrize("bi", [False, True], ids=["uni", "bi"])
@pytest.mark.parametrize("rev", [False, True], ids=["fwd", "rev"])
def test_gradients_op_ignores_padding_and_matches_reference(cpu_backend, rng, rev, bi):
    """The explicit gradient op with lengths: equal to the reference's, and blind to whatever
    source_gradient and z_state hold at padded steps (here NaN and huge values)."""
    T, N, H = 6, 4, 3
    inputs = make_inputs(rng, T, N, 2, H, bidirectional=bi, mask="float")
    lengths = np.array([2, 6, 0, 4], np.int32)
    flags = dict(activation="tanh", reverse=rev, bidirectional=bi, seq_lengths=lengths)
    _, z = op(**inputs, **flags, training=True)
    dy = random_array(rng, z.shape, z.dtype)
    got = jax_sgrnn.single_gate_rnn_gradients(source_gradient=dy, z_state=z, **inputs, **flags)
    want = jax_sgrnn.reference_gradients(source_gradient=dy, z_state=z, **inputs, **flags)
    assert_close(got, want)
    padded = jnp.asarray(np.arange(T)[:, None, None] >= lengths[None, :, None])
    noisy = dict(source_gradient=jnp.where(padded, jnp.nan, dy),
                 z_state=jnp.where(padded, 1e30, z))
    assert_close(jax_sgrnn.single_gate_rnn_gradients(**noisy, **inputs, **flags), got)


def test_lengths_of_t_equal_no_lengths_and_zero_gives_initial_state(rng):
    inputs = make_inputs(rng, 5, 3, 2, 4, bidirectional=True, mask="bool")
    flags = dict(activation="relu", bidirectional=True)
    c = random_array(rng, out_shape(inputs, True), jnp.float64)
    assert_close(full_results(op, inputs, c, {**flags, "seq_lengths": np.full(3, 5)}),
                 full_results(op, inputs, c, flags))
    nothing = full_results(op, inputs, c, {**flags, "seq_lengths": np.zeros(3, np.int32)})
    for key in ("y", "y_train", "z"):
        assert not np.asarray(nothing[key]).any()
    for name, g in nothing["grads"].items():
        assert not np.asarray(g).any(), name


@pytest.mark.parametrize("lengths,message", [
    ([3, -1, 2], "seq_lengths: expected lengths in [0, T=4], got -1 at batch row 1"),
    ([5, 1, 2], "seq_lengths: expected lengths in [0, T=4], got 5 at batch row 0"),
])
def test_concrete_lengths_outside_the_sequence_raise(rng, lengths, message):
    inputs = make_inputs(rng, 4, 3, 2, 3)
    for call in (op, ref):
        with pytest.raises(ValueError, match=re.escape(message)):
            call(**inputs, seq_lengths=np.array(lengths))


@pytest.mark.parametrize("lengths,error,message", [
    (np.array([1.0, 2.0, 3.0]), TypeError, "seq_lengths: expected an integer dtype, got float64"),
    (np.array([True, False, True]), TypeError, "seq_lengths: expected an integer dtype, got bool"),
    (np.array([1, 2]), ValueError, "seq_lengths: expected shape [3] (one length per batch row), "
                                   "got (2,)"),
    (np.array([[1, 2, 3]]), ValueError, "seq_lengths: expected shape [3]"),
])
def test_bad_lengths_name_the_argument(rng, lengths, error, message):
    inputs = make_inputs(rng, 4, 3, 2, 3)
    for call in (op, ref):
        with pytest.raises(error, match=re.escape(message)):
            call(**inputs, seq_lengths=lengths)


def test_lengths_are_validated_as_given_with_x64_off():
    """With x64 off JAX holds integers in int32; int64 lengths that int32 cannot hold are
    refused from the caller's values, not from their wrapped int32 ones."""
    code = """if True:
        import jax, jax.numpy as jnp, numpy as np, jax_sgrnn
        assert not jax.config.jax_enable_x64
        x, R = jnp.ones((4, 2, 3)), jnp.eye(3) * 0.5
        for fn in (jax_sgrnn.single_gate_rnn, jax_sgrnn.reference):
            for lengths in ([2**32 + 1, 1], np.array([1, 2**32 + 1]), [-2**32 + 2, 0]):
                try:
                    fn(x, R, seq_lengths=lengths)
                except ValueError as e:
                    assert "seq_lengths: expected lengths in [0, T=4]" in str(e), e
                else:
                    raise AssertionError(f"{fn.__name__} accepted {lengths}")
            y = fn(x, R, seq_lengths=np.array([3, 1], np.int64))
            np.testing.assert_allclose(y[:3, 0], fn(x[:3, :1], R)[:, 0], rtol=1e-6)
        print("ok")
    """
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=os.path.dirname(__file__),
                         env=dict(os.environ, JAX_PLATFORMS="cpu", JAX_ENABLE_X64="0"))
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_traced_lengths_are_clamped(rng):
    inputs = make_inputs(rng, 4, 3, 2, 3, init_state=True)
    run = jax.jit(lambda lengths: op(**inputs, training=True, seq_lengths=lengths))
    assert_close(run(jnp.array([-3, 9, 2])), op(**inputs, training=True, seq_lengths=[0, 4, 2]))


def test_jit_grad_and_traced_lengths_reuse_one_compilation(rng):
    inputs = make_inputs(rng, 5, 3, 2, 4, mask="float")
    traces = []

    @jax.jit
    def loss(diff, lengths):
        traces.append(1)
        return jnp.sum(op(**{**inputs, **diff}, activation="tanh", seq_lengths=lengths) ** 2)

    def oracle(diff, lengths):
        y = ref(**{**inputs, **diff}, activation="tanh", seq_lengths=lengths)
        return jnp.sum(y ** 2)

    for lengths in ([5, 0, 3], [1, 2, 4]):
        lengths = jnp.array(lengths, jnp.int32)
        assert_close(jax.grad(loss)(diff_inputs(inputs), lengths),
                     jax.grad(oracle)(diff_inputs(inputs), lengths))
    assert len(traces) == 1


@pytest.mark.parametrize("mapped", ["lengths", "source", "both", "weights"])
def test_vmap(cpu_backend, rng, mapped):
    """vmap over problems, with the lengths mapped, shared, or alongside mapped weights (the
    batched-scan fallback): equal to a loop over the problems, values and gradients."""
    B, T, N = 3, 5, 2
    inputs = make_inputs(rng, T, N, 2, 3, mask="float")
    batched = dict(inputs)
    axes = {k: None for k in inputs}
    if mapped in ("source", "both", "weights"):
        batched["source"] = random_array(rng, (B, *inputs["source"].shape), jnp.float64)
        axes["source"] = 0
    if mapped == "weights":
        batched["recurrent_weight"] = random_array(rng, (B, 3, 3), jnp.float64, 0.3)
        axes["recurrent_weight"] = 0
    lengths = np.stack([mixed_lengths(rng, T, N) for _ in range(B)])
    lengths_axis = 0 if mapped in ("lengths", "both", "weights") else None
    if lengths_axis is None:
        lengths = lengths[0]

    def loss(args, lengths, fn):
        return jnp.sum(jnp.sin(fn(**args, activation="tanh", seq_lengths=lengths)))

    got = jax.vmap(jax.value_and_grad(lambda a, l: loss(a, l, op)), (axes, lengths_axis))(
        batched, lengths)
    for i in range(B):
        args = {k: v if axes[k] is None else v[i] for k, v in batched.items()}
        row_lengths = lengths if lengths_axis is None else lengths[i]
        want = jax.value_and_grad(lambda a: loss(a, row_lengths, ref))(args)
        assert_close(jax.tree.map(lambda g: g[i], got), want, err_msg=f"problem {i}")


# Every path a call with lengths can take: the native handler, the decomposition (the "scan"
# backend, what other platforms run), the reference, the fallback of a loss on z (autodiff of
# the reference), the gradient op, and a second derivative.
PADDING_PATHS = ("native", "scan", "reference", "z_loss", "gradients_op", "second_derivative")
PADDING_T, PADDING_LENGTHS = 4, np.array([4, 2, 0], np.int32)


def _poison_padding(inputs: dict, where: str, value, dy, z):
    """`inputs`, dy and z with `value` at every position only padding reads: the source, the
    (full) mask and dy/z at padded steps, or the initial state of the row of length 0."""
    padded = ~np.asarray((np.arange(PADDING_T)[:, None] < PADDING_LENGTHS[None, :])[..., None])
    poison = lambda a: jnp.where(padded, jnp.asarray(value, a.dtype), a)
    inputs = dict(inputs)
    if where == "source":
        inputs["source"] = poison(inputs["source"])
    elif where == "mask":
        inputs["mask"] = poison(inputs["mask"])
    elif where == "init_state":
        inputs["init_state"] = inputs["init_state"].at[2].set(value)
    elif where == "dy_z":
        dy, z = poison(dy), poison(z)
    return inputs, dy, z


def _padding_path_results(path: str, inputs: dict, flags: dict, dy, z):
    """The path's outputs and gradients (with respect to every differentiable input)."""
    lengths = jnp.asarray(PADDING_LENGTHS)
    diff = diff_inputs(inputs)
    if path == "gradients_op":
        return jax_sgrnn.single_gate_rnn_gradients(
            inputs["source"], inputs["recurrent_weight"], dy, z, inputs["input_weight"],
            inputs["bias"], inputs["init_state"], inputs["mask"], seq_lengths=lengths, **flags)
    fn = ref if path == "reference" else op

    def loss(d):
        out = fn(**{**inputs, **d}, **flags, seq_lengths=lengths, training=True)
        # A loss on z as well as y: the op then differentiates the reference (the fallback).
        return jnp.sum(out[0] * dy) + (jnp.sum(jnp.sin(out[1])) if path == "z_loss" else 0.0)

    if path == "second_derivative":
        return jax.grad(lambda d: sum(jnp.sum(g ** 2) for g in jax.grad(loss)(d).values()))(diff)
    backend = "scan" if path == "scan" else "native"
    with jax_sgrnn.cpu_backend(backend):
        return jax.value_and_grad(loss)(diff)


@pytest.mark.parametrize("path", PADDING_PATHS)
@pytest.mark.parametrize("where,value", [("source", np.nan), ("source", np.inf),
                                         ("mask", np.nan), ("init_state", np.nan),
                                         ("dy_z", np.nan)])
@pytest.mark.parametrize("rev,bi", [(False, False), (True, False), (False, True)],
                         ids=["fwd", "rev", "bi"])
def test_padding_content_never_reaches_a_result(rng, path, where, value, rev, bi):
    """NaN or Inf wherever only padding reads it changes no output and no gradient of any path:
    each equals the same call with zeros there, and is finite."""
    if where == "dy_z" and path != "gradients_op":
        pytest.skip("dy and z are the gradient op's inputs")
    flags = dict(activation="tanh", reverse=rev, bidirectional=bi)
    inputs = make_inputs(rng, PADDING_T, 3, 2, 3, bidirectional=bi, mask="float")
    y, z = ref(**inputs, **flags, seq_lengths=PADDING_LENGTHS, training=True)
    dy = random_array(rng, y.shape, jnp.float64)
    clean_inputs, clean_dy, clean_z = _poison_padding(inputs, where, 0.0, dy, z)
    bad_inputs, bad_dy, bad_z = _poison_padding(inputs, where, value, dy, z)
    clean = _padding_path_results(path, clean_inputs, flags, clean_dy, clean_z)
    got = _padding_path_results(path, bad_inputs, flags, bad_dy, bad_z)
    for leaf in jax.tree.leaves(got):
        assert np.isfinite(np.asarray(leaf)).all(), f"{path}: {got}"
    assert_close(got, clean)


def test_vmap_of_gradients_op_with_mapped_lengths(rng):
    """Grouped gradient op (G > 1), each group with its own lengths."""
    B, T, N = 3, 4, 3
    inputs = make_inputs(rng, T, N, 2, 3, bidirectional=True)
    xs = random_array(rng, (B, T, N, 2), jnp.float64)
    dys = random_array(rng, (B, T, N, 6), jnp.float64)
    lengths = np.stack([mixed_lengths(rng, T, N) for _ in range(B)])
    rest = {k: v for k, v in inputs.items() if k != "source"}

    def grads(fn, x, dy, lengths):
        _, z = op(x, **rest, bidirectional=True, training=True, seq_lengths=lengths)
        return fn(x, source_gradient=dy, z_state=z, **rest, bidirectional=True,
                  seq_lengths=lengths)

    got = jax.vmap(lambda *a: grads(jax_sgrnn.single_gate_rnn_gradients, *a))(xs, dys, lengths)
    for i in range(B):
        want = grads(jax_sgrnn.reference_gradients, xs[i], dys[i], lengths[i])
        assert_close([g[i] for g in got], want, err_msg=f"group {i}")


def test_second_derivatives_with_lengths(rng):
    inputs = make_inputs(rng, 4, 3, 2, 3, init_state=True)
    lengths = np.array([4, 1, 0], np.int32)

    def loss(fn):
        def f(R):
            return jnp.sum(fn(**{**inputs, "recurrent_weight": R}, activation="tanh",
                              seq_lengths=lengths) ** 2)
        return f

    R = inputs["recurrent_weight"]
    assert_close(jax.hessian(loss(op))(R), jax.hessian(loss(ref))(R))


def test_hlo_is_the_custom_call_and_mps_falls_back_to_the_decomposition(native_backend, rng):
    """Lengths run natively in the CPU handler (no while loop); MPSGraph has no lengths, so
    with "mps" chosen such a call lowers to the decomposition, never to a wrong answer
    (float32: float64 goes to the native handler whatever is chosen)."""
    inputs = make_inputs(rng, LOOP_T, 3, 2, 3, dtype=jnp.float32)
    lengths = jnp.array([1, 4, 2], jnp.int32)

    def fn(x):
        return jnp.sum(op(**{**inputs, "source": x}, seq_lengths=lengths) ** 2)

    text = lowered_text(jax.grad(fn), inputs["source"])
    targets = jax_sgrnn.backends()["native"].targets
    assert targets["forward"] in text and targets["gradients"] in text
    assert "while" not in text
    with jax_sgrnn.cpu_backend("mps"):
        text = lowered_text(jax.grad(fn), inputs["source"])
        mps = jax_sgrnn.backends()["mps"].targets
        assert mps["forward"] not in text and "while" in text
        assert_close(jax.grad(fn)(inputs["source"]), jax.grad(
            lambda x: jnp.sum(ref(**{**inputs, "source": x}, seq_lengths=lengths) ** 2))(
                inputs["source"]))



@pytest.mark.parametrize("stacked", [False, True], ids=["layer", "stack"])
@pytest.mark.parametrize("bi", [False, True], ids=["uni", "bi"])
def test_flax_modules_read_each_padded_row_as_if_alone(rng, bi, stacked):
    """nn modules (batch-first) with seq_lengths: outputs and final states of a padded batch
    equal each row run alone, unpadded; padded outputs are zero; a row of length 0 keeps its
    initial state."""
    from flax import nnx

    from jax_sgrnn.nn import SingleGateRNN, StackedSingleGateRNN

    N, T, I, H = 4, 6, 3, 5
    D = 2 if bi else 1
    if stacked:
        model = StackedSingleGateRNN(I, H, 2, bidirectional=bi, param_dtype=jnp.float64,
                                     rngs=nnx.Rngs(0))
        h0 = random_array(rng, (2, N, D * H), jnp.float64)
        row_state = lambda n: h0[:, n:n + 1]
    else:
        model = SingleGateRNN(I, H, bidirectional=bi, param_dtype=jnp.float64, rngs=nnx.Rngs(0))
        h0 = random_array(rng, (N, D * H), jnp.float64)
        row_state = lambda n: h0[n:n + 1]
    x = random_array(rng, (N, T, I), jnp.float64)
    lengths = np.array([6, 2, 0, 4], np.int32)
    y, h_n = model(x, h0, seq_lengths=lengths, return_state=True)
    for n, length in enumerate(lengths):
        assert not np.asarray(y[n, length:]).any()
        if length == 0:
            assert_close(h_n[..., n, :], h0[..., n, :])
            continue
        y_row, h_row = model(x[n:n + 1, :length], row_state(n), return_state=True)
        assert_close(y[n:n + 1, :length], y_row, err_msg=f"row {n}")
        assert_close(h_n[..., n:n + 1, :], h_row, err_msg=f"row {n} final state")
