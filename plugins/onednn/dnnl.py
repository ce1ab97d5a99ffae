"""A ctypes binding over oneDNN's C API, as much as the plugin needs: a CPU engine and stream,
memory descriptors and memories, the forward primitives a CNN runs (convolution, deconvolution,
inner product, pooling, eltwise, binary, softmax, concat, reorder), eltwise post-ops, and the walk
over every implementation oneDNN has for an operation.

Two generations of the C API, chosen at load time by the library found: ``libdnnl.so.2`` (2.x:
Debian 12's 2.6.3) when present, else the ``libdnnl.so.3*`` the linker knows (3.x: Debian 13's
3.7.2, soname ``libdnnl.so.3.6``). What differs between them (memory descriptors as structs or as
opaque handles, operation descriptors or per-kind primitive descriptor creation, the
implementation iterator, renumbered format tags and eltwise algorithms) is in dnnl2.py and dnnl3.py;
the rest of the plugin calls only this module. An operation (``convolution(...)``, ...) is the
generation's own object, handed back to ``implementations`` / ``primitive_desc``.

Every call's ``dnnl_status_t`` is checked: a failure raises ``DnnlError`` naming the call.

Threads: Debian builds oneDNN with the OpenMP runtime (libgomp) on amd64 and arm64 alike, where a
primitive runs on ``omp_get_max_threads()`` threads of the calling thread, read when the primitive
descriptor is created (the JIT kernels split their work then) and when it executes; ``set_threads``
sets it through the libgomp that libdnnl itself loaded.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import functools
import importlib
import platform
from typing import Iterable, Sequence

import numpy as np

SONAME_2 = "libdnnl.so.2"
INSTALL_HINT = "apt-get install libdnnl-dev"
MAX_NDIMS = 12

# -- enums with the same values in the 2.x and 3.x headers (the others are in dnnl2.py / dnnl3.py) --
SUCCESS, UNIMPLEMENTED, LAST_IMPLEMENTATION = 0, 3, 4  # dnnl_status_t
F16, BF16, F32 = 1, 2, 3  # dnnl_data_type_t
ITEM_SIZE = {F16: 2, BF16: 2, F32: 4}
CPU_ENGINE = 1
STREAM_DEFAULT_FLAGS = 1
FORWARD_INFERENCE = 96
RUNTIME_OMP = 2

CONVOLUTION = {"direct": 1, "winograd": 2}
DECONVOLUTION_DIRECT = 10
POOLING = {"max": 0x1FF, "avg_include_padding": 0x2FF, "avg_exclude_padding": 0x3FF}
BINARY = {"add": 0x1FFF0, "mul": 0x1FFF1, "max": 0x1FFF2, "min": 0x1FFF3, "div": 0x1FFF4, "sub": 0x1FFF5}

QUERY_IMPL_INFO_STR = 8
QUERY_SRC_MD, QUERY_WEIGHTS_MD, QUERY_DST_MD, QUERY_SCRATCHPAD_MD = 129, 131, 133, 136

ARG_SRC, ARG_SRC_1, ARG_DST, ARG_WEIGHTS, ARG_BIAS = 1, 2, 17, 33, 41
ARG_FROM, ARG_TO = 1, 17
ARG_MULTIPLE_SRC = 1024
DATA_TYPE_UNDEF = 0

# dnnl_fpmath_mode_t: how far an f32 primitive may round its operands down to compute faster
FPMATH_MODES = {"strict": 0, "bf16": 1}

Dims = ctypes.c_int64 * MAX_NDIMS


class DnnlError(RuntimeError):
    def __init__(self, status: int, call: str):
        self.status = status
        self.call = call
        super().__init__(f"oneDNN {call} failed: {status_name(status)} (status {status})")


class ExecArg(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_int), ("memory", ctypes.c_void_p)]


class Version(ctypes.Structure):
    _fields_ = [("major", ctypes.c_int), ("minor", ctypes.c_int), ("patch", ctypes.c_int), ("hash", ctypes.c_char_p),
                ("cpu_runtime", ctypes.c_uint), ("gpu_runtime", ctypes.c_uint)]


_P = ctypes.c_void_p


def _signatures(md) -> dict:
    """The functions both generations declare alike; ``md``: how they take a memory descriptor."""
    return {
        "dnnl_engine_create": [ctypes.POINTER(_P), ctypes.c_int, ctypes.c_size_t],
        "dnnl_engine_destroy": [_P],
        "dnnl_stream_create": [ctypes.POINTER(_P), _P, ctypes.c_uint],
        "dnnl_stream_wait": [_P],
        "dnnl_stream_destroy": [_P],
        "dnnl_memory_create": [ctypes.POINTER(_P), md, _P, _P],
        "dnnl_memory_set_data_handle": [_P, _P],
        "dnnl_memory_destroy": [_P],
        "dnnl_primitive_attr_create": [ctypes.POINTER(_P)],
        "dnnl_primitive_attr_destroy": [_P],
        "dnnl_primitive_attr_set_post_ops": [_P, _P],
        "dnnl_primitive_attr_set_fpmath_mode": [_P, ctypes.c_int],
        "dnnl_post_ops_create": [ctypes.POINTER(_P)],
        "dnnl_post_ops_destroy": [_P],
        "dnnl_reorder_primitive_desc_create": [ctypes.POINTER(_P), md, _P, md, _P, _P],
        "dnnl_primitive_desc_destroy": [_P],
        "dnnl_primitive_desc_query": [_P, ctypes.c_int, ctypes.c_int, _P],
        "dnnl_primitive_create": [ctypes.POINTER(_P), _P],
        "dnnl_primitive_execute": [_P, _P, ctypes.c_int, ctypes.POINTER(ExecArg)],
        "dnnl_primitive_destroy": [_P],
    }


def _restypes(md) -> dict:
    return {
        "dnnl_version": (ctypes.POINTER(Version), []),
        "dnnl_memory_desc_equal": (ctypes.c_int, [md, md]),
        "dnnl_memory_desc_get_size": (ctypes.c_size_t, [md]),
        "dnnl_status2str": (ctypes.c_char_p, [ctypes.c_uint]),
        "dnnl_runtime2str": (ctypes.c_char_p, [ctypes.c_uint]),
        "dnnl_get_effective_cpu_isa": (ctypes.c_int, []),
        "dnnl_cpu_isa2str": (ctypes.c_char_p, [ctypes.c_int]),
    }


@functools.lru_cache(maxsize=None)
def _load() -> tuple[ctypes.CDLL, str, object]:
    """(the library, its soname, the module of its C API generation); raises OSError when none loads."""
    try:
        soname = SONAME_2
        dll = ctypes.CDLL(soname)
    except OSError as no_2:
        soname = ctypes.util.find_library("dnnl")  # the soname of the libdnnl.so the linker knows
        if soname is None:
            raise OSError(f"no oneDNN library: {no_2}; no other libdnnl.so.* known to the linker") from no_2
        dll = ctypes.CDLL(soname)
    dll.dnnl_version.restype = ctypes.POINTER(Version)
    major = dll.dnnl_version().contents.major
    if major not in (2, 3):
        raise OSError(f"{soname} reports oneDNN {major}.x: this binding is for 2.x and 3.x")
    api = importlib.import_module(f"kselect.plugins.onednn.dnnl{major}")
    api.check_layout()
    for name, argtypes in {**_signatures(api.MD_ARG), **api.SIGNATURES}.items():
        fn = getattr(dll, name)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int
    for name, (restype, argtypes) in {**_restypes(api.MD_ARG), **api.RESTYPES}.items():
        fn = getattr(dll, name)
        fn.restype = restype
        fn.argtypes = argtypes
    return dll, soname, api


def lib() -> ctypes.CDLL:
    """libdnnl with its functions' signatures set; raises OSError when it cannot be loaded."""
    return _load()[0]


