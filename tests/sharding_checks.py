"""Checks of the op on several devices, run by ``test_sharding.py`` in a subprocess (the device
count is fixed when JAX starts): ``python sharding_checks.py`` prints one JSON object mapping
each check's name to ``{"error": text}`` or to the facts the test asserts (HLO counts).

Each check compares the op under a sharding with the same op on one device: the same kernels,
so the only differences are the order of the weight gradients' sums.
"""

from __future__ import annotations

import json
import os
import re
import sys
import traceback

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=4")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jax_sgrnn  # noqa: E402

TARGETS = jax_sgrnn.backends()["native"].targets
TOLERANCE = {np.dtype(np.float64): 1e-12, np.dtype(np.float32): 1e-5}
T, N, I, H = 4, 8, 3, 4
CHECKS = {}


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


def mesh_1d() -> Mesh:
    return Mesh(np.array(jax.devices()[:4]), ("batch",))


def explicit_mesh() -> Mesh:
    """Four devices along "batch", of ``AxisType.Explicit`` (sharding in types)."""
    from jax.sharding import AxisType

    return jax.make_mesh((4,), ("batch",), axis_types=(AxisType.Explicit,))


def spec_entries(a) -> list:
    """``a``'s PartitionSpec, one entry per axis (a spec may leave trailing axes out)."""
    return [e for e in a.sharding.spec] + [None] * (a.ndim - len(a.sharding.spec))


def mesh_2d() -> Mesh:
    return Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))


def problem(seed=0, *, bidirectional=False, mask_shape=None, dtype=np.float64) -> dict:
    """The op's inputs (every optional present), R scaled so states stay O(1)."""
    rng = np.random.default_rng(seed)
    D = 2 if bidirectional else 1
    inputs = dict(
        source=rng.normal(size=(T, N, I)),
        recurrent_weight=rng.normal(size=(D, H, H) if bidirectional else (H, H)) * 0.5 / H**.5,
        input_weight=rng.normal(size=(D * H, I)) / I**.5,
        bias=rng.normal(size=(D * H,)) * 0.5,
        init_state=rng.normal(size=(N, D * H)))
    inputs = {k: jnp.asarray(v, dtype) for k, v in inputs.items()}
    if mask_shape is not None:
        inputs["mask"] = jnp.asarray(rng.random(mask_shape) < 0.7)
    return inputs


def batch_spec(name: str, batch_axes) -> P:
    """The PartitionSpec that splits ``name``'s batch axis over ``batch_axes``."""
    return {"source": P(None, batch_axes), "init_state": P(batch_axes),
            "mask": P(None, batch_axes), "seq_lengths": P(batch_axes)}.get(name, P())


def put(inputs: dict, mesh: Mesh, specs: dict) -> dict:
    return {k: jax.device_put(v, NamedSharding(mesh, specs.get(k, P())))
            for k, v in inputs.items()}


def loss(flags: dict):
    def f(diff, rest):
        y = jax_sgrnn.single_gate_rnn(**diff, **rest, **flags)
        return jnp.sum(jnp.sin(y) * jnp.arange(y.shape[-1]))
    return f


def split_diff(inputs: dict) -> tuple[dict, dict]:
    """(differentiable inputs, the rest: mask and lengths)."""
    constant = ("mask", "seq_lengths")
    return ({k: v for k, v in inputs.items() if k not in constant},
            {k: v for k, v in inputs.items() if k in constant})


def assert_same(actual, expected, what: str) -> None:
    for (path, a), e in zip(jax.tree_util.tree_leaves_with_path(actual),
                            jax.tree.leaves(expected)):
        e = np.asarray(e)
        tol = TOLERANCE[e.dtype]
        np.testing.assert_allclose(np.asarray(a), e, rtol=tol,
                                   atol=tol * max(1.0, float(np.abs(e).max())),
                                   err_msg=f"{what} {jax.tree_util.keystr(path)}")


