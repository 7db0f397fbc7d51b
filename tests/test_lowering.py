"""What each call lowers to: on CPU the custom calls (forward, its training form under
jax.grad, the gradient op, every dtype), with CUDA's where the package was built with them
(test_cuda.py checks those), every other platform the decomposition; export, shape-polymorphic
export, and ``available`` against ``runs_here``. Which CPU handler a call picks:
test_backends.py.

Lowering for a platform needs no device of it, so this runs on any machine.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import jax_sgrnn
from conftest import (LOOP_T, custom_calls, diff_inputs, lowered_text, make_inputs, out_shape,
                      random_array, requires_native)

op = jax_sgrnn.single_gate_rnn
ref = jax_sgrnn.reference

#: Every backend's FFI targets: none may appear off CPU (or, from the CUDA build, off CUDA).
TARGETS = tuple(t for b in jax_sgrnn.backends().values() for t in b.targets.values())
CUDA_BUILT = jax_sgrnn.backends()["cuda"].available
NATIVE = jax_sgrnn.backends()["native"].targets


def _problem(bidirectional: bool):
    rng = np.random.default_rng(7)
    T, N, I, H = LOOP_T, 3, 5, 2
    D = 2 if bidirectional else 1
    R = rng.normal(size=(2, H, H) if bidirectional else (H, H)).astype(np.float32)
    return (rng.normal(size=(T, N, I)).astype(np.float32), R,
            rng.normal(size=(D * H, I)).astype(np.float32),
            (rng.random((T, N, D * H)) > 0.3))


def _loss(x, R, W, mask, bidirectional):
    y = jax_sgrnn.single_gate_rnn(x, R, W, mask=mask, activation="tanh",
                                  bidirectional=bidirectional)
    return jnp.sum(y * y)


@pytest.mark.parametrize("platform", [
    pytest.param("cuda", marks=pytest.mark.skipif(
        CUDA_BUILT, reason="built with the CUDA handler: cuda lowers to it (test_cuda.py)")),
    "rocm", "tpu"])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_other_platforms_lower_the_decomposition(platform, bidirectional):
    x, R, W, mask = _problem(bidirectional)
    grad = jax.jit(jax.grad(_loss, argnums=(0, 1, 2)), static_argnums=4)
    module = export.export(grad, platforms=[platform])(x, R, W, mask, bidirectional).mlir_module()
    assert not any(t in module for t in TARGETS)
    assert "stablehlo.while" in module  # the lax.scan recurrence


@pytest.mark.parametrize("rows,steps_an_iteration", [(128, 2), (2, 4)])
def test_decomposition_scans_whole_iterations_where_a_steps_output_is_large(rows,
                                                                            steps_an_iteration):
    """10 steps are not a whole number of 4-step iterations: with 32,768 elements a step the
    scan runs 2 an iteration (lax.scan's loop of the steps left over copies the sequence in
    and out: a concatenate of the whole sequence); with few elements it keeps 4 and that
    loop."""
    T, H = 10, 256
    assert jax_sgrnn._lowering.steps_per_iteration(T, rows * H) == steps_an_iteration
    shapes = [jax.ShapeDtypeStruct(s, np.float32) for s in ((T, rows, 4), (H, H), (H, 4))]
    module = export.export(jax.jit(lambda x, R, W: op(x, R, W, activation="tanh")),
                           platforms=["rocm"])(*shapes).mlir_module()
    assert "stablehlo.while" in module
    whole_sequence = re.search(rf"stablehlo.concatenate .*-> tensor<{T}x", module)
    assert bool(whole_sequence) == (steps_an_iteration == 4)


@requires_native
@pytest.mark.parametrize("bi", [False, True], ids=["uni", "bi"])
def test_hlo_forward_and_grad_use_custom_calls(native_backend, rng, bi):
    inputs = make_inputs(rng, 4, 3, 3, 5, bidirectional=bi, mask="bool")
    flags = dict(activation="tanh", bidirectional=bi)
    fwd_text = lowered_text(lambda i: op(**i, **flags), inputs)
    fwd_calls = custom_calls(fwd_text, NATIVE["forward"])
    assert fwd_calls, fwd_text
    assert not custom_calls(fwd_text, NATIVE["gradients"])
    # Inference: no z is produced.
    assert all(re.search(r"training = false", l) for l in fwd_calls), fwd_calls
    # The op does not fall back to the scan decomposition on CPU.
    assert "stablehlo.while" not in fwd_text

    c = random_array(rng, out_shape(inputs, bi), jnp.float64)
    grad_fn = jax.grad(lambda d: jnp.sum(op(**{**inputs, **d}, **flags) * c))
    grad_text = lowered_text(grad_fn, diff_inputs(inputs))
    fwd_in_grad = custom_calls(grad_text, NATIVE["forward"])
    assert fwd_in_grad, grad_text
    assert custom_calls(grad_text, NATIVE["gradients"]), grad_text
    # Under differentiation the inference op runs the training forward (z saved).
    assert all(re.search(r"training = true", l) for l in fwd_in_grad), fwd_in_grad
    assert "stablehlo.while" not in grad_text


@requires_native
@pytest.mark.parametrize("bi", [False, True], ids=["uni", "bi"])
def test_hlo_of_jvp_is_two_forward_calls(native_backend, rng, bi):
    """jax.jvp runs the training forward and the tangent's forward (activation none) as custom
    calls: no gradient op, no scan."""
    inputs = make_inputs(rng, LOOP_T, 3, 3, 5, bidirectional=bi, mask="float")
    flags = dict(activation="tanh", bidirectional=bi)
    primals = diff_inputs(inputs)
    text = lowered_text(lambda p, t: jax.jvp(lambda p: op(**{**inputs, **p}, **flags), (p,),
                                             (t,)), primals, primals)
    calls = custom_calls(text, NATIVE["forward"])
    assert len(calls) == 2, text
    assert sum("training = true" in c for c in calls) == 1, calls
    assert sum("activation = 0 : i32" in c for c in calls) == 1, calls
    assert not custom_calls(text, NATIVE["gradients"])
    assert "stablehlo.while" not in text


@requires_native
def test_hlo_gradients_op_uses_custom_call(native_backend, rng):
    inputs = make_inputs(rng, 4, 3, 3, 5)
    _, z = ref(**inputs, training=True)
    text = lowered_text(lambda i, dy, z: jax_sgrnn.single_gate_rnn_gradients(
        i["source"], i["recurrent_weight"], dy, z, i["input_weight"], i["bias"],
        i["init_state"]), inputs, z, z)
    assert custom_calls(text, NATIVE["gradients"]), text
    assert not custom_calls(text, NATIVE["forward"])


@requires_native
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32],
                         ids=["float16", "bfloat16", "float32"])
def test_hlo_custom_call_for_other_dtypes(native_backend, rng, dtype):
    inputs = make_inputs(rng, 4, 3, 3, 5, dtype=dtype)
    text = lowered_text(jax.grad(lambda d: jnp.sum(op(**{**inputs, **d}).astype(jnp.float32))),
                        diff_inputs(inputs))
    assert custom_calls(text, NATIVE["forward"])
    assert custom_calls(text, NATIVE["gradients"])


def test_lowering_for_other_platforms_is_the_decomposition(rng):
    """Off CPU (here: lowering for TPU, which needs no device) the op lowers to the lax.scan
    decomposition, not to the CPU custom calls."""
    inputs = make_inputs(rng, LOOP_T, 3, 3, 5)
    traced = jax.jit(jax.grad(lambda d: jnp.sum(op(**{**inputs, **d})))).trace(
        diff_inputs(inputs))
    try:
        text = traced.lower(lowering_platforms=("tpu",)).as_text()
    except TypeError as err:  # pragma: no cover - older/newer jax without the keyword
        pytest.skip(f"cross-platform lowering unavailable: {err}")
    assert "jax_sgrnn_" not in text
    assert "stablehlo.while" in text


@pytest.mark.parametrize("platform,loops", [("rocm", 2), ("cuda", 2), ("tpu", 4)])
def test_decomposition_merges_directions_on_gpus(rng, platform, loops):
    """A bidirectional forward+backward lowered to the decomposition: on GPUs one scan steps
    both directions (a loop for the forward, one for the backward), elsewhere one scan per
    direction (``GPU_FORM_PLATFORMS``). For cuda with the CUDA handler off."""
    inputs = make_inputs(rng, LOOP_T, 3, 3, 5, bidirectional=True)
    with jax_sgrnn.cuda_handler(False):
        traced = jax.jit(jax.grad(lambda d: jnp.sum(op(**{**inputs, **d}, bidirectional=True)))
                         ).trace(diff_inputs(inputs))
    try:
        text = traced.lower(lowering_platforms=(platform,)).as_text()
    except TypeError as err:  # pragma: no cover - older/newer jax without the keyword
        pytest.skip(f"cross-platform lowering unavailable: {err}")
    assert "jax_sgrnn_" not in text
    assert text.count("stablehlo.while") == loops


def test_portable_lowering_functions_match_the_custom_call(native_backend):
    """What other platforms run (the functions their lowering rule traces) equals the
    CPU custom call, for the forward and for a grouped (G = 2) gradient call."""
    from jax_sgrnn._primitives import (OpConfig, forward_p, forward_reference, gradients_p,
                                       gradients_reference)

    x, R, W, mask = _problem(True)
    mask = mask.astype(np.float32)
    desc = jax_sgrnn.SingleGateRNNDescriptor(bidirectional=True, training=True,
                                             activation="sigmoid")
    config = OpConfig.of(desc, ("native",), input_weight=W, mask=mask)
    native = forward_p.bind(x, R, W, mask, config=config)
    portable = forward_reference(x, R, W, mask, config=config)
    for a, b in zip(native, portable):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

    z = native[1]
    dy = np.random.default_rng(3).normal(size=(2, *z.shape)).astype(np.float32)
    grouped = (np.stack([x, 2 * x]), R, dy, np.stack([z, z]), W, mask[None])
    native = gradients_p.bind(*grouped, config=config)
    portable = gradients_reference(*grouped, config=config)
    assert [g.shape for g in native] == [(2, *x.shape), (2, *R.shape), (2, *W.shape)]
    for a, b in zip(native, portable):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def _runs_here(platform: str) -> bool:
    """Whether a program exported for ``platform`` runs on this process's default backend."""
    return {"cpu": "cpu", "cuda": "gpu"}[platform] == jax.default_backend()


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_export_with_the_packages_safety_checks(native_backend, platform):
    """The README's export recipe: without export_safety_checks() JAX refuses the custom calls;
    with it the program serialises, and (on CPU) the deserialised one runs and agrees."""
    if platform == "cuda" and not CUDA_BUILT:
        pytest.skip("built without the CUDA handler: cuda lowers to the decomposition")
    x, R, W, mask = _problem(False)
    grad = jax.jit(jax.grad(_loss, argnums=(0, 1, 2)), static_argnums=4)
    with pytest.raises(ValueError, match="custom call"):
        export.export(grad, platforms=[platform])(x, R, W, mask, False)
    exported = export.export(grad, platforms=[platform],
                             disabled_checks=jax_sgrnn.export_safety_checks())(
        x, R, W, mask, False)
    targets = jax_sgrnn.backends()["native" if platform == "cpu" else "cuda"].targets.values()
    assert all(t in exported.mlir_module() for t in targets)
    restored = export.deserialize(exported.serialize())
    if _runs_here(platform):
        for got, want in zip(restored.call(x, R, W, mask), grad(x, R, W, mask, False)):
            np.testing.assert_allclose(got, want, rtol=1e-6)


