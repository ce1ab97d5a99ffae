"""One conv or fully connected op built as a config says: operator path, micro-kernel (through
the verified override), threads and column tile. Tuning candidates and the whole-model executor
build their operators here, so what was measured is what runs.

Config keys (all optional; a missing key means XNNPack's own choice):
- ``path``: "nhwc" (NHWC operator) or "nchw" (XNNPack's NCHW operator: SpMM for 1x1, CHW
  depthwise, the 3x3/s2 HWC->CHW first-layer kernel); the NCHW path converts NHWC<->NCHW around
  the operator and that conversion is part of its cost;
- ``ukernel`` (+ ``mr`` for GEMM): the micro-kernel, XNNPack's name without ``xnn_``;
- ``threads``: 1 runs on the calling thread, n > 1 on a pthreadpool of n threads;
- ``tile_n``: "default" or the column tile (output channels per parallel task, a multiple of the
  kernel's nr) of the GEMM / IGEMM parallel loop, set through the pthreadpool shim;
- ``loop``: "rows" (XNNPack's order: row tiles outer, every column tile of a row tile in turn)
  or "columns" (column tiles outer: a column tile's packed weights stay in cache while every row
  tile uses them), also through the shim;
- ``spinning`` (threads > 1; one value per plan): 1 = the pool's workers spin-wait between
  parallel loops (pthreadpool's default), 0 = they sleep in the kernel
  (``PTHREADPOOL_FLAG_YIELD_WORKERS`` added to every call by the shim).
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import sys

import numpy as np

from kselect.plugins.xnnpack import (
    kernels,
    tileshim,
    ukernel_arm64,
    ukernel_catalog,
    ukernel_forcing,
    ukernel_probes,
    ukernel_table,
)
from kselect.plugins.xnnpack import xnnpack_api as xa

SLACK_BYTES = 64  # XNNPack may read XNN_EXTRA_BYTES (16) past an input's end; 64 bytes kept free


def buffer(shape, dtype=np.float32) -> np.ndarray:
    """An uninitialised float32 (or ``dtype``: float16 for an f16 operator) array, 64-byte aligned,
    with readable slack after its end (XNNPack's micro-kernels may read a few bytes past an input
    tensor)."""
    itemsize = np.dtype(dtype).itemsize
    size = int(np.prod(shape)) if len(shape) else 1
    raw = np.empty(size + (64 + SLACK_BYTES) // itemsize, dtype)
    offset = (-raw.ctypes.data % 64) // itemsize
    return raw[offset:offset + size].reshape(shape)


class ConfigError(ValueError):
    """A config this build / machine cannot run (refused before anything native happens)."""


# -- thread pools (one per thread count, shared by every operator of this process) ----------
_POOLS: dict[int, xa.Threadpool] = {}


def pool_for(threads: int | None) -> xa.Threadpool | None:
    threads = int(threads or 1)
    if threads <= 1:
        return None
    if threads not in _POOLS:
        _POOLS[threads] = xa.Threadpool(threads)
    return _POOLS[threads]


def in_measuring_child() -> bool:
    """True in kselect's measuring child (core/measuring/worker.py) or a micro-kernel child
    (ukernel_probes.run_child), where a crash is contained and recorded as a failed candidate."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return getattr(spec, "name", "") == "kselect.core.measuring.worker" \
        or os.environ.get(ukernel_probes.CHILD_ENV) == "1"


# -- the table must be XNNPack's own outside an override -----------------------------------
_PRISTINE: list[tuple[int, bytes]] | None = None


def _table_regions() -> list[tuple[int, int]]:
    if kernels.on_2024_build():
        return ukernel_arm64.table_regions()
    b = ukernel_table.verify_build()
    t = b.table
    regions = []
    for family in ("f32",) + ukernel_table.INT8_FAMILIES:  # every entry an override (f32 or 8-bit) may rewrite
        entries = getattr(t, family)
        regions.append((ctypes.addressof(entries.gemm), ctypes.sizeof(ukernel_table.GemmParams)))
        regions += [(ctypes.addressof(e), ctypes.sizeof(ukernel_table.DwconvParams)) for e in entries.dwconv]
    return regions


