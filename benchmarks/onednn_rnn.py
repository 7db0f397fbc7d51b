"""oneDNN's `vanilla_rnn` primitive as a benchmark peer, through its C API (ctypes).

Optional: `pip install onednn` (Intel's build, SYCL runtime over TBB) puts `libdnnl.so` under the
environment's `lib/`; `ONEDNN_LIBRARY=/path/to/libdnnl.so` picks another build. Nothing here is
compiled, so any oneDNN 3.x library works without its headers.

The peer runs the problem `bench_cpu.problem()` builds: one layer, one direction, the given
activation, with bias and initial state, float32. The forward is oneDNN's inference forward; the
forward+backward is its training forward (which fills the workspace) then its backward, every
gradient written (not accumulated). Weights are reordered into the layouts each primitive
prefers once, at set-up, and the weight gradients are left in oneDNN's layout: a training loop
would pay those reorders on every step, so the timings favour oneDNN.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import pathlib
import re
import sys

import numpy as np

# oneDNN 3.x C API values (oneapi/dnnl/dnnl_types.h, dnnl_common_types.h); the ABI keeps them
# within a major version, which load_library checks.
_F32 = 3
_TAG_ANY, _TNC, _LDNC, _LDIGO = 1, 4, 5, 6  # ldnc is also ldgo (the bias): both abcd
_FORWARD_TRAINING, _FORWARD_INFERENCE, _BACKWARD = 64, 96, 128
_ACTIVATIONS = {"tanh": 33, "relu": 32}
_LEFT2RIGHT = 1
_DIFF_WEIGHTS_OVERWRITE = 0x1
_QUERY_IMPL_INFO_STR, _QUERY_EXEC_ARG_MD = 8, 255
_ENGINE_CPU, _STREAM_DEFAULT = 1, 1
_ARG = dict(src_layer=1, src_iter=2, dst_layer=17, weights_layer=33, weights_iter=34, bias=41,
            workspace=64, diff_src_layer=129, diff_src_iter=130, diff_dst_layer=145,
            diff_weights_layer=161, diff_weights_iter=162, diff_bias=169, from_=1, to=17)
_MEMORY_ALLOCATE = ctypes.c_void_p(2 ** 64 - 1)

_Dims = ctypes.c_int64 * 12


class _ExecArg(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_int), ("memory", ctypes.c_void_p)]


class _Version(ctypes.Structure):
    _fields_ = [("major", ctypes.c_int), ("minor", ctypes.c_int), ("patch", ctypes.c_int),
                ("hash", ctypes.c_char_p), ("cpu_runtime", ctypes.c_uint),
                ("gpu_runtime", ctypes.c_uint)]


def library_path() -> pathlib.Path | None:
    """Where libdnnl is: $ONEDNN_LIBRARY, this environment's lib/ (`pip install onednn`), or
    the system's loader path; None where none is found."""
    if os.environ.get("ONEDNN_LIBRARY"):
        return pathlib.Path(os.environ["ONEDNN_LIBRARY"])
    for name in ("libdnnl.so.3", "libdnnl.so", "libdnnl.3.dylib", "libdnnl.dylib"):
        path = pathlib.Path(sys.prefix) / "lib" / name
        if path.exists():
            return path
    found = ctypes.util.find_library("dnnl")
    return pathlib.Path(found) if found else None


def _load_with_neighbours(path: pathlib.Path) -> ctypes.CDLL:
    """Loads a shared library, first loading the libraries it needs from its own folder (a pip
    install puts TBB and the compiler runtime beside libdnnl, outside the loader's path)."""
    while True:
        try:
            return ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
        except OSError as err:
            missing = re.match(r"([^:\s]+): cannot open shared object file", str(err))
            beside = path.parent / missing.group(1) if missing else None
            if beside is None or not beside.exists():
                raise
            _load_with_neighbours(beside)


def load_library(path: pathlib.Path) -> ctypes.CDLL:
    """libdnnl at `path`, its functions' return types declared; oneDNN 3.x only."""
    icd = path.parent / "libintelocl.so"
    if icd.exists() and "OCL_ICD_FILENAMES" not in os.environ:
        # Intel's pip build runs its CPU engine through SYCL, on the OpenCL CPU device that
        # intel-opencl-rt puts beside it, where the ICD loader does not look by itself.
        os.environ["OCL_ICD_FILENAMES"] = str(icd)
    lib = _load_with_neighbours(path)
    lib.dnnl_version.restype = ctypes.POINTER(_Version)
    lib.dnnl_primitive_desc_query_md.restype = ctypes.c_void_p
    lib.dnnl_primitive_desc_query_md.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    major = lib.dnnl_version().contents.major
    if major != 3:
        raise OSError(f"{path}: oneDNN {major}.x; this peer speaks oneDNN 3.x's C API")
    return lib


