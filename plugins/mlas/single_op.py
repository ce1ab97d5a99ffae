"""Isolated single-op models, for timing one op as a rewritten model runs it: one Conv in NCHW or
NCHWc (``single_conv_model``, with its activation as a node or fused into the NCHWc conv) and one
tensor's layout change (``reorder_model``: a ReorderInput, after the channel Pad the rewrite
inserts when C % 4 != 0, or a ReorderOutput); ``conv_output_hw`` gives a conv's output size.
Load the models with ``ort_session.session_options()``; feed and read blocked tensors with
layout.py's ``nchwc_feed`` / ``from_blocked``.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kselect.plugins.mlas.layout import (
    NCHW,
    NCHWC,
    conv_nchwc_unsupported,
    conv_takes_blocked_input,
    nchwc_block_size,
    norm_layout,
    pack_conv,
    round_up,
)
from kselect.plugins.mlas.ort_session import NCHWC_DOMAIN


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
    layout = norm_layout(layout)
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
        cin_phys = round_up(cin, block) if blocked_in else cin
        packed = pack_conv(w, b, group, block, blocked_in, cin_phys)
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
    cp = round_up(c, block)
    d = direction.replace(" ", "").lower()
    inits = []
    if d in _TO_NCHWC:
        in_shape, out_shape = (n, c, h, w), (n, cp, h, w)
        src, nodes = "x", []
        if c % 4:
            inits.append(numpy_helper.from_array(np.array([0, 0, 0, 0, 0, round_up(c, 4) - c, 0, 0], np.int64),
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
    "conv_output_hw",
    "reorder_model",
    "single_conv_model",
]