def api():
    """dnnl2 or dnnl3: the module of the loaded library's C API generation."""
    return _load()[2]


def soname() -> str:
    return _load()[1]


def debian_package() -> str:
    """Debian's name for the package of the loaded soname: libdnnl.so.2 is libdnnl2, libdnnl.so.3.6 libdnnl3.6."""
    return "libdnnl" + soname().split(".so.", 1)[1]


def availability() -> tuple[bool, str]:
    try:
        lib()
        engine()
    except (OSError, DnnlError) as exc:
        return False, f"{exc} ({INSTALL_HINT})"
    return True, ""


def check(status: int, call: str) -> None:
    if status != SUCCESS:
        raise DnnlError(status, call)


def call(name: str, *args) -> None:
    check(getattr(lib(), name)(*args), name)


def status_name(status: int) -> str:
    try:
        return lib().dnnl_status2str(status).decode()
    except OSError:
        return str(status)


def version() -> tuple[int, int, int]:
    v = lib().dnnl_version().contents
    return v.major, v.minor, v.patch


def cpu_runtime() -> str:
    return lib().dnnl_runtime2str(lib().dnnl_version().contents.cpu_runtime).decode()


def on_arm() -> bool:
    return platform.machine() in ("aarch64", "arm64")


@functools.lru_cache(maxsize=None)
def effective_isa() -> str:
    """The instruction set oneDNN's JIT kernels use here, e.g. ``avx512_core_bf16``. On aarch64
    ``dnnl_get_effective_cpu_isa`` names x86 ones only (Debian's 3.7.2 says ``sse41`` there), so the
    ISA is named as oneDNN's aarch64 kernels are: ``asimd`` without SVE, else ``sve_<vector bits>``."""
    if on_arm():
        from kselect.core.measuring.device import this_device

        if "sve" not in this_device().features:
            return "asimd"
        vector_bytes = ctypes.CDLL(None).prctl(51, 0, 0, 0, 0)  # PR_SVE_GET_VL: the length in its low 16 bits
        return f"sve_{(vector_bytes & 0xFFFF) * 8}" if vector_bytes > 0 else "sve"
    dll = lib()
    return dll.dnnl_cpu_isa2str(dll.dnnl_get_effective_cpu_isa()).decode().removeprefix("cpu_isa_")


