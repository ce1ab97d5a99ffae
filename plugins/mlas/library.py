"""The MLAS library plugin: spaces, defaults, measuring single-op sessions, applying plans."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kselect.core.contract.labels import Label
from kselect.core.contract.library import Candidate, Library
from kselect.core.contract.space import Categorical, Integer, Space
from kselect.core.measuring.device import Device
from kselect.core.measuring.measure import task_model
from kselect.core.models.activations import clamp_range, onnx_nodes
from kselect.core.models.tasks import Task
from kselect.core.precision.quant import asymmetric_u8
from kselect.plugins.mlas import half, int8
from kselect.plugins.mlas.arm import BF16_PLAN_ERROR, kleidiai_applies, missing_arm_dims, offered_arm_dims
from kselect.plugins.mlas.apply import default_session, plan_session, write_optimized_model
from kselect.plugins.mlas.int8 import ACTIVATION_TYPES, WEIGHT_GRANULARITY, has_int8_form
from kselect.plugins.mlas.layout import (
    conv_nchwc_unsupported,
    conv_takes_blocked_input,
    from_blocked,
    nchwc_block_size,
    nchwc_feed,
)
from kselect.plugins.mlas.ort_session import NCHWC_DOMAIN, ort_matmul_nodes, ort_nchwc_convs, ort_optimized
from kselect.plugins.mlas.profiling import profiled_run
from kselect.plugins.mlas.session_config import FORCE_SPINNING_STOP_KEY, SPINNING_KEY, session_options
from kselect.plugins.mlas.single_op import reorder_model, single_conv_model
from kselect.plugins.ops.conv import as_conv1d

# MLAS's default batch is 128 input channels ("default": the key left unset).
POINTWISE_BATCHES = ("default", 32, 64, 256, 512)


class OrtCandidate(Candidate):
    def __init__(self, session, feeds: dict, unblock):
        self.session = session
        self.feeds = feeds
        self.unblock = unblock
        self.result = None

    def run(self) -> None:
        self.result = self.session.run(None, self.feeds)[0]

    def output(self) -> np.ndarray:
        return self.unblock(self.result)


class MlasLibrary(Library):
    name = "mlas"
    baseline = True
    default_plan_differs = True  # kselect's NCHWc rewrite, unless its layouts are ORT's own (apply.py)
    spin_dim = "spinning"  # ONNX Runtime's default session: the reference, and the runner of any ONNX op
    fresh_instances = 3  # sessions of one config can settle at different speeds
    # int8 ops: the activation type and weight granularity are one choice for the whole quantized
    # model, as onnxruntime.quantization makes it (int8.py)
    # kleidiai, bf16_fastmath: ONNX Runtime's Arm64 options, offered where they change something (arm.py)
    plan_level_dims = ("threads", "spinning", "depthwise_sliding", "pointwise_batch", "prepacking", "activations",
                       "weights", "kleidiai", "bf16_fastmath")
    op_specific_dims = frozenset({"bf16_fastmath"})  # fully connected layers ORT runs as MatMul only
    # MLAS's half-precision GEMM accumulates in float16 (half.py)
    accumulates_in_half = frozenset({"fp16"})

    @property
    def precisions(self) -> tuple[str, ...]:
        """fp32; int8 on ONNX Runtime's QDQ kernels (int8.py); fp16 where ONNX Runtime has float16
        kernels of its own on this CPU (half.py: arm64 with FP16 arithmetic)."""
        return ("fp32", "int8") + (("fp16",) if half.available()[0] else ())

    @property
    def plan_precisions(self) -> tuple[str, ...]:
        """A plan with int8 ops runs as the QDQ model (int8.py), its fp16 ops in float16 between
        casts (half.py): the same as ``precisions``."""
        return self.precisions

    def missing_precisions(self) -> dict[str, str]:
        missing = {"bf16": "ONNX Runtime has no bf16 conv / deconv / fc kernels on CPU (on arm64 its bf16 "
                           "fast-math GEMM is a plan-level knob of fp32 MatMuls, bf16_fastmath)"}
        fp16_ok, fp16_why = half.available()
        if not fp16_ok:
            missing["fp16"] = fp16_why
        return missing

    @property
    def int8_passes(self) -> frozenset[str]:
        """The op types onnxruntime.quantization's quantize_static quantizes by default (its
        registries), which ONNX Runtime then runs on 8-bit tensors; calibration.nodes_to_quantize hands it
        the untuned nodes whose data inputs all come from int8 ops."""
        from onnxruntime.quantization.registry import (  # heavy: not imported with the plugin
            QDQRegistry,
            QLinearOpsRegistry,
        )

        return frozenset(QDQRegistry) | frozenset(QLinearOpsRegistry)

    def requantized_label(self) -> Label:
        """Between two int8 ops, ONNX Runtime's transpose optimiser cancels the transposes its
        NHWC int8 convs put around a DequantizeLinear -> float op -> QuantizeLinear, so that
        round trip is a plain DequantizeLinear and QuantizeLinear, measured on the flat tensor."""
        return Label(self.name, "int8-in-place")

    def availability(self) -> tuple[bool, str]:
        try:
            import onnxruntime as ort  # heavy (~0.3 s): not imported with the plugin
        except ImportError as exc:
            return False, f"onnxruntime is not installed ({exc}): pip install onnxruntime"
        if "CPUExecutionProvider" not in ort.get_available_providers():
            return False, "this onnxruntime build has no CPUExecutionProvider"
        fp16_ok, fp16_what = half.available()
        return True, f"fp16: {fp16_what}" if fp16_ok else f"no fp16 ({fp16_what})"

    def version(self) -> str:
        return "onnxruntime " + metadata.version("onnxruntime")

    def __init__(self):
        self.ort_nchwc_nodes: set[str] | None = None  # convs ORT's default session runs as NCHWc
        self.ort_matmul_nodes: set[str] | None = None  # fully connected nodes it runs as MatMul (not Gemm)
        # (int8 task key, activations, weights) -> whether ORT runs that op channels-last
        self.int8_channels_last: dict[tuple, bool] = {}

    def prepare_model(self, model) -> None:
        optimized = ort_optimized(model.proto)
        self.ort_nchwc_nodes = ort_nchwc_convs(model.proto, optimized)
        self.ort_matmul_nodes = ort_matmul_nodes(optimized)

    def missing_dims(self) -> dict[str, str]:
        """The Arm64 knobs this machine, onnxruntime build or CPU cannot use (arm.py); the NCHWc
        knobs where MLAS has no NCHWc kernels (as on aarch64); and the bf16 fast-math GEMM for a
        model (``prepare_model``) with no MatMul ONNX Runtime keeps."""
        missing = missing_arm_dims()
        if self._block() == 1:  # the same test as nchwc_possible: no NCHWc layout, so no NCHWc knob
            for dim in ("depthwise_sliding", "pointwise_batch"):
                missing[dim] = ("a knob of MLAS's NCHWc kernels, and ONNX Runtime has none on this machine "
                                "(its NCHWc block size here is 1)")
        if "bf16_fastmath" not in missing and self.ort_matmul_nodes == set():
            missing["bf16_fastmath"] = ("ONNX Runtime's bf16 fast-math GEMM reaches MatMul only, and it runs no MatMul "
                                        "in this model (its fully connected layers are Gemm, or MatMul + Add fused "
                                        "into Gemm)")
        return missing

    def runs_as_matmul(self, task: Task) -> bool:
        """Whether ONNX Runtime runs most of this fc task's nodes as MatMul (the only op its bf16
        fast-math GEMM reaches); unknown without ``prepare_model``: no."""
        if task.kind != "fc" or self.ort_matmul_nodes is None:
            return False
        return 2 * sum(node in self.ort_matmul_nodes for node in task.nodes) > len(task.nodes)

    def plan_error_bound(self, settings: dict) -> float | None:
        """A plan whose MatMuls compute in bf16 (``bf16_fastmath``) is held to bf16's bound end to end."""
        return BF16_PLAN_ERROR if settings.get("bf16_fastmath") == 1 else None

    def computes_in(self, task: Task, config: dict) -> str:
        """bf16 for a MatMul under the bf16 fast-math GEMM: its candidates get bf16's tolerance."""
        return "bf16" if config.get("bf16_fastmath") == 1 else task.precision

    def supports(self, task: Task) -> bool:
        if task.precision == "int8":  # any activation (int8.single_op_model)
            return has_int8_form(task)
        if task.precision == "fp16":  # where ONNX Runtime runs it in float16 without casts (half.py)
            return half.runs_in_half(task)
        return task.kind in ("conv", "deconv", "fc")

    def tolerance(self, task: Task, config: dict) -> float:
        # every MLAS fp32 path is an exact fp32 algorithm (no Winograd/FFT): only summation order differs
        # (the bf16 fast-math GEMM: bf16's tolerance, ``computes_in``)
        return 1e-4

    def _block(self) -> int:
        return nchwc_block_size()

    def nchwc_possible(self, task: Task) -> bool:
        """Whether kselect can write this conv as an NCHWc node (a 2-D conv only, as in ORT), on a
        machine where MLAS has NCHWc kernels at all (block 1: none, as on aarch64)."""
        block = self._block()
        return (block > 1 and not task.conv1d
                and conv_nchwc_unsupported(task.weight_shape, task.attrs["group"], block) is None)

    def ort_converts(self, task: Task) -> bool:
        """Whether ONNX Runtime's default session runs this task's convs as NCHWc. Known exactly
        for the model given to ``prepare_model`` (most of the task's nodes decide); otherwise
        ORT's rule for a conv alone: block-multiple channels, except a plain conv with fewer
        input channels than a block (it reads NCHW)."""
        if self.ort_nchwc_nodes is not None:
            return 2 * sum(node in self.ort_nchwc_nodes for node in task.nodes) > len(task.nodes)
        block, group = self._block(), task.attrs["group"]
        input_channels, output_channels = task.input_shape[1], task.weight_shape[0]
        if not self.nchwc_possible(task):
            return False
        if group > 1:
            return output_channels % block == 0 and (task.is_depthwise or input_channels // group % block == 0)
        return input_channels < block or input_channels % block == 0

    @staticmethod
    def sliding_kernel_applies(task: Task) -> bool:
        """MLAS's sliding depthwise kernel covers stride 1, dilation 1, kernel width 3, 5 or 7."""
        a = task.attrs
        return task.is_depthwise and a["strides"] == [1, 1] and a["dilations"] == [1, 1] and a["kernel"][1] in (3, 5, 7)

    def space(self, task: Task, device: Device) -> Space:
        space = Space()
        if task.precision == "int8":
            space.add(Categorical("activations", ACTIVATION_TYPES, role="precision"))
            space.add(Categorical("weights", WEIGHT_GRANULARITY, role="precision"))
            space.add(Integer("threads", 1, device.cores))
            space.add(Categorical("spinning", (1, 0)))
            return space
        if task.precision == "fp16":  # ONNX Runtime lays a float16 op out itself
            space.add(Integer("threads", 1, device.cores))
            space.add(Categorical("spinning", (1, 0)))
            return space
        if task.kind == "conv":
            layouts = ("NCHWc", "NCHW") if self.nchwc_possible(task) else ("NCHW",)
            space.add(Categorical("layout", layouts, role="layout"))
            if self.sliding_kernel_applies(task) and "NCHWc" in layouts:
                space.add(Categorical("depthwise_sliding", (1, 0), role="algorithm", when={"layout": ["NCHWc"]}))
            if task.is_pointwise and "NCHWc" in layouts:
                space.add(Categorical("pointwise_batch", POINTWISE_BATCHES, role="memory", when={"layout": ["NCHWc"]}))
        space.add(Integer("threads", 1, device.cores))
        space.add(Categorical("spinning", (1, 0)))
        if task.kind == "fc":
            space.add(Categorical("prepacking", (1, 0), role="memory"))
        for dim, values in self._arm_dims(task).items():
            space.add(Categorical(dim, values, role="algorithm"))
        return space

    def _arm_dims(self, task: Task) -> dict[str, tuple]:
        """The Arm64 knobs that can change this fp32 task here (arm.py), with their values, ORT's default first."""
        offered, dims = offered_arm_dims(), {}
        if "kleidiai" in offered and kleidiai_applies(task):
            dims["kleidiai"] = (1, 0)
        if "bf16_fastmath" in offered and self.runs_as_matmul(task):
            dims["bf16_fastmath"] = (0, 1)
        return dims

    def default_config(self, task: Task, device: Device) -> dict:
        """What a default ONNX Runtime session does: NCHWc where its NCHWc transformer converts the
        conv, all cores, spinning, sliding depthwise kernel, MLAS's own channel batch, prepacking."""
        config: dict = {}
        if task.precision == "int8":  # what onnxruntime.quantization.quantize_static writes for x86
            return {"activations": "u8", "weights": "per-channel", "threads": device.cores, "spinning": 1}
        if task.precision == "fp16":
            return {"threads": device.cores, "spinning": 1}
        if task.kind == "conv":
            config["layout"] = "NCHWc" if self.ort_converts(task) else "NCHW"
            # the NCHWc-only knobs, where ORT runs the conv as NCHWc (the space's `when`)
            if config["layout"] == "NCHWc" and self.sliding_kernel_applies(task):
                config["depthwise_sliding"] = 1
            if config["layout"] == "NCHWc" and task.is_pointwise:
                config["pointwise_batch"] = "default"
        config["threads"] = device.cores
        config["spinning"] = 1
        if task.kind == "fc":
            config["prepacking"] = 1
        config.update({dim: values[0] for dim, values in self._arm_dims(task).items()})
        return config

    def prepare(self, task: Task, config: dict, inputs: dict[str, np.ndarray]) -> Candidate:
        import onnxruntime as ort  # heavy (~0.3 s): not imported with the plugin

        if task.precision == "int8":
            params, activations = inputs["quant"], config["activations"]
            model = int8.single_op_model(task, inputs, config)
            feed = int8.quantize_activation(inputs["x"], params.x_scale, params.x_zero_point, activations)
            nhwc = False
            if len(task.input_shape) == 4 and len(task.output_shape) == 4:
                key = (task.key, activations, config.get("weights"))
                if key not in self.int8_channels_last:
                    self.int8_channels_last[key] = int8.runs_channels_last(model, session_options(config))
                nhwc = self.int8_channels_last[key]
            if nhwc:  # as inside a whole int8 model (int8.TO_NHWC)
                model, feed = int8.channels_last(model), np.ascontiguousarray(feed.transpose(int8.TO_NHWC))
            session = ort.InferenceSession(model.SerializeToString(), session_options(config),
                                           providers=["CPUExecutionProvider"])
            return OrtCandidate(session, {"x_q": feed}, lambda y: int8.dequantize_activation(
                y.transpose(int8.TO_NCHW) if nhwc else y, params.y_scale, params.y_zero_point, activations))

        if task.precision == "fp16":
            session = ort.InferenceSession(half.single_op_model(task, inputs).SerializeToString(),
                                           session_options(config), providers=["CPUExecutionProvider"])
            return OrtCandidate(session, {"x": inputs["x"]}, lambda y: y)

        epilogue = task.epilogue
        if task.kind == "conv" and not task.conv1d:
            block, a = self._block(), task.attrs
            attrs = {"kernel_shape": a["kernel"], "strides": a["strides"], "pads": a["pads"],
                     "dilations": a["dilations"], "group": a["group"]}
            fused = {}
            if config["layout"] == "NCHWc" and fused_by_mlas(epilogue):
                # as the whole-model rewrite does: the activation reading only the conv becomes its attribute
                fused = {"activation": epilogue[0][0], "activation_params": mlas_activation_params(epilogue[0])}
                epilogue = epilogue[1:]
            model, _, _ = single_conv_model(attrs, task.input_shape, inputs["w"], inputs.get("b"),
                                            config["layout"], block, **fused)
            x, unblock = inputs["x"], (lambda y: y)
            if config["layout"] == "NCHWc":
                if conv_takes_blocked_input(task.input_shape[1], a["group"], block):
                    x = nchwc_feed(inputs["x"], block)
                channels = task.output_shape[1]
                if any(step[0] == "PRelu" for step in epilogue):
                    # a PRelu reads NCHW (its slope is per channel): the conv's output is reordered first,
                    # as ORT's transformer and kselect's rewrite do
                    reordered_output(model, channels)
                else:
                    unblock = lambda y: from_blocked(y, channels, block)  # noqa: E731
        elif "bf16_fastmath" in config:  # an fc ORT runs as MatMul, measured as one
            model, epilogue = matmul_model(task, inputs), []
            x, unblock = inputs["x"], (lambda y: y)
        else:  # a Gemm, ORT's ConvTranspose (NCHW only: MLAS's GEMM and col2im) or 1-D Conv, with the epilogue
            model, epilogue = task_model(task, inputs), []
            x, unblock = inputs["x"], (lambda y: y)
            if task.conv1d:
                x, shape = inputs["x"].reshape(as_conv1d(task.input_shape)), task.output_shape
                unblock = lambda y: y.reshape(shape)  # noqa: E731
        if epilogue:
            with_epilogue(model, epilogue)
        session = ort.InferenceSession(model.SerializeToString(), session_options(config),
                                       providers=["CPUExecutionProvider"])
        return OrtCandidate(session, {session.get_inputs()[0].name: x}, unblock)

    # -- layouts, for plans that mix libraries ------------------------------------------------
    def layout_label(self, config: dict) -> Label:
        return Label(self.name, config.get('layout', 'NCHW'))

    def input_label(self, task: Task, label: str) -> str:
        """An NCHWc conv with fewer input channels than a block (a model's first conv, on RGB)
        reads NCHW directly, as measured: entering it costs no ReorderInput."""
        if (label == "mlas:NCHWc" and task.kind == "conv"
                and not conv_takes_blocked_input(task.input_shape[1], task.attrs["group"], self._block())):
            return "mlas:NCHW"
        return label

    def conversion(self, label: str, direction: str, x: np.ndarray) -> Candidate | None:
        """Entering ONNX Runtime costs a session call, plus a
        ReorderInput into NCHWc; leaving NCHWc costs a ReorderOutput; leaving NCHW costs nothing."""
        import onnxruntime as ort  # heavy (~0.3 s): not imported with the plugin

        layout = Label(label).form
        if layout == "int8-in-place":  # the "int8" sides of the flat tensor: no transpose (requantized_label)
            flat = self.conversion("mlas:int8", direction, x.reshape(-1))
            return OrtCandidate(flat.session, flat.feeds, lambda y: flat.unblock(y).reshape(x.shape))
        if layout == "int8":  # a QuantizeLinear into an int8 op, a DequantizeLinear out of one, 4-D: and NHWC
            scale, zero_point = asymmetric_u8(x.min(), x.max())
            model = int8.boundary_model(x.shape, direction, scale, zero_point)
            nhwc = x.ndim == 4  # int8 tensors are NHWC (boundary_model)
            if direction == "in":
                feed, unblock = x, (lambda y: int8.dequantize_activation(y.transpose(int8.TO_NCHW) if nhwc else y,
                                                                         scale, zero_point, "u8"))
            else:
                quantized = int8.quantize_activation(x, scale, zero_point, "u8")
                feed = np.ascontiguousarray(quantized.transpose(int8.TO_NHWC)) if nhwc else quantized
                unblock = lambda y: y  # noqa: E731
        elif layout == "NCHWc":
            block = self._block()
            if direction == "in":
                model, _, _ = reorder_model(x.shape, "NCHW->NCHWc", block)
                feed, unblock = x, (lambda y: from_blocked(y, x.shape[1], block))
            else:
                model, _, _ = reorder_model(x.shape, "NCHWc->NCHW", block)
                feed, unblock = nchwc_feed(x, block), (lambda y: y)
        elif direction == "out":
            return None
        else:  # a session call that reads the tensor in place (Shape), as a segment's session does
            graph = helper.make_graph([helper.make_node("Shape", ["x"], ["y"])], "enter",
                                      [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
                                      [helper.make_tensor_value_info("y", TensorProto.INT64, [x.ndim])])
            model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
            feed, unblock = x, (lambda y: x)
        session = ort.InferenceSession(model.SerializeToString(), session_options({}), providers=["CPUExecutionProvider"])
        return OrtCandidate(session, {session.get_inputs()[0].name: feed}, unblock)

    # -- plans ----------------------------------------------------------------------------
    def apply(self, plan, model, out_dir: Path, stem: str | None = None) -> list[Path]:
        return write_optimized_model(plan, model, Path(out_dir), stem or model.name)

    def node_times(self, model, plan, feeds: list[dict], runs: int):
        """From ONNX Runtime's profiler, in the session ``model_runner`` would make (profiling.py)."""
        def session(prefix):
            if plan is None:
                return default_session(model, profile_prefix=prefix)
            return plan_session(model, plan, profile_prefix=prefix)
        return profiled_run(session, feeds, runs)

    def model_runner(self, model, plan, in_mixed_plan: bool = False):
        # Its threads stop spinning at the end of each run: 197 -> 112 ms on resnet101 with two
        # XNNPack ops (MLAS plan alone: 103 ms), since the next segment gets both cores at once.
        stop = {FORCE_SPINNING_STOP_KEY: "1"} if in_mixed_plan else {}
        if plan is None:
            # ONNX Runtime running the ops another library lacks. A segment of data movement and
            # element-wise ops does not spin: a fresh session's idle threads spun while the other
            # library's threads waited for a core (yolov8n on oneDNN with 22 such segments, 2
            # cores: 1st run 540 ms, then runs of 30-60 ms for a while, against 5 ms), and once
            # warm the runs are as fast without. A segment with matrix work (an LSTM, a MatMul)
            # spins as ONNX Runtime's default does: its parallel loops are where the time goes
            # (ddddocr-ocr-beta on oneDNN, its LSTM in ONNX Runtime: 13.1 ms spinning, 15.0 ms not).
            if in_mixed_plan and not holds_matrix_work(model):
                stop[SPINNING_KEY] = "0"
            session = default_session(model, stop, segment=in_mixed_plan)
        else:
            session = plan_session(model, plan, stop, segment=in_mixed_plan)
        return SessionRunner(session)


class SessionRunner:
    """A model runner of ONNX Runtime: the session's outputs for the feeds, in graph order."""

    def __init__(self, session):
        self.session = session
        self.names = [o.name for o in session.get_outputs()]

    def __call__(self, feeds):
        return self.session.run(self.names, feeds)


# ONNX ops ONNX Runtime runs on MLAS's GEMM or convolution kernels across its threads.
MATRIX_OPS = frozenset({"Conv", "ConvTranspose", "ConvInteger", "QLinearConv", "Gemm", "MatMul", "MatMulInteger",
                        "QLinearMatMul", "Einsum", "LSTM", "GRU", "RNN", "Attention", "MultiHeadAttention"})


def holds_matrix_work(model) -> bool:
    """Whether the model (a segment of ONNX Runtime's in a plan) runs any matrix op."""
    return any(node.op_type in MATRIX_OPS for node in model.proto.graph.node)


# The activations an NCHWc conv takes as its ``activation`` attribute (MLAS_ACTIVATION_KIND).
MLAS_ACTIVATIONS = ("Relu", "Clip", "Sigmoid", "Tanh", "LeakyRelu", "HardSigmoid")


def fused_by_mlas(epilogue: list) -> bool:
    """Whether the epilogue's first step is an activation MLAS fuses and reads the conv alone
    (rewrite.py fuses it then; a second reader keeps the conv's output)."""
    if not epilogue or epilogue[0][0] not in MLAS_ACTIVATIONS:
        return False
    return not any("x" in step[1] for step in epilogue[1:])


def mlas_activation_params(step: list) -> list[float]:
    op, _, attrs = step
    if op == "Clip":
        low, high = clamp_range([step])
        limit = float(np.finfo(np.float32).max)
        return [max(low, -limit), min(high, limit)]
    if op == "LeakyRelu":
        return [attrs["alpha"]]
    if op == "HardSigmoid":
        return [attrs["alpha"], attrs["beta"]]
    return []


def matmul_model(task: Task, inputs: dict[str, np.ndarray]):
    """An fc task as the MatMul ONNX Runtime runs (x @ w.T, weights stored K x N as in the model),
    then its epilogue; a MatMul node has no bias (``fc.FullyConnectedKind.read``)."""
    out = "op_out" if task.epilogue else "y"
    weights = numpy_helper.from_array(np.ascontiguousarray(inputs["w"].T * task.attrs["alpha"]), "w")
    nodes, constants = onnx_nodes(task.epilogue, out, "y")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], [out], name="op"), *nodes], "op",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(task.input_shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(task.output_shape))],
                              [weights, *constants])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _divert_output(graph, name: str) -> str:
    """Renames the graph output where its node writes it to ``name``; returns the output's name,
    for the nodes appended after it."""
    output = graph.output[0].name
    for node in graph.node:
        for k, written in enumerate(node.output):
            if written == output:
                node.output[k] = name
    return output


def reordered_output(model, channels: int) -> None:
    """Makes a single NCHWc conv model write NCHW: a ReorderOutput after the conv."""
    graph = model.graph
    output = _divert_output(graph, "blocked_out")
    graph.node.append(helper.make_node("ReorderOutput", ["blocked_out"], [output], name="reorder_out",
                                       domain=NCHWC_DOMAIN, channels=channels))
    graph.output[0].CopyFrom(helper.make_tensor_value_info(output, onnx.TensorProto.FLOAT, None))


def with_epilogue(model, epilogue: list) -> None:
    """Appends the epilogue's nodes to a single-op model: they read its output (NCHW, or
    blocked, where they run blocked as in the whole-model rewrite) and write the model's output."""
    graph = model.graph
    output = _divert_output(graph, "op_out")
    nodes, initializers = onnx_nodes(epilogue, "op_out", output)
    graph.node.extend(nodes)
    graph.initializer.extend(initializers)