def test_available_is_lowering_and_runs_here_needs_a_device():
    """available: lowering is possible here; runs_here: a device here can also run it."""
    table = jax_sgrnn.backends()
    for backend in table.values():
        assert not backend.runs_here or backend.available
    assert table["native"].runs_here == table["native"].available
    if table["cuda"].available:  # a CUDA build lowers for cuda with or without a GPU
        assert "cuda" in jax_sgrnn.NATIVE_PLATFORMS
        assert table["cuda"].runs_here == (jax.default_backend() == "gpu")


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
@pytest.mark.parametrize("symbolic", ["T", "N", "vmapped"])
def test_shape_polymorphic_export(native_backend, platform, symbolic):
    """Symbolic T or N, or a vmapped batch folded into N: exports for CPU (the custom call runs
    any size) and for CUDA (the handler's plan depends on the sizes: a symbolic one lowers to
    the decomposition, right for every value)."""
    if platform == "cuda" and not CUDA_BUILT:
        pytest.skip("built without the CUDA handler: cuda lowers to the decomposition anyway")
    T, N, I, H = 6, 3, 5, 4
    spec = {"T": f"t, {N}, {I}", "N": f"{T}, n, {I}", "vmapped": f"b, {T}, {N}, {I}"}[symbolic]
    x = jax.ShapeDtypeStruct(export.symbolic_shape(spec), jnp.float32)
    R = jax.ShapeDtypeStruct((H, H), jnp.float32)
    W = jax.ShapeDtypeStruct((H, I), jnp.float32)

    def loss(x, R, W):
        return jnp.sum(jax_sgrnn.single_gate_rnn(x, R, W, activation="tanh") ** 2)

    grad = jax.grad(loss, argnums=(0, 1, 2))
    if symbolic == "vmapped":
        grad = jax.vmap(grad, in_axes=(0, None, None))
    exported = export.export(jax.jit(grad), platforms=[platform],
                             disabled_checks=jax_sgrnn.export_safety_checks())(x, R, W)
    module = exported.mlir_module()
    targets = jax_sgrnn.backends()["native" if platform == "cpu" else "cuda"].targets
    if platform == "cpu":
        assert all(t in module for t in NATIVE.values())
    else:  # N or T symbolic in the forward (a vmapped batch joins N): its plan is unknown
        assert targets["forward"] not in module and "stablehlo.while" in module
    if _runs_here(platform):
        rng = np.random.default_rng(0)
        concrete = {"T": (9, N, I), "N": (T, 7, I), "vmapped": (2, T, N, I)}[symbolic]
        args = (rng.normal(size=concrete).astype(np.float32),
                (0.3 * rng.normal(size=(H, H))).astype(np.float32),
                rng.normal(size=(H, I)).astype(np.float32))
        for got, want in zip(exported.call(*args), jax.jit(grad)(*args)):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not CUDA_BUILT, reason="built without the CUDA handler")