def hlo_facts(compiled_text: str) -> dict:
    """What the compiled (partitioned) module communicates, and which custom calls it runs."""
    all_reduces = re.findall(r"^\s*\S+ = (.*?) all-reduce(?:-start)?\(", compiled_text, re.M)
    return dict(
        all_reduce=len(all_reduces), all_reduce_types=all_reduces,
        all_gather=len(re.findall(r" all-gather(?:-start)?\(", compiled_text)),
        all_to_all=len(re.findall(r" all-to-all\(", compiled_text)),
        collective_permute=len(re.findall(r" collective-permute(?:-start)?\(", compiled_text)),
        forward_calls=compiled_text.count(f'custom_call_target="{TARGETS["forward"]}"'),
        gradient_calls=compiled_text.count(f'custom_call_target="{TARGETS["gradients"]}"'))


def compare_grad(inputs: dict, mesh: Mesh, specs: dict, flags: dict) -> dict:
    """jax.grad of a loss w.r.t. every differentiable input: sharded as ``specs`` says vs
    one device; returns the HLO facts of the sharded program."""
    grad = jax.jit(jax.grad(loss(flags)))
    expected = grad(*split_diff(inputs))
    sharded = split_diff(put(inputs, mesh, specs))
    assert_same(grad(*sharded), expected, "grad")
    return hlo_facts(grad.lower(*sharded).compile().as_text())


def batch_sharded(inputs: dict, batch_axes) -> dict:
    return {k: batch_spec(k, batch_axes) for k in inputs}


# ------------------------------------------------------------------------------ checks

@check
def forward_1d():
    """Inference forward, bidirectional with a full mask, N split over 4 devices."""
    flags = dict(bidirectional=True, activation="tanh")
    inputs = problem(1, bidirectional=True, mask_shape=(T, N, 2 * H))
    fwd = jax.jit(lambda a: jax_sgrnn.single_gate_rnn(**a, **flags))
    sharded = put(inputs, mesh_1d(), batch_sharded(inputs, "batch"))
    y = fwd(sharded)
    assert_same(y, fwd(inputs), "y")
    assert y.sharding.spec == P(None, "batch"), y.sharding
    return hlo_facts(fwd.lower(sharded).compile().as_text())


@check
def training_forward_1d():
    """training=True returns (y, z), reverse, N split over 4 devices."""
    flags = dict(reverse=True, training=True, activation="relu")
    inputs = problem(2)
    fwd = jax.jit(lambda a: jax_sgrnn.single_gate_rnn(**a, **flags))
    sharded = put(inputs, mesh_1d(), batch_sharded(inputs, "batch"))
    assert_same(fwd(sharded), fwd(inputs), "(y, z)")
    return hlo_facts(fwd.lower(sharded).compile().as_text())


@check
def grad_1d():
    inputs = problem(3)
    return compare_grad(inputs, mesh_1d(), batch_sharded(inputs, "batch"),
                        dict(activation="tanh"))


@check
def grad_1d_float32():
    inputs = problem(4, dtype=np.float32)
    return compare_grad(inputs, mesh_1d(), batch_sharded(inputs, "batch"),
                        dict(activation="sigmoid"))


@check
def grad_bidirectional_masked_1d():
    inputs = problem(5, bidirectional=True, mask_shape=(T, N, 2 * H))
    return compare_grad(inputs, mesh_1d(), batch_sharded(inputs, "batch"),
                        dict(bidirectional=True, activation="tanh"))


@check
def grad_reverse_batch_broadcast_mask_1d():
    """A mask broadcast along the batch ([T, 1, H]) is replicated, the rest split."""
    inputs = problem(6, mask_shape=(T, 1, H))
    specs = {**batch_sharded(inputs, "batch"), "mask": P()}
    return compare_grad(inputs, mesh_1d(), specs, dict(reverse=True, activation="tanh"))


@check
def grad_2x2_batch_over_both_axes():
    inputs = problem(7, mask_shape=(T, N, H))
    return compare_grad(inputs, mesh_2d(), batch_sharded(inputs, ("a", "b")),
                        dict(activation="tanh"))


