"""The activation after a conv or fc, taken as part of the op (its "epilogue").

A library that fuses an activation into its kernel (MLAS's activation kinds, XNNPack's output
clamp, ACL's ActivationLayerInfo) does less work than one that runs it as a separate pass, so
an op is measured with the nodes that follow it up to the point where the result leaves: Relu,
Relu6 as Clip, LeakyRelu, Sigmoid, Tanh, HardSigmoid, HardSwish, PRelu, and the patterns
exporters write for SiLU (``x * Sigmoid(x)``) and HardSwish (``x * HardSigmoid(x)``,
``x * Clip(x + 3, 0, 6) / 6``).

An epilogue is a list of steps ``[op_type, inputs, attrs]`` in the model's own order, where an
input is ``"x"`` (the op's output), ``"t<k>"`` (step k's output), a number (a scalar constant),
``{"slope": shape}`` (PRelu's learned slope: its shape is the work, its values are not, so ops
whose slopes differ share a task and are measured with ``slope_values``) or None (an absent
optional input). The steps are the model's nodes, so every library runs the same work its
whole-model runner runs.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

UNARY = ("Relu", "Clip", "LeakyRelu", "Sigmoid", "Tanh", "HardSigmoid", "HardSwish")
BINARY = ("Add", "Sub", "Mul", "Div")
MAX_STEPS = 6
# ONNX's attribute defaults, written out so that equal activations have equal signatures
DEFAULTS = {"LeakyRelu": {"alpha": 0.01}, "HardSigmoid": {"alpha": 0.2, "beta": 0.5}}


def _attrs(node: onnx.NodeProto) -> dict:
    attrs = dict(DEFAULTS.get(node.op_type, {}))
    for attribute in node.attribute:
        if attribute.name in ("alpha", "beta", "min", "max"):  # min, max: Clip before opset 11
            attrs[attribute.name] = float(helper.get_attribute_value(attribute))
    return attrs


def _scalar(initializers: dict, name: str):
    tensor = initializers.get(name)
    if tensor is None:
        return None
    value = numpy_helper.to_array(tensor)
    if value.size != 1 or value.dtype.kind != "f":
        return None
    return float(value.reshape(()))


def consumers_by_index(graph: onnx.GraphProto) -> dict[str, list[int]]:
    """Each tensor name -> the indices of the graph's nodes that read it (``find_epilogue`` takes it)."""
    consumers: dict[str, list[int]] = {}
    for index, node in enumerate(graph.node):
        for name in node.input:
            consumers.setdefault(name, []).append(index)
    return consumers


def find_epilogue(model, node_index: int, consumers: dict[str, list[int]]) -> tuple[list, list[int]]:
    """The activation steps after node ``node_index`` of the model's graph (empty when none), and
    the indices of the graph nodes they are.

    Nodes are taken in graph order while every input they read is the op's output, an earlier
    step's output or a scalar constant; the longest such run whose intermediate tensors are read
    only inside it (and are no graph output) is the epilogue."""
    nodes = model.proto.graph.node
    graph_outputs = {o.name for o in model.proto.graph.output}
    start = nodes[node_index].output[0]
    refs = {start: "x"}
    steps, taken, outputs = [], [], [start]
    best: list = []
    for index in range(node_index + 1, len(nodes)):
        node = nodes[index]
        if not any(i in refs for i in node.input):
            continue  # another branch of the graph
        step = _step(node, refs, model.initializers)
        if step is None or len(steps) == MAX_STEPS:
            break
        refs[node.output[0]] = f"t{len(steps)}"
        steps.append(step)
        taken.append(index)
        outputs.append(node.output[0])
        read_inside = all(set(consumers.get(t, [])) <= set(taken) for t in outputs[:-1])
        if read_inside and not graph_outputs & set(outputs[:-1]):
            best = list(steps)
    return best, taken[:len(best)]


def slope_values(shape: list[int]) -> np.ndarray:
    """The PRelu slope a task is measured with: distinct per channel, so a kernel that mixes
    channels up computes a wrong output."""
    size = int(np.prod(shape)) if shape else 1
    return np.linspace(0.05, 0.45, size, dtype=np.float32).reshape(shape)


def _step(node: onnx.NodeProto, refs: dict, initializers: dict) -> list | None:
    """The node as an epilogue step, or None when it is not one (not elementwise, or it reads a
    tensor from outside the epilogue)."""
    if node.domain not in ("", "ai.onnx") or len(node.output) != 1:
        return None
    if node.op_type == "PRelu" and len(node.input) == 2 and node.input[0] in refs:
        slope = initializers.get(node.input[1])
        if slope is None or slope.data_type != onnx.TensorProto.FLOAT:
            return None
        dims = [1] * (4 - len(slope.dims)) + list(slope.dims)
        if len(dims) != 4 or (int(np.prod(dims)) != 1 and dims[:1] + dims[2:] != [1, 1, 1]):
            return None  # a slope neither scalar nor per channel
        return ["PRelu", [refs[node.input[0]], {"slope": list(slope.dims)}], {}]
    if node.op_type in UNARY:
        if node.input[0] not in refs:
            return None
        inputs = [refs[node.input[0]]]
        attrs = _attrs(node)
        if node.op_type == "Clip":  # bounds as inputs (opset 11+), whichever way the model wrote them
            bounds = list(node.input[1:3]) + [""] * (3 - len(node.input))
            for name, attribute in zip(bounds, ("min", "max")):
                value = attrs.pop(attribute, None) if name == "" else _scalar(initializers, name)
                if name != "" and value is None:
                    return None
                inputs.append(value)
        return [node.op_type, inputs, attrs]
    if node.op_type in BINARY and len(node.input) == 2:
        inputs = [refs[name] if name in refs else _scalar(initializers, name) for name in node.input]
        if any(value is None for value in inputs):
            return None
        return [node.op_type, inputs, {}]
    return None


