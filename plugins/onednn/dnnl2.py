"""oneDNN 2.x's C API (Debian 12's libdnnl.so.2, 2.6.3), the part that differs from 3.x: memory
descriptors are structs passed by pointer (``MemoryDesc``, checked against its C size, 696 bytes on
LP64, at load), operations are operation descriptors (``*_desc_init``) from which a primitive
descriptor is created, and ``dnnl_primitive_desc_iterator_*`` walks their implementations. Enum
values are those of the 2.x headers (dnnl_types.h), stable across the 2.x soname. dnnl.py loads this
module or dnnl3.py and calls it only through the names below."""

from __future__ import annotations

import ctypes
from typing import Sequence

from kselect.plugins.onednn import dnnl

TAGS = {  # dnnl_format_tag_t
    "any": 1, "a": 2, "x": 2, "ab": 3, "nc": 3, "oi": 3, "abc": 4, "ncw": 4, "abcd": 5, "nchw": 5, "oihw": 5,
    "abcde": 7, "goihw": 7, "ba": 22, "io": 22, "iohw": 24, "giohw": 18, "acdb": 20, "nhwc": 20,
    "nChw4c": 75, "nChw8c": 93, "nChw16c": 69,
}
ELTWISE = {  # dnnl_alg_kind_t
    "relu": 0x1F, "tanh": 0x2F, "elu": 0x3F, "linear": 0x7F, "logistic": 0xAF, "swish": 0xDF, "clip": 0xFF,
    "clip_v2": 0x10, "hardswish": 0x70,
}


def eltwise_kind(algorithm: str, alpha: float, beta: float) -> tuple[int, float, float]:
    """(dnnl_alg_kind_t, alpha, beta) of the eltwise ``algorithm`` (hardswish ignores alpha and beta in 2.x)."""
    return ELTWISE[algorithm], alpha, beta


class BlockingDesc(ctypes.Structure):
    _fields_ = [("strides", dnnl.Dims), ("inner_nblks", ctypes.c_int), ("inner_blks", dnnl.Dims),
                ("inner_idxs", dnnl.Dims)]


class _FormatDesc(ctypes.Union):  # blocking, wino_desc (48 bytes) and rnn_packed_desc (296 bytes)
    _fields_ = [("blocking", BlockingDesc), ("reserved", ctypes.c_uint8 * 296)]


class _ExtraDesc(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("compensation_mask", ctypes.c_int), ("scale_adjust", ctypes.c_float),
                ("asymm_compensation_mask", ctypes.c_int), ("reserved", ctypes.c_char * 60)]


class MemoryDesc(ctypes.Structure):
    """dnnl_memory_desc_t (a C function declared to take its pointer takes the struct itself)."""
    _fields_ = [("ndims", ctypes.c_int), ("dims", dnnl.Dims), ("data_type", ctypes.c_int),
                ("padded_dims", dnnl.Dims), ("padded_offsets", dnnl.Dims), ("offset0", ctypes.c_int64),
                ("format_kind", ctypes.c_int), ("format_desc", _FormatDesc), ("extra", _ExtraDesc)]

    @property
    def shape(self) -> list[int]:
        return [int(self.dims[i]) for i in range(self.ndims)]

    def copy(self) -> "MemoryDesc":
        other = MemoryDesc()
        ctypes.pointer(other)[0] = self
        return other


MD_ARG = ctypes.POINTER(MemoryDesc)  # how the C functions take a memory descriptor

# Operation descriptors are only passed by pointer: a buffer larger than any of them (the largest
# here, dnnl_convolution_desc_t, is 5,976 bytes) and 8-byte aligned.
OpDesc = ctypes.c_int64 * 1024