@check
def grad_2x2_batch_over_one_axis():
    """N split over "a"; "b" replicates: the weight gradients are summed over "a" only."""
    inputs = problem(8, bidirectional=True)
    return compare_grad(inputs, mesh_2d(), batch_sharded(inputs, "a"),
                        dict(bidirectional=True, activation="tanh"))


@check
def grad_time_sharded():
    """Unsupported shardings (time, hidden features, weights): XLA reshards, still correct."""
    inputs = problem(9)
    specs = {"source": P("batch"), "init_state": P(None, "batch"),
             "recurrent_weight": P(None, "batch"), "input_weight": P("batch")}
    return compare_grad(inputs, mesh_1d(), specs, dict(activation="tanh"))


@check
def grad_time_and_batch_sharded_2x2():
    """x split over time ("a") and batch ("b"): only the time split is undone."""
    inputs = problem(10)
    specs = {"source": P("a", "b"), "init_state": P("b")}
    return compare_grad(inputs, mesh_2d(), specs, dict(activation="tanh"))


@check
def gradient_op_direct():
    """single_gate_rnn_gradients on sharded x, dy, z, h0."""
    flags = dict(bidirectional=True, activation="tanh")
    inputs = problem(11, bidirectional=True, mask_shape=(T, N, 2 * H))
    _, z = jax_sgrnn.single_gate_rnn(**inputs, **flags, training=True)
    dy = jnp.asarray(np.random.default_rng(12).normal(size=z.shape))
    arrays = dict(inputs, source_gradient=dy, z_state=z)
    grads = jax.jit(lambda a: jax_sgrnn.single_gate_rnn_gradients(**a, **flags))
    specs = {**batch_sharded(inputs, "batch"), "source_gradient": P(None, "batch"),
             "z_state": P(None, "batch")}
    sharded = put(arrays, mesh_1d(), specs)
    assert_same(grads(sharded), grads(arrays), "gradient op")
    return hlo_facts(grads.lower(sharded).compile().as_text())


@check
def vmap_per_example_grads():
    """vmap of grad (the gradient primitive's group axis G), the mapped axis split."""
    inputs = problem(13)
    B = 4
    xs = jnp.asarray(np.random.default_rng(14).normal(size=(B, T, N, I)))
    flags = dict(activation="tanh")

    def per_example(x, diff, rest):
        return jax.grad(loss(flags))({**diff, "source": x}, rest)

    diff, rest = split_diff(inputs)
    grad = jax.jit(jax.vmap(per_example, in_axes=(0, None, None)))
    expected = grad(xs, diff, rest)
    mesh = mesh_1d()
    for spec in (P("batch"), P(None, None, "batch")):  # split over the vmapped axis, then N
        sharded = jax.device_put(xs, NamedSharding(mesh, spec))
        assert_same(grad(sharded, diff, rest), expected, f"vmap(grad), x {spec}")
    return hlo_facts(grad.lower(jax.device_put(xs, NamedSharding(mesh, P("batch"))), diff,
                                rest).compile().as_text())


def user_shard_map(f, mesh: Mesh, in_specs, out_specs, check: bool):
    """jax.shard_map (jax >= 0.7) or its experimental predecessor."""
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                             check_vma=check)
    from jax.experimental.shard_map import shard_map
    return shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=check)