PATTERNS = {  # several steps with one name, as exporters write them
    ("Sigmoid", "Mul"): "silu",
    ("HardSigmoid", "Mul"): "hard_swish",
    ("Add", "Clip", "Mul", "Div"): "hard_swish",
    ("Add", "Clip", "Mul", "Mul"): "hard_swish",
}
SINGLE = {"LeakyRelu": "leaky_relu", "HardSigmoid": "hard_sigmoid", "HardSwish": "hard_swish", "PRelu": "prelu"}


def name(epilogue: list) -> str:
    """A short name: relu, relu6, silu, hard_swish, ..., or the names of its parts joined by '+'
    (mul+add+hard_swish)."""
    ops, parts, k = [step[0] for step in epilogue], [], 0
    while k < len(ops):
        pattern = next((p for p in PATTERNS if tuple(ops[k:k + len(p)]) == p), None)
        if pattern is not None:
            parts.append(PATTERNS[pattern])
            k += len(pattern)
            continue
        if ops[k] == "Clip" and _bounds(epilogue[k][1]) == (0.0, 6.0):
            parts.append("relu6")
        else:
            parts.append(SINGLE.get(ops[k], ops[k].lower()))
        k += 1
    return "+".join(parts)


def clamp_range(epilogue: list) -> tuple[float, float] | None:
    """(min, max) when the epilogue is one Relu or Clip: an output clamp."""
    if len(epilogue) != 1:
        return None
    op, inputs, _ = epilogue[0]
    if op == "Relu":
        return 0.0, float("inf")
    if op == "Clip":
        return _bounds(inputs)
    return None


def _bounds(clip_inputs: list) -> tuple[float, float]:
    low, high = clip_inputs[1], clip_inputs[2]
    return (float("-inf") if low is None else low), (float("inf") if high is None else high)


def onnx_nodes(epilogue: list, source: str, output: str, prefix: str = "act") -> tuple[list, list]:
    """ONNX nodes (and their scalar initializers) computing the epilogue from tensor ``source``
    into ``output``: the model's own nodes again, for a single-op model."""
    nodes, initializers = [], []
    names = {"x": source}
    for k, (op, inputs, attrs) in enumerate(epilogue):
        node_inputs = []
        for position, value in enumerate(inputs):
            if value is None:
                node_inputs.append("")
            elif isinstance(value, str):
                node_inputs.append(names[value])
            elif isinstance(value, dict):
                constant = f"{prefix}.{k}.slope"
                initializers.append(numpy_helper.from_array(slope_values(value["slope"]), constant))
                node_inputs.append(constant)
            else:
                constant = f"{prefix}.{k}.c{position}"
                initializers.append(numpy_helper.from_array(np.array(value, np.float32), constant))
                node_inputs.append(constant)
        out = output if k == len(epilogue) - 1 else f"{prefix}.{k}"
        names[f"t{k}"] = out
        nodes.append(helper.make_node(op, node_inputs, [out], name=f"{prefix}.{k}", **attrs))
    return nodes, initializers


def reference(epilogue: list, x: np.ndarray, each=None) -> np.ndarray:
    """The epilogue in float64, for checking a candidate's output; ``each``, when given, is
    applied to every intermediate tensor (int8 bounds round each onto its own grid)."""
    values = {"x": x}

    def operand(value):
        if isinstance(value, dict):
            return slope_values(value["slope"]).astype(np.float64)
        return values[value] if isinstance(value, str) else value

    for k, (op, inputs, attrs) in enumerate(epilogue):
        a = operand(inputs[0])
        if op == "Relu":
            y = np.maximum(a, 0.0)
        elif op == "Clip":
            y = np.clip(a, *_bounds(inputs))
        elif op == "LeakyRelu":
            y = np.where(a >= 0, a, attrs["alpha"] * a)
        elif op == "Sigmoid":
            y = 1.0 / (1.0 + np.exp(-a))
        elif op == "Tanh":
            y = np.tanh(a)
        elif op == "HardSigmoid":
            y = np.clip(attrs["alpha"] * a + attrs["beta"], 0.0, 1.0)
        elif op == "HardSwish":
            y = a * np.clip(a / 6.0 + 0.5, 0.0, 1.0)
        elif op == "PRelu":
            y = np.where(a >= 0, a, operand(inputs[1]) * a)
        else:
            b = operand(inputs[1])
            y = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Div": np.divide}[op](a, b)
        values[f"t{k}"] = y if each is None or k == len(epilogue) - 1 else each(y)
    return values[f"t{len(epilogue) - 1}"] if epilogue else x
