"""The OpenVINO library plugin: per conv / deconv / fc op, which implementation of OpenVINO's CPU
plugin runs it (``primitives_priority``); per plan, the thread count and whether threads are
pinned to cores. The op's bf16 and fp16 twins (core/precision/) run in OpenVINO's bf16 and f16
where its CPU plugin computes in them here. Every candidate is what the runtime model shows
OpenVINO ran: a hint it ignored is a failed candidate, never a measured one (ir.py)."""

from __future__ import annotations

import functools
import json
import platform
import statistics
from dataclasses import dataclass

import numpy as np
import onnx

from kselect.core.contract.labels import Label
from kselect.core.contract.library import CallCandidate, Candidate, Library
from kselect.core.contract.space import Categorical, Integer, Space
from kselect.core.errors import KselectError
from kselect.core.measuring.device import Device, this_device
from kselect.core.measuring.measure import reference_output, task_inputs, task_model
from kselect.core.models.tasks import Task, task_key
from kselect.core.plans.plan import int8_nodes
from kselect.core.precision.quant import PRECISIONS, dequantize, quant_params, quantize
from kselect.core.whole_model.context import timed_runs
from kselect.plugins.openvino import int8, ir
from kselect.plugins.openvino.export import write_ir
from kselect.plugins.openvino.runtime import openvino

PACKAGE = "openvino==2026.4.1"
# Implementation types the CPU plugin knows (impl_type_to_string in
# src/plugins/intel_cpu/src/onednn/iml_type_mapper.cpp). Which of them a node takes on this CPU
# and this OpenVINO is found by compiling the op with each as its hint.
IMPLEMENTATION_TYPES = (
    "brgconv_avx512", "brgconv_avx512_1x1", "brgconv_avx512_dw", "brgconv_avx512_amx", "brgconv_avx512_amx_1x1",
    "brgconv_avx2", "brgconv_avx2_1x1", "brgconv_avx2_dw", "brgconv_avx", "brgconv_avx_1x1", "brgconv_sse42",
    "brgconv_sse42_1x1", "brgconv_uni", "brgconv_uni_1x1",
    "jit_avx512", "jit_avx512_1x1", "jit_avx512_dw", "jit_avx512_winograd", "jit_avx512_amx", "jit_avx512_amx_1x1",
    "jit_avx512_amx_dw", "jit_avx2", "jit_avx2_1x1", "jit_avx2_dw", "jit_avx", "jit_avx_1x1", "jit_avx_dw",
    "jit_sse42", "jit_sse42_1x1", "jit_sse42_dw", "jit_uni", "jit_uni_1x1", "jit_uni_dw",
    "brgemm_avx512", "brgemm_avx512_amx", "brgemm_avx2", "brgemm_avx", "brgemm_sse42", "brgemm_uni",
    "gemm_mlas", "jit_gemm", "gemm_avx512", "gemm_avx2", "gemm_avx", "gemm_sse42", "gemm_blas", "gemm_any",
    "ref", "ref_any",
    "acl", "dw_acl", "gemm_acl", "winograd_acl", "jit_asimd", "jit_sve128", "jit_sve256", "jit_sve384",
    "jit_sve512", "kleidiai", "gemm_kleidiai", "shl", "gemm_shl", "gv", "jit_gv",
)
# Words that name another processor family's kernels: not asked for on this one.
ARCH_WORDS = {"x86": ("sse42", "avx", "amx", "mlas", "uni"), "arm": ("acl", "kleidiai", "asimd", "sve"),
              "riscv": ("shl", "gv")}
# kselect's precision names (Task.precision) -> OpenVINO's (INFERENCE_PRECISION_HINT, runtimePrecision,
# a config's "precision").
OV_PRECISIONS = {"fp32": "f32", "bf16": "bf16", "fp16": "f16", "int8": "i8"}
# The entry of the CPU plugin's OPTIMIZATION_CAPABILITIES saying it computes in a reduced precision
# on this CPU (bf16: AVX512_BF16 or AMX; f16: Arm's FP16 arithmetic, AVX512_FP16 or AMX-FP16; int8:
# integer kernels, which a QDQ model reaches, int8.py).
CAPABILITIES = {"bf16": "BF16", "fp16": "FP16", "int8": "INT8"}
# Copies of an op compiled together while finding the hints it takes: at most this many bytes of data.
PROBE_BYTES = 256 << 20


