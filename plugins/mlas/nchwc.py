"""kselect's own writer of ONNX Runtime's ``com.microsoft.nchwc`` nodes (MLAS NCHWc layout).

ONNX Runtime's ``NchwcTransformer`` converts *every* eligible Conv of a model to MLAS's blocked
NCHWc layout.  kselect wants to choose the layout per Conv, so this module writes the NCHWc nodes
itself (``rewrite_model``) and the result is loaded with ORT's own transformer switched off.  It
also builds the isolated single-op models used to time one Conv in either layout
(``single_conv_model``) and the cost of a layout change (``reorder_model``).

Everything here was written for onnxruntime 1.32 (the venv's build) and checked against its
sources (nchwc_transformer.cc, nchwc_schema_defs.cc, contrib_ops/cpu/nchwc_ops.cc,
mlas/lib/snchwc.cpp, onnxruntime_session_options_config_keys.h) and by running it.

Input model
-----------
``rewrite_model`` works on ONNX ``Conv`` nodes and on ORT's ``com.microsoft.FusedConv`` (its
activation attributes are kept).  It does not fold BatchNormalization: give it a model already
optimised by ORT at ORT_ENABLE_BASIC (Conv+BN/Mul/Add folded, node names kept) or
ORT_ENABLE_EXTENDED (Conv+activation -> FusedConv), saved with ``optimized_model_filepath``;
otherwise a BatchNormalization after an NCHWc conv reads NCHW through a ReorderOutput.
``layouts`` keys are node names, which ORT's optimisers preserve for the surviving conv.

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

Rules followed (ORT's NchwcTransformer, nchwc_transformer.cc)
------------------------------------------------------------
* Weights are constant float 4-D initializers, bias (optional) constant 1-D of the output count.
* Weights are reordered statically: OIHWBiBo (``[O/B][I/B][kh][kw][Bi][Bo]``) for ordinary convs;
  OIHWBo (``[O/B][I][kh][kw][Bo]``) for depthwise convs (group == C, one input channel per group,
  no multiplier) and for ``group == 1`` convs whose input channels are **fewer than the block**:
  those read the NCHW tensor directly (no ReorderInput; MLAS's "NCHW" algorithm - typically the
  first conv on RGB input).
* Output channels are padded to a block multiple with zero weights and zero bias; the initializer
  keeps the OIHW dims with O (and I for OIHWBiBo) padded, exactly as ORT writes them.
* Grouped (non-depthwise) convs need per-group input and output channels that are block
  multiples, otherwise they stay NCHW (also ORT's rule).
* Activation fusion: a Relu / Clip (constant min/max) / Sigmoid / Tanh / LeakyRelu / HardSigmoid
  that is the *only* reader of an NCHWc conv's output (and the output is no graph output) is fused
  as ``activation`` (+ ``activation_params``: Clip [min,max], LeakyRelu [alpha],
  HardSigmoid [alpha,beta]); ORT itself gets there via FusedConv.
* Sum fusion: ``Add``/``Sum`` of two blocked tensors of equal logical channels and equal shape,
  where one input is the single-use output of an NCHWc conv without activation, becomes that
  conv's 4th input ``Sum`` (the conv accumulates into it); an activation following the Add can
  then still be fused (``act(conv + bias + sum)``, as in ORT).
* Propagation of the blocked layout, only when the input is already blocked: MaxPool (no
  indices output) / AveragePool / GlobalAveragePool / GlobalMaxPool -> their nchwc versions;
  the elementwise unaries above -> same op on the blocked tensor; Add / Sum / Mul of blocked
  tensors with equal logical channels and equal inferred shapes -> same op; Concat on axis 1 when
  every input's logical channels are a block multiple -> Concat axis 1 of the blocked tensors.
  Everything else reads NCHW.

kselect extensions beyond ORT's transformer (all verified against the NCHW reference):
* A conv whose input is already blocked but whose input channels are not a block multiple (e.g.
  the 24- or 51-channel output of a previous NCHWc conv) reads the padded tensor; its weights get
  zero input channels up to the padded count.  ORT would refuse (it requires Cin % B == 0).
* Depthwise convs whose channel count is not a block multiple use ``group = Cp`` and zero-padded
  weights (as ORT does for BatchNormalization->depthwise conv).
* Inputs with ``C % 4 != 0`` that must be reordered get the channel ``Pad`` described above.
* HardSwish on a blocked tensor, and Add / Sub / Mul / Div of a blocked tensor and a scalar
  constant, stay blocked (elementwise, so the layout does not matter; the padded channels hold
  values no consumer reads). ORT reorders to NCHW for these: the ``x * Clip(x + 3, 0, 6) / 6``
  HardSwish that Paddle exports cost a ReorderOutput and a ReorderInput per conv.

Reorders: one ``ReorderInput`` (node ``<tensor>.reorder_in``, output ``<tensor>.nchwc``) per NCHW
tensor read blocked, one ``ReorderOutput`` (node ``<tensor>.reorder_out``, output ``<tensor>``,
the original name) per blocked tensor read as NCHW or listed as graph output, each shared by all
consumers.  ORT does not remove ReorderOutput->ReorderInput pairs written into a model, so none
are ever written.  Converted nodes keep their original names; blocked tensors are named
``<original tensor>.nchwc``.

ORT session settings for a rewritten model
------------------------------------------
* Disable ORT's transformer, else it converts the remaining NCHW convs too::

      so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
      so.add_session_config_entry("optimization.disable_specified_optimizers", "NchwcTransformer")
      # or: ort.InferenceSession(path, so, disabled_optimizers=["NchwcTransformer"])

  ``NchwcTransformer`` is the registered name (graph_transformer_utils.cc, Level3).  The config
  value is a **';'-separated** list in 1.32 (the header says comma, but
  "ConvActivationFusion,NchwcTransformer" is taken as one unknown name and disables nothing).
  Unknown names are ignored silently.  ``session_options()`` below applies this.
* At ORT_ENABLE_ALL with the transformer disabled the model still gets every level-1/2 fusion
  (constant folding, ConvActivationFusion -> FusedConv for the NCHW convs, Gemm fusions, ...)
  and the level-3 ConvAddActivationFusion for NCHW Conv+Add(+act).  ORT_ENABLE_EXTENDED also
  works without disabling anything (NchwcTransformer is level 3) but loses that level-3 fusion.
  Nodes in the ``com.microsoft.nchwc`` domain are left alone by all of these.
* Serialising such a model (``optimized_model_filepath``) bakes in the block size: it only runs
  on CPUs with the same ``nchwc_block_size()``.

MLAS session config keys (present in 1.32's onnxruntime_session_options_config_keys.h and in the
binary; unknown keys and bad values are accepted silently, except that a non-integer value for
the pointwise key aborts the process):

=====================================================  =========  ==================================
key                                                     default    applies to
=====================================================  =========  ==================================
``mlas.nchwc_depthwise_sliding``                        "1"        NCHWc depthwise convs only, on
                                                                   AVX-512; the sliding-window
                                                                   kernel covers stride 1, dilation
                                                                   1, kernel width 3/5/7 (others use
                                                                   the asm kernel); "0" = always the
                                                                   asm kernel; bitwise identical
``mlas.nchwc_pointwise_conv_max_input_channel_batch``   "0"=128    NCHWc pointwise (1x1) convs only:
                                                                   input channels accumulated per
                                                                   kernel call, rounded up to the
                                                                   block; "0"/unset = MLAS default
                                                                   128
``session.intra_op.allow_spinning``                     "1"        every multi-threaded op, both
                                                                   layouts ("0" in client-package
                                                                   builds).  Also
                                                                   ``session.intra_op.spin_duration_us``
                                                                   (unset = iteration-count spin)
                                                                   and ``..spin_backoff_max`` ("1")
``session.disable_prepacking``                          "0"        prepacking on; neither NCHW Conv
                                                                   nor NCHWc Conv prepacks in 1.32
                                                                   (checked with
                                                                   session.save_external_prepacked_
                                                                   constant_initializers: only the
                                                                   MatMul/Gemm weights get a
                                                                   prepacked blob), so it matters
                                                                   for the Gemm/MatMul, not convs
=====================================================  =========  ==================================

So for NCHW convs only the session-wide knobs (threads, spinning) matter; the two ``mlas.nchwc_*``
keys only change NCHWc convs.  ``mlas.disable_kleidiai`` / ``mlas.kleidiai.conv_igemm_max_work``
exist too but are Arm64 only.
"""

