"""OpenVINO IR with per-node hints, and what the CPU plugin really ran.

The CPU plugin reads two runtime attributes per node that kselect uses:

* ``primitives_priority`` (``cpu:<implementation type>``): put ahead of the plugin's own order of
  implementations for that node. Set from Python on a node's rt_info it is ignored; written into
  the IR XML inside the layer's ``<rt_info>`` and read back, it is honoured. So a model is
  converted once (``ov.convert_model``), serialised, and every compile edits the XML.
* ``precise``: keeps a node in f32 when the model is compiled with a reduced
  ``INFERENCE_PRECISION_HINT`` (bf16, f16): how a plan runs some ops in bf16 and others in f32.
  It goes on every layer the plugin fuses into the node's executed node (its bias, activation,
  a residual Add summed into its output): a conv kept in f32 whose fused residual Add is not
  fails to compile ("object is not initialized").

A hint the plugin cannot honour is dropped without a word, so after compiling kselect reads the
runtime model (``compiled.get_runtime_model()``): each executed node's ``primitiveType`` (e.g.
``brgconv_avx512_1x1_f32``), ``runtimePrecision`` and ``originalLayersNames`` (the IR layers
fused into it), and takes that as what ran.
"""

from __future__ import annotations

import functools
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from kselect.core.errors import KselectError
from kselect.plugins.openvino.runtime import openvino

# The IR op types that hold the work of a tuned ONNX node (Conv, ConvTranspose, Gemm, MatMul).
COMPUTE_TYPES = ("Convolution", "GroupConvolution", "ConvolutionBackpropData", "GroupConvolutionBackpropData",
                 "MatMul")
# Ops the ONNX frontend puts between a tuned node's work and the tensor the node writes: its
# bias, Gemm's alpha and beta.
BETWEEN_TYPES = ("Add", "Multiply", "Reshape", "Squeeze", "Unsqueeze", "Convert")
# The runtime model's layer types of those ops.
RUNTIME_TYPES = ("Convolution", "Deconvolution", "FullyConnected", "MatMul")
# The suffix of an integer kernel's primitive type ("brgconv_avx512_I8"), whatever its runtime
# precision says of its activations (u8 or i8).
INT8_SUFFIX = "_I8"
# Kinds of one-op models whose output is given in the reduced precision they are compiled in.
# Under a reduced INFERENCE_PRECISION_HINT the CPU plugin keeps a graph's tail in f32: the nodes
# between an output and the last Convolution, FullyConnected or MatMul before it
# (Graph::EnforceInferencePrecision, "to maintain accuracy"), unless the output itself is in the
# reduced precision. Deconvolution is not on that list, so a lone deconv computes in f32 however
# the model is compiled, while inside a model (a conv after it) the default bf16 runs it in bf16.
REDUCED_OUTPUT_KINDS = ("deconv",)
STREAMS = 1  # one stream: every core works on the one inference at a time (latency)


@functools.lru_cache(maxsize=1)
def core():
    ov = openvino()

    return ov.Core()


@dataclass
class Hint:
    """What a plan or a candidate asks of one IR layer."""

    impl: str | None = None  # a cpu: implementation type, or None: the plugin's own order
    keep_f32: bool = False  # stays f32 under a reduced inference precision


@dataclass
class RuntimeChoice:
    impl: str  # the implementation type, without the precision suffix: "brgconv_avx512_1x1"
    precision: str  # "f32", "bf16", ...
    primitive: str  # as the runtime model names it: "brgconv_avx512_1x1_f32"
    fused: tuple[str, ...] = ()  # the IR layers the executed node holds (originalLayersNames)


def output_array(tensor) -> np.ndarray:
    """An output tensor's data; a bf16 one's as float32 (its ``data`` holds its bits, typed float16)."""
    if tensor.element_type == openvino().Type.bf16:
        bits = np.ascontiguousarray(tensor.data).view(np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32)
    return tensor.data