def bf16_instructions_missing() -> str | None:
    """Why this CPU has no bf16 instructions for oneDNN's kernels, or None when it has them."""
    isa = effective_isa()
    if on_arm():
        from kselect.core.measuring.device import this_device

        return None if "bf16" in this_device().features else \
            f"oneDNN runs {isa} here (bf16 needs the BF16 extension, Armv8.6-A: no bf16 in /proc/cpuinfo Features)"
    return None if "bf16" in isa or "amx" in isa else f"oneDNN runs {isa} here (bf16 needs AVX512_BF16 or AMX)"


# -- engine, stream, threads -------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def engine() -> int:
    handle = _P()
    call("dnnl_engine_create", ctypes.byref(handle), CPU_ENGINE, 0)
    return handle.value


@functools.lru_cache(maxsize=None)
def stream() -> int:
    handle = _P()
    call("dnnl_stream_create", ctypes.byref(handle), engine(), STREAM_DEFAULT_FLAGS)
    return handle.value


def wait() -> None:
    call("dnnl_stream_wait", stream())


@functools.lru_cache(maxsize=None)
def _openmp():
    """The OpenMP runtime libdnnl was linked against (already loaded with it), or None when this
    build uses another threading runtime."""
    if lib().dnnl_version().contents.cpu_runtime != RUNTIME_OMP:
        return None
    for name in ("libgomp.so.1", "libomp.so.5", "libiomp5.so"):
        try:
            runtime = ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL | getattr(ctypes, "RTLD_NOLOAD", 4))
        except OSError:
            continue
        runtime.omp_set_num_threads.argtypes = [ctypes.c_int]
        runtime.omp_set_num_threads.restype = None
        runtime.omp_get_max_threads.restype = ctypes.c_int
        return runtime
    return None


def threading_control() -> str:
    """How thread counts are set here, for the plugin's status line."""
    runtime = _openmp()
    if runtime is None:
        return f"{cpu_runtime()} runtime: thread count not settable"
    return f"{cpu_runtime()} runtime: threads set with omp_set_num_threads"


def set_threads(count: int) -> None:
    """The number of threads primitives created and executed from now on (this thread) use."""
    runtime = _openmp()
    if runtime is None:
        raise DnnlError(3, f"set_threads({count}): oneDNN's {cpu_runtime()} runtime has no thread control here")
    runtime.omp_set_num_threads(int(count))


def max_threads() -> int:
    runtime = _openmp()
    return runtime.omp_get_max_threads() if runtime is not None else 1


class Owned:
    """Owns a oneDNN handle, destroyed by ``_destroy`` on ``close()`` or garbage collection."""

    _destroy = ""
    handle = None

    def close(self) -> None:
        if self.handle:
            getattr(lib(), self._destroy)(self.handle)
            self.handle = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


# -- memory descriptors and memories ----------------------------------------------------------
# A memory descriptor is the generation's ``MemoryDesc``: ``shape``, ``data_type``, ``copy()``;
# a C function declared to take one takes it as it is.
def dims(values: Sequence[int]) -> Dims:
    array = Dims()
    for i, v in enumerate(values):
        array[i] = int(v)
    return array


def desc(shape: Sequence[int], tag: str = "any", data_type: int = F32):
    """A memory descriptor of ``shape`` in format ``tag`` (a name of the generation's ``TAGS``), f32 unless told."""
    return api().desc(shape, tag, data_type)


