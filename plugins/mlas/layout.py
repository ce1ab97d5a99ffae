"""MLAS's NCHWc layout: the block size (``nchwc_block_size``), NCHW <-> blocked arrays
(``to_blocked``, ``nchwc_feed``, ``from_blocked``), the filter reorders (OIHWBiBo, OIHWBo), and
which convs can run as NCHWc and read blocked input (``conv_nchwc_unsupported``,
``conv_takes_blocked_input``, ``pack_conv``), shared by the whole-graph rewrite (rewrite.py) and
the single-op models (single_op.py).

Written for onnxruntime 1.32 (the venv's build) and checked against its sources
(nchwc_transformer.cc, nchwc_schema_defs.cc, contrib_ops/cpu/nchwc_ops.cc, mlas/lib/snchwc.cpp)
and by running it.

NCHWc tensors in ORT
--------------------
* A blocked tensor is still a **4-D** ORT tensor ``(N, Cp, H, W)`` where ``Cp`` is the channel
  count rounded up to the block size; its memory is ``(N, Cp/B, H, W, B)``.  Padding channels are
  zero after ``ReorderInput`` and after a Conv whose padded weights/bias are zero; they are never
  read across channels, so any finite value there is harmless.
* ``nchwc_block_size()`` asks ORT itself: a 3->1 channel 1x1 Conv is optimised at ORT_ENABLE_ALL
  into ``optimized_model_filepath`` and the leading dim of the rewritten weight is the block
  (output channels are padded to one block).  16 on this AVX-512 machine, 8 with AVX2 only;
  1 means the platform has no NCHWc kernels (ORT then does not register the transformer).
* ``ReorderInput`` requires ``C % 4 == 0`` (ORT_ENFORCE in nchwc_ops.cc).  ORT's transformer never
  reorders such tensors; kselect inserts a channel ``Pad`` to the next multiple of 4 first
  (node ``<tensor>.pad_c``), both in ``rewrite_model`` and in ``reorder_model`` so that the
  measured conversion cost matches what the rewritten model pays.
* ``ReorderOutput`` takes ``channels`` (logical count) and strips the padding; ORT checks
  ``Cp % B == 0 and 0 <= Cp - channels < B``.

Conv weights (ORT's NchwcTransformer, nchwc_transformer.cc; ``pack_conv``)
--------------------------------------------------------------------------
* Weights are reordered statically: OIHWBiBo (``[O/B][I/B][kh][kw][Bi][Bo]``) for ordinary convs;
  OIHWBo (``[O/B][I][kh][kw][Bo]``) for depthwise convs (group == C, one input channel per group,
  no multiplier) and for ``group == 1`` convs whose input channels are **fewer than the block**:
  those read the NCHW tensor directly (no ReorderInput; MLAS's "NCHW" algorithm - typically the
  first conv on RGB input).
* Output channels are padded to a block multiple with zero weights and zero bias; the initializer
  keeps the OIHW dims with O (and I for OIHWBiBo) padded, exactly as ORT writes them.
* Grouped (non-depthwise) convs need per-group input and output channels that are block
  multiples, otherwise they stay NCHW (also ORT's rule).

kselect extensions beyond ORT's transformer (verified against the NCHW reference):
* A conv whose input is already blocked but whose input channels are not a block multiple (e.g.
  the 24- or 51-channel output of a previous NCHWc conv) reads the padded tensor; its weights get
  zero input channels up to the padded count.  ORT would refuse (it requires Cin % B == 0).
* Depthwise convs whose channel count is not a block multiple use ``group = Cp`` and zero-padded
  weights (as ORT does for BatchNormalization->depthwise conv).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from kselect.plugins.mlas.ort_session import NCHWC_DOMAIN, ort_optimized

NCHW = "NCHW"
NCHWC = "NCHWc"


def round_up(value: int, multiple: int) -> int:
    return (int(value) + multiple - 1) // multiple * multiple


def norm_layout(value: str) -> str:
    v = str(value).strip().lower()
    if v == "nchwc":
        return NCHWC
    if v == "nchw":
        return NCHW
    raise ValueError(f"layout must be 'NCHW' or 'NCHWc', got {value!r}")


# --------------------------------------------------------------------------------------------
# Block size
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def nchwc_block_size() -> int:
    """MLAS's NCHWc block size on this CPU, as ONNX Runtime itself reports it.

    A tiny 3->1 channel 1x1 Conv is optimised at ORT_ENABLE_ALL into a temporary file; ORT's
    NchwcTransformer pads the output channels of the reordered weight to one block, so the
    weight's leading dimension is the block size.  Returns 1 if ORT did not produce an NCHWc conv
    (no NCHWc support on this platform).  Cached per process.
    """
    w = numpy_helper.from_array(np.ones((1, 3, 1, 1), np.float32), "W")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "W"], ["y"], name="probe")],
        "nchwc_block_probe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 1, 1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 1, 1])],
        [w],
    )
    optimized = ort_optimized(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]))
    inits = {t.name: t for t in optimized.graph.initializer}
    for node in optimized.graph.node:
        if node.domain == NCHWC_DOMAIN and node.op_type == "Conv" and node.input[1] in inits:
            return int(inits[node.input[1]].dims[0])
    return 1


# --------------------------------------------------------------------------------------------
# numpy helpers
# --------------------------------------------------------------------------------------------


def to_blocked(x: np.ndarray, block: int) -> np.ndarray:
    """NCHW array -> blocked array of shape (N, Cp/block, H, W, block), padding channels zero.

    ORT takes blocked tensors as 4-D ``(N, Cp, H, W)`` with the same memory: feed
    ``to_blocked(x, block).reshape(input_shape_fed)`` (see ``nchwc_feed``).
    """
    x = np.asarray(x)
    if x.ndim != 4:
        raise ValueError(f"expected an NCHW array, got shape {x.shape}")
    n, c, h, w = x.shape
    cp = round_up(c, block)
    if cp != c:
        padded = np.zeros((n, cp, h, w), dtype=x.dtype)
        padded[:, :c] = x
        x = padded
    return np.ascontiguousarray(x.reshape(n, cp // block, block, h, w).transpose(0, 1, 3, 4, 2))


def nchwc_feed(x: np.ndarray, block: int) -> np.ndarray:
    """NCHW array -> the 4-D ``(N, Cp, H, W)`` array ORT expects for a blocked input."""
    xb = to_blocked(x, block)
    n, cb, h, w, b = xb.shape
    return xb.reshape(n, cb * b, h, w)


def from_blocked(y: np.ndarray, channels: int, block: Optional[int] = None) -> np.ndarray:
    """Blocked array -> NCHW array with ``channels`` channels (padding stripped).

    ``y`` is either 5-D ``(N, Cp/B, H, W, B)`` or the 4-D ``(N, Cp, H, W)`` array ORT returns for
    a blocked output (then ``block`` is required, default: ``nchwc_block_size()``).
    """
    y = np.asarray(y)
    if y.ndim == 4:
        block = block or nchwc_block_size()
        n, cp, h, w = y.shape
        if cp % block:
            raise ValueError(f"{cp} channels is not a multiple of block {block}")
        y = y.reshape(n, cp // block, h, w, block)
    elif y.ndim != 5:
        raise ValueError(f"expected a 4-D or 5-D blocked array, got shape {y.shape}")
    n, cb, h, w, b = y.shape
    if channels > cb * b:
        raise ValueError(f"channels={channels} exceeds the blocked channel count {cb * b}")
    return np.ascontiguousarray(y.transpose(0, 1, 4, 2, 3).reshape(n, cb * b, h, w)[:, :channels])


def reorder_filter_oihwbibo(w: np.ndarray, block: int, in_channels: Optional[int] = None) -> np.ndarray:
    """OIHW weights -> MLAS OIHWBiBo, O and I zero-padded (I to ``in_channels`` if given).

    Returned with the padded OIHW shape ``(Op, Ip, kh, kw)`` (the dims ORT stores), data in
    ``[O/B][I/B][kh][kw][Bi][Bo]`` order.
    """
    o, i, kh, kw = w.shape
    op = round_up(o, block)
    ip = round_up(in_channels if in_channels is not None else i, block)
    if ip < i:
        raise ValueError("in_channels smaller than the weight's input channels")
    padded = np.zeros((op, ip, kh, kw), np.float32)
    padded[:o, :i] = w
    packed = padded.reshape(op // block, block, ip // block, block, kh, kw).transpose(0, 2, 4, 5, 3, 1)
    return np.ascontiguousarray(packed).reshape(op, ip, kh, kw)


def reorder_filter_oihwbo(w: np.ndarray, block: int, out_channels: Optional[int] = None) -> np.ndarray:
    """OIHW weights -> MLAS OIHWBo (``[O/B][I][kh][kw][Bo]``), O zero-padded (to ``out_channels``)."""
    o, i, kh, kw = w.shape
    op = round_up(out_channels if out_channels is not None else o, block)
    padded = np.zeros((op, i, kh, kw), np.float32)
    padded[:o] = w
    packed = padded.reshape(op // block, block, i, kh, kw).transpose(0, 2, 3, 4, 1)
    return np.ascontiguousarray(packed).reshape(op, i, kh, kw)


# --------------------------------------------------------------------------------------------
# Conv support rules shared by rewrite_model and single_conv_model
# --------------------------------------------------------------------------------------------


def conv_nchwc_unsupported(w_shape: Sequence[int], group: int, block: int) -> Optional[str]:
    """Why a Conv with these weights cannot run as NCHWc (None if it can)."""
    if len(w_shape) != 4:
        return f"weights are {len(w_shape)}-D (only 2-D convs)"
    cout, cin_g = int(w_shape[0]), int(w_shape[1])
    if group < 1 or cout % group:
        return f"bad group {group}"
    if group > 1:
        if cin_g == 1 and cout == group:
            return None  # depthwise
        if cin_g == 1:
            return "depthwise conv with channel multiplier"
        if cin_g % block or (cout // group) % block:
            return f"grouped conv: per-group channels {cin_g}->{cout // group} not multiples of {block}"
    return None


def conv_takes_blocked_input(in_channels: int, group: int, block: int, input_is_blocked: bool = False) -> bool:
    """Whether an NCHWc Conv reads a blocked input (else the NCHW tensor directly).

    ``group == 1`` convs with fewer input channels than the block read NCHW (OIHWBo weights),
    unless the input is already available blocked (``input_is_blocked``).
    """
    if input_is_blocked:
        return True
    return not (group == 1 and in_channels < block)


@dataclass
class PackedConv:
    weight: np.ndarray
    bias: Optional[np.ndarray]  # None: no bias input; the original bias is fine if not padded
    bias_padded: bool
    group: int
    weight_format: str
    out_channels_padded: int


def pack_conv(w: np.ndarray, b: Optional[np.ndarray], group: int, block: int, blocked_input: bool,
               input_channels_phys: int) -> PackedConv:
    cout, cin_g, kh, kw = w.shape
    op = round_up(cout, block)
    depthwise = group > 1 and cin_g == 1 and cout == group
    if depthwise:
        # group = physical channel count; padded channels get zero filters.
        weight = reorder_filter_oihwbo(w, block, out_channels=op)
        new_group, fmt = op, "OIHWBo"
        if input_channels_phys != op:
            raise ValueError("depthwise conv input must be blocked with the same channel count")
    elif group > 1:
        weight = reorder_filter_oihwbibo(w, block)
        new_group, fmt = group, "OIHWBiBo"
    elif not blocked_input:
        weight = reorder_filter_oihwbo(w, block)
        new_group, fmt = 1, "OIHWBo"
    else:
        weight = reorder_filter_oihwbibo(w, block, in_channels=input_channels_phys)
        new_group, fmt = 1, "OIHWBiBo"
    bias = None
    bias_padded = False
    if b is not None:
        if op != cout:
            bias = np.zeros((op,), np.float32)
            bias[:cout] = b
            bias_padded = True
        else:
            bias = np.asarray(b, np.float32)
    return PackedConv(weight, bias, bias_padded, new_group, fmt, op)


__all__ = [
    "NCHW",
    "NCHWC",
    "PackedConv",
    "conv_nchwc_unsupported",
    "conv_takes_blocked_input",
    "from_blocked",
    "nchwc_block_size",
    "nchwc_feed",
    "norm_layout",
    "pack_conv",
    "reorder_filter_oihwbibo",
    "reorder_filter_oihwbo",
    "round_up",
    "to_blocked",
]
