"""Convolutions as op kinds: "conv" (2-D Conv, and 1-D Conv held as 2-D of height 1) and
"deconv" (2-D ConvTranspose), with their float64 references."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from kselect.core.contract.opkind import OnnxOp, OpKind
from kselect.core.errors import KselectError
from kselect.core.models.tasks import Op, constant_float_weights, explicit_pads, node_attr, tensor_shape

_SUPPORTED_DIMS = "only 1-D and 2-D convolutions and 2-D transposed convolutions are tuned"


class ConvKind(OpKind):
    """Conv: x NCHW, w OIHW. A 1-D conv's shapes are [N, C, 1, W] and its attrs say ``conv1d``."""

    name = "conv"
    onnx_ops = ("Conv",)

    def read(self, model, node: onnx.NodeProto):
        shapes = _shapes(model, node)
        if isinstance(shapes, str):
            return shapes
        x, w, y, has_bias = shapes
        check_conv(node, x, w, y)
        if len(x) == 3:
            return Op(node.name, self.name, *_as_2d(x, w, y), _conv1d_attrs(node, x, w), has_bias)
        if len(x) != 4:
            return f"{len(x) - 2}-D Conv: {_SUPPORTED_DIMS}"
        return Op(node.name, self.name, x, w, y, _conv_attrs(node, x, w[2:]), has_bias)

    def macs(self, op) -> int:
        n, cout, oh, ow = op.output_shape
        _, cin_per_group, kh, kw = op.weight_shape
        return n * cout * oh * ow * cin_per_group * kh * kw

    def inputs(self, task, rng):
        return _inputs(task, rng, fan_in=int(np.prod(task.weight_shape[1:])))

    def reference(self, task, inputs):
        a = task.attrs
        return conv_reference(inputs["x"], inputs["w"], inputs.get("b"), a["strides"], a["pads"], a["dilations"],
                              a["group"])

    def onnx_op(self, task, inputs, output):
        a, names = task.attrs, ["x", "w"] + (["b"] if "b" in inputs else [])
        if a.get("conv1d"):
            node = helper.make_node("Conv", names, [output], name="op", kernel_shape=a["kernel"][1:],
                                    strides=a["strides"][1:], pads=[a["pads"][1], a["pads"][3]],
                                    dilations=a["dilations"][1:], group=a["group"])
            return OnnxOp(node, as_conv1d(task.input_shape), as_conv1d(task.output_shape), inputs["w"][:, :, 0, :])
        node = helper.make_node("Conv", names, [output], name="op", kernel_shape=a["kernel"], strides=a["strides"],
                                pads=a["pads"], dilations=a["dilations"], group=a["group"])
        return OnnxOp(node, task.input_shape, task.output_shape, inputs["w"])

    def describe(self, task) -> str:
        a = task.attrs
        if a.get("conv1d"):
            pads = a["pads"][1] if a["pads"][1] == a["pads"][3] else f"{a['pads'][1]},{a['pads'][3]}"
            text = f"1-D k{a['kernel'][1]} s{a['strides'][1]} p{pads}"
            text += f" d{a['dilations'][1]}" if a["dilations"][1] != 1 else ""
            return text + (f" g{a['group']}" if a["group"] > 1 else "")
        return _describe_2d(a)


class DeconvKind(OpKind):
    """ConvTranspose: x NCHW, w as ONNX has it, [C_in, C_out / group, kH, kW]; pads explicit."""

    name = "deconv"
    onnx_ops = ("ConvTranspose",)

    def read(self, model, node: onnx.NodeProto):
        shapes = _shapes(model, node)
        if isinstance(shapes, str):
            return shapes
        x, w, y, has_bias = shapes
        if len(x) != 4:
            return f"{len(x) - 2}-D ConvTranspose: {_SUPPORTED_DIMS}"
        attrs, why = deconv_attrs(node, x, w, y)
        if attrs is None:
            return why
        return Op(node.name, self.name, x, w, y, attrs, has_bias)

    def macs(self, op) -> int:  # every input pixel scatters a kernel-sized patch per output channel
        n, cin, h, w = op.input_shape
        _, cout_per_group, kh, kw = op.weight_shape
        return n * cin * h * w * cout_per_group * kh * kw

    def inputs(self, task, rng):
        # an output pixel sums over C_in / stride^2 of the kernel's taps
        fan_in = int(np.prod(task.weight_shape)) // output_channels(task) // int(np.prod(task.attrs["strides"]))
        return _inputs(task, rng, fan_in=max(1, fan_in))

    def reference(self, task, inputs):
        a = task.attrs
        return deconv_reference(inputs["x"], inputs["w"], inputs.get("b"), a["strides"], a["pads"], a["dilations"],
                                a["group"], a["output_padding"])

    def onnx_op(self, task, inputs, output):
        a, names = task.attrs, ["x", "w"] + (["b"] if "b" in inputs else [])
        node = helper.make_node("ConvTranspose", names, [output], name="op", kernel_shape=a["kernel"],
                                strides=a["strides"], pads=a["pads"], dilations=a["dilations"], group=a["group"],
                                output_padding=a["output_padding"])
        return OnnxOp(node, task.input_shape, task.output_shape, inputs["w"])

    def describe(self, task) -> str:
        a = task.attrs
        text = _describe_2d(a)
        if any(a.get("output_padding", [0, 0])):
            text += f" op{a['output_padding'][0]}x{a['output_padding'][1]}"
        return text


