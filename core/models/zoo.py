"""Built-in model zoo: classic CNNs generated with ``onnx.helper``.

Every model takes an NCHW float32 tensor named ``"input"`` of shape
1x3x224x224 and produces ``"output"``, the 1x1000 class probabilities after a
Softmax.  Weights are seeded random numbers (He initialisation), so the models
are meant for measuring kernels, not for classifying images; the same
``(name, seed)`` always gives a byte-identical model.

The graphs use a deliberately small op set so that every executor in kselect
can run them: Conv (with bias), Relu, Clip (ReLU6), MaxPool, AveragePool,
GlobalAveragePool, Add, Concat, Flatten, Gemm (transB=1) and Softmax.  There is
no BatchNormalization (deployment models have it folded into the conv bias), no
LRN and no Dropout.  Padding is always given explicitly through ``pads`` (no
``auto_pad``, no ``ceil_mode``); where a framework would use ``ceil_mode`` or
"same" padding with an even kernel, the equivalent asymmetric ``pads`` are used
(ONNX order ``[top, left, bottom, right]``).

Usage::

    from kselect.core.models.zoo import BUILTIN_MODELS, build_model
    model = build_model("resnet50", seed=0)
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = ["BUILTIN_MODELS", "build_model", "INPUT_NAME", "OUTPUT_NAME", "INPUT_SHAPE", "NUM_CLASSES"]

INPUT_NAME = "input"
OUTPUT_NAME = "output"
INPUT_SHAPE = (1, 3, 224, 224)
NUM_CLASSES = 1000
OPSET = 17
# IR version 8 goes with opset 17 (onnx 1.12/1.13) and is accepted by every
# onnxruntime release that kselect supports.
IR_VERSION = 8

BUILTIN_MODELS: dict[str, str] = {
    "resnet18": "ResNet-18 (basic blocks, 1x1 projection shortcuts)",
    "resnet50": "ResNet-50 v1.5 (bottlenecks, stride on the 3x3)",
    "resnet101": "ResNet-101 v1.5 (bottlenecks, stride on the 3x3)",
    "alexnet": "AlexNet, torchvision variant (64/192/384/256/256 channels, no LRN)",
    "vgg16": "VGG-16 (configuration D, no batch norm)",
    "googlenet": "GoogLeNet / Inception v1 (no aux heads, no BN, true 5x5 branch as in the paper)",
    "mobilenetv2": "MobileNetV2 width 1.0 (inverted residuals, depthwise convs, ReLU6)",
    "resnetxy": "ResNetXY, the ACLTuner paper's atypical ResNet-50-shaped model (14x14 stem, 4x4/6x6/1x1 bottlenecks)",
}


def _same_pads(size: int, k: int, stride: int) -> tuple[int, int]:
    """(begin, end) padding giving ``ceil(size / stride)`` outputs: ``k // 2`` on both sides for
    odd kernels (as torchvision pads), the extra on the end for even ones (SAME_UPPER)."""
    if k % 2 == 1 and (size + 2 * (k // 2) - k) // stride + 1 == -(-size // stride):
        return k // 2, k // 2
    out = -(-size // stride)
    total = max((out - 1) * stride + k - size, 0)
    return total // 2, total - total // 2


class _Builder:
    """Accumulates nodes and initializers; tracks (C, H, W) of every tensor."""

    def __init__(self, name: str, seed: int, weights: bool = True):
        self.name = name
        self.weights = weights
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[TensorProto] = []
        self.shapes: dict[str, tuple[int, int, int]] = {INPUT_NAME: INPUT_SHAPE[1:]}
        self._names: set[str] = set()
        self._relu6_bounds: tuple[str, str] | None = None

    # -- helpers -----------------------------------------------------------
    def _node(self, op: str, name: str, inputs: Sequence[str], output: str | None = None, **attrs) -> str:
        if name in self._names:
            raise ValueError(f"duplicate node name {name!r}")
        self._names.add(name)
        out = output or name
        self.nodes.append(helper.make_node(op, list(inputs), [out], name=name, **attrs))
        return out

    def _init(self, name: str, array: np.ndarray) -> str:
        if self.weights or array.ndim == 0:
            self.inits.append(numpy_helper.from_array(np.asarray(array, dtype=np.float32), name))
        else:  # a weight's dims without its values: enough to count parameters and MACs
            self.inits.append(TensorProto(name=name, data_type=TensorProto.FLOAT, dims=array.shape))
        return name

    def _he(self, shape: Sequence[int], fan_in: int, scale: float = 1.0) -> np.ndarray:
        if not self.weights:
            return np.empty(tuple(shape), np.float32)  # never filled: only its shape is read
        std = np.float32(scale * math.sqrt(2.0 / fan_in))
        w = self.rng.standard_normal(tuple(shape), dtype=np.float32)
        w *= std
        return w

    def _bias(self, n: int) -> np.ndarray:
        if not self.weights:
            return np.empty(n, np.float32)
        b = self.rng.standard_normal(n, dtype=np.float32)
        b *= np.float32(0.01)
        return b

    # -- layers ------------------------------------------------------------
    def conv(
        self,
        x: str,
        name: str,
        cout: int,
        k: int,
        stride: int = 1,
        pads: Sequence[int] | None = None,
        group: int = 1,
        act: str | None = None,
        act_name: str | None = None,
        scale: float = 1.0,
    ) -> str:
        """Conv with bias; ``pads`` defaults to "same" (asymmetric for even kernels).

        ``act`` is ``None``, ``"relu"`` or ``"relu6"``; the activation node is
        called ``act_name`` (default ``name + ".relu"``/``".relu6"``).
        """
        cin, h, w = self.shapes[x]
        if cin % group or cout % group:
            raise ValueError(f"{name}: channels {cin}->{cout} not divisible by group {group}")
        if pads is None:
            (t, b), (l, r) = _same_pads(h, k, stride), _same_pads(w, k, stride)
            pads = [t, l, b, r]
        pads = [int(p) for p in pads]
        fan_in = (cin // group) * k * k
        wname = self._init(f"{name}.weight", self._he((cout, cin // group, k, k), fan_in, scale))
        bname = self._init(f"{name}.bias", self._bias(cout))
        y = self._node(
            "Conv", name, [x, wname, bname],
            kernel_shape=[k, k], strides=[stride, stride], pads=pads, dilations=[1, 1], group=group,
        )
        oh = (h + pads[0] + pads[2] - k) // stride + 1
        ow = (w + pads[1] + pads[3] - k) // stride + 1
        self.shapes[y] = (cout, oh, ow)
        if act == "relu":
            y = self.relu(y, act_name or f"{name}.relu")
        elif act == "relu6":
            y = self.relu6(y, act_name or f"{name}.relu6")
        elif act is not None:
            raise ValueError(act)
        return y

    def relu(self, x: str, name: str) -> str:
        y = self._node("Relu", name, [x])
        self.shapes[y] = self.shapes[x]
        return y

    def relu6(self, x: str, name: str) -> str:
        if self._relu6_bounds is None:
            self._relu6_bounds = (
                self._init("relu6.min", np.array(0.0, np.float32)),
                self._init("relu6.max", np.array(6.0, np.float32)),
            )
        y = self._node("Clip", name, [x, *self._relu6_bounds])
        self.shapes[y] = self.shapes[x]
        return y

    def _pool(self, op: str, x: str, name: str, k: int, stride: int, pads: Sequence[int]) -> str:
        c, h, w = self.shapes[x]
        y = self._node(op, name, [x], kernel_shape=[k, k], strides=[stride, stride], pads=list(pads))
        self.shapes[y] = (
            c,
            (h + pads[0] + pads[2] - k) // stride + 1,
            (w + pads[1] + pads[3] - k) // stride + 1,
        )
        return y

    def maxpool(self, x: str, name: str, k: int, stride: int, pads: Sequence[int] = (0, 0, 0, 0)) -> str:
        return self._pool("MaxPool", x, name, k, stride, pads)

    def avgpool(self, x: str, name: str, k: int, stride: int, pads: Sequence[int] = (0, 0, 0, 0)) -> str:
        return self._pool("AveragePool", x, name, k, stride, pads)

    def add(self, a: str, b: str, name: str) -> str:
        if self.shapes[a] != self.shapes[b]:
            raise ValueError(f"{name}: shape mismatch {self.shapes[a]} vs {self.shapes[b]}")
        y = self._node("Add", name, [a, b])
        self.shapes[y] = self.shapes[a]
        return y

    def concat(self, xs: Sequence[str], name: str) -> str:
        hw = {self.shapes[x][1:] for x in xs}
        if len(hw) != 1:
            raise ValueError(f"{name}: spatial mismatch {hw}")
        y = self._node("Concat", name, list(xs), axis=1)
        self.shapes[y] = (sum(self.shapes[x][0] for x in xs), *hw.pop())
        return y

    def global_avgpool(self, x: str, name: str = "avgpool") -> str:
        y = self._node("GlobalAveragePool", name, [x])
        self.shapes[y] = (self.shapes[x][0], 1, 1)
        return y

    def flatten(self, x: str, name: str = "flatten") -> str:
        c, h, w = self.shapes[x]
        y = self._node("Flatten", name, [x], axis=1)
        self.shapes[y] = (c * h * w, 1, 1)  # (features, 1, 1) for bookkeeping
        return y

    def gemm(self, x: str, name: str, nout: int, act: str | None = None) -> str:
        nin = self.shapes[x][0]
        wname = self._init(f"{name}.weight", self._he((nout, nin), nin))
        bname = self._init(f"{name}.bias", self._bias(nout))
        y = self._node("Gemm", name, [x, wname, bname], alpha=1.0, beta=1.0, transB=1)
        self.shapes[y] = (nout, 1, 1)
        if act == "relu":
            y = self.relu(y, f"{name}.relu")
        return y

    def classifier_head(self, x: str) -> None:
        """fc features -> 1000 logits -> Softmax producing ``"output"``."""
        y = self.gemm(x, "fc", NUM_CLASSES)
        self._node("Softmax", "softmax", [y], output=OUTPUT_NAME, axis=1)

    # -- finish ------------------------------------------------------------
    def model(self, doc: str) -> onnx.ModelProto:
        graph = helper.make_graph(
            self.nodes,
            self.name,
            [helper.make_tensor_value_info(INPUT_NAME, TensorProto.FLOAT, list(INPUT_SHAPE))],
            [helper.make_tensor_value_info(OUTPUT_NAME, TensorProto.FLOAT, [INPUT_SHAPE[0], NUM_CLASSES])],
            initializer=self.inits,
            doc_string=doc,
        )
        model = helper.make_model(
            graph,
            opset_imports=[helper.make_opsetid("", OPSET)],
            producer_name="kselect.zoo",
            producer_version="1",
            doc_string=doc,
        )
        model.ir_version = IR_VERSION
        model.model_version = 1
        return model


# Residual branches end with a conv whose He-initialised weights are scaled by
# this factor (a Fixup-style down-weighting of the residual branch).  Without
# batch norm every residual Add would otherwise roughly double the activation
# variance: with a scale of 1, ResNet-101's logits reach ~1e7 (fp16 overflow,
# saturated softmax); with 0.25 every zoo model keeps activations and logits
# below ~100.  Shapes, parameter counts and MACs are unaffected.
_RESIDUAL_SCALE = 0.25


# ---------------------------------------------------------------------------
# ResNets
# ---------------------------------------------------------------------------
def _resnet_stem(b: _Builder) -> str:
    x = b.conv(INPUT_NAME, "conv1", 64, 7, stride=2, pads=[3, 3, 3, 3], act="relu", act_name="relu")
    return b.maxpool(x, "maxpool", 3, 2, [1, 1, 1, 1])


def _basic_block(b: _Builder, x: str, prefix: str, planes: int, stride: int) -> str:
    cin = b.shapes[x][0]
    y = b.conv(x, f"{prefix}.conv1", planes, 3, stride, act="relu", act_name=f"{prefix}.relu1")
    y = b.conv(y, f"{prefix}.conv2", planes, 3, 1, scale=_RESIDUAL_SCALE)
    sc = x
    if stride != 1 or cin != planes:
        sc = b.conv(x, f"{prefix}.downsample", planes, 1, stride)
    y = b.add(y, sc, f"{prefix}.add")
    return b.relu(y, f"{prefix}.relu")


def _bottleneck(b: _Builder, x: str, prefix: str, planes: int, stride: int, expansion: int = 4) -> str:
    cin = b.shapes[x][0]
    y = b.conv(x, f"{prefix}.conv1", planes, 1, act="relu", act_name=f"{prefix}.relu1")
    y = b.conv(y, f"{prefix}.conv2", planes, 3, stride, act="relu", act_name=f"{prefix}.relu2")
    y = b.conv(y, f"{prefix}.conv3", planes * expansion, 1, scale=_RESIDUAL_SCALE)
    sc = x
    if stride != 1 or cin != planes * expansion:
        sc = b.conv(x, f"{prefix}.downsample", planes * expansion, 1, stride)
    y = b.add(y, sc, f"{prefix}.add")
    return b.relu(y, f"{prefix}.relu")


def _resnet(b: _Builder, block: Callable, layers: Sequence[int]) -> None:
    x = _resnet_stem(b)
    for i, (planes, n) in enumerate(zip((64, 128, 256, 512), layers)):
        for j in range(n):
            x = block(b, x, f"layer{i + 1}.{j}", planes, 2 if (i > 0 and j == 0) else 1)
    x = b.global_avgpool(x)
    b.classifier_head(b.flatten(x))


def _build_resnet18(b: _Builder) -> None:
    _resnet(b, _basic_block, (2, 2, 2, 2))


def _build_resnet50(b: _Builder) -> None:
    _resnet(b, _bottleneck, (3, 4, 6, 3))


def _build_resnet101(b: _Builder) -> None:
    _resnet(b, _bottleneck, (3, 4, 23, 3))


def _build_resnetxy(b: _Builder) -> None:
    """ACLTuner's ResNetXY (Table 5): ResNet-50 layout, atypical kernels/channels.

    Stem: 14x14 conv, 51 channels, stride 2 (pads 6) + ReLU, then 3x3/2 max pool
    -> 56x56.  Four stages of 3, 4, 6, 3 bottlenecks [4x4 conv C; 6x6 conv C;
    1x1 conv 2C] with C = 77, 97, 279, 511.  As in ResNet-50 v1.5 the stride 2
    of stages 2-4 sits on the second conv (the 6x6) of the first block, and the
    first block of every stage has a 1x1 projection shortcut (channels change in
    all four).  Even kernels use "same" asymmetric pads (4x4/1: [1,1,2,2],
    6x6/1: [2,2,3,3], 6x6/2: [2,2,2,2]) so the spatial sizes are 56, 28, 14, 7.
    Totals: 87.59 M params, 16.33 G MACs (paper: 86.6 M, 16.35 G).
    """
    x = b.conv(INPUT_NAME, "conv1", 51, 14, stride=2, act="relu", act_name="relu")
    x = b.maxpool(x, "maxpool", 3, 2, [1, 1, 1, 1])
    for i, (c, n) in enumerate(zip((77, 97, 279, 511), (3, 4, 6, 3))):
        for j in range(n):
            prefix = f"layer{i + 1}.{j}"
            stride = 2 if (i > 0 and j == 0) else 1
            y = b.conv(x, f"{prefix}.conv1", c, 4, act="relu", act_name=f"{prefix}.relu1")
            y = b.conv(y, f"{prefix}.conv2", c, 6, stride, act="relu", act_name=f"{prefix}.relu2")
            y = b.conv(y, f"{prefix}.conv3", 2 * c, 1, scale=_RESIDUAL_SCALE)
            sc = x if j else b.conv(x, f"{prefix}.downsample", 2 * c, 1, stride)
            x = b.relu(b.add(y, sc, f"{prefix}.add"), f"{prefix}.relu")
        assert b.shapes[x][1] == (56, 28, 14, 7)[i], b.shapes[x]
    x = b.global_avgpool(x)
    b.classifier_head(b.flatten(x))


# ---------------------------------------------------------------------------
# AlexNet, VGG
# ---------------------------------------------------------------------------
def _build_alexnet(b: _Builder) -> None:
    x = b.conv(INPUT_NAME, "features.0", 64, 11, stride=4, pads=[2, 2, 2, 2], act="relu", act_name="features.1")
    x = b.maxpool(x, "features.2", 3, 2)  # 55 -> 27
    x = b.conv(x, "features.3", 192, 5, act="relu", act_name="features.4")
    x = b.maxpool(x, "features.5", 3, 2)  # 27 -> 13
    x = b.conv(x, "features.6", 384, 3, act="relu", act_name="features.7")
    x = b.conv(x, "features.8", 256, 3, act="relu", act_name="features.9")
    x = b.conv(x, "features.10", 256, 3, act="relu", act_name="features.11")
    x = b.maxpool(x, "features.12", 3, 2)  # 13 -> 6; adaptive 6x6 avgpool is the identity
    assert b.shapes[x] == (256, 6, 6)
    x = b.flatten(x)
    x = b.gemm(x, "classifier.1", 4096, act="relu")
    x = b.gemm(x, "classifier.4", 4096, act="relu")
    b.classifier_head(x)


def _build_vgg16(b: _Builder) -> None:
    cfg = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]
    x, stage, idx = INPUT_NAME, 1, 1
    for v in cfg:
        if v == "M":
            x = b.maxpool(x, f"pool{stage}", 2, 2)
            stage, idx = stage + 1, 1
        else:
            x = b.conv(x, f"conv{stage}_{idx}", v, 3, act="relu", act_name=f"relu{stage}_{idx}")
            idx += 1
    assert b.shapes[x] == (512, 7, 7)
    x = b.flatten(x)
    x = b.gemm(x, "fc6", 4096, act="relu")
    x = b.gemm(x, "fc7", 4096, act="relu")
    b.classifier_head(x)


# ---------------------------------------------------------------------------
# GoogLeNet
# ---------------------------------------------------------------------------
def _inception(b: _Builder, x: str, p: str, c1: int, c3r: int, c3: int, c5r: int, c5: int, pp: int) -> str:
    b1 = b.conv(x, f"{p}.branch1", c1, 1, act="relu")
    b2 = b.conv(x, f"{p}.branch2.0", c3r, 1, act="relu")
    b2 = b.conv(b2, f"{p}.branch2.1", c3, 3, act="relu")
    b3 = b.conv(x, f"{p}.branch3.0", c5r, 1, act="relu")
    b3 = b.conv(b3, f"{p}.branch3.1", c5, 5, act="relu")  # the paper's true 5x5 (torchvision uses 3x3)
    b4 = b.maxpool(x, f"{p}.branch4.pool", 3, 1, [1, 1, 1, 1])
    b4 = b.conv(b4, f"{p}.branch4.1", pp, 1, act="relu")
    return b.concat([b1, b2, b3, b4], f"{p}.concat")


def _build_googlenet(b: _Builder) -> None:
    # torchvision's ceil_mode=True max pools are written as floor-mode pools
    # with one extra row/column of end padding (identical output).
    x = b.conv(INPUT_NAME, "conv1", 64, 7, stride=2, pads=[3, 3, 3, 3], act="relu")
    x = b.maxpool(x, "maxpool1", 3, 2, [0, 0, 1, 1])  # 112 -> 56
    x = b.conv(x, "conv2", 64, 1, act="relu")
    x = b.conv(x, "conv3", 192, 3, act="relu")
    x = b.maxpool(x, "maxpool2", 3, 2, [0, 0, 1, 1])  # 56 -> 28
    x = _inception(b, x, "inception3a", 64, 96, 128, 16, 32, 32)
    x = _inception(b, x, "inception3b", 128, 128, 192, 32, 96, 64)
    x = b.maxpool(x, "maxpool3", 3, 2, [0, 0, 1, 1])  # 28 -> 14
    x = _inception(b, x, "inception4a", 192, 96, 208, 16, 48, 64)
    x = _inception(b, x, "inception4b", 160, 112, 224, 24, 64, 64)
    x = _inception(b, x, "inception4c", 128, 128, 256, 24, 64, 64)
    x = _inception(b, x, "inception4d", 112, 144, 288, 32, 64, 64)
    x = _inception(b, x, "inception4e", 256, 160, 320, 32, 128, 128)
    x = b.maxpool(x, "maxpool4", 2, 2)  # 14 -> 7
    x = _inception(b, x, "inception5a", 256, 160, 320, 32, 128, 128)
    x = _inception(b, x, "inception5b", 384, 192, 384, 48, 128, 128)
    assert b.shapes[x] == (1024, 7, 7)
    x = b.global_avgpool(x)
    b.classifier_head(b.flatten(x))


# ---------------------------------------------------------------------------
# MobileNetV2
# ---------------------------------------------------------------------------
def _build_mobilenetv2(b: _Builder) -> None:
    settings = [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)]
    x = b.conv(INPUT_NAME, "features.0", 32, 3, stride=2, pads=[1, 1, 1, 1], act="relu6")
    idx = 1
    for t, c, n, s in settings:
        for j in range(n):
            stride = s if j == 0 else 1
            cin = b.shapes[x][0]
            hidden = cin * t
            p = f"features.{idx}"
            y = x
            if t != 1:
                y = b.conv(y, f"{p}.expand", hidden, 1, act="relu6")
            y = b.conv(y, f"{p}.dw", hidden, 3, stride, pads=[1, 1, 1, 1], group=hidden, act="relu6")
            residual = stride == 1 and cin == c
            y = b.conv(y, f"{p}.project", c, 1, scale=_RESIDUAL_SCALE if residual else 1.0)
            x = b.add(x, y, f"{p}.add") if residual else y
            idx += 1
    x = b.conv(x, f"features.{idx}", 1280, 1, act="relu6")
    x = b.global_avgpool(x)
    b.classifier_head(b.flatten(x))


_BUILDERS: dict[str, Callable[[_Builder], None]] = {
    "resnet18": _build_resnet18,
    "resnet50": _build_resnet50,
    "resnet101": _build_resnet101,
    "alexnet": _build_alexnet,
    "vgg16": _build_vgg16,
    "googlenet": _build_googlenet,
    "mobilenetv2": _build_mobilenetv2,
    "resnetxy": _build_resnetxy,
}
assert list(_BUILDERS) == list(BUILTIN_MODELS)


def build_model(name: str, seed: int = 0, weights: bool = True) -> onnx.ModelProto:
    """Build built-in model ``name`` with weights drawn from ``numpy.random.default_rng(seed)``;
    ``weights=False``: the graph with its weights' dims and no values (vgg16 in milliseconds
    instead of seconds), to count parameters and MACs, not to run.

    Raises ``KeyError`` for a name not in :data:`BUILTIN_MODELS`.
    """
    if name not in _BUILDERS:
        raise KeyError(f"unknown built-in model {name!r}; choose from {', '.join(BUILTIN_MODELS)}")
    b = _Builder(name, seed, weights)
    _BUILDERS[name](b)
    return b.model(f"kselect built-in {name} (seed {seed}): {BUILTIN_MODELS[name]}")