from __future__ import annotations

import functools
import heapq
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

NCHWC_DOMAIN = "com.microsoft.nchwc"
NCHWC_TRANSFORMER = "NchwcTransformer"
DISABLE_OPTIMIZERS_KEY = "optimization.disable_specified_optimizers"

#: Verified config keys of onnxruntime 1.32 and their defaults (see the module docstring).
CONFIG_KEYS: dict[str, str] = {
    "mlas.nchwc_depthwise_sliding": "1",
    "mlas.nchwc_pointwise_conv_max_input_channel_batch": "0",  # 0/unset -> MLAS default 128
    "session.intra_op.allow_spinning": "1",
    "session.intra_op.spin_duration_us": "",  # unset -> iteration-count based spinning
    "session.intra_op.spin_backoff_max": "1",
    "session.disable_prepacking": "0",
}

NCHW = "NCHW"
NCHWC = "NCHWc"

# Elementwise unary ops that may run on a blocked tensor and be fused into an NCHWc conv.
_UNARY_ACTIVATIONS = ("Relu", "Clip", "Sigmoid", "Tanh", "LeakyRelu", "HardSigmoid")
_POOLS = ("MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool")
_FLT_MAX = float(np.finfo(np.float32).max)


def _round_up(value: int, multiple: int) -> int:
    return (int(value) + multiple - 1) // multiple * multiple


def _norm_layout(value: str) -> str:
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


def session_options(so: Any = None, *, level: Any = None) -> Any:
    """Session options suitable for a model written by ``rewrite_model``.

    Sets ORT_ENABLE_ALL (or ``level``) and disables ORT's NchwcTransformer (appending to any
    names already listed under ``optimization.disable_specified_optimizers``).
    """
    import onnxruntime as ort

    if so is None:
        so = ort.SessionOptions()
    so.graph_optimization_level = level if level is not None else ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    existing = so.get_session_config_entry(DISABLE_OPTIMIZERS_KEY) if _has_entry(so, DISABLE_OPTIMIZERS_KEY) else ""
    names = [n for n in existing.split(";") if n]
    if NCHWC_TRANSFORMER not in names:
        names.append(NCHWC_TRANSFORMER)
    so.add_session_config_entry(DISABLE_OPTIMIZERS_KEY, ";".join(names))
    return so


def _has_entry(so: Any, key: str) -> bool:
    try:
        so.get_session_config_entry(key)
        return True
    except Exception:  # ORT raises when the key is absent
        return False


# --------------------------------------------------------------------------------------------
# numpy helpers
# --------------------------------------------------------------------------------------------


def ort_optimized(model: onnx.ModelProto) -> onnx.ModelProto:
    """The graph ONNX Runtime's default session (ORT_ENABLE_ALL) actually runs."""
    import onnxruntime as ort

    with tempfile.TemporaryDirectory(prefix="kselect_nchwc_") as tmp:
        path = os.path.join(tmp, "optimized.onnx")
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.optimized_model_filepath = path
        so.log_severity_level = 3
        so.intra_op_num_threads = 1
        ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        return onnx.load(path)


def ort_nchwc_convs(model: onnx.ModelProto) -> set[str]:
    """Names of the Conv nodes ONNX Runtime's own NchwcTransformer turns into NCHWc convs.

    Its choice depends on the graph around a conv (e.g. a conv whose input channels are not a
    block multiple is converted only when its producer already is), so ORT is asked: the model
    is optimised as a default session would, and each NCHWc conv, which ORT names after its
    output tensor + "_nchwc" (the conv's, or that of the activation fused into it), is traced
    back to the original node.
    """
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    conv_of_tensor: dict[str, str] = {}
    for node in model.graph.node:
        if node.op_type == "Conv":
            conv_of_tensor[node.output[0]] = node.name
            readers = consumers.get(node.output[0], [])
            if len(readers) == 1 and readers[0].op_type in _UNARY_ACTIVATIONS:
                conv_of_tensor[readers[0].output[0]] = node.name
    converted = set()
    for node in ort_optimized(model).graph.node:
        if node.domain == NCHWC_DOMAIN and node.op_type == "Conv" and node.name.endswith("_nchwc"):
            original = conv_of_tensor.get(node.name[: -len("_nchwc")])
            if original is not None:
                converted.add(original)
    return converted