def _arch() -> str:
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64", "i686"):
        return "x86"
    return "arm" if machine.startswith(("arm", "aarch64")) else "riscv"


def asked_types() -> tuple[str, ...]:
    """The implementation types worth a hint on this processor family."""
    foreign = [w for family, words in ARCH_WORDS.items() if family != _arch() for w in words]
    return tuple(name for name in IMPLEMENTATION_TYPES if not any(word in name for word in foreign))


@functools.lru_cache(maxsize=1)
def reduced_missing() -> dict[str, str]:
    """Each reduced precision (kselect's name) the CPU plugin does not compute in here, and why."""
    capabilities = list(ir.core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"))
    missing = {precision: f"OpenVINO's CPU plugin runs no {OV_PRECISIONS[precision]} here (its "
                          f"OPTIMIZATION_CAPABILITIES: {', '.join(capabilities)})"
               for precision, capability in CAPABILITIES.items() if capability not in capabilities}
    if "int8" not in missing:
        failure = int8_probe_failure()
        if failure:
            missing["int8"] = failure
    return missing


def int8_probe_failure() -> str | None:
    """Why the CPU plugin does not run kselect's int8 form of a conv (int8.single_op_model) here,
    or None: a 3x3 conv with bias on 16 channels, compiled once. (OpenVINO 2026.4 on aarch64
    lists INT8 and refuses it: "Convolution input precision should be single".)"""
    attrs = {"kernel": [3, 3], "strides": [1, 1], "pads": [1, 1, 1, 1], "dilations": [1, 1], "group": 1}
    signature = {"kind": "conv", "x": [1, 16, 12, 12], "w": [16, 16, 3, 3], "y": [1, 16, 12, 12], "attrs": attrs,
                 "epilogue": []}
    task = Task("probe", task_key(signature), "conv", [1, 16, 12, 12], [16, 16, 3, 3], [1, 16, 12, 12], attrs, True,
                ["probe"], []).at_precision("int8")
    inputs = task_inputs(task)
    inputs["quant"] = quant_params(task, inputs, reference_output(task, inputs))
    try:
        converted = ir.ConvertedModel(int8.single_op_model(task, inputs), {}, ["op"])
        ran = converted.runtime_choices(converted.compile({}, compile_properties("i8", None, None)))["op"]
    except Exception as exc:  # the plugin refuses the model
        return f"OpenVINO's CPU plugin does not compile an int8 (QDQ) convolution here: {_last_line(exc)}"
    if ran.precision != "i8":
        return f"OpenVINO's CPU plugin runs an int8 (QDQ) convolution in {ran.precision} here ({ran.primitive})"
    return None


def _last_line(exc: Exception) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1][:200] if lines else type(exc).__name__


class IgnoredHint(KselectError):
    """OpenVINO ran something else than the candidate asked for."""


@dataclass(frozen=True)
class Offer:
    """What the CPU plugin does with one op in one precision: the implementation it picks by
    itself (``own``) and those a ``primitives_priority`` hint makes it take instead (``hinted``).
    Hinting its own pick is not the same as leaving it be: in f32 a ``brgconv_avx512`` hint is
    dropped for a conv whose unhinted pick is ``brgconv_avx512``."""

    own: str
    hinted: tuple[str, ...]


