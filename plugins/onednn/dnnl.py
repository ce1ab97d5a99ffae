"""A ctypes binding over oneDNN 2.x's C API (Debian's libdnnl.so.2, 2.6.3), as much as the plugin
needs: a CPU engine and stream, memory descriptors and memories, the forward primitives a CNN
runs (convolution, deconvolution, inner product, pooling, eltwise, binary, softmax, concat,
reorder), post-ops, and the primitive descriptor iterator that walks every implementation
oneDNN has for an operation.

Every call's ``dnnl_status_t`` is checked: a failure raises ``DnnlError`` naming the call.
Enum values and struct layouts are those of the 2.x headers (dnnl_types.h), stable across the
2.x soname; ``MemoryDesc`` is checked against its C size (696 bytes on LP64) at load.

Threads: Debian builds oneDNN with the OpenMP runtime (libgomp), where a primitive runs on
``omp_get_max_threads()`` threads of the calling thread, read when the primitive descriptor is
created (the JIT kernels split their work then) and when it executes; ``set_threads`` sets it
through the libgomp that libdnnl itself loaded.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Iterable, Sequence

import numpy as np

SONAME = "libdnnl.so.2"
DEBIAN_PACKAGE = "libdnnl2"
MAX_NDIMS = 12

# -- enums (dnnl_types.h, oneDNN 2.6) --------------------------------------------------------
SUCCESS, ITERATOR_ENDS = 0, 4
BF16, F32 = 2, 3  # dnnl_data_type_t
ITEM_SIZE = {BF16: 2, F32: 4}
FORMAT_KIND_ANY, FORMAT_KIND_BLOCKED = 1, 2
CPU_ENGINE = 1
STREAM_DEFAULT_FLAGS = 1
FORWARD_INFERENCE = 96
RUNTIME_OMP, RUNTIME_SEQ, RUNTIME_TBB, RUNTIME_THREADPOOL = 2, 1, 4, 8

TAGS = {  # dnnl_format_tag_t
    "any": 1, "a": 2, "x": 2, "ab": 3, "nc": 3, "oi": 3, "abc": 4, "ncw": 4, "abcd": 5, "nchw": 5, "oihw": 5,
    "abcde": 7, "goihw": 7, "ba": 22, "io": 22, "iohw": 24, "giohw": 18, "acdb": 20, "nhwc": 20,
    "nChw4c": 75, "nChw8c": 93, "nChw16c": 69,
}

CONVOLUTION = {"direct": 1, "winograd": 2}
DECONVOLUTION_DIRECT = 10
ELTWISE = {  # dnnl_alg_kind_t
    "relu": 0x1F, "tanh": 0x2F, "elu": 0x3F, "linear": 0x7F, "bounded_relu": 0x8F, "logistic": 0xAF,
    "swish": 0xDF, "clip": 0xFF, "clip_v2": 0x10, "hardswish": 0x70,
}
POOLING = {"max": 0x1FF, "avg_include_padding": 0x2FF, "avg_exclude_padding": 0x3FF}
BINARY = {"add": 0x1FFF0, "mul": 0x1FFF1, "max": 0x1FFF2, "min": 0x1FFF3, "div": 0x1FFF4, "sub": 0x1FFF5}

QUERY_IMPL_INFO_STR = 8
QUERY_SRC_MD, QUERY_WEIGHTS_MD, QUERY_DST_MD, QUERY_SCRATCHPAD_MD = 129, 131, 133, 136

ARG_SRC, ARG_SRC_1, ARG_DST, ARG_WEIGHTS, ARG_BIAS = 1, 2, 17, 33, 41
ARG_FROM, ARG_TO = 1, 17
ARG_MULTIPLE_SRC = 1024

Dims = ctypes.c_int64 * MAX_NDIMS


class DnnlError(RuntimeError):
    def __init__(self, status: int, call: str):
        self.status = status
        self.call = call
        super().__init__(f"oneDNN {call} failed: {status_name(status)} (status {status})")


class BlockingDesc(ctypes.Structure):
    _fields_ = [("strides", Dims), ("inner_nblks", ctypes.c_int), ("inner_blks", Dims), ("inner_idxs", Dims)]


class _FormatDesc(ctypes.Union):  # blocking, wino_desc (48 bytes) and rnn_packed_desc (296 bytes)
    _fields_ = [("blocking", BlockingDesc), ("reserved", ctypes.c_uint8 * 296)]


class _ExtraDesc(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("compensation_mask", ctypes.c_int), ("scale_adjust", ctypes.c_float),
                ("asymm_compensation_mask", ctypes.c_int), ("reserved", ctypes.c_char * 60)]


class MemoryDesc(ctypes.Structure):
    """dnnl_memory_desc_t."""
    _fields_ = [("ndims", ctypes.c_int), ("dims", Dims), ("data_type", ctypes.c_int), ("padded_dims", Dims),
                ("padded_offsets", Dims), ("offset0", ctypes.c_int64), ("format_kind", ctypes.c_int),
                ("format_desc", _FormatDesc), ("extra", _ExtraDesc)]

    @property
    def shape(self) -> list[int]:
        return [int(self.dims[i]) for i in range(self.ndims)]

    def copy(self) -> "MemoryDesc":
        other = MemoryDesc()
        ctypes.pointer(other)[0] = self
        return other


class ExecArg(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_int), ("memory", ctypes.c_void_p)]


class Version(ctypes.Structure):
    _fields_ = [("major", ctypes.c_int), ("minor", ctypes.c_int), ("patch", ctypes.c_int), ("hash", ctypes.c_char_p),
                ("cpu_runtime", ctypes.c_uint), ("gpu_runtime", ctypes.c_uint)]


# Operation descriptors are only passed by pointer: a buffer larger than any of them (the largest
# here, dnnl_convolution_desc_t, is 5,976 bytes) and 8-byte aligned.
OpDesc = ctypes.c_int64 * 1024

_P = ctypes.c_void_p
_MD = ctypes.POINTER(MemoryDesc)
_SIGNATURES = {
    "dnnl_engine_create": [ctypes.POINTER(_P), ctypes.c_int, ctypes.c_size_t],
    "dnnl_engine_destroy": [_P],
    "dnnl_stream_create": [ctypes.POINTER(_P), _P, ctypes.c_uint],
    "dnnl_stream_wait": [_P],
    "dnnl_stream_destroy": [_P],
    "dnnl_memory_desc_init_by_tag": [_MD, ctypes.c_int, Dims, ctypes.c_int, ctypes.c_int],
    "dnnl_memory_desc_init_by_strides": [_MD, ctypes.c_int, Dims, ctypes.c_int, Dims],
    "dnnl_memory_desc_reshape": [_MD, _MD, ctypes.c_int, Dims],
    "dnnl_memory_create": [ctypes.POINTER(_P), _MD, _P, _P],
    "dnnl_memory_set_data_handle": [_P, _P],
    "dnnl_memory_destroy": [_P],
    "dnnl_primitive_attr_create": [ctypes.POINTER(_P)],
    "dnnl_primitive_attr_destroy": [_P],
    "dnnl_primitive_attr_set_post_ops": [_P, _P],
    "dnnl_primitive_attr_set_fpmath_mode": [_P, ctypes.c_int],
    "dnnl_post_ops_create": [ctypes.POINTER(_P)],
    "dnnl_post_ops_destroy": [_P],
    "dnnl_post_ops_append_eltwise": [_P, ctypes.c_float, ctypes.c_int, ctypes.c_float, ctypes.c_float],
    "dnnl_convolution_forward_desc_init": [_P, ctypes.c_int, ctypes.c_int, _MD, _MD, _MD, _MD, Dims, Dims, Dims],
    "dnnl_dilated_convolution_forward_desc_init": [_P, ctypes.c_int, ctypes.c_int, _MD, _MD, _MD, _MD, Dims, Dims,
                                                   Dims, Dims],
    "dnnl_dilated_deconvolution_forward_desc_init": [_P, ctypes.c_int, ctypes.c_int, _MD, _MD, _MD, _MD, Dims, Dims,
                                                     Dims, Dims],
    "dnnl_inner_product_forward_desc_init": [_P, ctypes.c_int, _MD, _MD, _MD, _MD],
    "dnnl_pooling_v2_forward_desc_init": [_P, ctypes.c_int, ctypes.c_int, _MD, _MD, Dims, Dims, Dims, Dims, Dims],
    "dnnl_eltwise_forward_desc_init": [_P, ctypes.c_int, ctypes.c_int, _MD, ctypes.c_float, ctypes.c_float],
    "dnnl_binary_desc_init": [_P, ctypes.c_int, _MD, _MD, _MD],
    "dnnl_softmax_forward_desc_init": [_P, ctypes.c_int, _MD, ctypes.c_int],
    "dnnl_concat_primitive_desc_create": [ctypes.POINTER(_P), _MD, ctypes.c_int, ctypes.c_int, _MD, _P, _P],
    "dnnl_reorder_primitive_desc_create": [ctypes.POINTER(_P), _MD, _P, _MD, _P, _P],
    "dnnl_primitive_desc_iterator_create": [ctypes.POINTER(_P), _P, _P, _P, _P],
    "dnnl_primitive_desc_iterator_next": [_P],
    "dnnl_primitive_desc_iterator_destroy": [_P],
    "dnnl_primitive_desc_create": [ctypes.POINTER(_P), _P, _P, _P, _P],
    "dnnl_primitive_desc_destroy": [_P],
    "dnnl_primitive_desc_query": [_P, ctypes.c_int, ctypes.c_int, _P],
    "dnnl_primitive_create": [ctypes.POINTER(_P), _P],
    "dnnl_primitive_execute": [_P, _P, ctypes.c_int, ctypes.POINTER(ExecArg)],
    "dnnl_primitive_destroy": [_P],
}


@functools.lru_cache(maxsize=None)
def lib() -> ctypes.CDLL:
    """libdnnl.so.2 with its functions' signatures set; raises OSError when it cannot be loaded."""
    dll = ctypes.CDLL(SONAME)
    if ctypes.sizeof(MemoryDesc) != 696:
        raise OSError(f"dnnl_memory_desc_t layout mismatch ({ctypes.sizeof(MemoryDesc)} bytes): not oneDNN 2.x")
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(dll, name)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int
    dll.dnnl_version.restype = ctypes.POINTER(Version)
    dll.dnnl_version.argtypes = []
    dll.dnnl_primitive_desc_iterator_fetch.restype = _P
    dll.dnnl_primitive_desc_iterator_fetch.argtypes = [_P]
    dll.dnnl_primitive_desc_query_md.restype = _MD
    dll.dnnl_primitive_desc_query_md.argtypes = [_P, ctypes.c_int, ctypes.c_int]
    dll.dnnl_memory_desc_equal.restype = ctypes.c_int
    dll.dnnl_memory_desc_equal.argtypes = [_MD, _MD]
    dll.dnnl_memory_desc_get_size.restype = ctypes.c_size_t
    dll.dnnl_memory_desc_get_size.argtypes = [_MD]
    for name in ("dnnl_status2str", "dnnl_runtime2str"):
        getattr(dll, name).restype = ctypes.c_char_p
        getattr(dll, name).argtypes = [ctypes.c_uint]
    dll.dnnl_get_effective_cpu_isa.restype = ctypes.c_int
    dll.dnnl_get_effective_cpu_isa.argtypes = []
    dll.dnnl_cpu_isa2str.restype = ctypes.c_char_p
    dll.dnnl_cpu_isa2str.argtypes = [ctypes.c_int]
    version = dll.dnnl_version().contents
    if version.major != 2:
        raise OSError(f"{SONAME} reports oneDNN {version.major}.{version.minor}: this binding is for 2.x")
    return dll