def to_blocked(x: np.ndarray, block: int) -> np.ndarray:
    """NCHW array -> blocked array of shape (N, Cp/block, H, W, block), padding channels zero.

    ORT takes blocked tensors as 4-D ``(N, Cp, H, W)`` with the same memory: feed
    ``to_blocked(x, block).reshape(input_shape_fed)`` (see ``nchwc_feed``).
    """
    x = np.asarray(x)
    if x.ndim != 4:
        raise ValueError(f"expected an NCHW array, got shape {x.shape}")
    n, c, h, w = x.shape
    cp = _round_up(c, block)
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
    op = _round_up(o, block)
    ip = _round_up(in_channels if in_channels is not None else i, block)
    if ip < i:
        raise ValueError("in_channels smaller than the weight's input channels")
    padded = np.zeros((op, ip, kh, kw), np.float32)
    padded[:o, :i] = w
    packed = padded.reshape(op // block, block, ip // block, block, kh, kw).transpose(0, 2, 4, 5, 3, 1)
    return np.ascontiguousarray(packed).reshape(op, ip, kh, kw)


def reorder_filter_oihwbo(w: np.ndarray, block: int, out_channels: Optional[int] = None) -> np.ndarray:
    """OIHW weights -> MLAS OIHWBo (``[O/B][I][kh][kw][Bo]``), O zero-padded (to ``out_channels``)."""
    o, i, kh, kw = w.shape
    op = _round_up(out_channels if out_channels is not None else o, block)
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
class _PackedConv:
    weight: np.ndarray
    bias: Optional[np.ndarray]  # None: no bias input; the original bias is fine if not padded
    bias_padded: bool
    group: int
    weight_format: str
    out_channels_padded: int


def _pack_conv(w: np.ndarray, b: Optional[np.ndarray], group: int, block: int, blocked_input: bool,
               input_channels_phys: int) -> _PackedConv:
    cout, cin_g, kh, kw = w.shape
    op = _round_up(cout, block)
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
    return _PackedConv(weight, bias, bias_padded, new_group, fmt, op)


# --------------------------------------------------------------------------------------------
# rewrite_model
# --------------------------------------------------------------------------------------------


@dataclass
class _ConvState:
    node: onnx.NodeProto
    has_activation: bool = False
    has_sum: bool = False


@dataclass
class _Blocked:
    name: str  # name of the blocked (4-D, channel padded) tensor
    channels: int  # logical channel count
    conv: Optional[_ConvState] = None  # set when the tensor is the output of an NCHWc conv


@dataclass
class RewriteInfo:
    """What ``rewrite_model`` did (filled into the ``info`` dict passed to it)."""

    nchwc_convs: list[str] = field(default_factory=list)
    fallback: dict[str, str] = field(default_factory=dict)  # conv asked NCHWc -> reason kept NCHW
    fused: dict[str, list[str]] = field(default_factory=dict)  # conv -> fused node names
    blocked_ops: list[str] = field(default_factory=list)  # non-conv nodes run blocked
    reorder_inputs: list[str] = field(default_factory=list)  # tensors reordered NCHW -> NCHWc
    reorder_outputs: list[str] = field(default_factory=list)  # tensors reordered NCHWc -> NCHW
    channel_pads: list[str] = field(default_factory=list)  # tensors padded to C % 4 == 0 first
    beyond_ort: list[str] = field(default_factory=list)  # nodes blocked where ORT's transformer reorders


def _subgraph_implicit_inputs(node: onnx.NodeProto) -> set[str]:
    names: set[str] = set()
    for attr in node.attribute:
        graphs = []
        if attr.type == onnx.AttributeProto.GRAPH:
            graphs = [attr.g]
        elif attr.type == onnx.AttributeProto.GRAPHS:
            graphs = list(attr.graphs)
        for g in graphs:
            defined = {i.name for i in g.input} | {t.name for t in g.initializer}
            defined |= {t.name for t in g.sparse_initializer}
            referenced: set[str] = set()
            for n in g.node:
                defined.update(o for o in n.output if o)
                referenced.update(i for i in n.input if i)
                referenced |= _subgraph_implicit_inputs(n)
            referenced.update(o.name for o in g.output)
            names |= referenced - defined
    return names


def _attr(node: onnx.NodeProto, name: str, default: Any = None) -> Any:
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


class _Rewriter:
    def __init__(self, model: onnx.ModelProto, layouts: Mapping[str, str], block: int, strict: bool,
                 block_inputs: bool = False):
        if block <= 1:
            raise ValueError(f"block size {block}: this platform has no NCHWc kernels")
        self.block = int(block)
        self.strict = strict
        self.block_inputs = block_inputs
        self.model = onnx.ModelProto()
        self.model.CopyFrom(model)
        self.graph = self.model.graph
        self.layouts = {k: _norm_layout(v) for k, v in layouts.items()}
        self.info = RewriteInfo()
        self.opset = 1
        for op in self.model.opset_import:
            if op.domain in ("", "ai.onnx"):
                self.opset = op.version

        self.shapes: dict[str, list[Any]] = {}
        try:
            inferred = onnx.shape_inference.infer_shapes(self.model)
            vis = list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output)
        except Exception:
            vis = list(self.graph.value_info) + list(self.graph.input) + list(self.graph.output)
        for vi in vis:
            tt = vi.type.tensor_type
            if tt.HasField("shape"):
                dims = []
                for d in tt.shape.dim:
                    if d.HasField("dim_value"):
                        dims.append(int(d.dim_value))
                    elif d.HasField("dim_param"):
                        dims.append(d.dim_param)
                    else:
                        dims.append(None)
                self.shapes[vi.name] = dims

        self.consts: dict[str, np.ndarray] = {t.name: numpy_helper.to_array(t) for t in self.graph.initializer}
        for n in self.graph.node:
            if n.op_type == "Constant" and n.domain in ("", "ai.onnx"):
                v = _attr(n, "value")
                if isinstance(v, TensorProto):
                    self.consts[n.output[0]] = numpy_helper.to_array(v)

        self.graph_outputs = {o.name for o in self.graph.output}
        self.uses: dict[str, int] = {}
        for n in self.graph.node:
            for i in list(n.input) + sorted(_subgraph_implicit_inputs(n)):
                if i:
                    self.uses[i] = self.uses.get(i, 0) + 1
        for o in self.graph_outputs:
            self.uses[o] = self.uses.get(o, 0) + 1

        self.taken: set[str] = set()
        for n in self.graph.node:
            self.taken.update(n.input)
            self.taken.update(n.output)
            if n.name:
                self.taken.add(n.name)
        self.taken.update(t.name for t in self.graph.initializer)
        self.taken.update(i.name for i in self.graph.input)

        self.blk: dict[str, _Blocked] = {}
        self.nchw_ready: set[str] = set()  # blocked tensors whose NCHW form was materialised
        self.reordered_in: dict[str, str] = {}  # NCHW tensor -> its ReorderInput output
        self.out_nodes: list[onnx.NodeProto] = []
        self.new_inits: list[TensorProto] = []
        self.packed_cache: dict[tuple, tuple[str, Optional[str], int]] = {}
        self.maybe_unused: set[str] = set()

    # ---- naming -----------------------------------------------------------------------------
    def fresh(self, base: str) -> str:
        name, k = base, 1
        while name in self.taken:
            name = f"{base}_{k}"
            k += 1
        self.taken.add(name)
        return name

    def add_init(self, base: str, array: np.ndarray) -> str:
        name = self.fresh(base)
        self.new_inits.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    # ---- layout access ----------------------------------------------------------------------
    def nchw(self, tensor: str) -> str:
        """Name of ``tensor`` in NCHW layout, inserting a shared ReorderOutput if needed."""
        b = self.blk.get(tensor)
        if b is None or tensor in self.nchw_ready:
            return tensor
        node = helper.make_node("ReorderOutput", [b.name], [tensor], name=self.fresh(f"{tensor}.reorder_out"),
                                domain=NCHWC_DOMAIN, channels=int(b.channels))
        self.out_nodes.append(node)
        self.nchw_ready.add(tensor)
        self.info.reorder_outputs.append(tensor)
        return tensor

    def blocked(self, tensor: str, channels: int) -> str:
        """Name of ``tensor`` in NCHWc layout, inserting a shared (Pad+)ReorderInput if needed."""
        b = self.blk.get(tensor)
        if b is not None:
            return b.name
        if tensor in self.reordered_in:
            return self.reordered_in[tensor]
        src = tensor
        if channels % 4:
            src = self._pad_channels(tensor, channels)
        out = self.fresh(f"{tensor}.nchwc")
        self.out_nodes.append(helper.make_node("ReorderInput", [src], [out], name=self.fresh(f"{tensor}.reorder_in"),
                                               domain=NCHWC_DOMAIN))
        self.reordered_in[tensor] = out
        self.info.reorder_inputs.append(tensor)
        return out

    def _pad_channels(self, tensor: str, channels: int) -> str:
        extra = _round_up(channels, 4) - channels
        pads = [0, 0, 0, 0, 0, extra, 0, 0]
        out = self.fresh(f"{tensor}.pad_c")
        name = self.fresh(f"{tensor}.pad_c")
        if self.opset >= 11:
            pads_name = self.add_init(f"{tensor}.pad_c_pads", np.array(pads, np.int64))
            node = helper.make_node("Pad", [tensor, pads_name], [out], name=name, mode="constant")
        else:
            node = helper.make_node("Pad", [tensor], [out], name=name, mode="constant", pads=pads, value=0.0)
        self.out_nodes.append(node)
        self.info.channel_pads.append(tensor)
        return out

    def single_use(self, tensor: str) -> bool:
        return self.uses.get(tensor, 0) == 1 and tensor not in self.graph_outputs

    def same_shape(self, names: Sequence[str]) -> bool:
        shapes = [self.shapes.get(n) for n in names]
        if any(s is None or len(s) != 4 or any(d is None for d in s) for s in shapes):
            return False
        return all(s == shapes[0] for s in shapes[1:])

    # ---- node handlers ----------------------------------------------------------------------
    def passthrough(self, node: onnx.NodeProto) -> None:
        for name in sorted(_subgraph_implicit_inputs(node)):
            self.nchw(name)
        new = onnx.NodeProto()
        new.CopyFrom(node)
        del new.input[:]
        new.input.extend(self.nchw(i) if i else i for i in node.input)
        self.out_nodes.append(new)

    def emit_blocked(self, node: onnx.NodeProto, inputs: Sequence[str], channels: int,
                     domain: Optional[str] = None) -> None:
        out = self.fresh(f"{node.output[0]}.nchwc")
        new = onnx.NodeProto()
        new.CopyFrom(node)
        del new.input[:]
        new.input.extend(inputs)
        del new.output[:]
        new.output.append(out)
        if domain is not None:
            new.domain = domain
        self.out_nodes.append(new)
        self.blk[node.output[0]] = _Blocked(out, channels)
        self.info.blocked_ops.append(node.name or node.output[0])

    def conv(self, node: onnx.NodeProto) -> None:
        name = node.name
        if self.layouts.get(name, NCHW) != NCHWC:
            return self.passthrough(node)
        reason = self.conv_reason(node)
        if reason is not None:
            if self.strict:
                raise ValueError(f"Conv {name!r} cannot run as NCHWc: {reason}")
            self.info.fallback[name] = reason
            return self.passthrough(node)

        x, w_name = node.input[0], node.input[1]
        b_name = node.input[2] if len(node.input) > 2 and node.input[2] else None
        w = self.consts[w_name].astype(np.float32)
        b = self.consts[b_name].astype(np.float32) if b_name else None
        group = int(_attr(node, "group", 1))
        cout, cin_g = w.shape[0], w.shape[1]
        cin = cin_g * group

        xb = self.blk.get(x)
        if xb is not None:
            if xb.channels != cin:
                raise ValueError(f"Conv {name!r}: input has {xb.channels} channels, weights expect {cin}")
            x_in, blocked_input = xb.name, True
        elif conv_takes_blocked_input(cin, group, self.block):
            x_in, blocked_input = self.blocked(x, cin), True
        else:
            x_in, blocked_input = self.nchw(x), False
        cin_phys = _round_up(cin, self.block) if blocked_input else cin

        key = (w_name, b_name, group, blocked_input, cin_phys)
        if key not in self.packed_cache:
            packed = _pack_conv(w, b, group, self.block, blocked_input, cin_phys)
            new_w = self.add_init(f"{w_name}.nchwc", packed.weight)
            if packed.bias is None:
                new_b = None
            elif packed.bias_padded:
                new_b = self.add_init(f"{b_name}.nchwc", packed.bias)
            else:
                new_b = b_name
            self.packed_cache[key] = (new_w, new_b, packed.group)
            self.maybe_unused.add(w_name)
            if b_name:
                self.maybe_unused.add(b_name)
        new_w, new_b, new_group = self.packed_cache[key]

        out = self.fresh(f"{node.output[0]}.nchwc")
        inputs = [x_in, new_w] + ([new_b] if new_b else [])
        new = helper.make_node("Conv", inputs, [out], name=name, domain=NCHWC_DOMAIN)
        for a in node.attribute:
            if a.name != "group":
                new.attribute.append(a)
        if new_group != 1:
            new.attribute.append(helper.make_attribute("group", int(new_group)))
        self.out_nodes.append(new)
        # A FusedConv (ORT_ENABLE_EXTENDED output) brings its activation attributes along.
        state = _ConvState(new, has_activation=_attr(node, "activation") is not None)
        self.blk[node.output[0]] = _Blocked(out, int(cout), state)
        self.info.nchwc_convs.append(name)

    def conv_reason(self, node: onnx.NodeProto) -> Optional[str]:
        if len(node.input) < 2 or len(node.output) != 1:
            return "unexpected Conv signature"
        if len(node.input) > 3 and any(node.input[3:]):
            return "FusedConv with a Z (sum) input"
        w = self.consts.get(node.input[1])
        if w is None:
            return "weights are not a constant initializer"
        if w.dtype != np.float32:
            return f"weights are {w.dtype}, not float32"
        if w.ndim != 4:
            return f"weights are {w.ndim}-D (only 2-D convs)"
        if len(node.input) > 2 and node.input[2]:
            b = self.consts.get(node.input[2])
            if b is None or b.dtype != np.float32 or b.shape != (w.shape[0],):
                return "bias is not a constant float32 vector of the output channels"
        x_shape = self.shapes.get(node.input[0])
        if x_shape is not None and len(x_shape) != 4:
            return f"input rank {len(x_shape)}"
        return conv_nchwc_unsupported(w.shape, int(_attr(node, "group", 1)), self.block)

    def activation_params(self, node: onnx.NodeProto) -> Optional[list[float]]:
        """MLAS activation_params for a fusable activation node, None if it cannot be fused."""
        op = node.op_type
        if op in ("Relu", "Sigmoid", "Tanh"):
            return []
        if op == "LeakyRelu":
            return [float(_attr(node, "alpha", 0.01))]
        if op == "HardSigmoid":
            return [float(_attr(node, "alpha", 0.2)), float(_attr(node, "beta", 0.5))]
        if op == "Clip":
            if self.opset < 11:
                return [float(_attr(node, "min", -_FLT_MAX)), float(_attr(node, "max", _FLT_MAX))]
            bounds = []
            for idx, default in ((1, -_FLT_MAX), (2, _FLT_MAX)):
                if len(node.input) > idx and node.input[idx]:
                    v = self.consts.get(node.input[idx])
                    if v is None or v.size != 1:
                        return None
                    bounds.append(float(v.reshape(())))
                else:
                    bounds.append(default)
            return bounds
        return None

    def activation(self, node: onnx.NodeProto) -> None:
        x = node.input[0]
        xb = self.blk.get(x)
        if xb is None:
            return self.passthrough(node)
        params = self.activation_params(node)
        state = xb.conv
        if (params is not None and state is not None and not state.has_activation and self.single_use(x)):
            # Fuse: the conv now produces this node's output.
            conv = state.node
            conv.attribute.append(helper.make_attribute("activation", node.op_type))
            if params:
                conv.attribute.append(helper.make_attribute("activation_params", [float(p) for p in params]))
            out = self.fresh(f"{node.output[0]}.nchwc")
            conv.output[0] = out
            state.has_activation = True
            self.maybe_unused.update(i for i in node.input[1:] if i)
            self.blk[node.output[0]] = _Blocked(out, xb.channels, state)
            self.info.fused.setdefault(conv.name, []).append(node.name or node.output[0])
            return
        inputs = [xb.name] + [self.nchw(i) if i else i for i in node.input[1:]]
        if node.op_type not in _UNARY_ACTIVATIONS:
            self.info.beyond_ort.append(node.name or node.output[0])
        self.emit_blocked(node, inputs, xb.channels)

    def binary(self, node: onnx.NodeProto) -> None:
        ins = list(node.input)
        blks = [self.blk.get(i) for i in ins]
        scalars = [b is None and self.consts.get(i) is not None and self.consts[i].size == 1 for b, i in zip(blks, ins)]
        if len(ins) == 2 and sum(b is not None for b in blks) == 1 and any(scalars):
            # a blocked tensor and a scalar constant: elementwise whatever the layout
            blocked = next(b for b in blks if b is not None)
            self.info.beyond_ort.append(node.name or node.output[0])
            return self.emit_blocked(node, [b.name if b is not None else i for b, i in zip(blks, ins)], blocked.channels)
        if node.op_type in ("Sub", "Div"):
            return self.passthrough(node)
        if (len(ins) < 2 or any(b is None for b in blks) or len({b.channels for b in blks}) != 1
                or not self.same_shape(ins)):
            return self.passthrough(node)
        if node.op_type in ("Add", "Sum") and len(ins) == 2:
            for k in (0, 1):
                state = blks[k].conv
                other = blks[1 - k]
                if (state is not None and not state.has_activation and not state.has_sum
                        and self.single_use(ins[k]) and ins[0] != ins[1]):
                    conv = state.node
                    if len(conv.input) == 2:
                        conv.input.append("")
                    conv.input.append(other.name)
                    out = self.fresh(f"{node.output[0]}.nchwc")
                    conv.output[0] = out
                    state.has_sum = True
                    self.blk[node.output[0]] = _Blocked(out, blks[k].channels, state)
                    self.info.fused.setdefault(conv.name, []).append(node.name or node.output[0])
                    return
        self.emit_blocked(node, [b.name for b in blks], blks[0].channels)

    def concat(self, node: onnx.NodeProto) -> None:
        axis = int(_attr(node, "axis", 1))
        blks = [self.blk.get(i) for i in node.input]
        if (axis not in (1, -3) or not blks or any(b is None for b in blks)
                or any(b.channels % self.block for b in blks)):
            return self.passthrough(node)
        new_inputs = [b.name for b in blks]
        self.emit_blocked(node, new_inputs, sum(b.channels for b in blks))
        self.out_nodes[-1].ClearField("attribute")
        self.out_nodes[-1].attribute.append(helper.make_attribute("axis", 1))

    def pool(self, node: onnx.NodeProto) -> None:
        x = node.input[0]
        xb = self.blk.get(x)
        if xb is None or (len(node.output) > 1 and any(node.output[1:])):
            return self.passthrough(node)
        if node.op_type in ("MaxPool", "AveragePool"):
            ks = _attr(node, "kernel_shape")
            if ks is None or len(ks) != 2:
                return self.passthrough(node)
            if node.op_type == "MaxPool" and int(_attr(node, "storage_order", 0)) != 0:
                return self.passthrough(node)
        self.emit_blocked(node, [xb.name], xb.channels, domain=NCHWC_DOMAIN)
        del self.out_nodes[-1].output[1:]

    # ---- driver -------------------------------------------------------------------------------
    def run(self) -> onnx.ModelProto:
        if self.block_inputs:
            for name in _inputs_added_or_joined(self.model, self.block):
                channels = int(self.shapes[name][1])
                self.blk[name] = _Blocked(self.blocked(name, channels), channels)
                self.nchw_ready.add(name)  # the graph input itself is the NCHW form
        for node in self.graph.node:
            std = node.domain in ("", "ai.onnx")
            op = node.op_type
            if (std and op == "Conv") or (node.domain == "com.microsoft" and op == "FusedConv"):
                self.conv(node)
            elif std and op in _UNARY_ACTIVATIONS + ("HardSwish",):  # HardSwish: blocked, never fused
                self.activation(node)
            elif std and op in ("Add", "Sum", "Mul", "Sub", "Div"):
                self.binary(node)
            elif std and op == "Concat":
                self.concat(node)
            elif std and op in _POOLS:
                self.pool(node)
            else:
                self.passthrough(node)
        for out in self.graph.output:
            self.nchw(out.name)
        for name, want in self.layouts.items():
            if want == NCHWC and name not in self.info.nchwc_convs and name not in self.info.fallback:
                self.info.fallback[name] = "no Conv node of that name"
        return self.finish()

    def finish(self) -> onnx.ModelProto:
        g = self.graph
        available = {i.name for i in g.input} | {t.name for t in g.initializer} | {t.name for t in self.new_inits}
        nodes = _toposort(self.out_nodes, available)
        del g.node[:]
        g.node.extend(nodes)

        referenced: set[str] = set(self.graph_outputs)
        for n in nodes:
            referenced.update(n.input)
            referenced |= _subgraph_implicit_inputs(n)
        graph_input_names = {i.name for i in g.input}
        keep = [t for t in g.initializer
                if t.name in referenced or t.name not in self.maybe_unused or t.name in graph_input_names]
        del g.initializer[:]
        g.initializer.extend(keep)
        g.initializer.extend(self.new_inits)

        produced = {o for n in nodes for o in n.output} | graph_input_names
        value_info = [vi for vi in g.value_info if vi.name in produced]
        del g.value_info[:]
        g.value_info.extend(value_info)

        if any(n.domain == NCHWC_DOMAIN for n in nodes):
            if not any(op.domain == NCHWC_DOMAIN for op in self.model.opset_import):
                self.model.opset_import.append(helper.make_opsetid(NCHWC_DOMAIN, 1))
        return self.model