@functools.lru_cache(maxsize=None)
def _offer(task_json: str, precision: str) -> Offer | None:
    task = Task.from_json(json.loads(task_json))
    inputs = task_inputs(task)
    if precision == "i8":
        inputs["quant"] = quant_params(task, inputs, reference_output(task, inputs))
    single = op_model(task, inputs)
    names = asked_types()
    data_bytes = max(1, sum(v.nbytes for v in inputs.values() if isinstance(v, np.ndarray)))
    # Copies of a fully connected op compiled together drop each other's hints (a FullyConnected
    # hinted jit_gemm in bf16 takes it alone, not beside a copy): it is compiled once per hint.
    copies = 1 if task.kind == "fc" else max(1, min(len(names), PROBE_BYTES // data_bytes))
    properties = compile_properties(precision, None, None)
    alone = converted_op(task, single, ["op"], precision)
    try:
        unhinted = alone.runtime_choices(alone.compile({}, properties))["op"]
    except Exception:  # the plugin refuses this op in that form (an int8 one on aarch64): not offered
        return None
    if unhinted.precision != precision:
        return None  # the plugin does not run this op in that precision here
    own, hinted = unhinted.impl, []
    for start in range(0, len(names), copies):
        chunk = names[start:start + copies]
        if copies == 1:
            converted, nodes = alone, ["op"]
        else:
            proto, nodes = ir.replicated(single, len(chunk))
            converted = converted_op(task, proto, nodes, precision)
        ran = converted.runtime_choices(converted.compile(dict(zip(nodes, map(ir.Hint, chunk))), properties))
        hinted += [name for node, name in zip(nodes, chunk) if (ran[node].impl, ran[node].precision) == (name, precision)]
    return Offer(own, tuple(name for name in hinted if name != own))


def op_model(task: Task, inputs: dict):
    """The one-op model of a candidate: the op in float, or, for an int8 task, between a
    dequantize of its input and a quantize of its output (int8.py)."""
    return int8.single_op_model(task, inputs) if task.precision == "int8" else task_model(task, inputs)


def converted_op(task: Task, proto, nodes: list[str], precision: str) -> ir.ConvertedModel:
    """A one-op model (or copies of it) converted for compiling in ``precision``: a deconv's
    output is given in a reduced precision it computes in, or the plugin computes it in f32
    (ir.REDUCED_OUTPUT_KINDS)."""
    reduced = task.kind in ir.REDUCED_OUTPUT_KINDS and precision in ("bf16", "f16")
    return ir.ConvertedModel(proto, {}, nodes, output_precision=precision if reduced else None)


def offer(task: Task, precision: str) -> Offer | None:
    """Found by compiling the op with each implementation type as its hint, with OpenVINO's own
    thread count; once per task and precision in a process. None: not run in ``precision``."""
    return _offer(json.dumps(task.to_json(), sort_keys=True), precision)


def compile_properties(precision: str, threads: int | None, pinning: bool | None) -> dict:
    """``precision``: OpenVINO's inference precision; int8 ("i8") comes from the model's QDQ
    nodes, the rest of it computing in f32."""
    properties = {"INFERENCE_PRECISION_HINT": "f32" if precision == "i8" else precision, "NUM_STREAMS": ir.STREAMS}
    if threads:
        properties["INFERENCE_NUM_THREADS"] = int(threads)
    if pinning is not None:
        properties["ENABLE_CPU_PINNING"] = bool(pinning)
    return properties


class OpenvinoLibrary(Library):
    name = "openvino"
    plan_level_dims = ("threads", "pinning")
    # OpenVINO compiled with no properties, as its users run it (bf16 on a CPU with bf16)
    users_default = {"factory": "kselect.plugins.openvino.baselines:runner", "args": {}}
    # On Arm the CPU plugin's f16 convolutions and fully connected layers run on ACL's / KleidiAI's
    # half-precision GEMMs, which accumulate in f16 (an f16 3x3 conv of the contract model on the
    # arm64 root: 1.83e-3 off the reference, beyond the fp32-accumulation bound); on x86 oneDNN's
    # f16 kernels accumulate in f32.
    accumulates_in_half = frozenset({"fp16"}) if _arch() == "arm" else frozenset()
    # Untuned ops the CPU plugin runs on u8 between int8 ops of a QDQ model (the runtime model's
    # precision of each, tests/test_openvino.py): no dequantize and quantize around them.
    int8_passes = frozenset({"MaxPool", "AveragePool", "GlobalAveragePool", "Add", "Concat", "Resize", "Flatten"})

    # -- identity ---------------------------------------------------------------------------
    def availability(self) -> tuple[bool, str]:
        try:
            openvino()
        except ImportError as exc:
            return False, f"the openvino package does not import ({exc}): pip install {PACKAGE}"
        try:
            devices = ir.core().available_devices
        except Exception as exc:  # a broken install: its plugins do not load
            return False, f"OpenVINO does not start: {exc}"
        if "CPU" not in devices:
            return False, "OpenVINO finds no CPU device"
        return True, ""

    def version(self) -> str:
        ov = openvino()

        return f"OpenVINO {ov.get_version()}"

    @property
    def precisions(self) -> tuple[str, ...]:
        """fp32, and bf16 / fp16 where OpenVINO's CPU plugin computes in them here (``missing_precisions``)."""
        return ("fp32",) + tuple(p for p in CAPABILITIES if p not in self.missing_precisions())

    @property
    def plan_precisions(self) -> tuple[str, ...]:
        """A plan's one reduced precision is the model's inference precision, its f32 ops marked
        ``precise`` (plan_compilation): the same as ``precisions``."""
        return self.precisions

    def missing_dims(self) -> dict[str, str]:
        """The CPU plugin's plan-level properties kselect does not choose, and why."""
        clusters = len(this_device().clusters)
        taken = ir.memory_formats_taken()
        version = openvino().__version__.split("-")[0]
        return {
            "memory_format": (
                f"InputMemoryFormats / OutputMemoryFormats take no effect in OpenVINO {version}: written into the "
                "IR or set on a node from Python, a conv keeps the layout the plugin picks (it reads them only as "
                "its own C++ attribute class, which neither route makes)" if not any(taken.values()) else
                f"OpenVINO {version} takes a per-node memory format ({' and '.join(r for r, t in taken.items() if t)}"
                " route), but kselect's OpenVINO plugin does not offer it yet"),
            "streams": f"NUM_STREAMS is {ir.STREAMS}: one inference at a time on every core (latency); more "
                       "streams run each inference on a share of the cores, which `threads` already chooses",
            "core_type": ("SCHEDULING_CORE_TYPE has nothing to choose: one kind of core here" if clusters <= 1 else
                          f"SCHEDULING_CORE_TYPE (big or little cores) is not chosen yet: {clusters} clusters of "
                          "cores here, and no hybrid CPU was available to check it on"),
        }

    def missing_precisions(self) -> dict[str, str]:
        """Each precision kselect knows that this plugin does not measure here, and why."""
        if self.availability()[0]:
            missing = reduced_missing()
        else:
            missing = {precision: "OpenVINO is not available" for precision in CAPABILITIES}
        return {precision: missing[precision] for precision in PRECISIONS if precision in missing}

    def supports(self, task: Task) -> bool:
        """A conv, deconv or fc the CPU plugin runs in the task's precision (a bf16 or fp16 twin
        in OpenVINO's bf16 or f16; an int8 twin of a conv or fc on its integer kernels)."""
        if task.kind not in ("conv", "deconv", "fc") or task.precision not in self.precisions:
            return False
        if task.precision == "int8" and not int8.has_int8_form(task):
            return False
        return offer(task, OV_PRECISIONS[task.precision]) is not None

    # -- spaces -----------------------------------------------------------------------------
    def space(self, task: Task, device: Device) -> Space:
        """The op in the task's one precision (``precision``: "f32" for an fp32 task, "bf16" for
        its bf16 twin, "f16" for its fp16 twin)."""
        precision = OV_PRECISIONS[task.precision]
        found = offer(task, precision)
        space = Space()
        space.add(Categorical("impl", (found.own, *found.hinted), role="algorithm"))
        space.add(Categorical("precision", (precision,), role="knob"))
        space.add(Categorical("hinted", (False, True), role="knob"))
        space.constrain("impl is the plugin's own pick (no hint) or one a hint makes it take",
                        lambda c, found=found: (c["impl"] in found.hinted) if c["hinted"] else c["impl"] == found.own)
        space.add(Integer("threads", 1, device.cores))
        space.add(Categorical("pinning", (default_pinning(), not default_pinning()), role="knob"))
        return space

    def default_config(self, task: Task, device: Device) -> dict:
        """OpenVINO's own pick for the op in the task's precision, all cores, its own pinning.
        (Its own precision for a model on a CPU with bf16 is bf16; kselect's baseline is the model
        run in f32.)"""
        precision = OV_PRECISIONS[task.precision]
        return {"impl": offer(task, precision).own, "precision": precision, "hinted": False, "threads": device.cores,
                "pinning": default_pinning()}

    # -- candidates (in the measuring child) --------------------------------------------------
    def prepare(self, task: Task, config: dict, inputs: dict[str, np.ndarray]) -> Candidate:
        ov = openvino()

        proto = op_model(task, inputs)
        converted = converted_op(task, proto, ["op"], config["precision"])
        compiled = converted.compile({"op": hint(config)},
                                     compile_properties(config["precision"], config["threads"], config["pinning"]))
        ran = converted.runtime_choices(compiled)["op"]
        if (ran.impl, ran.precision) != (config["impl"], config["precision"]):
            asked = f"cpu:{config['impl']}" if config["hinted"] else f"its own pick {config['impl']}"
            raise IgnoredHint(f"OpenVINO did not run {asked} in {config['precision']}: it ran {ran.primitive}")
        request = compiled.create_infer_request()
        x_shape = [d.dim_value for d in proto.graph.input[0].type.tensor_type.shape.dim]
        x = int8.quantized_input(inputs) if task.precision == "int8" else inputs["x"]
        request.set_input_tensor(ov.Tensor(np.ascontiguousarray(x.reshape(x_shape))))

        def output():
            y = ir.output_array(request.get_output_tensor(0)).reshape(task.output_shape).copy()
            return int8.dequantized_output(y, inputs["quant"]) if task.precision == "int8" else y
        candidate = CallCandidate(request.infer, output)
        candidate.compiled = compiled  # kept alive as long as its request
        return candidate

    # -- tensors crossing into and out of OpenVINO ---------------------------------------------
    def conversion(self, label: str, direction: str, x: np.ndarray) -> Candidate | None:
        """What ``ModelRunner`` does to a tensor at a segment's edge, in NCHW or flat (OpenVINO takes
        and gives plain tensors; its layouts inside a compiled model are its own): entering, one
        more infer call with the tensor copied into the request; leaving, the tensor copied out of
        it. ``openvino:int8``, a tensor between a float op and an int8 one: its quantize ("in") or
        dequantize ("out") compiled and timed in OpenVINO."""
        if Label(label).form == "int8":
            return int8_side(x, direction)
        if not Label(label).is_plain:
            raise KselectError(f"OpenVINO converts no tensor into {label}: it takes and gives plain tensors")
        if direction == "out":
            return CallCandidate(x.copy, lambda: x)
        return segment_entry(x)

    # -- plans ----    # -- plans ------------------------------------------------------------------------------
    def apply(self, plan, model, out_dir, stem: str | None = None):
        hints, properties = plan_compilation(plan)
        return write_ir(plan, model, plan_model(model, plan), out_dir, hints, properties, stem)

    def model_runner(self, model, plan, in_mixed_plan: bool = False):
        return ModelRunner(model, plan)

    def node_times(self, model, plan, feeds: list[dict], runs: int):
        """The whole run timed as compiled for the plan; the nodes from OpenVINO's performance
        counters (``PERF_COUNT``) in a second compile, each executed node's real time under the
        planned ONNX node whose IR layers it holds, else under its own name."""
        plain = ModelRunner(model, plan)
        try:
            whole = timed_runs(plain, feeds, runs)
        finally:
            plain.close()
        profiled = ModelRunner(model, plan, {"PERF_COUNT": True})
        try:
            per_node: dict[str, list[float]] = {}
            timed_runs(profiled, feeds, 0)
            for index in range(runs):
                profiled(feeds[index % len(feeds)])
                this_run: dict[str, float] = {}
                for counted in profiled.request.get_profiling_info():
                    name = profiled.owner.get(counted.node_name, counted.node_name)
                    this_run[name] = this_run.get(name, 0.0) + counted.real_time.total_seconds() * 1e6
                for name, us in this_run.items():
                    per_node.setdefault(name, []).append(us)
        finally:
            profiled.close()
        return statistics.median(whole), {name: statistics.median(times) for name, times in per_node.items()}

    def runs_op(self, op_type: str) -> bool:
        return True  # OpenVINO's ONNX frontend and CPU plugin run every op of the models kselect takes


def hint(config: dict, keep_f32: bool = False) -> ir.Hint:
    return ir.Hint(impl=config["impl"] if config["hinted"] else None, keep_f32=keep_f32)


@functools.lru_cache(maxsize=1)
def default_pinning() -> bool:
    return bool(ir.core().get_property("CPU", "ENABLE_CPU_PINNING"))


def int8_side(x: np.ndarray, direction: str) -> Candidate:
    """The quantize ("in") or dequantize ("out") of ``x`` on its own range, in OpenVINO
    (int8.conversion_model); ``output()`` is the float tensor after it: ``conversion`` for the
    label ``openvino:int8``."""
    ov = openvino()
    proto, scale, zero_point = int8.conversion_model(x, direction)
    compiled = ir.ConvertedModel(proto, {}, []).compile({}, compile_properties("f32", None, None))
    request = compiled.create_infer_request()
    fed = x if direction == "in" else quantize(x, scale, zero_point)
    request.set_input_tensor(ov.Tensor(np.ascontiguousarray(fed)))

    def output():
        y = request.get_output_tensor(0).data.copy()
        return dequantize(y, scale, zero_point) if direction == "in" else y
    candidate = CallCandidate(request.infer, output)
    candidate.compiled = compiled  # kept alive as long as its request
    return candidate


def segment_entry(x: np.ndarray) -> Candidate:
    """One infer call of a compiled model that hands its input straight to its output, the input
    copied in as ``ModelRunner`` copies a segment's inputs (its output, left in place, is the
    "out" side's copy)."""
    model = onnx.helper.make_model(
        onnx.helper.make_graph([onnx.helper.make_node("Identity", ["x"], ["y"])], "enter",
                               [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, list(x.shape))],
                               [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, list(x.shape))]),
        opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=8)
    compiled = ir.ConvertedModel(model, {}, []).compile({}, compile_properties("f32", None, None))
    request = compiled.create_infer_request()
    feed = {compiled.inputs[0]: np.ascontiguousarray(x)}
    candidate = CallCandidate(lambda: request.infer(feed, share_outputs=True),
                              lambda: request.get_output_tensor(0).data.copy())
    candidate.compiled = compiled  # kept alive as long as its request
    return candidate


