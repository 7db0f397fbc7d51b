"""The table of native backends, the loader that fills it in, and the choice of backend.

Each :class:`Backend` says once what the rest of the package needs to know about a handler:
its platform, its extension module, its FFI target names (from the C++ table
``csrc/sgrnn/targets.h`` via the native module, checked against the module's own
``registrations()``), which dtypes it runs as they are, which it widens to float32 and which it
hands to another backend, and whether it is available in this process (and if not, why).

On the ``cuda`` platform the ``cuda`` handler runs the recurrence whenever the package was built
with it (the lowering applies the input weight and the bias, and the weight gradients, with
XLA's matrix products), for hidden sizes whose R fits on chip; other sizes lower to the
decomposition. On the ``cpu`` platform two handlers can serve a call: ``native`` (C++ and a BLAS) and ``mps``
(MPSGraph on the Apple GPU over unified memory). ``set_cpu_backend`` chooses; the choice is
part of JAX's jit key, and the backend chosen for a call is part of the primitives' static
config (``OpConfig.backends``), so a lowering never guesses.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import importlib
import importlib.util
import os
import sys
import threading
import warnings
from types import MappingProxyType
from typing import Callable, Mapping, Optional

import jax
import numpy as np
from jax._src import config as jax_config  # enum_state: a jit-keyed, env-backed option

from ._spec import known_sizes

__all__ = ["Backend", "backends", "cpu_backend", "cuda_handler", "export_safety_checks",
           "get_cpu_backend", "mps_self_check", "set_cpu_backend", "use_cuda_handler"]


@dataclasses.dataclass(frozen=True)
class Backend:
    """One native handler of the op, and its state in this process.

    Attributes:
      name: ``"native"``, ``"mps"`` or ``"cuda"``.
      platform: the XLA platform its FFI targets are registered for.
      module: its extension module inside ``jax_sgrnn`` (for ``cuda``, else inside the plugin
        package ``jax_sgrnn_cuda13``).
      native_dtypes: dtypes it computes in as they are.
      widened_dtypes: dtypes computed in float32 around the custom call (stored back).
      handoff: dtype -> the backend that runs calls of that dtype instead.
      seq_lengths: whether its handler takes per-row sequence lengths; a call with lengths
        lowers to the ``lax.scan`` decomposition on a backend that does not.
      available: whether its handlers are registered here, so that programs using it can be
        lowered (and exported) in this process. Whether they can also run here is
        :attr:`runs_here`: a CUDA build lowers for ``cuda`` on a machine without a GPU.
      reason: why not, when not available.
      device: the device it runs on, where that is not the host CPU (the Metal GPU's name).
      targets: ``"forward"`` / ``"gradients"`` -> FFI target name.
      recurrence_only: its handler takes the projected source; the lowering applies the input
        weight and bias and computes dW, db and dx with XLA around it.
      runs_on_chip: ``(steps, hidden, batch, directions, itemsize, gradients) -> bool``:
        whether its handler runs (and pays at) those sizes on this process's devices; a call
        that does not lowers to the decomposition. None: every size.
      self_check: ``mps`` only: the verdict of the check of MPSGraph against this package's
        semantics (:func:`mps_self_check`): ``"not run"``, ``"passed"``, ``"failed: <fact>
        ..."`` (with the worst error seen), or ``"off"`` (``JAX_SGRNN_MPS_SELF_CHECK=0``).
        None for the other backends.
    """

    name: str
    platform: str
    module: str
    native_dtypes: tuple[str, ...]
    widened_dtypes: tuple[str, ...]
    handoff: Mapping[str, str] = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    seq_lengths: bool = False
    available: bool = False
    reason: Optional[str] = None
    device: Optional[str] = None
    targets: Mapping[str, str] = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    recurrence_only: bool = False
    runs_on_chip: Optional[Callable[[int, int, int, int, int, bool], bool]] = None
    self_check: Optional[str] = None

    def runs(self, steps: int, hidden: int, batch: int, directions: int, dtype,
             gradients: bool) -> bool:
        """Whether its handler runs a call of these sizes in ``dtype`` (the forward, or with
        ``gradients`` the gradient op). A symbolic size (shape-polymorphic export) runs where
        the handler runs every size; else the decomposition, which is right for any value."""
        if self.runs_on_chip is None:
            return True
        if not known_sizes(steps, hidden, batch):
            return False
        return self.runs_on_chip(steps, hidden, batch, directions,
                                 self.compute_dtype(dtype).itemsize, gradients)

    @property
    def runs_here(self) -> bool:
        """Whether its handler can also run in this process: it is available and this process
        has a device of its platform that runs it (a Metal device for ``mps``; for ``cuda`` an
        NVIDIA GPU of compute capability 9.0 or later). Asks JAX for the platform's devices the
        first time, so it starts that backend; importing the package does not."""
        if not self.available:
            return False
        if self.platform == "cpu":
            return True
        return _has_devices(self.platform) and cuda_devices_run_handler()

    def compute_dtype(self, dtype) -> np.dtype:
        """The dtype the custom call computes in for inputs of ``dtype``."""
        dtype = np.dtype(dtype)
        if dtype.name in self.native_dtypes:
            return dtype
        if dtype.name in self.widened_dtypes:
            return np.dtype(np.float32)
        raise ValueError(f"jax_sgrnn: the {self.name!r} backend does not run {dtype.name}")


# The static part of the table; the loader fills in availability, device and targets.
_SPECS = (
    Backend("native", "cpu", "_sgrnn_cpu", native_dtypes=("float32", "float64"),
            widened_dtypes=("float16", "bfloat16"), seq_lengths=True),
    # Metal has no float64; bfloat16 needs macOS 14 in MPSGraph, so it is widened everywhere.
    # MPSGraph's op has no per-row lengths.
    Backend("mps", "cpu", "_sgrnn_mps", native_dtypes=("float32", "float16"),
            widened_dtypes=("bfloat16",), handoff=MappingProxyType({"float64": "native"}),
            self_check="not run"),
    # NVIDIA GPUs: float32 and float64 as they are; half precisions accumulate in float32.
    Backend("cuda", "cuda", "_sgrnn_cuda", native_dtypes=("float32", "float64"),
            widened_dtypes=("float16", "bfloat16"), seq_lengths=True, recurrence_only=True),
)


# The platform names jax.ffi.register_ffi_target takes where they differ from the lowering's:
# the CUDA plugin registers its handler table under "CUDA".
_REGISTRATION_PLATFORM = {"cuda": "CUDA"}


def _preload_openblas() -> None:
    """Loads scipy-openblas32 by path, so the native module finds it wherever pip put it (the
    module's rpath covers only a shared site-packages). macOS uses Accelerate instead."""
    if sys.platform == "darwin":
        return
    import scipy_openblas32

    ctypes.CDLL(os.path.join(scipy_openblas32.get_lib_dir(),
                             scipy_openblas32.get_library(True)), mode=ctypes.RTLD_GLOBAL)


# The wheel that carries the CUDA handler when this package's own build has none
# (plugins/cuda13, the jax-sgrnn[cuda13] extra).
_CUDA_PLUGIN = "jax_sgrnn_cuda13"


def _import(module: str):
    """The extension module, or the reason it cannot be imported."""
    if module == "_sgrnn_mps" and sys.platform != "darwin":
        return None, "built on macOS only (MPSGraph runs on Apple GPUs)"
    if module == "_sgrnn_cuda" and sys.platform == "darwin":
        return None, "not built on macOS (no CUDA)"
    try:
        return importlib.import_module(f"{__package__}.{module}"), None
    except ImportError as err:  # e.g. a source tree that was never built
        reason = f"its extension module did not import ({err})"
    if module == "_sgrnn_cuda" and importlib.util.find_spec(_CUDA_PLUGIN) is not None:
        return _import_cuda_plugin()
    return None, reason


def _import_cuda_plugin():
    """The CUDA handler from the plugin wheel, if it is of this release (its attributes and
    targets must match this package's lowering)."""
    from importlib.metadata import version

    plugin = importlib.import_module(_CUDA_PLUGIN)
    ours = version("jax-sgrnn")
    if plugin.__version__ != ours:
        return None, (f"{_CUDA_PLUGIN} {plugin.__version__} does not match jax-sgrnn {ours}; "
                      f'install the matching one: pip install "jax-sgrnn[cuda13]=={ours}"')
    try:
        return importlib.import_module(f"{_CUDA_PLUGIN}._sgrnn_cuda"), None
    except ImportError as err:
        return None, f"the extension module of {_CUDA_PLUGIN} did not import ({err})"


def _runs_on_these_gpus(runs_on_chip: Callable[..., bool], steps: int, hidden: int,
                        batch: int, directions: int, itemsize: int, gradients: bool) -> bool:
    """A CUDA build's ``runs_on_chip``: its kernels run these sizes, on GPUs that can run them. The
    forward and the gradient kernel share one plan, so ``gradients`` does not change it."""
    del gradients
    return (runs_on_chip(steps, hidden, batch, directions, itemsize)
            and cuda_devices_run_handler())


def _load() -> dict[str, Backend]:
    """Imports every backend's module and registers its targets, once."""
    _preload_openblas()
    native, why_native = _import("_sgrnn_cpu")
    if native is None:
        warnings.warn(f"jax_sgrnn: native CPU handler unavailable ({why_native}); the op "
                      "falls back to its lax.scan decomposition on CPU", RuntimeWarning,
                      stacklevel=3)
        return {s.name: dataclasses.replace(s, reason=why_native if s.name == "native" else
                                            "the native module, which names every backend's "
                                            "targets, did not import")
                for s in _SPECS}
    names = native.target_names()
    missing_handlers = native.missing_backend_handlers()
    table = {}
    for spec in _SPECS:
        targets = MappingProxyType(dict(names[spec.name]))
        module, reason = (native, None) if spec.module == "_sgrnn_cpu" else _import(spec.module)
        if module is None and spec.platform != "cpu":  # the decomposition runs instead
            table[spec.name] = dataclasses.replace(spec, reason=reason, targets=targets)
            continue
        if module is None:
            # Lowering for this backend stays possible (set_cpu_backend); running fails clearly.
            for target, capsule in zip(targets.values(), missing_handlers[spec.name]):
                jax.ffi.register_ffi_target(target, capsule, platform=spec.platform)
            table[spec.name] = dataclasses.replace(spec, reason=reason, targets=targets)
            continue
        registrations = module.registrations()
        if set(registrations) != set(targets.values()):
            raise RuntimeError(f"jax_sgrnn: {spec.module} registers {sorted(registrations)}, "
                               f"the target table says {sorted(targets.values())}: the "
                               "extension modules come from different builds; reinstall")
        for target, capsule in registrations.items():
            jax.ffi.register_ffi_target(
                target, capsule, platform=_REGISTRATION_PLATFORM.get(spec.platform, spec.platform))
        device = module.device_name() if hasattr(module, "device_name") else None
        runs_on_chip = getattr(module, "runs_on_chip", None)
        if runs_on_chip is not None:  # its kernels need GPUs that can run them, too
            runs_on_chip = functools.partial(_runs_on_these_gpus, runs_on_chip)
        if device == "":
            table[spec.name] = dataclasses.replace(
                spec, targets=targets, reason="no Metal device is visible to this process")
        else:  # a CUDA build is available wherever it imports: lowering needs no GPU
            table[spec.name] = dataclasses.replace(spec, available=True, device=device,
                                                   targets=targets,
                                                   runs_on_chip=runs_on_chip)
    return table


_TABLE: dict[str, Backend] = _load()


def backends() -> dict[str, Backend]:
    """Every native backend this package knows, with whether it is available here and why
    not (for users choosing one, and for bug reports)."""
    return dict(_TABLE)


# ---------------------------------------------------------------- choosing the cpu handler

CPU_BACKEND_CHOICES = ("auto", "native", "mps", "scan")
_ENV_VAR = "JAX_SGRNN_CPU_BACKEND"


def _check_choice(name, where: str) -> str:
    if name not in CPU_BACKEND_CHOICES:
        raise ValueError(f"{where}: expected one of {', '.join(map(repr, CPU_BACKEND_CHOICES))}, "
                         f"got {name!r}")
    return name


_check_choice(os.environ.get(_ENV_VAR, "auto"), _ENV_VAR)
# A JAX config option: its value is part of the jit cache key, so a function traced under one
# choice is traced again under another; its default comes from JAX_SGRNN_CPU_BACKEND.
_cpu_backend = jax_config.enum_state(
    name=_ENV_VAR.lower(), enum_values=list(CPU_BACKEND_CHOICES), default="auto",
    help="Which handler runs jax_sgrnn's ops on the cpu platform: auto, native, mps or scan.",
    include_in_jit_key=True, include_in_trace_context=True)


def get_cpu_backend() -> str:
    """The current choice for the ``cpu`` platform: one of ``CPU_BACKEND_CHOICES``."""
    return _cpu_backend.value


def set_cpu_backend(name: str) -> "_ProcessWideSetting":
    """Chooses which handler runs the ops on the ``cpu`` platform, process-wide, from now on
    (as ``jax.config.update`` does; :func:`cpu_backend` chooses for one block in one thread).

    ``"auto"`` (the default, or ``$JAX_SGRNN_CPU_BACKEND``): MPSGraph when its extension loaded,
    a Metal device exists and its self-check passed (:func:`mps_self_check`, run the first time
    a call would go to MPSGraph), else native. ``"native"``: the C++ handler. ``"mps"``: the
    MPSGraph handler, even when its self-check failed (with a warning naming the fact); this
    lowers on any OS (only the FFI targets change), and running it where the handler is not
    available fails with an error naming the backend. float64 always runs on
    the native handler (Metal has no float64). ``"scan"``: no handler, the ``lax.scan``
    decomposition that other platforms run.

    The choice is read when a function is traced and is part of ``jax.jit``'s cache key. Like
    any process-wide JAX setting, change it while no other thread is tracing.
    """
    return _set_process_wide(_cpu_backend, _check_choice(name, "set_cpu_backend"),
                             "set_cpu_backend", "cpu_backend")


def cpu_backend(name: str) -> contextlib.AbstractContextManager[None]:
    """``with jax_sgrnn.cpu_backend(name): ...`` chooses the ``cpu`` handler (the names of
    :func:`set_cpu_backend`) inside the block, in the calling thread only, as JAX's own config
    context managers do: other threads, and functions they trace meanwhile, keep theirs."""
    return _cpu_backend(_check_choice(name, "cpu_backend"))


class _ProcessWideSetting:
    """What the process-wide setters return. Entering it is a mistake the old API invited (a
    ``with`` block that changed the choice for every thread): it undoes the setting and says
    which context manager scopes a choice to a block."""

    def __init__(self, option, previous, value, setter: str, scoped: str):
        self._option, self._previous, self._value = option, previous, value
        self._setter, self._scoped = setter, scoped

    def __enter__(self):
        if self._option.value == self._value:
            jax.config.update(self._option.name, self._previous)
        raise TypeError(f"{self._setter}(...) sets the process-wide choice and is not a context "
                        f"manager (it was undone): for a choice inside a `with` block, in this "
                        f"thread only, use `with jax_sgrnn.{self._scoped}({self._value!r}):`")

    def __exit__(self, *exc):
        return False

    def __repr__(self) -> str:  # what an interactive session echoes after the call
        return f"<{self._setter}({self._value!r}): set process-wide>"


def _set_process_wide(option, value, setter: str, scoped: str) -> "_ProcessWideSetting":
    previous = option.value
    jax.config.update(option.name, value)
    return _ProcessWideSetting(option, previous, value, setter, scoped)


# Whether the cuda platform uses the CUDA handler (when built); off: the decomposition, to
# compare the two or to rule the handler out. Part of the jit key, like the cpu choice.
_cuda_handler = jax_config.bool_state(
    name="jax_sgrnn_cuda_handler", default=True,
    help="Whether jax_sgrnn's ops run the CUDA handler on NVIDIA GPUs (else lax.scan).",
    include_in_jit_key=True, include_in_trace_context=True)


def _check_on(on, where: str) -> bool:
    if not isinstance(on, (bool, np.bool_)):  # bool("false") is True
        raise TypeError(f"{where}: expected True or False, got {on!r}")
    return bool(on)


def use_cuda_handler(on: bool) -> "_ProcessWideSetting":
    """Turns the CUDA handler on (the default where the package was built with it) or off
    (the ``lax.scan`` decomposition runs on NVIDIA GPUs instead), process-wide, from now on;
    :func:`cuda_handler` does it for one block in one thread."""
    return _set_process_wide(_cuda_handler, _check_on(on, "use_cuda_handler"),
                             "use_cuda_handler", "cuda_handler")


def cuda_handler(on: bool) -> contextlib.AbstractContextManager[None]:
    """``with jax_sgrnn.cuda_handler(False): ...`` turns the CUDA handler off (or on) inside the
    block, in the calling thread only."""
    return _cuda_handler(_check_on(on, "cuda_handler"))


@functools.cache
def _has_devices(platform: str) -> bool:
    try:
        return bool(jax.devices(platform))
    except RuntimeError:  # no such backend in this process
        return False


def export_safety_checks() -> list:
    """The ``disabled_checks`` that ``jax.export.export`` needs for a program that calls this
    package's handlers: one ``DisabledSafetyCheck.custom_call`` per FFI target of every backend.
    JAX refuses by default to serialise custom calls whose ABI it does not guarantee; these
    targets are this package's, so an exported program runs where a build of the same
    jax_sgrnn version is installed (and imported before the program is called)."""
    from jax import export

    return [export.DisabledSafetyCheck.custom_call(target)
            for backend in _TABLE.values() for target in backend.targets.values()]


#: The CUDA handler's kernels use thread-block clusters (CMakeLists.txt builds sm_90 code).
CUDA_MIN_COMPUTE_CAPABILITY = (9, 0)


@functools.cache
def cuda_devices_run_handler() -> bool:
    """Whether this process's NVIDIA GPUs, if it has any, can run the CUDA handler's kernels
    (compute capability 9.0 or later: they use thread-block clusters). With no GPU (lowering
    for ``cuda`` on another machine) it answers True. Asked at lowering time, not at import,
    so that importing the package does not start JAX's backends."""
    try:
        devices = jax.devices("cuda")
    except RuntimeError:  # no CUDA backend in this process
        return True
    return all(tuple(map(int, d.compute_capability.split("."))) >= CUDA_MIN_COMPUTE_CAPABILITY
               for d in devices)


def backends_for(dtype, seq_lengths: bool = False) -> tuple[str, ...]:
    """The backends a call with inputs of ``dtype`` (and per-row lengths, if ``seq_lengths``)
    lowers to, at most one per platform; platforms not named lower to the ``lax.scan``
    decomposition."""
    gpu = ("cuda",) if _TABLE["cuda"].available and _cuda_handler.value else ()
    return _cpu_backend_for(dtype, seq_lengths) + gpu


def _cpu_backend_for(dtype, seq_lengths: bool) -> tuple[str, ...]:
    choice = get_cpu_backend()
    if choice == "scan":
        return ()
    automatic = choice == "auto"
    if automatic:
        choice = next((n for n in ("mps", "native") if _TABLE[n].available), None)
        if choice is None:
            return ()
    backend, name = _TABLE[choice], np.dtype(dtype).name
    while name in backend.handoff:
        backend = _TABLE[backend.handoff[name]]
    if not backend.targets:  # only when the native module itself is missing
        raise RuntimeError(f"jax_sgrnn: the {backend.name!r} backend was chosen but cannot even "
                           f"be lowered here: {backend.reason}")
    if seq_lengths and not backend.seq_lengths:
        return ()
    if backend.name == "mps" and backend.available and not _mps_trusted(automatic):
        return ("native",) if automatic else ("mps",)
    return (backend.name,)


# ---------------------------------------------------------------- MPSGraph's self-check

_SELF_CHECK_ENV = "JAX_SGRNN_MPS_SELF_CHECK"
if os.environ.get(_SELF_CHECK_ENV, "1") not in ("0", "1"):
    raise ValueError(f"{_SELF_CHECK_ENV}: expected '1' (run MPSGraph's self-check, the default) or "
                     f"'0' (skip it), got {os.environ[_SELF_CHECK_ENV]!r}")

_self_check_lock = threading.Lock()
_self_check_report: Optional[dict] = None
_self_check_warned: set[bool] = set()  # automatic or not: one warning each per process


def _run_mps_self_check() -> dict:
    """The MPSGraph extension's self-check report (replaced by tests on machines without it)."""
    return importlib.import_module(f"{__package__}._sgrnn_mps").self_check()


def mps_self_check(rerun: bool = False) -> dict:
    """Checks MPSGraph's single-gate RNN on this machine against this package's semantics.

    Tiny problems (a few steps, rows and units; float32 and float16) that between them exercise
    each fact of ``docs/semantics.md`` that is our reading of MPSGraph's undocumented behaviour
    (reverse time order, the bidirectional layout, the mask not flipped, the activation honoured,
    the bias gradient's shape), every activation and every optional input, through the MPSGraph
    handler (forward, z and the gradient op), each compared in C++ with a scalar computation in
    double. ``"auto"`` runs it once per process before it first picks MPSGraph; this runs it
    on demand (again with ``rerun``), whatever ``JAX_SGRNN_MPS_SELF_CHECK`` says.

    Returns the report: ``passed``, ``failed_fact`` (the first fact that failed, or None),
    ``problems``, ``seconds``, and ``facts``: for each fact its ``status`` ("passed",
    "failed" or "not checked", when a fact it builds on failed), ``statement``,
    ``worst_error`` and ``tolerance`` (relative to the output's largest magnitude, at least 1),
    ``where`` (the problem, output and element of the worst error) and ``comparisons``.

    Raises:
      RuntimeError: the ``mps`` backend is not available here (its ``reason`` says why).
    """
    global _self_check_report
    backend = _TABLE["mps"]
    if not backend.available:
        raise RuntimeError(f"jax_sgrnn: MPSGraph's self-check cannot run here: the 'mps' backend "
                           f"is not available ({backend.reason})")
    with _self_check_lock:
        if _self_check_report is None or rerun:
            report = _run_mps_self_check()
            _self_check_report = report
            _TABLE["mps"] = dataclasses.replace(_TABLE["mps"],
                                                self_check=_self_check_verdict(report))
        return _self_check_report


def _self_check_verdict(report: dict) -> str:
    """``Backend.self_check`` of a report: "passed" or the first failed fact, with its worst
    error."""
    seconds = f"{report['problems']} problems, {report['seconds']:.3g} s"
    fact = report["failed_fact"]
    if fact is None:
        return f"passed ({seconds})"
    facts = report["facts"][fact]
    return (f"failed: {fact} (worst error {facts['worst_error']:.3g}, tolerance "
            f"{facts['tolerance']:.3g}; {facts['where']}; {seconds})")


def _mps_trusted(automatic: bool) -> bool:
    """Whether calls may be routed to MPSGraph: its self-check passed (run now, the first time)
    or is turned off. On a failure, warns once per kind of choice (``automatic`` or
    ``set_cpu_backend("mps")``)."""
    if os.environ.get(_SELF_CHECK_ENV, "1") == "0":
        if _TABLE["mps"].self_check == "not run":
            _TABLE["mps"] = dataclasses.replace(
                _TABLE["mps"], self_check=f"off ({_SELF_CHECK_ENV}=0: the user vouches for "
                                          "MPSGraph on this machine)")
        return True
    report = mps_self_check()
    if report["passed"]:
        return True
    with _self_check_lock:
        if automatic in _self_check_warned:
            return False
        _self_check_warned.add(automatic)
    facts = report["facts"][report["failed_fact"]]
    action = ("The 'auto' CPU backend uses the native C++ handler instead." if automatic else
              "set_cpu_backend('mps') asked for it, so MPSGraph still runs: its results may be "
              "wrong.")
    warnings.warn(
        f"jax_sgrnn: MPSGraph's single-gate RNN on this machine disagrees with jax_sgrnn's "
        f"semantics: self-check fact {report['failed_fact']!r} failed ({facts['statement']}; "
        f"worst error {facts['worst_error']:.3g} against a tolerance of "
        f"{facts['tolerance']:.3g}: {facts['where']}). {action} Please report it to the "
        f"jax-sgrnn issue tracker with the output of jax_sgrnn.mps_self_check() and "
        f"jax_sgrnn.backends()['mps'], your macOS version and chip.",
        RuntimeWarning, stacklevel=2)
    return False


def backend_for_platform(names: tuple[str, ...], platform: str) -> Optional[Backend]:
    """The entry among ``names`` registered for ``platform``, if any."""
    return next((_TABLE[n] for n in names if _TABLE[n].platform == platform), None)


def platforms() -> tuple[str, ...]:
    """The platforms some backend registers for (each gets a lowering rule)."""
    return tuple(dict.fromkeys(s.platform for s in _SPECS))