def _toposort(nodes: Sequence[onnx.NodeProto], available: Iterable[str]) -> list[onnx.NodeProto]:
    """Stable topological sort (keeps emission order where dependencies allow)."""
    producer: dict[str, int] = {}
    for idx, n in enumerate(nodes):
        for o in n.output:
            if o:
                producer[o] = idx
    deps: list[set[int]] = []
    for idx, n in enumerate(nodes):
        needed = {i for i in n.input if i} | _subgraph_implicit_inputs(n)
        deps.append({producer[i] for i in needed if i in producer and producer[i] != idx})
    users: dict[int, list[int]] = {}
    for idx, d in enumerate(deps):
        for p in d:
            users.setdefault(p, []).append(idx)
    remaining = [len(d) for d in deps]
    heap = [idx for idx, r in enumerate(remaining) if r == 0]
    heapq.heapify(heap)
    order = []
    while heap:
        idx = heapq.heappop(heap)
        order.append(nodes[idx])
        for u in users.get(idx, []):
            remaining[u] -= 1
            if remaining[u] == 0:
                heapq.heappush(heap, u)
    if len(order) != len(nodes):
        raise RuntimeError("rewritten graph has a cycle")
    return order


def rewrite_model(model: onnx.ModelProto, layouts: Mapping[str, str], block: int, *,
                  info: Optional[dict] = None, strict: bool = False, block_inputs: bool = False) -> onnx.ModelProto:
    """Return a copy of ``model`` where the Convs marked ``"NCHWc"`` in ``layouts`` run as MLAS
    NCHWc convs (``com.microsoft.nchwc`` domain) and the blocked layout is propagated as far as
    it is free; Convs absent from ``layouts`` or marked ``"NCHW"`` stay ordinary Convs.

    Reorders are inserted only where a tensor changes layout, one per tensor and direction.
    A Conv that cannot run as NCHWc (see ``conv_nchwc_unsupported``) stays NCHW and is listed
    with the reason in ``info["fallback"]`` (or raises with ``strict=True``).  If ``info`` is a
    dict it receives the fields of ``RewriteInfo``.  Load the result with ``session_options()``
    (ORT's NchwcTransformer disabled). ``block_inputs``: graph inputs that an Add, Sum, Mul or
    Concat reads are reordered once at the start (see ``anchor_inputs``), for a model cut out of
    a larger one.
    """
    rw = _Rewriter(model, layouts, block, strict, block_inputs)
    out = rw.run()
    if info is not None:
        info.update(vars(rw.info))
    return out