_P = ctypes.c_void_p
_D = dnnl.Dims
SIGNATURES = {
    "dnnl_memory_desc_init_by_tag": [MD_ARG, ctypes.c_int, _D, ctypes.c_int, ctypes.c_int],
    "dnnl_memory_desc_init_by_strides": [MD_ARG, ctypes.c_int, _D, ctypes.c_int, _D],
    "dnnl_post_ops_append_eltwise": [_P, ctypes.c_float, ctypes.c_int, ctypes.c_float, ctypes.c_float],
    "dnnl_post_ops_append_sum": [_P, ctypes.c_float],
    "dnnl_dilated_convolution_forward_desc_init": [_P, ctypes.c_int, ctypes.c_int, MD_ARG, MD_ARG, MD_ARG, MD_ARG,
                                                   _D, _D, _D, _D],
    "dnnl_dilated_deconvolution_forward_desc_init": [_P, ctypes.c_int, ctypes.c_int, MD_ARG, MD_ARG, MD_ARG, MD_ARG,
                                                     _D, _D, _D, _D],
    "dnnl_inner_product_forward_desc_init": [_P, ctypes.c_int, MD_ARG, MD_ARG, MD_ARG, MD_ARG],
    "dnnl_pooling_v2_forward_desc_init": [_P, ctypes.c_int, ctypes.c_int, MD_ARG, MD_ARG, _D, _D, _D, _D, _D],
    "dnnl_eltwise_forward_desc_init": [_P, ctypes.c_int, ctypes.c_int, MD_ARG, ctypes.c_float, ctypes.c_float],
    "dnnl_binary_desc_init": [_P, ctypes.c_int, MD_ARG, MD_ARG, MD_ARG],
    "dnnl_softmax_forward_desc_init": [_P, ctypes.c_int, MD_ARG, ctypes.c_int],
    "dnnl_concat_primitive_desc_create": [ctypes.POINTER(_P), MD_ARG, ctypes.c_int, ctypes.c_int, MD_ARG, _P, _P],
    "dnnl_primitive_desc_iterator_create": [ctypes.POINTER(_P), _P, _P, _P, _P],
    "dnnl_primitive_desc_iterator_next": [_P],
    "dnnl_primitive_desc_iterator_destroy": [_P],
    "dnnl_primitive_desc_create": [ctypes.POINTER(_P), _P, _P, _P, _P],
}
RESTYPES = {"dnnl_primitive_desc_iterator_fetch": (_P, [_P]),
            "dnnl_primitive_desc_query_md": (MD_ARG, [_P, ctypes.c_int, ctypes.c_int])}


def check_layout() -> None:
    if ctypes.sizeof(MemoryDesc) != 696:
        raise OSError(f"dnnl_memory_desc_t layout mismatch ({ctypes.sizeof(MemoryDesc)} bytes): not oneDNN 2.x")


# -- memory descriptors ------------------------------------------------------------------------
def desc(shape: Sequence[int], tag: str, data_type: int) -> MemoryDesc:
    md = MemoryDesc()
    dnnl.call("dnnl_memory_desc_init_by_tag", md, len(shape), dnnl.dims(shape), data_type, TAGS[tag])
    return md


def strided_desc(shape: Sequence[int], strides: Sequence[int], data_type: int) -> MemoryDesc:
    md = MemoryDesc()
    dnnl.call("dnnl_memory_desc_init_by_strides", md, len(shape), dnnl.dims(shape), data_type, dnnl.dims(strides))
    return md


def as_data_type(md: MemoryDesc, data_type: int) -> MemoryDesc:
    other = md.copy()
    other.data_type = data_type
    return other


def md_key(md: MemoryDesc) -> bytes:
    return ctypes.string_at(ctypes.addressof(md), ctypes.sizeof(md))


def query_md(pd: int, what: int, index: int) -> MemoryDesc | None:
    found = dnnl.lib().dnnl_primitive_desc_query_md(pd, what, index)
    return found.contents.copy() if found else None


# -- operations --------------------------------------------------------------------------------
def append_eltwise(post_ops: int, algorithm: int, alpha: float, beta: float) -> None:
    dnnl.call("dnnl_post_ops_append_eltwise", post_ops, 1.0, algorithm, alpha, beta)  # 1.0: the post-op's scale