def as_data_type(md, data_type: int):
    """``md``'s layout (blocking, padding: counted in elements) holding ``data_type``."""
    return api().as_data_type(md, data_type)


def plain_desc(shape: Sequence[int]):
    """Row-major (ONNX / numpy order) f32 descriptor of any rank."""
    strides, step = [], 1
    for d in reversed(shape):
        strides.insert(0, step)
        step *= int(d)
    return api().strided_desc(shape, strides, F32)


def equal(a, b) -> bool:
    return bool(lib().dnnl_memory_desc_equal(a, b))


def size_of(md) -> int:
    return int(lib().dnnl_memory_desc_get_size(md))


def md_key(md) -> bytes:
    """Bytes equal for equal descriptors, to key a dict by a descriptor."""
    return api().md_key(md)


def format_name(md, names: Iterable[str]) -> str | None:
    """Which of the format ``names`` ``md`` is (same shape), or None."""
    shape, data_type = md.shape, md.data_type
    for name in names:
        try:
            if equal(md, desc(shape, name, data_type)):
                return name
        except DnnlError:  # a format of another rank
            continue
    return None


def aligned_buffer(floats: int) -> np.ndarray:
    """A float32 array of ``floats`` elements, 64-byte aligned."""
    raw = np.empty(max(int(floats), 1) + 16, np.float32)
    start = (-raw.ctypes.data % 64) // 4
    return raw[start:start + max(int(floats), 1)]