class ConvertedModel:
    """An ONNX model converted to OpenVINO once and held as IR text and weights, with the IR layers
    of each tuned ONNX node (``layers``: ONNX node name -> the compute layer's name, then those of
    the bias and scaling ops after it, which the CPU plugin fuses into one executed node, naming
    it after any of them: a Gemm's FullyConnected takes its bias Add's name).
    ``output_precision`` ("bf16", "f16"): the model's outputs are given in that precision, not
    f32 (see ``REDUCED_OUTPUT_KINDS``)."""

    def __init__(self, proto: onnx.ModelProto, input_shapes: dict[str, list[int]], nodes: list[str],
                 output_precision: str | None = None):
        ov = openvino()

        with tempfile.TemporaryDirectory() as folder:
            onnx_path = Path(folder) / "model.onnx"
            onnx.save(proto, str(onnx_path))
            model = ov.convert_model(str(onnx_path))
            if input_shapes:
                model.reshape({name: ov.PartialShape(shape) for name, shape in input_shapes.items()})
            if output_precision:
                steps = ov.preprocess.PrePostProcessor(model)
                for index in range(len(model.outputs)):
                    steps.output(index).tensor().set_element_type(getattr(ov.Type, output_precision))
                model = steps.build()
            self.layers = _compute_layers(model, proto, nodes)
            ov.save_model(model, str(Path(folder) / "model.xml"), compress_to_fp16=False)
            self.xml = (Path(folder) / "model.xml").read_text()
            self.weights = (Path(folder) / "model.bin").read_bytes()
        self.output_names = [o.name for o in proto.graph.output]

    def hinted_xml(self, hints: dict[str, Hint]) -> str:
        """The IR XML with ``hints`` (ONNX node -> Hint) written into its layers' rt_info."""
        root = ET.fromstring(self.xml)
        by_name = {layer.get("name"): layer for layer in root.iter("layer")}
        for node, hint in hints.items():
            compute, *after = self.layers[node]
            # on the compute layer alone: the plugin merges the hints of the layers it fuses, and
            # a FullyConnected fused from a MatMul and its bias Add both hinted takes neither
            if hint.impl:
                ET.SubElement(_rt_info(by_name[compute]), "attribute", name="primitives_priority", version="0",
                              value=f"cpu:{hint.impl}")
            if hint.keep_f32:
                for name in dict.fromkeys((compute, *after, *self.fused_layers[node])):
                    # a layer the plugin made while compiling (the Multiply of a dequantize it
                    # decomposed, fused into an f32 conv reading an int8 op's output) is no IR layer
                    if name in by_name:
                        ET.SubElement(_rt_info(by_name[name]), "attribute", name="precise", version="0")
        return ET.tostring(root, encoding="unicode")

    @functools.cached_property
    def fused_layers(self) -> dict[str, tuple[str, ...]]:
        """ONNX node -> the IR layers the plugin fuses into the executed node running it, as the
        runtime model of the model compiled in f32 without hints shows them."""
        compiled = self.compile({}, {"INFERENCE_PRECISION_HINT": "f32", "NUM_STREAMS": STREAMS})
        return {node: choice.fused for node, choice in self.runtime_choices(compiled).items()}

    def read(self, hints: dict[str, Hint]):
        """The ov.Model of the IR with ``hints``, as plain ``core.read_model`` reads it."""
        return self.read_xml(self.hinted_xml(hints))

    def read_xml(self, xml: str):
        """The ov.Model of ``xml`` (this IR, edited) on this model's weights."""
        ov = openvino()

        weights = ov.Tensor(np.frombuffer(self.weights, np.uint8)) if self.weights else ov.Tensor(np.zeros(0, np.uint8))
        return core().read_model(xml, weights)

    def compile(self, hints: dict[str, Hint], properties: dict):
        return core().compile_model(self.read(hints), "CPU", properties)

    def runtime_choices(self, compiled) -> dict[str, RuntimeChoice]:
        """ONNX node -> the implementation and precision its layer ran with."""
        return runtime_choices(compiled, self.layers)


def _rt_info(layer: ET.Element) -> ET.Element:
    """The IR layer's ``<rt_info>`` element, added if it has none."""
    found = layer.find("rt_info")
    return found if found is not None else ET.SubElement(layer, "rt_info")


def runtime_choices(compiled, layers: dict[str, tuple[str, ...]]) -> dict[str, RuntimeChoice]:
    """``layers``: ONNX node -> its IR layers' names; the executed node holding them."""
    holder = {}
    for node in compiled.get_runtime_model().get_ordered_ops():
        info = node.get_rt_info()
        if info["layerType"].astype(str) not in RUNTIME_TYPES:
            continue
        primitive = info["primitiveType"].astype(str)
        precision = info["runtimePrecision"].astype(str)
        if primitive.endswith(INT8_SUFFIX):  # an integer kernel, on u8 or i8 activations: kselect's int8
            precision = "i8"
        suffix = INT8_SUFFIX if precision == "i8" else f"_{precision}"
        impl = primitive[:-len(suffix)] if primitive.endswith(suffix) else primitive
        fused = tuple(info["originalLayersNames"].astype(str).split(","))
        for name in fused:
            holder[name] = RuntimeChoice(impl, precision, primitive, fused)
    found = {node: next((holder[name] for name in names if name in holder), None) for node, names in layers.items()}
    missing = [node for node, choice in found.items() if choice is None]
    if missing:
        raise KselectError(f"OpenVINO's runtime model holds no executed node for {', '.join(missing)}")
    return found


