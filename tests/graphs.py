"""The tests' small ONNX models, built one way: ``model`` wraps nodes and initializers into a
ModelProto, ``weights`` and ``conv`` make the usual pieces, ``small_cnn`` is the model most tests
tune."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def model(nodes, inits=(), input_shape=(1, 3, 16, 16), outputs=("y",), opset=17, name="g", input_name="x",
          output_shapes=None, ir_version=8) -> onnx.ModelProto:
    """One float input ``input_name`` of ``input_shape`` (names for symbolic dims), float
    ``outputs`` (of unknown shape unless ``output_shapes`` gives them), default-domain ``opset``."""
    shapes = output_shapes or [None] * len(outputs)
    graph = helper.make_graph(list(nodes), name,
                              [helper.make_tensor_value_info(input_name, TensorProto.FLOAT, list(input_shape))],
                              [helper.make_tensor_value_info(out, TensorProto.FLOAT, shape)
                               for out, shape in zip(outputs, shapes)], list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=ir_version)


def saved(proto: onnx.ModelProto, path: Path) -> Path:
    onnx.save(proto, path)
    return path


def weights(rng, name: str, shape, scale: float = 0.2) -> onnx.TensorProto:
    """A float32 initializer of normal random values times ``scale``."""
    return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)


def conv(nodes, inits, rng, name, x, cin, cout, k, stride=1, pads=None, group=1, relu=True) -> str:
    """Appends a Conv (He-scaled weights, small bias; "same" pads unless given) reading ``x``, and a
    Relu after it unless ``relu`` is False; returns the name of the tensor written last."""
    w = (rng.standard_normal((cout, cin // group, k, k)) * np.sqrt(2.0 / (cin // group * k * k))).astype(np.float32)
    b = (rng.standard_normal(cout) * 0.1).astype(np.float32)
    inits += [numpy_helper.from_array(w, f"{name}.w"), numpy_helper.from_array(b, f"{name}.b")]
    pads = pads if pads is not None else [k // 2] * 4
    nodes.append(helper.make_node("Conv", [x, f"{name}.w", f"{name}.b"], [f"{name}.y"], name=name,
                                  kernel_shape=[k, k], strides=[stride, stride], pads=pads, group=group))
    if not relu:
        return f"{name}.y"
    nodes.append(helper.make_node("Relu", [f"{name}.y"], [f"{name}.r"], name=f"{name}.relu"))
    return f"{name}.r"


def small_cnn(dynamic: bool = False, seed: int = 0) -> onnx.ModelProto:
    """A small CNN with the op kinds kselect tunes: dense 3x3 (two identical ones: one task),
    strided conv with asymmetric pads, 1x1, depthwise, a residual add, and a Gemm."""
    rng = np.random.default_rng(seed)
    nodes, inits = [], []
    x = conv(nodes, inits, rng, "stem", "input", 3, 16, 3)
    a = conv(nodes, inits, rng, "block.conv1", x, 16, 16, 3)
    a = conv(nodes, inits, rng, "block.conv2", a, 16, 16, 3, relu=False)
    nodes.append(helper.make_node("Add", [a, x], ["block.sum"], name="block.add"))
    x = conv(nodes, inits, rng, "down", "block.sum", 16, 32, 4, stride=2, pads=[1, 1, 2, 2])
    x = conv(nodes, inits, rng, "dw", x, 32, 32, 3, group=32)
    x = conv(nodes, inits, rng, "pw", x, 32, 48, 1)
    nodes.append(helper.make_node("GlobalAveragePool", [x], ["gap"], name="gap"))
    nodes.append(helper.make_node("Flatten", ["gap"], ["flat"], name="flatten"))
    w = (rng.standard_normal((10, 48)) * 0.2).astype(np.float32)
    inits += [numpy_helper.from_array(w, "fc.w"), numpy_helper.from_array(np.zeros(10, np.float32), "fc.b")]
    nodes.append(helper.make_node("Gemm", ["flat", "fc.w", "fc.b"], ["output"], name="fc", transB=1))
    shape = ["N", 3, "H", "W"] if dynamic else [1, 3, 32, 32]
    return model(nodes, inits, shape, outputs=["output"], name="small_cnn", input_name="input")