def check_table_pristine() -> None:
    """Raises (and repairs) if an earlier override was not undone: the table must hold exactly
    what xnn_initialize put there whenever no override is being applied."""
    global _PRISTINE
    if _PRISTINE is None:
        _PRISTINE = [(addr, ctypes.string_at(addr, size)) for addr, size in _table_regions()]
        return
    dirty = [(addr, raw) for addr, raw in _PRISTINE if ctypes.string_at(addr, len(raw)) != raw]
    for addr, raw in dirty:
        ctypes.memmove(addr, raw, len(raw))
    if dirty:
        raise RuntimeError("xnn_params was not restored after an earlier override (repaired now)")


@contextlib.contextmanager
def _forced(choice):
    if choice is None:
        yield
        return
    check_table_pristine()
    gemm = choice if isinstance(choice, ukernel_catalog.GemmChoice) else None
    dwconv = choice if isinstance(choice, ukernel_catalog.DwconvChoice) else None
    try:
        if isinstance(choice, ukernel_arm64.ConfigChoice):
            forcing = ukernel_arm64.forced_config(choice, allow_in_process=True)
        else:
            forcing = ukernel_forcing.forced_kernels(gemm, dwconv, allow_in_process=True)
        with forcing:
            yield
    finally:
        check_table_pristine()


# -- describing an op -----------------------------------------------------------------------
class OpSpec:
    """What building one conv / fc needs; from a Task, or from a graph node in the executor."""

    def __init__(self, task):
        self.task = task
        self.kind = task.kind
        self.cls = kernels.op_class(task)
        self.rows = kernels.gemm_rows(task)
        if task.kind == "conv":
            self.taps = task.attrs["kernel"][0] * task.attrs["kernel"][1]
            self.output_channels = task.weight_shape[0]
            self.groups = task.attrs["group"]
        elif task.kind == "deconv":
            self.taps = task.attrs["kernel"][0] * task.attrs["kernel"][1]
            self.output_channels = task.weight_shape[1] * task.attrs["group"]
            self.groups = task.attrs["group"]
        else:
            self.taps = None
            self.output_channels = task.weight_shape[0]
            self.groups = 1

    def nchw_path(self) -> tuple[bool, str]:
        """Whether XNNPack's NCHW operator takes this conv; the path name (xnnpack_api)."""
        if self.kind != "conv":
            return False, f"no NCHW operator for a {self.kind} op"
        a, t = self.task.attrs, self.task
        for input_nhwc in (False, True):
            ok, path = xa.nchw_convolution_supported(a["kernel"], a["strides"], a["dilations"], a["pads"], a["group"],
                                                     t.input_shape[1], t.weight_shape[0], input_nhwc=input_nhwc)
            if ok:
                return True, path
        return False, path