def _joins(node: onnx.NodeProto) -> bool:
    """An Add, Sum, Mul or Concat: ORT's transformer blocks it only when every input is blocked."""
    return node.op_type in ("Add", "Sum", "Mul", "Concat") and node.domain in ("", "ai.onnx")


def _inputs_added_or_joined(model: onnx.ModelProto, block: int) -> list[str]:
    """4-D graph inputs with a block-multiple channel count that an Add, Sum, Mul or Concat reads."""
    joined = {name for node in model.graph.node if _joins(node) for name in node.input}
    found = []
    for value in model.graph.input:
        dims = value.type.tensor_type.shape.dim
        if (value.name in joined and value.type.tensor_type.elem_type == TensorProto.FLOAT and len(dims) == 4
                and dims[1].HasField("dim_value") and dims[1].dim_value % block == 0):
            found.append(value.name)
    return found


def anchor_inputs(model: onnx.ModelProto, block: int) -> onnx.ModelProto:
    """For ORT's own transformer on a model cut out of a larger one (a segment of a plan across
    libraries): each graph input an Add, Sum, Mul or Concat reads (4-D, channels a block
    multiple) reaches those ops through a 1x1 MaxPool, an exact copy. ORT's transformer blocks an
    Add only when every input comes from an NCHWc node; it reorders a graph input for a Conv or
    a pool but does not record it as blocked (nchwc_transformer.cc, TransformBinary). So a
    residual branch passed in as a graph input kept its Add, the Relu after it and the reorders
    around them in NCHW down to the next downsampling conv: resnet50 cut before layer1.1 ran
    1.9 ms slower than whole, 1.8 ms of it those ops. Through the pool ORT reorders the input
    once and fuses the Add into the conv, as in the whole model."""
    if block <= 1:  # no NCHWc kernels here
        return model
    anchored = onnx.ModelProto()
    anchored.CopyFrom(model)
    graph = anchored.graph
    taken = {name for node in graph.node for name in (*node.input, *node.output)} | {i.name for i in graph.input}
    pools = []
    for name in _inputs_added_or_joined(model, block):
        copy = f"{name}.blocked"
        while copy in taken:
            copy += "_"
        taken.add(copy)
        pools.append(helper.make_node("MaxPool", [name], [copy], name=copy, kernel_shape=[1, 1]))
        for node in graph.node:
            if _joins(node):
                node.input[:] = [copy if i == name else i for i in node.input]
    nodes = pools + list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes)
    return anchored