class Memory(Owned):
    """A oneDNN memory over a numpy buffer it owns (``buffer``: flat float32 holding the
    descriptor's size, padding included; a bf16 memory's elements are 2 bytes of it each)."""

    _destroy = "dnnl_memory_destroy"

    def __init__(self, md, buffer: np.ndarray | None = None):
        self.md = md.copy()
        self.nbytes = size_of(self.md)
        self.shape = self.md.shape
        if buffer is None:
            buffer = aligned_buffer(-(-self.nbytes // 4))
            if self.nbytes > ITEM_SIZE[self.md.data_type] * np.prod(self.shape):
                buffer[:] = 0  # blocked formats pad channels: the padding must read as zeros
        elif buffer.nbytes < self.nbytes:
            raise ValueError(f"buffer of {buffer.nbytes} bytes for a memory of {self.nbytes}")
        self.buffer = buffer
        handle = _P()
        call("dnnl_memory_create", ctypes.byref(handle), self.md, engine(), self.buffer.ctypes.data)
        self.handle = handle.value

    def plain_view(self) -> np.ndarray:
        """The buffer as an array of the descriptor's shape (only meaningful in a plain format)."""
        return self.buffer[:int(np.prod(self.shape))].reshape(self.shape)


# -- attributes ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SumPostOp:
    """A sum post-op: the primitive's result plus what its destination held before it ran
    (``scale`` times it), as oneDNN fuses a residual Add."""

    scale: float = 1.0


class Attr(Owned):
    """Primitive attributes holding post-ops: eltwise ones, ``(algorithm name, alpha, beta)``, and
    ``SumPostOp``s, in chain order; and the fp-math mode, ``strict`` unless told (set explicitly,
    whatever ONEDNN_DEFAULT_FPMATH_MODE says)."""

    _destroy = "dnnl_primitive_attr_destroy"

    def __init__(self, post_ops: Sequence = (), fpmath: str = "strict"):
        handle = _P()
        call("dnnl_primitive_attr_create", ctypes.byref(handle))
        self.handle = handle.value
        call("dnnl_primitive_attr_set_fpmath_mode", self.handle, FPMATH_MODES[fpmath])
        if post_ops:
            ops = _P()
            call("dnnl_post_ops_create", ctypes.byref(ops))
            try:
                for post_op in post_ops:
                    if isinstance(post_op, SumPostOp):
                        api().append_sum(ops, float(post_op.scale))
                        continue
                    algorithm, alpha, beta = post_op
                    api().append_eltwise(ops, *api().eltwise_kind(algorithm, float(alpha), float(beta)))
                call("dnnl_primitive_attr_set_post_ops", self.handle, ops)
            finally:
                lib().dnnl_post_ops_destroy(ops)


# -- operations: the generation's own objects, for ``implementations`` / ``primitive_desc`` ------
def convolution(src, weights, bias, dst, strides, dilations, pads_begin, pads_end, algorithm: str = "direct"):
    """``dilations`` as ONNX has them (1 = dense); oneDNN counts the gaps (0 = dense). ``bias`` may be None."""
    return api().convolution(src, weights, bias, dst, dims(strides), dims([d - 1 for d in dilations]),
                             dims(pads_begin), dims(pads_end), CONVOLUTION[algorithm])


def deconvolution(src, weights, bias, dst, strides, dilations, pads_begin, pads_end):
    return api().deconvolution(src, weights, bias, dst, dims(strides), dims([d - 1 for d in dilations]),
                               dims(pads_begin), dims(pads_end))


def inner_product(src, weights, bias, dst):
    return api().inner_product(src, weights, bias, dst)


def pooling(algorithm: str, src, dst, strides, kernel, dilations, pads_begin, pads_end):
    return api().pooling(POOLING[algorithm], src, dst, dims(strides), dims(kernel), dims([d - 1 for d in dilations]),
                         dims(pads_begin), dims(pads_end))


def eltwise(algorithm: str, data, alpha: float = 0.0, beta: float = 0.0):
    kind, alpha, beta = api().eltwise_kind(algorithm, float(alpha), float(beta))
    return api().eltwise(kind, data, alpha, beta)


def binary(algorithm: str, src0, src1, dst):
    return api().binary(BINARY[algorithm], src0, src1, dst)


def softmax(data, axis: int):
    return api().softmax(data, int(axis))


# -- primitive descriptors and primitives ------------------------------------------------------
class PrimitiveDesc(Owned):
    _destroy = "dnnl_primitive_desc_destroy"

    def __init__(self, handle: int):
        self.handle = handle

    @property
    def impl(self) -> str:
        name = ctypes.c_char_p()
        call("dnnl_primitive_desc_query", self.handle, QUERY_IMPL_INFO_STR, 0, ctypes.byref(name))
        return name.value.decode()

    def md(self, what: int, index: int = 0):
        found = api().query_md(self.handle, what, index)
        if found is None:
            raise DnnlError(2, f"dnnl_primitive_desc_query_md({what}, {index})")
        return found

    @property
    def src(self):
        return self.md(QUERY_SRC_MD)

    @property
    def weights(self):
        return self.md(QUERY_WEIGHTS_MD)

    @property
    def dst(self):
        return self.md(QUERY_DST_MD)


def _attr_handle(attr: Attr | None) -> int | None:
    return attr.handle if attr else None


def implementations(op, attr: Attr | None = None) -> list[PrimitiveDesc]:
    """A primitive descriptor per implementation oneDNN has for ``op`` here, in its own order of
    preference (the first is what ``primitive_desc`` picks). Empty when none applies."""
    return [PrimitiveDesc(handle) for handle in api().implementations(op, _attr_handle(attr))]


def primitive_desc(op, attr: Attr | None = None) -> PrimitiveDesc:
    return PrimitiveDesc(api().primitive_desc(op, _attr_handle(attr)))


def concat_desc(dst, axis: int, sources: Sequence) -> PrimitiveDesc:
    return PrimitiveDesc(api().concat_desc(dst, int(axis), sources))


def reorder_desc(src, dst) -> PrimitiveDesc:
    handle = _P()
    call("dnnl_reorder_primitive_desc_create", ctypes.byref(handle), src, engine(), dst, engine(), None)
    return PrimitiveDesc(handle.value)


class Primitive(Owned):
    """A created primitive bound to its arguments (``{DNNL_ARG_*: Memory}``): ``step`` is the
    (function, *arguments) of one ``dnnl_primitive_execute`` call, ready for a tight loop."""

    _destroy = "dnnl_primitive_destroy"

    def __init__(self, pd: PrimitiveDesc, args: dict[int, Memory]):
        handle = _P()
        call("dnnl_primitive_create", ctypes.byref(handle), pd.handle)
        self.handle = handle.value
        self.impl = pd.impl
        self.memories = list(args.values())  # kept alive while the primitive may run
        self.args = (ExecArg * len(args))(*(ExecArg(k, m.handle) for k, m in args.items()))
        self.step = (lib().dnnl_primitive_execute, self.handle, stream(), len(args), self.args)

    def execute(self) -> None:
        fn, *rest = self.step
        check(fn(*rest), "dnnl_primitive_execute")



def reorder(src: Memory, dst: Memory) -> Primitive:
    pd = reorder_desc(src.md, dst.md)
    try:
        return Primitive(pd, {ARG_FROM: src, ARG_TO: dst})
    finally:
        pd.close()


def reorder_now(src: Memory, dst: Memory) -> None:
    primitive = reorder(src, dst)
    try:
        primitive.execute()
        wait()
    finally:
        primitive.close()