def check_conv(node: onnx.NodeProto, x: list[int], w: list[int], y: list[int]) -> None:
    """Refuses, before anything is measured, a Conv no library can run: no output channel,
    channels its groups do not divide or its weight does not take, a kernel larger than its
    padded input (an output dim of 0 or less)."""
    group = int(node_attr(node, "group", 1))
    where = f"Conv {node.name!r}"
    if w[0] == 0:
        raise KselectError(f"{where} has 0 output channels")
    if group < 1 or w[0] % group:
        raise KselectError(f"{where}: its {w[0]} output channels do not divide into {group} groups")
    if len(x) > 1 and x[1] != w[1] * group:
        raise KselectError(f"{where}: its input has {x[1]} channels, its weight takes {w[1] * group} ({w[1]} per "
                           f"group, {group} groups); check --input-shape")
    if any(d <= 0 for d in y[2:]):
        raise KselectError(f"{where}: its kernel {list(w[2:])} is larger than its padded input {list(x[2:])} "
                           f"(output {'x'.join(map(str, y))})")


def _shapes(model, node: onnx.NodeProto):
    """(x, w, y shapes, has bias) of a Conv or ConvTranspose, or why it is left untuned."""
    w = constant_float_weights(model, node, node.input[1])
    if isinstance(w, str):
        return w
    x, y = tensor_shape(model, node.input[0], node), tensor_shape(model, node.output[0], node)
    return x, w, y, len(node.input) > 2 and node.input[2] != ""


def _inputs(task, rng: np.random.Generator, fan_in: int) -> dict[str, np.ndarray]:
    """x standard normal, w scaled as He initialisation would, a small bias: random values matter,
    since some kernels run faster on zeros."""
    inputs = {
        "x": rng.standard_normal(task.input_shape, dtype=np.float32),
        "w": (rng.standard_normal(task.weight_shape, dtype=np.float32) * np.sqrt(2.0 / fan_in)).astype(np.float32),
    }
    if task.has_bias:
        inputs["b"] = (rng.standard_normal(output_channels(task), dtype=np.float32) * 0.1).astype(np.float32)
    return inputs


def _describe_2d(a: dict) -> str:
    pads = a["pads"]
    pad_text = str(pads[0]) if len(set(pads)) == 1 else ",".join(map(str, pads))
    stride_text = str(a["strides"][0]) if a["strides"][0] == a["strides"][1] else f"{a['strides'][0]}x{a['strides'][1]}"
    text = f"k{a['kernel'][0]}x{a['kernel'][1]} s{stride_text} p{pad_text}"
    if a["dilations"] != [1, 1]:
        text += f" d{a['dilations'][0]}x{a['dilations'][1]}"
    if a["group"] > 1:
        text += f" g{a['group']}"
    return text


def as_conv1d(shape: list[int]) -> list[int]:
    """A 1-D conv's tensor shape from its task's height-1 form: [N, C, 1, W] -> [N, C, W]."""
    return [shape[0], shape[1], shape[3]]


def _conv_attrs(node, x: list[int], kernel: list[int]) -> dict:
    strides = list(node_attr(node, "strides", [1, 1]))
    dilations = list(node_attr(node, "dilations", [1, 1]))
    return {"kernel": kernel, "strides": strides, "pads": explicit_pads(node, x, kernel, strides, dilations),
            "dilations": dilations, "group": int(node_attr(node, "group", 1))}



def _as_2d(x: list[int], w: list[int], y: list[int]) -> tuple[list[int], list[int], list[int]]:
    """A 1-D conv's shapes as a 2-D conv's of height 1 (the task's form; attrs["conv1d"] says so)."""
    return [x[0], x[1], 1, x[2]], [w[0], w[1], 1, w[2]], [y[0], y[1], 1, y[2]]



def _conv1d_attrs(node, x: list[int], w: list[int]) -> dict:
    """A 1-D conv's attributes in the 2-D form of height 1."""
    kernel, strides, dilations = [1, w[2]], [1, *node_attr(node, "strides", [1])], [1, *node_attr(node, "dilations", [1])]
    auto_pad = node_attr(node, "auto_pad", b"NOTSET")
    if (auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad) in ("NOTSET", ""):
        begin, end = node_attr(node, "pads", [0, 0])
        pads = [0, begin, 0, end]
    else:
        pads = explicit_pads(node, [x[0], x[1], 1, x[2]], kernel, strides, dilations)
    return {"kernel": kernel, "strides": strides, "pads": pads, "dilations": dilations,
            "group": int(node_attr(node, "group", 1)), "conv1d": True}