def append_sum(post_ops: int, scale: float) -> None:
    dnnl.call("dnnl_post_ops_append_sum", post_ops, scale)


def convolution(src, weights, bias, dst, strides, gaps, pads_begin, pads_end, algorithm: int) -> OpDesc:
    op = OpDesc()
    dnnl.call("dnnl_dilated_convolution_forward_desc_init", op, dnnl.FORWARD_INFERENCE, algorithm, src, weights, bias,
              dst, strides, gaps, pads_begin, pads_end)
    return op


def deconvolution(src, weights, bias, dst, strides, gaps, pads_begin, pads_end) -> OpDesc:
    op = OpDesc()
    dnnl.call("dnnl_dilated_deconvolution_forward_desc_init", op, dnnl.FORWARD_INFERENCE, dnnl.DECONVOLUTION_DIRECT,
              src, weights, bias, dst, strides, gaps, pads_begin, pads_end)
    return op


def inner_product(src, weights, bias, dst) -> OpDesc:
    op = OpDesc()
    dnnl.call("dnnl_inner_product_forward_desc_init", op, dnnl.FORWARD_INFERENCE, src, weights, bias, dst)
    return op


def pooling(algorithm: int, src, dst, strides, kernel, gaps, pads_begin, pads_end) -> OpDesc:
    op = OpDesc()
    dnnl.call("dnnl_pooling_v2_forward_desc_init", op, dnnl.FORWARD_INFERENCE, algorithm, src, dst, strides, kernel,
              gaps, pads_begin, pads_end)
    return op


def eltwise(algorithm: int, data, alpha: float, beta: float) -> OpDesc:
    op = OpDesc()
    dnnl.call("dnnl_eltwise_forward_desc_init", op, dnnl.FORWARD_INFERENCE, algorithm, data, alpha, beta)
    return op


def binary(algorithm: int, src0, src1, dst) -> OpDesc:
    op = OpDesc()
    dnnl.call("dnnl_binary_desc_init", op, algorithm, src0, src1, dst)
    return op


def softmax(data, axis: int) -> OpDesc:
    op = OpDesc()
    dnnl.call("dnnl_softmax_forward_desc_init", op, dnnl.FORWARD_INFERENCE, data, axis)
    return op


# -- primitive descriptors ---------------------------------------------------------------------
def implementations(op: OpDesc, attr: int | None) -> list[int]:
    """The primitive descriptor handles the iterator yields, in its order; empty when none applies."""
    dll, iterator = dnnl.lib(), _P()
    status = dll.dnnl_primitive_desc_iterator_create(ctypes.byref(iterator), op, attr, dnnl.engine(), None)
    if status == dnnl.UNIMPLEMENTED:
        return []
    dnnl.check(status, "dnnl_primitive_desc_iterator_create")
    found = []
    try:
        while True:
            handle = dll.dnnl_primitive_desc_iterator_fetch(iterator)
            if not handle:
                raise dnnl.DnnlError(5, "dnnl_primitive_desc_iterator_fetch")
            found.append(handle)
            status = dll.dnnl_primitive_desc_iterator_next(iterator)
            if status == dnnl.LAST_IMPLEMENTATION:
                return found
            dnnl.check(status, "dnnl_primitive_desc_iterator_next")
    except BaseException:
        for handle in found:
            dll.dnnl_primitive_desc_destroy(handle)
        raise
    finally:
        dll.dnnl_primitive_desc_iterator_destroy(iterator)


def primitive_desc(op: OpDesc, attr: int | None) -> int:
    handle = _P()
    dnnl.call("dnnl_primitive_desc_create", ctypes.byref(handle), op, attr, dnnl.engine(), None)
    return handle.value


def concat_desc(dst: MemoryDesc | None, axis: int, sources: Sequence[MemoryDesc]) -> int:
    handle = _P()
    array = (MemoryDesc * len(sources))(*sources)
    dnnl.call("dnnl_concat_primitive_desc_create", ctypes.byref(handle), dst, len(sources), axis, array, None,
              dnnl.engine())
    return handle.value
