"""Fully connected layers as the op kind "fc": Gemm, and MatMul with constant weights, when the
input is 2-D. x (M, K), w (N, K): y = alpha * x @ w.T + beta * b."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from kselect.core.contract.opkind import OnnxOp, OpKind
from kselect.core.models.tasks import Op, constant_float_weights, node_attr, tensor_shape


class FullyConnectedKind(OpKind):
    name = "fc"
    onnx_ops = ("Gemm", "MatMul")

    def read(self, model, node: onnx.NodeProto):
        w = constant_float_weights(model, node, node.input[1], computed="both operands computed at run time: "
                                                                       "no fixed weights")
        if isinstance(w, str):
            return w
        a = tensor_shape(model, node.input[0], node)
        if len(a) != 2 or len(w) != 2:
            return f"{len(a)}-D input: only fully connected layers (2-D) are tuned"
        if node.op_type == "Gemm":
            if node_attr(node, "transA", 0):
                return "Gemm with transA: not a fully connected layer"
            n_k = w if node_attr(node, "transB", 0) else [w[1], w[0]]
            has_bias = len(node.input) > 2 and node.input[2] != ""
            attrs = {"alpha": float(node_attr(node, "alpha", 1.0)),
                     "beta": float(node_attr(node, "beta", 1.0)) if has_bias else 1.0,
                     "transB": int(node_attr(node, "transB", 0))}
        else:
            n_k, has_bias, attrs = [w[1], w[0]], False, {"alpha": 1.0, "beta": 1.0, "transB": 0}
        return Op(node.name, self.name, a, n_k, tensor_shape(model, node.output[0], node), attrs, has_bias)

    def macs(self, op) -> int:
        n, k = op.weight_shape
        return op.input_shape[0] * n * k

    def inputs(self, task, rng):
        fan_in = task.weight_shape[1]
        inputs = {
            "x": rng.standard_normal(task.input_shape, dtype=np.float32),
            "w": (rng.standard_normal(task.weight_shape, dtype=np.float32) * np.sqrt(2.0 / fan_in)).astype(np.float32),
        }
        if task.has_bias:
            inputs["b"] = (rng.standard_normal(task.weight_shape[0], dtype=np.float32) * 0.1).astype(np.float32)
        return inputs

    def reference(self, task, inputs):
        y = task.attrs["alpha"] * (inputs["x"].astype(np.float64) @ inputs["w"].astype(np.float64).T)
        if "b" in inputs:
            y += task.attrs["beta"] * inputs["b"].astype(np.float64)
        return y

    def onnx_op(self, task, inputs, output):
        a = task.attrs
        node = helper.make_node("Gemm", ["x", "w"] + (["b"] if "b" in inputs else []), [output], name="op", transB=1,
                                alpha=a["alpha"], beta=a["beta"])
        return OnnxOp(node, task.input_shape, task.output_shape, inputs["w"])