def default_tile_n(spec: OpSpec, threads: int, mr: int, nr: int) -> int:
    """XNNPack's own column tile (the setup code of this snapshot)."""
    n_out = spec.output_channels // spec.groups
    nc = n_out
    if threads > 1:
        other = spec.groups * -(-spec.rows // mr)
        max_nc = -(-(n_out * other) // (threads * 5))
        if max_nc < nc:
            nc = min(nc, -(-nc // (max_nc * nr)) * nr)
    return nc


def effective_kernel(spec: OpSpec, config: dict) -> tuple[str | None, int | None]:
    """(kernel name, mr) the NHWC operator will run with this config (None for families without
    a choice)."""
    if spec.cls not in ("gemm", "igemm", "dwconv") or (kernels.override_status()[0] and not kernels.offers(spec)):
        return None, None
    if "ukernel" in config:
        name = config["ukernel"]
        if spec.cls == "dwconv":
            return name, None
        mr = config.get("mr")
        if mr is None:  # a single-row GEMM runs at mr=1; otherwise the kernel's own MR
            mr = 1 if spec.cls == "gemm" and spec.rows == 1 else kernels.native_mr(name)
        return name, int(mr)
    default = kernels.default_kernel(spec.cls, spec.rows, spec.taps) if kernels.override_status()[0] else None
    return default if default else (None, None)


def choice_for(spec: OpSpec, config: dict, unsafe: bool = False):
    """The override for this config, or None when the config is XNNPack's own choice."""
    if config.get("path", "nhwc") != "nhwc" or "ukernel" not in config:
        return None
    ok, why = kernels.override_status()
    if not ok:
        raise ConfigError(f"micro-kernel override unavailable: {why}")
    if spec.cls in ("gemm", "igemm", "dwconv") and not kernels.offers(spec):
        raise ConfigError(f"no micro-kernel choice for this {spec.cls} op on this build"
                          + (" (one depthwise kernel per tap count)" if spec.cls == "dwconv" else
                             " (fewer output channels than the kernels' nr: XNNPack runs its nr=2 config)"))
    name, mr = effective_kernel(spec, config)
    default = kernels.default_kernel(spec.cls, spec.rows, spec.taps)
    if default and (name, mr) == tuple(default):
        return None
    if spec.cls == "dwconv":
        return kernels.resolve("dwconv", name, None, spec.taps)
    if spec.cls not in ("gemm", "igemm"):
        raise ConfigError(f"no micro-kernel choice for a {spec.cls} operator")
    if spec.cls == "gemm" and spec.rows == 1 and mr != 1:
        raise ConfigError("a single-row GEMM runs the mr=1 kernel: choose mr=1")
    try:
        return kernels.resolve(spec.cls, name, mr, unsafe=unsafe)
    except KeyError as exc:
        raise ConfigError(str(exc)) from None


# -- built operators --------------------------------------------------------------------------
class Built:
    """A configured operator bound to fixed input and output buffers (NHWC or (M, K) in,
    NHWC or (M, N) out). ``steps`` are (function, a, b) calls returning 0 on success."""

    def __init__(self, op, steps, x, y, notes):
        self.op = op
        self.steps = steps
        self.x = x
        self.y = y
        self.notes = notes  # e.g. {"kernels": [...], "tile_n": 64}
        self._contexts: list[int] = []

    def run(self) -> None:
        for fn, a, b in self.steps:
            status = fn(a, b)
            if status:
                raise xa.XNNPackError(status, "xnn_run_operator")

    def close(self) -> None:
        shim = tileshim.shim()
        if shim is not None:
            for context in self._contexts:
                shim.remove(context)
        self._contexts.clear()
        if self.op is not None:
            self.op.close()
            self.op = None


YIELD_WORKERS = 0x2  # PTHREADPOOL_FLAG_YIELD_WORKERS


def pool_flags(config: dict) -> int:
    """The shim's extra pthreadpool flags for a config (or a plan's plan-level settings)."""
    if int(config.get("spinning", 1)):
        return 0
    if tileshim.shim() is None:
        raise ConfigError(f"spinning=0 needs the pthreadpool shim: {tileshim.status()[1]}")
    return YIELD_WORKERS


def _run_fn():
    return xa.lib().xnn.xnn_run_operator


def build(spec: OpSpec, config: dict, w: np.ndarray, b: np.ndarray | None, x: np.ndarray, y: np.ndarray,
          output_min: float = -math.inf, output_max: float = math.inf, *, unsafe: bool | None = None,
          check_kernels: bool = True) -> Built:
    """Creates the operator for ``config`` reading ``x`` and writing ``y`` (conv: NHWC arrays,
    weights OIHW; deconv: NHWC arrays, ONNX's weights; fc: (M, K) -> (M, N), weights (N, K)). ``unsafe`` allows overrides that can
    abort (only ever true in the measuring child)."""
    if unsafe is None:
        unsafe = False
    if "variant" in config:  # an int8 task's config (int8.py): never built as a float operator
        raise ConfigError(f"{config['variant']} is an 8-bit config: it is built by int8.py (the executor's int8 "
                          "nodes), never as a float operator")
    threads = int(config.get("threads", 1))
    pool = pool_for(threads)
    path = config.get("path", "nhwc")
    notes: dict = {}
    if path == "nchw":
        return _build_nchw(spec, config, w, b, x, y, pool, output_min, output_max)
    if path != "nhwc":
        raise ConfigError(f"unknown path {path!r}")
    choice = choice_for(spec, config, unsafe)
    a = spec.task.attrs
    with _forced(choice):
        if spec.kind == "fc":
            op = xa.FullyConnected(w, b, output_min=output_min, output_max=output_max, threadpool=pool)
        elif spec.kind == "deconv":
            op = xa.Deconvolution2DNHWC(w, b, stride=a["strides"], dilation=a["dilations"], padding=a["pads"],
                                        groups=a["group"], adjustment=a["output_padding"], output_min=output_min,
                                        output_max=output_max, threadpool=pool)
        else:
            op = xa.Convolution2DNHWC(w, b, stride=a["strides"], dilation=a["dilations"], padding=a["pads"],
                                      groups=a["group"], output_min=output_min, output_max=output_max, threadpool=pool)
    try:
        name, mr = effective_kernel(spec, config)
        if check_kernels and name is not None and kernels.override_status()[0]:
            held = [kernels.short(k) for k in kernels.kernels_in_operator(op)]
            notes["kernels"] = held
            if name not in held:
                raise RuntimeError(f"the operator holds {held}, not the configured {name}")
        shim = tileshim.shim()
        if shim is not None:
            shim.reset_last()
        op.setup(x, y)
        built = Built(op, [(_run_fn(), op.handle, None if pool is None else pool.handle)], x, y, notes)
        tile = config.get("tile_n", "default")
        loop = config.get("loop", "rows")
        if loop not in ("rows", "columns"):
            raise ConfigError(f"unknown loop order {loop!r}")
        if tile != "default" or loop != "rows":
            if shim is None:
                raise ConfigError(f"tile_n / loop need the pthreadpool shim: {tileshim.status()[1]}")
            if spec.cls not in ("gemm", "igemm"):
                raise ConfigError(f"tile_n / loop apply to GEMM / IGEMM operators, not {spec.cls}")
            nr = kernels.nr_of(name) if name else None
            if nr is None or (tile != "default" and int(tile) % nr):
                raise ConfigError(f"tile_n={tile} is not a multiple of the kernel's nr ({nr})")
            op.execute()  # records the operator's parallel call (its context, ranges and tiles)
            call = shim.last()
            if call is None or call["context"] == 0 or call["range"][-1] != spec.output_channels // spec.groups:
                raise RuntimeError(f"the operator's parallel loop was not seen by the shim ({call})")
            notes["tile_default"] = call["tile"][1]
            new_tile = call["tile"][1] if tile == "default" else int(tile)
            if new_tile != call["tile"][1] or loop == "columns":
                shim.set_tile(call, new_tile, swap=loop == "columns")
                built._contexts.append(call["context"])
            notes["tile_n"], notes["loop"] = new_tile, loop
        return built
    except BaseException:
        op.close()
        raise


def _build_nchw(spec, config, w, b, x, y, pool, output_min, output_max) -> Built:
    ok, kind = spec.nchw_path()
    if not ok:
        raise ConfigError(f"no NCHW operator for this conv: {kind}")
    if "ukernel" in config or config.get("tile_n", "default") != "default":
        raise ConfigError("the NCHW path has one kernel per case: no ukernel / tile_n")
    a = spec.task.attrs
    input_nhwc = kind == "conv2d_hwc2chw"
    op = xa.Convolution2DNCHW(w, b, stride=a["strides"], dilation=a["dilations"], padding=a["pads"],
                              groups=a["group"], input_nhwc=input_nhwc, output_min=output_min,
                              output_max=output_max, threadpool=pool)
    try:
        n, h, wd, c = x.shape
        x_nchw = x if input_nhwc else buffer((n, c, h, wd))
        _, oh, ow, oc = y.shape
        y_nchw = buffer((n, oc, oh, ow))
        op.setup(x_nchw, y_nchw)
        x_t = x.transpose(0, 3, 1, 2)
        y_t = y_nchw.transpose(0, 2, 3, 1)
        steps = []
        if not input_nhwc:
            steps.append((lambda dst, src: np.copyto(dst, src) or 0, x_nchw, x_t))
        steps.append((_run_fn(), op.handle, None if pool is None else pool.handle))
        steps.append((lambda dst, src: np.copyto(dst, src) or 0, y, y_t))
        built = Built(op, steps, x, y, {"nchw_path": kind})
        built.y_nchw = y_nchw
        return built
    except BaseException:
        op.close()
        raise