def plan_model(model, plan):
    """The ONNX model a plan compiles: the model, or, when the plan has int8 nodes, its QDQ form
    (int8.quantized_model)."""
    if plan is None or not int8_nodes(plan):
        return model.proto
    return int8.quantized_model(model, plan, OpenvinoLibrary.int8_passes)


def plan_compilation(plan) -> tuple[dict[str, ir.Hint], dict]:
    """The hints per ONNX node and the compile properties of a plan (None: OpenVINO's defaults in
    f32). The plan's one reduced precision, if any, is the model's inference precision, and the ops
    it keeps in f32 are marked ``precise``."""
    if plan is None:
        return {}, compile_properties("f32", None, None)
    configs = {node: entry["config"] for node, entry in plan.nodes.items()}
    reduced = sorted({c["precision"] for c in configs.values()} - {"f32", "i8"})
    if len(reduced) > 1:
        raise KselectError(f"the plan runs ops in {' and '.join(reduced)}: OpenVINO compiles a model in one reduced "
                           f"precision")
    precision = reduced[0] if reduced else "f32"
    hints = {node: hint(c, keep_f32=bool(reduced) and c["precision"] == "f32") for node, c in configs.items()}
    settings = plan.plan_level or next(iter(configs.values()), {})
    return hints, compile_properties(precision, settings.get("threads"), settings.get("pinning"))


