"""OpenVINO as its users run it, beside kselect's plans in benchmarks and ``timed_alone``: the ONNX
model compiled for the CPU with OpenVINO's own defaults (no properties: on a CPU with AVX512_BF16 or
AMX its inference precision is bf16), with given compile properties (e.g.
``{"INFERENCE_PRECISION_HINT": "f32"}``), or an IR file another tool wrote (NNCF's INT8 model).

A ``timed_alone`` candidate names one as ``{"factory": "kselect.plugins.openvino.baselines:runner",
"args": {...}}``; the process it runs in builds it with the model and those arguments."""

from __future__ import annotations

import numpy as np

from kselect.plugins.openvino import ir


class Runner:
    """``runner(feeds) -> [outputs]`` in the ONNX graph's output order."""

    def __init__(self, compiled, output_names: list[str]):
        self.request = compiled.create_infer_request()
        by_name = {}
        for index, output in enumerate(compiled.outputs):
            for name in output.get_names():
                by_name[name] = index
        self.output_indices = [by_name[name] for name in output_names]
        self.compiled = compiled

    def __call__(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        self.request.infer({name: np.ascontiguousarray(value) for name, value in feeds.items()})
        return [self.request.get_output_tensor(index).data.copy() for index in self.output_indices]

    def inference_precision(self) -> str:
        """The precision OpenVINO compiled the model in: "bf16", "f16" or "f32"."""
        value = self.compiled.get_property("INFERENCE_PRECISION_HINT")
        return value.to_string() if hasattr(value, "to_string") else str(value)

    def close(self) -> None:
        self.request = None


def runner(model, properties: dict | None = None, ir_path: str | None = None) -> Runner:
    """``model`` (a kselect Model) compiled by OpenVINO's CPU plugin with ``properties`` (None:
    its defaults), or the IR at ``ir_path`` (same inputs and outputs) compiled so."""
    output_names = [output.name for output in model.proto.graph.output]
    if ir_path is not None:
        compiled = ir.core().compile_model(ir.core().read_model(ir_path), "CPU", properties or {})
    else:
        converted = ir.ConvertedModel(model.proto, model.input_shapes, [])
        compiled = converted.compile({}, properties or {})
        output_names = converted.output_names
    return Runner(compiled, output_names)
