"""oneDNN 3.x's C API (Debian 13's libdnnl.so.3.6, 3.7.2), the part that differs from 2.x: memory
descriptors are opaque handles (``dnnl_memory_desc_create_with_*``, read with
``dnnl_memory_desc_query``), there are no operation descriptors (each primitive kind has its
``*_primitive_desc_create`` taking the engine and attributes), and ``dnnl_primitive_desc_next_impl``
moves a primitive descriptor to the next implementation. Enum values are those of the 3.7 headers
(oneapi/dnnl/dnnl_types.h), where format tags and eltwise algorithms were renumbered. dnnl.py loads
this module or dnnl2.py and calls it only through the names below."""

from __future__ import annotations

import ctypes
from typing import Sequence

from kselect.plugins.onednn import dnnl

TAGS = {  # dnnl_format_tag_t
    "any": 1, "a": 2, "x": 2, "ab": 3, "nc": 3, "oi": 3, "abc": 4, "ncw": 4, "abcd": 5, "nchw": 5, "oihw": 5,
    "abcde": 6, "goihw": 6, "ba": 14, "io": 14, "iohw": 25, "giohw": 32, "acdb": 22, "nhwc": 22,
    "nChw4c": 84, "nChw8c": 102, "nChw16c": 78,
}
ELTWISE = {  # dnnl_alg_kind_t
    "relu": 32, "tanh": 33, "elu": 34, "linear": 38, "logistic": 41, "swish": 44, "clip": 46, "clip_v2": 47,
    "hardswish": 52,
}


def eltwise_kind(algorithm: str, alpha: float, beta: float) -> tuple[int, float, float]:
    """(dnnl_alg_kind_t, alpha, beta) of the eltwise ``algorithm``. 2.x's hardswish is ONNX's
    HardSwish, ``x * clip(x / 6 + 1 / 2, 0, 1)``, and ignores alpha and beta; 3.x's takes the slope
    and shift as alpha and beta (zeros give zeros), so "hardswish" is given ONNX's."""
    if algorithm == "hardswish":
        return ELTWISE[algorithm], 1 / 6, 0.5
    return ELTWISE[algorithm], alpha, beta


SOFTMAX_ACCURATE = 0x30000
QUERY_NDIMS, QUERY_DIMS, QUERY_DATA_TYPE = 256, 257, 258  # dnnl_query_t, on a memory descriptor

_P = ctypes.c_void_p
_D = dnnl.Dims
MD_ARG = _P  # how the C functions take a memory descriptor: its handle (``MemoryDesc._as_parameter_``)
_PD = ctypes.POINTER(_P)
_I, _F = ctypes.c_int, ctypes.c_float
SIGNATURES = {
    "dnnl_memory_desc_create_with_tag": [ctypes.POINTER(_P), _I, _D, _I, _I],
    "dnnl_memory_desc_create_with_strides": [ctypes.POINTER(_P), _I, _D, _I, _D],
    "dnnl_memory_desc_clone": [ctypes.POINTER(_P), _P],
    "dnnl_memory_desc_destroy": [_P],
    "dnnl_memory_desc_query": [_P, _I, _P],
    "dnnl_memory_desc_get_blob": [_P, ctypes.POINTER(ctypes.c_size_t), _P],
    "dnnl_post_ops_append_eltwise": [_P, _I, _F, _F],
    "dnnl_post_ops_append_sum": [_P, _F, ctypes.c_int32, _I],
    "dnnl_convolution_forward_primitive_desc_create": [_PD, _P, _I, _I, _P, _P, _P, _P, _D, _D, _D, _D, _P],
    "dnnl_deconvolution_forward_primitive_desc_create": [_PD, _P, _I, _I, _P, _P, _P, _P, _D, _D, _D, _D, _P],
    "dnnl_inner_product_forward_primitive_desc_create": [_PD, _P, _I, _P, _P, _P, _P, _P],
    "dnnl_pooling_forward_primitive_desc_create": [_PD, _P, _I, _I, _P, _P, _D, _D, _D, _D, _D, _P],
    "dnnl_eltwise_forward_primitive_desc_create": [_PD, _P, _I, _I, _P, _P, _F, _F, _P],
    "dnnl_binary_primitive_desc_create": [_PD, _P, _I, _P, _P, _P, _P],
    "dnnl_softmax_forward_primitive_desc_create": [_PD, _P, _I, _I, _P, _P, _I, _P],
    "dnnl_concat_primitive_desc_create": [_PD, _P, _P, _I, _I, ctypes.POINTER(_P), _P],
    "dnnl_primitive_desc_next_impl": [_P],
    "dnnl_primitive_desc_clone": [_PD, _P],
}
RESTYPES = {"dnnl_primitive_desc_query_md": (_P, [_P, _I, _I])}