class ModelRunner:
    """The whole model compiled by OpenVINO as the plan says: ``runner(feeds) -> [outputs]`` in the
    ONNX graph's output order. ``ran``: what each planned node ran with (ir.RuntimeChoice);
    ``owner``: executed node name -> the planned ONNX node whose IR layers it holds.
    ``extra_properties``: compile properties added to the plan's (performance counters)."""

    def __init__(self, model, plan, extra_properties: dict | None = None):
        nodes = list(plan.nodes) if plan is not None else []
        self.converted = ir.ConvertedModel(plan_model(model, plan), model.input_shapes, nodes)
        self.hints, self.properties = plan_compilation(plan)
        compiled = self.converted.compile(self.hints, {**self.properties, **(extra_properties or {})})
        self.ran = self.converted.runtime_choices(compiled)
        layer_owner = {layer: node for node, layers in self.converted.layers.items() for layer in layers}
        self.owner = {}
        for executed in compiled.get_runtime_model().get_ordered_ops():
            layers = executed.get_rt_info()["originalLayersNames"].astype(str).split(",")
            owner = next((layer_owner[layer] for layer in layers if layer in layer_owner), None)
            if owner is not None:
                self.owner[executed.get_friendly_name()] = owner
        self.request = compiled.create_infer_request()
        by_name = {}
        for index, output in enumerate(compiled.outputs):
            for name in output.get_names():
                by_name[name] = index
        self.output_indices = [by_name[name] for name in self.converted.output_names]

    def __call__(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        self.request.infer({name: np.ascontiguousarray(value) for name, value in feeds.items()})
        return [self.request.get_output_tensor(index).data.copy() for index in self.output_indices]

    def close(self) -> None:
        self.request = None