def availability() -> tuple[bool, str]:
    try:
        lib()
        engine()
    except (OSError, DnnlError) as exc:
        return False, f"{exc} (apt-get install libdnnl-dev)"
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


def effective_isa() -> str:
    """The instruction set oneDNN's JIT kernels use here, e.g. ``avx512_core_bf16``."""
    dll = lib()
    return dll.dnnl_cpu_isa2str(dll.dnnl_get_effective_cpu_isa()).decode().removeprefix("cpu_isa_")


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


# -- memory descriptors and memories ----------------------------------------------------------
def _dims(values: Sequence[int]) -> Dims:
    dims = Dims()
    for i, v in enumerate(values):
        dims[i] = int(v)
    return dims


def desc(shape: Sequence[int], tag: str = "any", data_type: int = F32) -> MemoryDesc:
    """A memory descriptor of ``shape`` in format ``tag`` (a name of ``TAGS``), f32 unless told."""
    md = MemoryDesc()
    call("dnnl_memory_desc_init_by_tag", ctypes.byref(md), len(shape), _dims(shape), data_type, TAGS[tag])
    return md


def as_data_type(md: MemoryDesc, data_type: int) -> MemoryDesc:
    """``md``'s layout (blocking, padding: counted in elements) holding ``data_type``."""
    other = md.copy()
    other.data_type = data_type
    return other