# --------------------------------------------------------------------------------------------
# Isolated single-op models
# --------------------------------------------------------------------------------------------


def conv_output_hw(conv_attrs: Mapping[str, Any], x_hw: Sequence[int], kernel: Sequence[int]) -> tuple[int, int]:
    """Output (H, W) of a 2-D Conv/Pool with ONNX attributes ``conv_attrs``."""
    strides = list(conv_attrs.get("strides", [1, 1]))
    dil = list(conv_attrs.get("dilations", [1, 1]))
    auto_pad = conv_attrs.get("auto_pad", "NOTSET")
    if isinstance(auto_pad, bytes):
        auto_pad = auto_pad.decode()
    out = []
    for d in range(2):
        span = dil[d] * (kernel[d] - 1) + 1
        if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            out.append(-(-x_hw[d] // strides[d]))
        elif auto_pad == "VALID":
            out.append((x_hw[d] - span) // strides[d] + 1)
        else:
            pads = list(conv_attrs.get("pads", [0, 0, 0, 0]))
            out.append((x_hw[d] + pads[d] + pads[d + 2] - span) // strides[d] + 1)
    return out[0], out[1]


def _act_nodes(activation: Optional[str], params: Sequence[float], src: str, dst: str,
               inits: list) -> list[onnx.NodeProto]:
    if activation is None:
        return []
    if activation == "Clip":
        inits.append(numpy_helper.from_array(np.array(params[0], np.float32), "clip_min"))
        inits.append(numpy_helper.from_array(np.array(params[1], np.float32), "clip_max"))
        return [helper.make_node("Clip", [src, "clip_min", "clip_max"], [dst], name="act")]
    kwargs = {}
    if activation == "LeakyRelu" and params:
        kwargs["alpha"] = float(params[0])
    if activation == "HardSigmoid" and params:
        kwargs["alpha"], kwargs["beta"] = float(params[0]), float(params[1])
    return [helper.make_node(activation, [src], [dst], name="act", **kwargs)]


def single_conv_model(conv_attrs: Mapping[str, Any], x_shape: Sequence[int], w: np.ndarray,
                      b: Optional[np.ndarray] = None, layout: str = NCHWC, block: Optional[int] = None, *,
                      activation: Optional[str] = None, activation_params: Sequence[float] = (),
                      opset: int = 17, name: str = "conv") -> tuple[onnx.ModelProto, tuple, tuple]:
    """One Conv alone, for timing it in ``layout``.  Returns ``(model, input_shape_fed, output_shape)``.

    * ``"NCHW"``: an ordinary Conv (plus the activation node, which ORT fuses into FusedConv);
      input ``x_shape``, output ``(N, Cout, Ho, Wo)``.
    * ``"NCHWc"``: a ``com.microsoft.nchwc`` Conv with pre-reordered weights and no reorders, so
      the session times the kernel alone; the activation is fused as an attribute.  The input is
      fed already blocked as the 4-D ``(N, Cp, H, W)`` ORT tensor (``nchwc_feed(x, block)``, or
      ``to_blocked(x, block).reshape(input_shape_fed)``), except for ``group == 1`` convs with
      fewer input channels than the block, which read NCHW ``x_shape`` directly as in a real
      model (see ``conv_takes_blocked_input``).  The output stays blocked, ``(N, Op, Ho, Wo)``
      4-D; ``from_blocked(y, Cout, block)`` gives NCHW.

    ``conv_attrs`` are ONNX Conv attributes (pads, strides, dilations, group, auto_pad,
    kernel_shape).  Load the NCHWc model with ``session_options()`` (any level works: nothing in
    it is left for ORT's transformer, but disabling it costs nothing).
    """
    layout = _norm_layout(layout)
    w = np.asarray(w, np.float32)
    b = None if b is None else np.asarray(b, np.float32)
    x_shape = tuple(int(d) for d in x_shape)
    n, cin, h, wd = x_shape
    cout, cin_g, kh, kw = w.shape
    group = int(conv_attrs.get("group", 1))
    if cin_g * group != cin:
        raise ValueError(f"x has {cin} channels, weights expect {cin_g * group}")
    ho, wo = conv_output_hw(conv_attrs, (h, wd), (kh, kw))
    attrs = {k: v for k, v in conv_attrs.items() if k != "group"}
    inits = []
    if layout == NCHW:
        inits.append(numpy_helper.from_array(w, "W"))
        inputs = ["x", "W"]
        if b is not None:
            inits.append(numpy_helper.from_array(b, "B"))
            inputs.append("B")
        conv_out = "y" if activation is None else "conv_out"
        nodes = [helper.make_node("Conv", inputs, [conv_out], name=name, group=group, **attrs)]
        nodes += _act_nodes(activation, activation_params, conv_out, "y", inits)
        in_shape, out_shape = x_shape, (n, cout, ho, wo)
        opsets = [helper.make_opsetid("", opset)]
    else:
        if block is None:
            block = nchwc_block_size()
        reason = conv_nchwc_unsupported(w.shape, group, block)
        if reason is not None:
            raise ValueError(f"conv cannot run as NCHWc: {reason}")
        blocked_in = conv_takes_blocked_input(cin, group, block)
        cin_phys = _round_up(cin, block) if blocked_in else cin
        packed = _pack_conv(w, b, group, block, blocked_in, cin_phys)
        inits.append(numpy_helper.from_array(packed.weight, "W"))
        inputs = ["x", "W"]
        if packed.bias is not None:
            inits.append(numpy_helper.from_array(packed.bias, "B"))
            inputs.append("B")
        node = helper.make_node("Conv", inputs, ["y"], name=name, domain=NCHWC_DOMAIN, **attrs)
        if packed.group != 1:
            node.attribute.append(helper.make_attribute("group", packed.group))
        if activation is not None:
            node.attribute.append(helper.make_attribute("activation", activation))
            if activation_params:
                node.attribute.append(helper.make_attribute("activation_params", [float(p) for p in activation_params]))
        nodes = [node]
        in_shape = (n, cin_phys, h, wd)
        out_shape = (n, packed.out_channels_padded, ho, wo)
        opsets = [helper.make_opsetid("", opset), helper.make_opsetid(NCHWC_DOMAIN, 1)]
    graph = helper.make_graph(nodes, f"single_{layout.lower()}_{name}",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(in_shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(out_shape))], inits)
    return helper.make_model(graph, opset_imports=opsets), in_shape, out_shape


_TO_NCHWC = {"nchw->nchwc", "to_nchwc", "in", "reorderinput", "to_blocked"}
_TO_NCHW = {"nchwc->nchw", "to_nchw", "out", "reorderoutput", "from_blocked"}


def reorder_model(shape: Sequence[int], direction: str, block: Optional[int] = None, *,
                  opset: int = 17) -> tuple[onnx.ModelProto, tuple, tuple]:
    """A model holding only the layout change of one tensor of NCHW ``shape`` (N, C, H, W).

    ``direction`` "NCHW->NCHWc" (ReorderInput, preceded by a channel Pad when C % 4 != 0, as in
    ``rewrite_model``) or "NCHWc->NCHW" (ReorderOutput with ``channels=C``).  Returns
    ``(model, input_shape_fed, output_shape)``; the blocked side is 4-D ``(N, Cp, H, W)``.
    """
    if block is None:
        block = nchwc_block_size()
    n, c, h, w = (int(d) for d in shape)
    cp = _round_up(c, block)
    d = direction.replace(" ", "").lower()
    inits = []
    if d in _TO_NCHWC:
        in_shape, out_shape = (n, c, h, w), (n, cp, h, w)
        src, nodes = "x", []
        if c % 4:
            inits.append(numpy_helper.from_array(np.array([0, 0, 0, 0, 0, _round_up(c, 4) - c, 0, 0], np.int64),
                                                 "pads"))
            nodes.append(helper.make_node("Pad", ["x", "pads"], ["x_pad"], name="x.pad_c", mode="constant"))
            src = "x_pad"
        nodes.append(helper.make_node("ReorderInput", [src], ["y"], name="x.reorder_in", domain=NCHWC_DOMAIN))
    elif d in _TO_NCHW:
        in_shape, out_shape = (n, cp, h, w), (n, c, h, w)
        nodes = [helper.make_node("ReorderOutput", ["x"], ["y"], name="x.reorder_out", domain=NCHWC_DOMAIN,
                                  channels=c)]
    else:
        raise ValueError(f"direction must be 'NCHW->NCHWc' or 'NCHWc->NCHW', got {direction!r}")
    graph = helper.make_graph(nodes, "reorder",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(in_shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(out_shape))], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset),
                                                    helper.make_opsetid(NCHWC_DOMAIN, 1)])
    return model, in_shape, out_shape


__all__ = [
    "CONFIG_KEYS",
    "DISABLE_OPTIMIZERS_KEY",
    "NCHWC_DOMAIN",
    "NCHWC_TRANSFORMER",
    "RewriteInfo",
    "conv_nchwc_unsupported",
    "conv_output_hw",
    "conv_takes_blocked_input",
    "from_blocked",
    "nchwc_block_size",
    "nchwc_feed",
    "reorder_filter_oihwbibo",
    "reorder_filter_oihwbo",
    "reorder_model",
    "rewrite_model",
    "session_options",
    "single_conv_model",
    "to_blocked",
]