@check
def inside_shard_map():
    """The op in a user's shard_map: each device's shard is a whole problem, so the plain
    custom call runs there."""
    inputs = problem(15)
    flags = dict(activation="tanh")
    mesh = mesh_1d()
    specs = batch_sharded(inputs, "batch")
    diff, rest = split_diff(inputs)
    diff_specs = {k: specs[k] for k in diff}

    forward = jax.jit(user_shard_map(lambda a: jax_sgrnn.single_gate_rnn(**a, **rest, **flags),
                                     mesh, (diff_specs,), P(None, "batch"), check=True))
    assert_same(forward(put(diff, mesh, specs)),
                jax.jit(lambda a: jax_sgrnn.single_gate_rnn(**a, **flags))(inputs),
                "shard_map forward")

    expected = jax.jit(jax.grad(loss(flags)))(diff, rest)
    sharded = put(diff, mesh, specs)

    # check_vma on (the default): the weights enter the op unvarying, so JAX itself sums
    # their gradients over the devices, as for its own ops.
    checked = jax.jit(user_shard_map(lambda d: jax.grad(loss(flags))(d, rest), mesh,
                                     (diff_specs,), diff_specs, check=True))
    assert_same(checked(sharded), expected, "shard_map grad, check_vma on")

    # check_vma off: nothing is typed as varying, so the user sums the weight gradients.
    def local_grads(diff):
        g = jax.grad(loss(flags))(diff, rest)
        return {k: v if k in ("source", "init_state") else jax.lax.psum(v, "batch")
                for k, v in g.items()}

    unchecked = jax.jit(user_shard_map(local_grads, mesh, (diff_specs,), diff_specs,
                                       check=False))
    assert_same(unchecked(sharded), expected, "shard_map grad, check_vma off")
    return dict(checked=hlo_facts(checked.lower(sharded).compile().as_text()),
                unchecked=hlo_facts(unchecked.lower(sharded).compile().as_text()))


@check
def grad_with_seq_lengths_1d():
    """Per-row lengths split with the batch."""
    inputs = {**problem(17, bidirectional=True),
              "seq_lengths": jnp.array([4, 0, 1, 3, 2, 4, 4, 1], jnp.int32)}
    return compare_grad(inputs, mesh_1d(), batch_sharded(inputs, "batch"),
                        dict(bidirectional=True, activation="tanh"))


@check
def grad_1d_gspmd():
    """The same with the GSPMD partitioner (Shardy off)."""
    if not hasattr(jax.config, "jax_use_shardy_partitioner"):
        return {"skipped": "this jax has no GSPMD partitioner"}
    jax.config.update("jax_use_shardy_partitioner", False)
    try:
        inputs = problem(16)
        return compare_grad(inputs, mesh_1d(), batch_sharded(inputs, "batch"),
                            dict(activation="tanh"))
    finally:
        jax.config.update("jax_use_shardy_partitioner", True)


def _explicit(specs_by_name: dict, backend: str, bidirectional: bool) -> dict:
    """Under explicit sharding (``AxisType.Explicit``, ``jax.set_mesh``): the op's forward,
    jax.grad of the op and of the reference, and a Hessian through the op, each equal to the
    same call on one device; y keeps the source's batch sharding."""
    mesh = explicit_mesh()
    inputs = {**problem(18, bidirectional=bidirectional, mask_shape=(T, N, 1)),
              "seq_lengths": jnp.array([4, 0, 1, 3, 2, 4, 4, 1], jnp.int32)}
    flags = dict(bidirectional=bidirectional, activation="tanh")
    diff, rest = split_diff(inputs)
    forward = lambda diff, rest: jax_sgrnn.single_gate_rnn(**diff, **rest, **flags)
    hessian = lambda R, diff, rest: jax.hessian(
        lambda R: loss(flags)({**diff, "recurrent_weight": R}, rest))(R)
    reference_grad = jax.grad(lambda diff, rest: jnp.sum(
        jnp.sin(jax_sgrnn.reference(**diff, **rest, **flags))))
    programs = dict(forward=forward, grad=jax.grad(loss(flags)), reference_grad=reference_grad)
    with jax_sgrnn.cpu_backend(backend):
        expected = {k: jax.jit(f)(diff, rest) for k, f in programs.items()}
        expected["hessian"] = jax.jit(hessian)(diff["recurrent_weight"], diff, rest)
        with jax.set_mesh(mesh):
            sharded = {k: jax.device_put(v, NamedSharding(mesh, specs_by_name.get(k, P())))
                       for k, v in inputs.items()}
            sdiff, srest = split_diff(sharded)
            got = {k: jax.jit(f)(sdiff, srest) for k, f in programs.items()}
            got["hessian"] = jax.jit(hessian)(sdiff["recurrent_weight"], sdiff, srest)
    for name in expected:
        assert_same(got[name], expected[name], name)
    return dict(y_spec=spec_entries(got["forward"]), source_spec=spec_entries(sharded["source"]))