@pytest.mark.parametrize("rows_to_threshold", [-1, 0])
def test_weight_products_apart_from_the_threshold(monkeypatch, rows_to_threshold):
    """From PRODUCTS_APART_ROWS rows on, dW's product reads dz through an optimisation barrier,
    so that XLA does not merge it with dR's (docs/performance.md, "What one call runs"); below,
    no barrier. The threshold is lowered here to keep the problem small."""
    from jax_sgrnn import _lowering

    T, N, I, H = 4, 3, 5, 2
    monkeypatch.setattr(_lowering, "PRODUCTS_APART_ROWS", T * N - rows_to_threshold)
    x = jax.ShapeDtypeStruct((T, N, I), jnp.float32)
    R, W = jax.ShapeDtypeStruct((H, H), jnp.float32), jax.ShapeDtypeStruct((H, I), jnp.float32)

    def loss(x, R, W):
        return jnp.sum(jax_sgrnn.single_gate_rnn(x, R, W, activation="tanh") ** 2)

    module = export.export(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), platforms=["cuda"],
                           disabled_checks=jax_sgrnn.export_safety_checks())(x, R, W)
    text = module.mlir_module()
    assert jax_sgrnn.backends()["cuda"].targets["gradients"] in text
    assert ("optimization_barrier" in text) == (rows_to_threshold == 0)