_RUNTIMES = {0: "none", 1: "sequential", 2: "OpenMP", 4: "TBB", 8: "threadpool", 512: "SYCL"}


def version(lib: ctypes.CDLL) -> str:
    """oneDNN's version and CPU threading runtime, e.g. "3.13.1 (OpenMP)"."""
    v = lib.dnnl_version().contents
    return f"{v.major}.{v.minor}.{v.patch} ({_RUNTIMES.get(v.cpu_runtime, v.cpu_runtime)})"


class OneDnnRnn:
    """oneDNN's vanilla RNN on one problem: `forward()` and `forward_backward()` run it and
    wait; `y()` and `gradients()` read what the last calls wrote, for checking.

    x [T, N, I], R [H, H], W [H, I], b [H], h0 [N, H] and the cotangent c [T, N, H] are the op's
    operands (`docs/semantics.md`): h_t = act(x_t W^T + h_{t-1} R^T + b)."""

    def __init__(self, lib: ctypes.CDLL, x, R, W, b, h0, c, activation: str = "tanh"):
        self.lib = lib
        T, N, I = x.shape
        H = R.shape[0]
        self.engine, self.stream = ctypes.c_void_p(), ctypes.c_void_p()
        self._check(lib.dnnl_engine_create(ctypes.byref(self.engine), _ENGINE_CPU, 0))
        self._check(lib.dnnl_stream_create(ctypes.byref(self.stream), self.engine,
                                           _STREAM_DEFAULT))
        # oneDNN's weights are [I, H] and [H_in, H_out]: W and R transposed.
        self.arrays = {k: np.ascontiguousarray(v, np.float32) for k, v in dict(
            src_layer=x, src_iter=np.asarray(h0)[None, None], bias=np.asarray(b)[None, None, None],
            weights_layer=np.asarray(W).T[None, None, :, None],
            weights_iter=np.asarray(R).T[None, None, :, None], diff_dst_layer=c).items()}
        self.arrays.update({k: np.empty(s, np.float32) for k, s in dict(
            dst_layer=(T, N, H), diff_src_layer=(T, N, I), diff_src_iter=(1, 1, N, H),
            diff_bias=(1, 1, 1, H), diff_weights_layer=(1, 1, I, 1, H),
            diff_weights_iter=(1, 1, H, 1, H)).items()})
        plain = {k: self._desc(a.shape, {3: _TNC, 4: _LDNC, 5: _LDIGO}[a.ndim])
                 for k, a in self.arrays.items()}
        self.memory = {k: self._memory(plain[k], a) for k, a in self.arrays.items()}
        any_ = {k: self._desc(self.arrays[k].shape, _TAG_ANY)
                for k in ("weights_layer", "weights_iter")}
        act, null = _ACTIVATIONS[activation], ctypes.c_void_p()

        def forward_pd(prop_kind):
            pd = ctypes.c_void_p()
            self._check(lib.dnnl_vanilla_rnn_forward_primitive_desc_create(
                ctypes.byref(pd), self.engine, prop_kind, act, _LEFT2RIGHT, plain["src_layer"],
                plain["src_iter"], any_["weights_layer"], any_["weights_iter"], plain["bias"],
                plain["dst_layer"], null, _DIFF_WEIGHTS_OVERWRITE, ctypes.c_float(0),
                ctypes.c_float(0), null))
            return pd

        infer_pd, train_pd = forward_pd(_FORWARD_INFERENCE), forward_pd(_FORWARD_TRAINING)
        bwd_pd = ctypes.c_void_p()
        self._check(lib.dnnl_vanilla_rnn_backward_primitive_desc_create(
            ctypes.byref(bwd_pd), self.engine, _BACKWARD, act, _LEFT2RIGHT, plain["src_layer"],
            plain["src_iter"], any_["weights_layer"], any_["weights_iter"], plain["bias"],
            plain["dst_layer"], null, plain["diff_src_layer"], plain["diff_src_iter"],
            any_["weights_layer"], any_["weights_iter"], plain["diff_bias"],
            plain["diff_dst_layer"], null, _DIFF_WEIGHTS_OVERWRITE, ctypes.c_float(0),
            ctypes.c_float(0), train_pd, null))
        self.impl = {name: self._impl(pd) for name, pd in
                     (("forward", infer_pd), ("training forward", train_pd),
                      ("backward", bwd_pd))}
        workspace = self._allocated(self._arg_md(train_pd, "workspace"))
        diff_weights = {k: self._allocated(self._arg_md(bwd_pd, k))
                        for k in ("diff_weights_layer", "diff_weights_iter")}
        self._weight_grads_out = [self._reorder(diff_weights[k], self._arg_md(bwd_pd, k),
                                                self.memory[k], plain[k]) for k in diff_weights]

        def args_for(pd, names, **extra):
            args = {k: self.memory[k] for k in names}
            for k in ("weights_layer", "weights_iter"):
                args[k] = self._allocated(self._arg_md(pd, k))
                self._run(self._reorder(self.memory[k], plain[k], args[k], self._arg_md(pd, k)))
            return {**args, **extra}

        forward_args = ("src_layer", "src_iter", "bias", "dst_layer")
        self._forward = self._primitive(infer_pd, args_for(infer_pd, forward_args))
        self._train = self._primitive(train_pd, args_for(train_pd, forward_args,
                                                         workspace=workspace))
        self._backward = self._primitive(bwd_pd, args_for(
            bwd_pd, forward_args + ("diff_dst_layer", "diff_src_layer", "diff_src_iter",
                                    "diff_bias"), workspace=workspace, **diff_weights))
        self._check(lib.dnnl_stream_wait(self.stream))

    def forward(self) -> None:
        """oneDNN's inference forward, waited for."""
        self._run(self._forward)
        self._check(self.lib.dnnl_stream_wait(self.stream))

    def forward_backward(self) -> None:
        """oneDNN's training forward and its backward, waited for."""
        self._run(self._train)
        self._run(self._backward)
        self._check(self.lib.dnnl_stream_wait(self.stream))

    def y(self) -> np.ndarray:
        """The states the last forward wrote, [T, N, H]."""
        return self.arrays["dst_layer"].copy()

    def gradients(self) -> tuple:
        """(dx, dR, dW, db, dh0) of the last backward, in the op's layouts (the weight
        gradients reordered out of oneDNN's layout here, outside the timed calls)."""
        for reorder in self._weight_grads_out:
            self._run(reorder)
        self._check(self.lib.dnnl_stream_wait(self.stream))
        a = self.arrays
        return (a["diff_src_layer"].copy(), a["diff_weights_iter"][0, 0, :, 0].T.copy(),
                a["diff_weights_layer"][0, 0, :, 0].T.copy(), a["diff_bias"].reshape(-1).copy(),
                a["diff_src_iter"][0, 0].copy())

    # -- C API plumbing ----------------------------------------------------------------------

    @staticmethod
    def _check(status: int) -> None:
        if status != 0:
            raise RuntimeError(f"oneDNN call failed with dnnl_status_t {status}")

    def _desc(self, dims, tag) -> ctypes.c_void_p:
        md = ctypes.c_void_p()
        self._check(self.lib.dnnl_memory_desc_create_with_tag(
            ctypes.byref(md), len(dims), _Dims(*dims), _F32, tag))
        return md

    def _memory(self, md, array: np.ndarray) -> ctypes.c_void_p:
        """A oneDNN memory over `array`'s buffer (the caller keeps `array` alive)."""
        mem = ctypes.c_void_p()
        self._check(self.lib.dnnl_memory_create(ctypes.byref(mem), md, self.engine,
                                                array.ctypes.data_as(ctypes.c_void_p)))
        return mem

    def _allocated(self, md) -> ctypes.c_void_p:
        """A buffer oneDNN allocates, of layout `md`."""
        mem = ctypes.c_void_p()
        self._check(self.lib.dnnl_memory_create(ctypes.byref(mem), md, self.engine,
                                                _MEMORY_ALLOCATE))
        return mem

    def _arg_md(self, pd, arg: str) -> ctypes.c_void_p:
        """The layout `pd` chose for its execute argument `arg`."""
        return ctypes.c_void_p(self.lib.dnnl_primitive_desc_query_md(pd, _QUERY_EXEC_ARG_MD,
                                                                     _ARG[arg]))

    def _reorder(self, src, src_md, dst, dst_md) -> tuple:
        pd = ctypes.c_void_p()
        self._check(self.lib.dnnl_reorder_primitive_desc_create(
            ctypes.byref(pd), src_md, self.engine, dst_md, self.engine, None))
        return self._primitive(pd, dict(from_=src, to=dst))

    def _primitive(self, pd, args: dict) -> tuple:
        prim = ctypes.c_void_p()
        self._check(self.lib.dnnl_primitive_create(ctypes.byref(prim), pd))
        packed = (_ExecArg * len(args))(*(_ExecArg(_ARG[k], m.value) for k, m in args.items()))
        return prim, packed

    def _run(self, primitive: tuple) -> None:
        prim, args = primitive
        self._check(self.lib.dnnl_primitive_execute(prim, self.stream, len(args), args))

    def _impl(self, pd) -> str:
        name = ctypes.c_char_p()
        self._check(self.lib.dnnl_primitive_desc_query(pd, _QUERY_IMPL_INFO_STR, 0,
                                                       ctypes.byref(name)))
        return name.value.decode()