def deconv_attrs(node, x: list[int], w: list[int], y: list[int]) -> tuple[dict | None, str]:
    """A ConvTranspose's attributes with its pads explicit, or (None, why). Where its output size
    comes from auto_pad or output_shape, the pads are what ONNX Runtime crops to reach it: the
    odd one at the end for SAME_UPPER, at the start otherwise (checked against ONNX Runtime in
    tests/test_import.py)."""
    auto_pad = node_attr(node, "auto_pad", b"NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
    attrs = {"kernel": w[2:], "strides": list(node_attr(node, "strides", [1, 1])),
             "pads": list(node_attr(node, "pads", [0, 0, 0, 0])), "dilations": list(node_attr(node, "dilations", [1, 1])),
             "group": int(node_attr(node, "group", 1)), "output_padding": list(node_attr(node, "output_padding", [0, 0]))}
    derived = auto_pad not in ("NOTSET", "", "VALID") or node_attr(node, "output_shape") is not None
    if auto_pad == "VALID":
        attrs["pads"] = [0, 0, 0, 0]
    for axis in range(2):
        span = (attrs["kernel"][axis] - 1) * attrs["dilations"][axis] + 1
        full = attrs["strides"][axis] * (x[2 + axis] - 1) + attrs["output_padding"][axis] + span
        if derived:
            total = full - y[2 + axis]
            if total < 0:
                return None, f"ConvTranspose output {y} is larger than its input and kernel give"
            start = total // 2 if auto_pad == "SAME_UPPER" else total - total // 2
            attrs["pads"][axis], attrs["pads"][2 + axis] = start, total - start
        elif full - attrs["pads"][axis] - attrs["pads"][2 + axis] != y[2 + axis]:
            return None, f"ConvTranspose output {y} does not follow from its attributes"
    return attrs, ""



def output_channels(task) -> int:
    if task.kind == "deconv":
        return task.weight_shape[1] * task.attrs["group"]
    return task.weight_shape[0]



def conv_reference(x, w, b, strides, pads, dilations, group) -> np.ndarray:
    """Direct convolution in float64 (NCHW, OIHW, pads [top, left, bottom, right])."""
    n, c, _, _ = x.shape
    o, cg, kh, kw = w.shape
    x = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pads[0], pads[2]), (pads[1], pads[3])))
    span_h, span_w = (kh - 1) * dilations[0] + 1, (kw - 1) * dilations[1] + 1
    windows = np.lib.stride_tricks.sliding_window_view(x, (span_h, span_w), axis=(2, 3))
    windows = windows[:, :, :: strides[0], :: strides[1], :: dilations[0], :: dilations[1]]
    oh, ow = windows.shape[2], windows.shape[3]
    windows = windows.reshape(n, group, cg, oh, ow, kh, kw)
    weights = w.astype(np.float64).reshape(group, o // group, cg, kh, kw)
    y = np.einsum("ngchwij,gocij->ngohw", windows, weights, optimize=True).reshape(n, o, oh, ow)
    if b is not None:
        y += b.astype(np.float64).reshape(1, -1, 1, 1)
    return y



def deconv_reference(x, w, b, strides, pads, dilations, group, output_padding) -> np.ndarray:
    """Transposed convolution in float64 (NCHW; weights [C_in, C_out / group, kH, kW] as ONNX
    has them): each input pixel adds its kernel-sized patch, then the pads are cropped."""
    n, cin, h, wd = x.shape
    _, cog, kh, kw = w.shape
    full_h = (h - 1) * strides[0] + (kh - 1) * dilations[0] + 1 + output_padding[0]
    full_w = (wd - 1) * strides[1] + (kw - 1) * dilations[1] + 1 + output_padding[1]
    full = np.zeros((n, group, cog, full_h, full_w))
    xg = x.astype(np.float64).reshape(n, group, cin // group, h, wd)
    wg = w.astype(np.float64).reshape(group, cin // group, cog, kh, kw)
    for i in range(kh):
        for j in range(kw):
            top, left = i * dilations[0], j * dilations[1]
            rows = slice(top, top + (h - 1) * strides[0] + 1, strides[0])
            columns = slice(left, left + (wd - 1) * strides[1] + 1, strides[1])
            full[:, :, :, rows, columns] += np.einsum("ngchw,gco->ngohw", xg, wg[:, :, :, i, j], optimize=True)
    y = full.reshape(n, group * cog, full_h, full_w)[:, :, pads[0]:full_h - pads[2], pads[1]:full_w - pads[3]]
    if b is not None:
        y = y + b.astype(np.float64).reshape(1, -1, 1, 1)
    return y