def check_layout() -> None:
    """Nothing to check: 3.x's descriptors are opaque."""


class MemoryDesc(dnnl.Owned):
    """An owned ``dnnl_memory_desc_t`` handle; a C function declared to take one takes this object."""

    _destroy = "dnnl_memory_desc_destroy"

    def __init__(self, handle: int):
        self.handle = handle
        self._as_parameter_ = ctypes.c_void_p(handle)

    def _query(self, what: int, result) -> None:
        dnnl.call("dnnl_memory_desc_query", self.handle, what, ctypes.byref(result))

    @property
    def ndims(self) -> int:
        ndims = ctypes.c_int()
        self._query(QUERY_NDIMS, ndims)
        return ndims.value

    @property
    def shape(self) -> list[int]:
        dims = ctypes.POINTER(dnnl.Dims)()  # the descriptor's own array
        self._query(QUERY_DIMS, dims)
        return [int(dims.contents[i]) for i in range(self.ndims)]

    @property
    def data_type(self) -> int:
        data_type = ctypes.c_int()
        self._query(QUERY_DATA_TYPE, data_type)
        return data_type.value

    def copy(self) -> "MemoryDesc":
        return _clone(self.handle)


def _clone(handle: int) -> MemoryDesc:
    other = _P()
    dnnl.call("dnnl_memory_desc_clone", ctypes.byref(other), handle)
    return MemoryDesc(other.value)


# -- memory descriptors ------------------------------------------------------------------------
def desc(shape: Sequence[int], tag: str, data_type: int) -> MemoryDesc:
    handle = _P()
    dnnl.call("dnnl_memory_desc_create_with_tag", ctypes.byref(handle), len(shape), dnnl.dims(shape), data_type,
              TAGS[tag])
    return MemoryDesc(handle.value)


def strided_desc(shape: Sequence[int], strides: Sequence[int], data_type: int) -> MemoryDesc:
    handle = _P()
    dnnl.call("dnnl_memory_desc_create_with_strides", ctypes.byref(handle), len(shape), dnnl.dims(shape), data_type,
              dnnl.dims(strides))
    return MemoryDesc(handle.value)


def as_data_type(md: MemoryDesc, data_type: int) -> MemoryDesc:
    """3.x has no setter for a descriptor's data type: the same format tag with ``data_type``."""
    if md.data_type == data_type:
        return md.copy()
    tag = dnnl.format_name(md, (name for name in TAGS if name != "any"))
    if tag is None:
        raise dnnl.DnnlError(3, f"as_data_type: the layout of {md.shape} is none of the format tags {list(TAGS)}")
    return desc(md.shape, tag, data_type)


def md_key(md: MemoryDesc) -> bytes:
    """The descriptor serialised (``dnnl_memory_desc_get_blob``): equal descriptors, equal bytes."""
    size = ctypes.c_size_t()
    dnnl.call("dnnl_memory_desc_get_blob", None, ctypes.byref(size), md)
    blob = (ctypes.c_uint8 * size.value)()
    dnnl.call("dnnl_memory_desc_get_blob", blob, ctypes.byref(size), md)
    return bytes(blob)


def query_md(pd: int, what: int, index: int) -> MemoryDesc | None:
    found = dnnl.lib().dnnl_primitive_desc_query_md(pd, what, index)  # owned by the primitive descriptor
    return _clone(found) if found else None