def _compute_layers(model, proto: onnx.ModelProto, nodes: list[str]) -> dict[str, tuple[str, ...]]:
    """ONNX node -> the friendly names of the IR op doing its work and of the bias and scaling ops
    between it and the op writing the node's output tensor. Names are made unique."""
    writes = {node.name: node.output[0] for node in proto.graph.node if node.name in nodes}
    producer = {}
    for op in model.get_ordered_ops():
        if op.get_type_name() == "Result":  # it repeats the name of the tensor it returns
            continue
        for output in op.outputs():
            for name in output.get_names():
                producer[name] = op
    count = {}
    for op in model.get_ordered_ops():
        count[op.get_friendly_name()] = count.get(op.get_friendly_name(), 0) + 1
    layers, taken = {}, set()
    for node in nodes:
        op, chain = producer.get(writes.get(node, "")), []
        while op is not None and op.get_type_name() in BETWEEN_TYPES:
            chain.append(op)
            computed = [i.get_source_output().get_node() for i in op.inputs()
                        if not _constant(i.get_source_output().get_node())]
            op = computed[0] if len(computed) == 1 else None
        if op is None or op.get_type_name() not in COMPUTE_TYPES:
            raise KselectError(f"node {node!r}: no OpenVINO convolution or matrix product writes its output "
                               f"after conversion")
        chain.insert(0, op)
        for index, member in enumerate(chain):
            if count[member.get_friendly_name()] > 1 or member.get_friendly_name() in taken:
                member.set_friendly_name(f"{node}/kselect{index}")
            taken.add(member.get_friendly_name())
        layers[node] = tuple(member.get_friendly_name() for member in chain)
    return layers


def _constant(op) -> bool:
    """Whether ``op`` computes from constants alone (a Constant, or a quantized bias's Convert and
    Multiply in a QDQ model)."""
    if op.get_type_name() == "Constant":
        return True
    if op.get_type_name() == "Parameter":
        return False
    return all(_constant(i.get_source_output().get_node()) for i in op.inputs())


def replicated(proto: onnx.ModelProto, copies: int) -> tuple[onnx.ModelProto, list[str]]:
    """``copies`` independent copies of a one-op model (each its own input, weights and output),
    compiled once to ask the plugin about many hints at a time; returns the model and the node
    name of the tuned op in each copy (the original's node "op"). Copies sharing weights are not
    independent: the plugin then gives a FullyConnected hinted ``jit_gemm`` its default instead."""
    from onnx import helper

    graph = proto.graph
    nodes, inputs, outputs, initializers = [], [], [], []
    for copy in range(copies):
        def renamed(name: str) -> str:
            return f"c{copy}.{name}" if name else name

        for node in graph.node:
            clone = onnx.NodeProto()
            clone.CopyFrom(node)
            clone.name = renamed(node.name)
            clone.input[:] = [renamed(n) for n in node.input]
            clone.output[:] = [renamed(n) for n in node.output]
            nodes.append(clone)
        for values, into in ((graph.input, inputs), (graph.output, outputs), (graph.initializer, initializers)):
            for value in values:
                clone = type(value)()
                clone.CopyFrom(value)
                clone.name = renamed(value.name)
                into.append(clone)
    model = helper.make_model(helper.make_graph(nodes, "copies", inputs, outputs, initializers),
                              opset_imports=list(proto.opset_import), ir_version=proto.ir_version)
    return model, [f"c{copy}.op" for copy in range(copies)]


# The per-node memory format attributes the CPU plugin reads (utils/rt_info/memory_formats_attribute.hpp).
MEMORY_FORMAT_ATTRIBUTES = ("InputMemoryFormats", "OutputMemoryFormats")


@functools.lru_cache(maxsize=1)
def memory_formats_taken() -> dict[str, bool]:
    """Whether a per-node memory format asked for takes effect, by route: written into the IR's
    ``<rt_info>`` (as ``primitives_priority`` is) and set from Python on the node's rt_info. Probed
    on a 3x3 conv asking for the plain layout it does not pick unasked (or blocked, if it does).
    The plugin reads the attributes only as its own C++ class (``is<InputMemoryFormats>()``),
    which neither route makes, so both are expected False; a release that honours them makes
    this True and ``OpenvinoLibrary.missing_dims`` says so."""
    from onnx import TensorProto, helper, numpy_helper

    weight = numpy_helper.from_array(np.ones((16, 16, 3, 3), np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], name="conv", pads=[1, 1, 1, 1])], "probe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, 16, 16])], [weight])
    converted = ConvertedModel(helper.make_model(graph), {}, ["conv"])
    compute = converted.layers["conv"][0]
    properties = {"INFERENCE_PRECISION_HINT": "f32", "NUM_STREAMS": STREAMS}

    def layout(model) -> str:
        compiled = core().compile_model(model, "CPU", properties)
        return next(op.get_rt_info()["outputLayouts"].astype(str) for op in compiled.get_runtime_model().get_ordered_ops()
                    if compute in op.get_rt_info()["originalLayersNames"].astype(str).split(","))

    own = layout(converted.read({}))
    wanted = "cpu:nChw8c" if own == "abcd" else "cpu:nchw"
    root = ET.fromstring(converted.xml)
    rt_info = _rt_info(next(layer for layer in root.iter("layer") if layer.get("name") == compute))
    for name in MEMORY_FORMAT_ATTRIBUTES:
        ET.SubElement(rt_info, "attribute", name=name, version="0", value=wanted)
    through_ir = layout(converted.read_xml(ET.tostring(root, encoding="unicode"))) != own
    model = converted.read({})
    for op in model.get_ops():
        if op.get_friendly_name() == compute:
            for name in MEMORY_FORMAT_ATTRIBUTES:
                op.get_rt_info()[name] = wanted
    return {"ir": through_ir, "python": layout(model) != own}