def plain_desc(shape: Sequence[int]) -> MemoryDesc:
    """Row-major (ONNX / numpy order) f32 descriptor of any rank."""
    strides, step = [], 1
    for d in reversed(shape):
        strides.insert(0, step)
        step *= int(d)
    md = MemoryDesc()
    call("dnnl_memory_desc_init_by_strides", ctypes.byref(md), len(shape), _dims(shape), F32, _dims(strides))
    return md


def reshape(md: MemoryDesc, shape: Sequence[int]) -> MemoryDesc:
    out = MemoryDesc()
    call("dnnl_memory_desc_reshape", ctypes.byref(out), ctypes.byref(md), len(shape), _dims(shape))
    return out


def equal(a: MemoryDesc, b: MemoryDesc) -> bool:
    return bool(lib().dnnl_memory_desc_equal(ctypes.byref(a), ctypes.byref(b)))


def size_of(md: MemoryDesc) -> int:
    return int(lib().dnnl_memory_desc_get_size(ctypes.byref(md)))


def format_name(md: MemoryDesc, names: Iterable[str]) -> str | None:
    """Which of the format ``names`` ``md`` is (same shape), or None."""
    for name in names:
        try:
            if equal(md, desc(md.shape, name, md.data_type)):
                return name
        except DnnlError:  # a format of another rank
            continue
    return None


