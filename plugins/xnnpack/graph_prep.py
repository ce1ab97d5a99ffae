"""What the XNNPack executor reads off the ONNX graph before it builds anything: each tensor's
readers and last use, the conv / fc tasks (with their epilogues), and the graph rewrites, which
are the same with and without a plan:

- a Relu / Clip (constant bounds) after a Conv, ConvTranspose, Gemm, MatMul, Add, Mul, Sub or
  Div that is its only reader folds into that operator's output range;
- a Flatten (or a Reshape to 2-D) of an NHWC tensor whose only readers are fully connected ops
  folds into their weights (columns permuted to NHWC order, builders.py) instead of a transpose.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import onnx
from onnx import numpy_helper

from kselect.core.models.tasks import Task, find_ops

# ops whose XNNPack operator clamps its output: a Relu / Clip after one folds into it
CLAMPING_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul", "Add", "Mul", "Sub", "Div")
NO_CLAMP = (-math.inf, math.inf)


def attr(node, name, default=None):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def constant(model, name) -> np.ndarray | None:
    """An initializer as float32, or None when ``name`` is not one."""
    if name in model.initializers:
        return numpy_helper.to_array(model.initializers[name]).astype(np.float32)
    return None


def activation_range(model, node) -> tuple[float, float] | None:
    """The [low, high] a Relu or Clip keeps; None for a Clip whose bounds are not constants."""
    if node.op_type == "Relu":
        return (0.0, math.inf)
    lo, hi = attr(node, "min", None), attr(node, "max", None)
    if len(node.input) > 1 and node.input[1]:
        c = constant(model, node.input[1])
        if c is None:
            return None
        lo = float(c)
    if len(node.input) > 2 and node.input[2]:
        c = constant(model, node.input[2])
        if c is None:
            return None
        hi = float(c)
    return (-math.inf if lo is None else float(lo), math.inf if hi is None else float(hi))


@dataclasses.dataclass
class PreparedGraph:
    nodes: list
    consumers: dict[str, list[int]]  # tensor -> indices of the nodes reading it
    graph_outputs: set[str]
    last_use: dict[str, int]  # tensor -> index of its last reader (len(nodes) for a graph output)
    fused_into: dict[int, int]  # folded Relu / Clip node index -> index of the op it folds into
    fused_activation: dict[int, int]  # index of an op -> index of the Relu / Clip folded into it
    tasks: dict[str, Task]  # conv / fc node -> its task
    epilogues: dict[str, list]  # conv / fc node -> its task's epilogue

    def folds_into_fc(self, flattened: str) -> bool:
        """Whether a flattened NHWC tensor can stay in NHWC order: only fully connected ops read
        it, as their data input, and it is not a graph output."""
        readers = [self.nodes[k] for k in self.consumers.get(flattened, [])]
        return bool(readers) and flattened not in self.graph_outputs \
            and all(n.op_type in ("Gemm", "MatMul") and n.input[0] == flattened for n in readers)


def prepare(model) -> PreparedGraph:
    nodes = list(model.proto.graph.node)
    consumers: dict[str, list[int]] = {}
    for i, node in enumerate(nodes):
        for name in node.input:
            if name:
                consumers.setdefault(name, []).append(i)
    graph_outputs = {o.name for o in model.proto.graph.output}
    last_use = {name: max(uses) for name, uses in consumers.items()}
    for name in graph_outputs:
        last_use[name] = len(nodes)
    fused_into: dict[int, int] = {}
    for i, node in enumerate(nodes):
        if node.op_type in CLAMPING_OPS and len(node.output) == 1:
            out = node.output[0]
            uses = consumers.get(out, [])
            if len(uses) == 1 and out not in graph_outputs:
                j = uses[0]
                if nodes[j].op_type in ("Relu", "Clip") and activation_range(model, nodes[j]) is not None:
                    fused_into[j] = i
    ops = {op.node: op for op in find_ops(model)}
    tasks = {name: Task(name, "", op.kind, op.input_shape, op.weight_shape, op.output_shape, op.attrs, op.has_bias,
                        [name])
             for name, op in ops.items()}
    return PreparedGraph(nodes, consumers, graph_outputs, last_use, fused_into, {i: j for j, i in fused_into.items()},
                         tasks, {name: op.epilogue for name, op in ops.items()})