@check
def explicit_batch_sharded():
    return _explicit(batch_sharded(problem(0), "batch") | {"seq_lengths": P("batch")},
                     "native", bidirectional=False)


@check
def explicit_batch_sharded_bidirectional_scan():
    return _explicit(batch_sharded(problem(0), "batch") | {"seq_lengths": P("batch")},
                     "scan", bidirectional=True)


@check
def explicit_batch_sharded_gpu_form():
    """The reference's GPU loops (``gpu_form``: a bidirectional call's two directions in one
    scan) under explicit batch sharding: the forward and the gradient op equal to one
    device's, y sharded by batch."""
    mesh = explicit_mesh()
    inputs = problem(20, bidirectional=True, mask_shape=(T, N, 2 * H))
    flags = dict(bidirectional=True, activation="tanh", gpu_form=True, unroll=2)
    forward = jax.jit(lambda i: jax_sgrnn.reference(**i, training=True, **flags))
    gradients = jax.jit(lambda i, dy, z: jax_sgrnn.reference_gradients(
        **i, source_gradient=dy, z_state=z, **flags))
    y, z = forward(inputs)
    dy = jnp.asarray(np.random.default_rng(21).normal(size=y.shape))
    expected = dict(forward=(y, z), gradients=gradients(inputs, dy, z))
    with jax.set_mesh(mesh):
        sharded = put(inputs, mesh, batch_sharded(inputs, "batch"))
        sequence = NamedSharding(mesh, batch_spec("source", "batch"))
        got = dict(forward=forward(sharded))
        got["gradients"] = gradients(sharded, jax.device_put(dy, sequence),
                                     jax.device_put(z, sequence))
    for name in expected:
        assert_same(got[name], expected[name], name)
    return dict(y_spec=spec_entries(got["forward"][0]))


@check
def explicit_time_sharded():
    return _explicit({"source": P("batch")}, "native", bidirectional=False)


@check
def export_several_devices():
    """jax.export of a batch-sharded training step: serialises, and the deserialised program
    gives the one-device gradients (the op lowers to the decomposition there)."""
    from jax import export

    mesh = mesh_1d()
    inputs = {**problem(19, mask_shape=(T, N, 1)),
              "seq_lengths": jnp.array([4, 0, 1, 3, 2, 4, 4, 1], jnp.int32)}
    flags = dict(activation="tanh")
    grad = jax.jit(jax.grad(loss(flags)))
    expected = grad(*split_diff(inputs))
    sharded = split_diff(put(inputs, mesh, batch_sharded(inputs, "batch")))
    exported = export.export(grad, disabled_checks=jax_sgrnn.export_safety_checks())(*sharded)
    restored = export.deserialize(exported.serialize())
    assert_same(restored.call(*sharded), expected, "exported grad")
    module = exported.mlir_module()
    return dict(devices=exported.nr_devices,
                custom_calls=sum(module.count(t) for t in TARGETS.values()))


def main() -> dict:
    if len(jax.devices()) < 4:
        return {"skip": f"got {len(jax.devices())} devices of {jax.default_backend()}, not 4"}
    if not jax_sgrnn.backends()["native"].available:
        return {"skip": "the native CPU handler did not load, so no custom call is emitted"}
    jax_sgrnn.set_cpu_backend("native")
    names = sys.argv[1:] or CHECKS
    results = {}
    for name in names:
        try:
            results[name] = CHECKS[name]()
        except Exception:  # noqa: BLE001 - reported to the test that owns the check
            results[name] = {"error": traceback.format_exc()}
    return results


if __name__ == "__main__":
    print(json.dumps(main()))