def aligned_buffer(floats: int) -> np.ndarray:
    """A float32 array of ``floats`` elements, 64-byte aligned."""
    raw = np.empty(max(int(floats), 1) + 16, np.float32)
    start = (-raw.ctypes.data % 64) // 4
    return raw[start:start + max(int(floats), 1)]


class _Owned:
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


class Memory(_Owned):
    """A oneDNN memory over a numpy buffer it owns (``buffer``: flat float32 holding the
    descriptor's size, padding included; a bf16 memory's elements are 2 bytes of it each)."""

    _destroy = "dnnl_memory_destroy"

    def __init__(self, md: MemoryDesc, buffer: np.ndarray | None = None):
        self.md = md.copy()
        self.nbytes = size_of(self.md)
        if buffer is None:
            buffer = aligned_buffer(-(-self.nbytes // 4))
            if self.nbytes > ITEM_SIZE[self.md.data_type] * np.prod(md.shape):
                buffer[:] = 0  # blocked formats pad channels: the padding must read as zeros
        elif buffer.nbytes < self.nbytes:
            raise ValueError(f"buffer of {buffer.nbytes} bytes for a memory of {self.nbytes}")
        self.buffer = buffer
        handle = _P()
        call("dnnl_memory_create", ctypes.byref(handle), ctypes.byref(self.md), engine(), self.buffer.ctypes.data)
        self.handle = handle.value

    @property
    def shape(self) -> list[int]:
        return self.md.shape

    def plain_view(self) -> np.ndarray:
        """The buffer as an array of the descriptor's shape (only meaningful in a plain format)."""
        return self.buffer[:int(np.prod(self.shape))].reshape(self.shape)



# -- attributes ----------------------------------------------------------------------------
# dnnl_fpmath_mode_t: how far an f32 primitive may round its operands down to compute faster
FPMATH_MODES = {"strict": 0, "bf16": 1}


class Attr(_Owned):
    """Primitive attributes holding eltwise post-ops: ``[(algorithm name, alpha, beta), ...]``, and
    the fp-math mode, ``strict`` unless told (set explicitly, whatever ONEDNN_DEFAULT_FPMATH_MODE says)."""

    _destroy = "dnnl_primitive_attr_destroy"

    def __init__(self, post_ops: Sequence[tuple[str, float, float]] = (), fpmath: str = "strict"):
        handle = _P()
        call("dnnl_primitive_attr_create", ctypes.byref(handle))
        self.handle = handle.value
        call("dnnl_primitive_attr_set_fpmath_mode", self.handle, FPMATH_MODES[fpmath])
        if post_ops:
            ops = _P()
            call("dnnl_post_ops_create", ctypes.byref(ops))
            try:
                for algorithm, alpha, beta in post_ops:
                    call("dnnl_post_ops_append_eltwise", ops, 1.0, ELTWISE[algorithm], float(alpha), float(beta))
                call("dnnl_primitive_attr_set_post_ops", self.handle, ops)
            finally:
                lib().dnnl_post_ops_destroy(ops)



# -- operation descriptors -------------------------------------------------------------------
def _ref(md: MemoryDesc | None):
    return None if md is None else ctypes.byref(md)


def convolution(src: MemoryDesc, weights: MemoryDesc, bias: MemoryDesc | None, dst: MemoryDesc, strides,
                dilations, pads_begin, pads_end, algorithm: str = "direct") -> OpDesc:
    """``dilations`` as ONNX has them (1 = dense); oneDNN counts the gaps (0 = dense)."""
    op = OpDesc()
    call("dnnl_dilated_convolution_forward_desc_init", op, FORWARD_INFERENCE, CONVOLUTION[algorithm], ctypes.byref(src),
         ctypes.byref(weights), _ref(bias), ctypes.byref(dst), _dims(strides), _dims([d - 1 for d in dilations]),
         _dims(pads_begin), _dims(pads_end))
    return op


def deconvolution(src: MemoryDesc, weights: MemoryDesc, bias: MemoryDesc | None, dst: MemoryDesc, strides,
                  dilations, pads_begin, pads_end) -> OpDesc:
    op = OpDesc()
    call("dnnl_dilated_deconvolution_forward_desc_init", op, FORWARD_INFERENCE, DECONVOLUTION_DIRECT,
         ctypes.byref(src), ctypes.byref(weights), _ref(bias), ctypes.byref(dst), _dims(strides),
         _dims([d - 1 for d in dilations]), _dims(pads_begin), _dims(pads_end))
    return op


def inner_product(src: MemoryDesc, weights: MemoryDesc, bias: MemoryDesc | None, dst: MemoryDesc) -> OpDesc:
    op = OpDesc()
    call("dnnl_inner_product_forward_desc_init", op, FORWARD_INFERENCE, ctypes.byref(src), ctypes.byref(weights),
         _ref(bias), ctypes.byref(dst))
    return op


def pooling(algorithm: str, src: MemoryDesc, dst: MemoryDesc, strides, kernel, dilations, pads_begin,
            pads_end) -> OpDesc:
    op = OpDesc()
    call("dnnl_pooling_v2_forward_desc_init", op, FORWARD_INFERENCE, POOLING[algorithm], ctypes.byref(src),
         ctypes.byref(dst), _dims(strides), _dims(kernel), _dims([d - 1 for d in dilations]), _dims(pads_begin),
         _dims(pads_end))
    return op


def eltwise(algorithm: str, data: MemoryDesc, alpha: float = 0.0, beta: float = 0.0) -> OpDesc:
    op = OpDesc()
    call("dnnl_eltwise_forward_desc_init", op, FORWARD_INFERENCE, ELTWISE[algorithm], ctypes.byref(data),
         float(alpha), float(beta))
    return op


def binary(algorithm: str, src0: MemoryDesc, src1: MemoryDesc, dst: MemoryDesc) -> OpDesc:
    op = OpDesc()
    call("dnnl_binary_desc_init", op, BINARY[algorithm], ctypes.byref(src0), ctypes.byref(src1), ctypes.byref(dst))
    return op


def softmax(data: MemoryDesc, axis: int) -> OpDesc:
    op = OpDesc()
    call("dnnl_softmax_forward_desc_init", op, FORWARD_INFERENCE, ctypes.byref(data), int(axis))
    return op


# -- primitive descriptors and primitives ------------------------------------------------------
class PrimitiveDesc(_Owned):
    _destroy = "dnnl_primitive_desc_destroy"
    def __init__(self, handle: int):
        self.handle = handle

    @property
    def impl(self) -> str:
        name = ctypes.c_char_p()
        call("dnnl_primitive_desc_query", self.handle, QUERY_IMPL_INFO_STR, 0, ctypes.byref(name))
        return name.value.decode()

    def md(self, what: int, index: int = 0) -> MemoryDesc:
        found = lib().dnnl_primitive_desc_query_md(self.handle, what, index)
        if not found:
            raise DnnlError(2, f"dnnl_primitive_desc_query_md({what}, {index})")
        return found.contents.copy()

    @property
    def src(self) -> MemoryDesc:
        return self.md(QUERY_SRC_MD)

    @property
    def weights(self) -> MemoryDesc:
        return self.md(QUERY_WEIGHTS_MD)

    @property
    def dst(self) -> MemoryDesc:
        return self.md(QUERY_DST_MD)



def implementations(op: OpDesc, attr: Attr | None = None) -> list[PrimitiveDesc]:
    """A primitive descriptor per implementation oneDNN has for ``op`` here, in its own order of
    preference (the first is what ``primitive_desc`` picks). Empty when none applies."""
    iterator = _P()
    status = lib().dnnl_primitive_desc_iterator_create(ctypes.byref(iterator), op, attr.handle if attr else None,
                                                        engine(), None)
    if status == 3:  # dnnl_unimplemented: no implementation for these descriptors
        return []
    check(status, "dnnl_primitive_desc_iterator_create")
    found = []
    try:
        while True:
            handle = lib().dnnl_primitive_desc_iterator_fetch(iterator)
            if not handle:
                raise DnnlError(5, "dnnl_primitive_desc_iterator_fetch")
            found.append(PrimitiveDesc(handle))
            status = lib().dnnl_primitive_desc_iterator_next(iterator)
            if status == ITERATOR_ENDS:
                return found
            check(status, "dnnl_primitive_desc_iterator_next")
    finally:
        lib().dnnl_primitive_desc_iterator_destroy(iterator)


def primitive_desc(op: OpDesc, attr: Attr | None = None) -> PrimitiveDesc:
    handle = _P()
    call("dnnl_primitive_desc_create", ctypes.byref(handle), op, attr.handle if attr else None, engine(), None)
    return PrimitiveDesc(handle.value)


def concat_desc(dst: MemoryDesc | None, axis: int, sources: Sequence[MemoryDesc]) -> PrimitiveDesc:
    array = (MemoryDesc * len(sources))(*sources)
    handle = _P()
    call("dnnl_concat_primitive_desc_create", ctypes.byref(handle), _ref(dst), len(sources), int(axis), array, None,
         engine())
    return PrimitiveDesc(handle.value)


def reorder_desc(src: MemoryDesc, dst: MemoryDesc) -> PrimitiveDesc:
    handle = _P()
    call("dnnl_reorder_primitive_desc_create", ctypes.byref(handle), ctypes.byref(src), engine(), ctypes.byref(dst),
         engine(), None)
    return PrimitiveDesc(handle.value)


class Primitive(_Owned):
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