# -- operations: the primitive descriptor's creation call, less the descriptor and attributes ----
class Operation:
    """``dnnl_<kind>_primitive_desc_create(pd, engine, *arguments, attr)``: what a 2.x operation
    descriptor held. Keeps its memory descriptors alive."""

    def __init__(self, function: str, *arguments):
        self.function = function
        self.arguments = arguments

    def create(self, attr: int | None) -> tuple[int, int | None]:
        """(status, the first implementation's primitive descriptor handle on success)."""
        handle = _P()
        status = getattr(dnnl.lib(), self.function)(ctypes.byref(handle), dnnl.engine(), *self.arguments, attr)
        return status, handle.value


def append_eltwise(post_ops: int, algorithm: int, alpha: float, beta: float) -> None:
    dnnl.call("dnnl_post_ops_append_eltwise", post_ops, algorithm, alpha, beta)


def append_sum(post_ops: int, scale: float) -> None:
    dnnl.call("dnnl_post_ops_append_sum", post_ops, scale, 0, dnnl.DATA_TYPE_UNDEF)  # zero point 0, dst's type


def convolution(src, weights, bias, dst, strides, gaps, pads_begin, pads_end, algorithm: int) -> Operation:
    return Operation("dnnl_convolution_forward_primitive_desc_create", dnnl.FORWARD_INFERENCE, algorithm, src, weights,
                     bias, dst, strides, gaps, pads_begin, pads_end)


def deconvolution(src, weights, bias, dst, strides, gaps, pads_begin, pads_end) -> Operation:
    return Operation("dnnl_deconvolution_forward_primitive_desc_create", dnnl.FORWARD_INFERENCE,
                     dnnl.DECONVOLUTION_DIRECT, src, weights, bias, dst, strides, gaps, pads_begin, pads_end)


def inner_product(src, weights, bias, dst) -> Operation:
    return Operation("dnnl_inner_product_forward_primitive_desc_create", dnnl.FORWARD_INFERENCE, src, weights, bias,
                     dst)


def pooling(algorithm: int, src, dst, strides, kernel, gaps, pads_begin, pads_end) -> Operation:
    return Operation("dnnl_pooling_forward_primitive_desc_create", dnnl.FORWARD_INFERENCE, algorithm, src, dst,
                     strides, kernel, gaps, pads_begin, pads_end)


def eltwise(algorithm: int, data, alpha: float, beta: float) -> Operation:
    return Operation("dnnl_eltwise_forward_primitive_desc_create", dnnl.FORWARD_INFERENCE, algorithm, data, data,
                     alpha, beta)


def binary(algorithm: int, src0, src1, dst) -> Operation:
    return Operation("dnnl_binary_primitive_desc_create", algorithm, src0, src1, dst)


def softmax(data, axis: int) -> Operation:
    return Operation("dnnl_softmax_forward_primitive_desc_create", dnnl.FORWARD_INFERENCE, SOFTMAX_ACCURATE, data,
                     data, axis)


# -- primitive descriptors ---------------------------------------------------------------------
def implementations(op: Operation, attr: int | None) -> list[int]:
    """A primitive descriptor handle per implementation, in oneDNN's order: the first as created,
    each next one a clone after ``dnnl_primitive_desc_next_impl``; empty when none applies."""
    dll = dnnl.lib()
    status, walker = op.create(attr)
    if status == dnnl.UNIMPLEMENTED:
        return []
    dnnl.check(status, op.function)
    found = []
    try:
        while True:
            clone = _P()
            dnnl.call("dnnl_primitive_desc_clone", ctypes.byref(clone), walker)
            found.append(clone.value)
            status = dll.dnnl_primitive_desc_next_impl(walker)
            if status == dnnl.LAST_IMPLEMENTATION:
                return found
            dnnl.check(status, "dnnl_primitive_desc_next_impl")
    except BaseException:
        for handle in found:
            dll.dnnl_primitive_desc_destroy(handle)
        raise
    finally:
        dll.dnnl_primitive_desc_destroy(walker)


def primitive_desc(op: Operation, attr: int | None) -> int:
    status, handle = op.create(attr)
    dnnl.check(status, op.function)
    return handle


def concat_desc(dst: MemoryDesc | None, axis: int, sources: Sequence[MemoryDesc]) -> int:
    handle = _P()
    array = (_P * len(sources))(*(md.handle for md in sources))
    dnnl.call("dnnl_concat_primitive_desc_create", ctypes.byref(handle), dnnl.engine(), dst, len(sources), axis,
              array, None)
    return handle.value
