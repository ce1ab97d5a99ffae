"""kselect's own writer of ONNX Runtime's ``com.microsoft.nchwc`` nodes for a whole model.

ONNX Runtime's ``NchwcTransformer`` converts *every* eligible Conv of a model to MLAS's blocked
NCHWc layout.  kselect wants to choose the layout per Conv, so ``rewrite_model`` writes the NCHWc
nodes itself and the result is loaded with ORT's own transformer switched off
(``ort_session.session_options``).  ``anchor_inputs`` instead prepares a model cut out of a
larger one for ORT's own transformer.  Which convs can run as NCHWc and how their weights are
reordered and padded is in layout.py.

Written for onnxruntime 1.32 (the venv's build) and checked against its sources
(nchwc_transformer.cc, nchwc_schema_defs.cc, contrib_ops/cpu/nchwc_ops.cc) and by running it.

Input model
-----------
``rewrite_model`` works on ONNX ``Conv`` nodes and on ORT's ``com.microsoft.FusedConv`` (its
activation attributes are kept).  It does not fold BatchNormalization: give it a model already
optimised by ORT at ORT_ENABLE_BASIC (Conv+BN/Mul/Add folded, node names kept) or
ORT_ENABLE_EXTENDED (Conv+activation -> FusedConv), saved with ``optimized_model_filepath``;
otherwise a BatchNormalization after an NCHWc conv reads NCHW through a ReorderOutput.
``layouts`` keys are node names, which ORT's optimisers preserve for the surviving conv.

Rules followed (ORT's NchwcTransformer, nchwc_transformer.cc)
------------------------------------------------------------
* Weights are constant float 4-D initializers, bias (optional) constant 1-D of the output count.
  Their reorder and padding, and which grouped convs stay NCHW: see layout.py.
* Activation fusion: a Relu / Clip (constant min/max) / Sigmoid / Tanh / LeakyRelu / HardSigmoid
  that is the *only* reader of an NCHWc conv's output (and the output is no graph output) is fused
  as ``activation`` (+ ``activation_params``: Clip [min,max], LeakyRelu [alpha],
  HardSigmoid [alpha,beta]); ORT itself gets there via FusedConv.
* Sum fusion: ``Add``/``Sum`` of two blocked tensors of equal logical channels and equal shape,
  where one input is the single-use output of an NCHWc conv without activation, becomes that
  conv's 4th input ``Sum`` (the conv accumulates into it); an activation following the Add can
  then still be fused (``act(conv + bias + sum)``, as in ORT).
* Propagation of the blocked layout, only when the input is already blocked: MaxPool (no
  indices output) / AveragePool / GlobalAveragePool / GlobalMaxPool -> their nchwc versions;
  the elementwise unaries above -> same op on the blocked tensor; Add / Sum / Mul of blocked
  tensors with equal logical channels and equal inferred shapes -> same op; Concat on axis 1 when
  every input's logical channels are a block multiple -> Concat axis 1 of the blocked tensors.
  Everything else reads NCHW.

kselect extensions beyond ORT's transformer (all verified against the NCHW reference):
* Convs whose channel counts are not block multiples run as NCHWc, padded (see layout.py).
* Inputs with ``C % 4 != 0`` that must be reordered get the channel ``Pad`` described in
  layout.py.
* HardSwish on a blocked tensor, and Add / Sub / Mul / Div of a blocked tensor and a scalar
  constant, stay blocked (elementwise, so the layout does not matter; the padded channels hold
  values no consumer reads). ORT reorders to NCHW for these: the ``x * Clip(x + 3, 0, 6) / 6``
  HardSwish that Paddle exports cost a ReorderOutput and a ReorderInput per conv.

Reorders: one ``ReorderInput`` (node ``<tensor>.reorder_in``, output ``<tensor>.nchwc``) per NCHW
tensor read blocked, one ``ReorderOutput`` (node ``<tensor>.reorder_out``, output ``<tensor>``,
the original name) per blocked tensor read as NCHW or listed as graph output, each shared by all
consumers.  ORT does not remove ReorderOutput->ReorderInput pairs written into a model, so none
are ever written.  Converted nodes keep their original names; blocked tensors are named
``<original tensor>.nchwc``.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kselect.core.models.model import subgraph_inputs
from kselect.plugins.mlas.layout import (
    NCHW,
    NCHWC,
    conv_nchwc_unsupported,
    conv_takes_blocked_input,
    norm_layout,
    pack_conv,
    round_up,
)
from kselect.plugins.mlas.ort_session import NCHWC_DOMAIN, UNARY_ACTIVATIONS

_POOLS = ("MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool")
_FLT_MAX = float(np.finfo(np.float32).max)


@dataclass
class _ConvState:
    node: onnx.NodeProto
    has_activation: bool = False
    has_sum: bool = False


@dataclass
class _Blocked:
    name: str  # name of the blocked (4-D, channel padded) tensor
    channels: int  # logical channel count
    conv: Optional[_ConvState] = None  # set when the tensor is the output of an NCHWc conv


@dataclass
class RewriteInfo:
    """What ``rewrite_model`` did (filled into the ``info`` dict passed to it)."""

    nchwc_convs: list[str] = field(default_factory=list)
    fallback: dict[str, str] = field(default_factory=dict)  # conv asked NCHWc -> reason kept NCHW
    fused: dict[str, list[str]] = field(default_factory=dict)  # conv -> fused node names
    blocked_ops: list[str] = field(default_factory=list)  # non-conv nodes run blocked
    reorder_inputs: list[str] = field(default_factory=list)  # tensors reordered NCHW -> NCHWc
    reorder_outputs: list[str] = field(default_factory=list)  # tensors reordered NCHWc -> NCHW
    channel_pads: list[str] = field(default_factory=list)  # tensors padded to C % 4 == 0 first
    beyond_ort: list[str] = field(default_factory=list)  # nodes blocked where ORT's transformer reorders


def _attr(node: onnx.NodeProto, name: str, default: Any = None) -> Any:
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


class _Rewriter:
    def __init__(self, model: onnx.ModelProto, layouts: Mapping[str, str], block: int, strict: bool,
                 block_inputs: bool = False):
        if block <= 1:
            raise ValueError(f"block size {block}: this platform has no NCHWc kernels")
        self.block = int(block)
        self.strict = strict
        self.block_inputs = block_inputs
        self.model = onnx.ModelProto()
        self.model.CopyFrom(model)
        self.graph = self.model.graph
        self.layouts = {k: norm_layout(v) for k, v in layouts.items()}
        self.info = RewriteInfo()
        self.opset = 1
        for op in self.model.opset_import:
            if op.domain in ("", "ai.onnx"):
                self.opset = op.version

        self.shapes: dict[str, list[Any]] = {}
        try:
            inferred = onnx.shape_inference.infer_shapes(self.model)
            vis = list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output)
        except Exception:
            vis = list(self.graph.value_info) + list(self.graph.input) + list(self.graph.output)
        for vi in vis:
            tt = vi.type.tensor_type
            if tt.HasField("shape"):
                dims = []
                for d in tt.shape.dim:
                    if d.HasField("dim_value"):
                        dims.append(int(d.dim_value))
                    elif d.HasField("dim_param"):
                        dims.append(d.dim_param)
                    else:
                        dims.append(None)
                self.shapes[vi.name] = dims

        self.consts: dict[str, np.ndarray] = {t.name: numpy_helper.to_array(t) for t in self.graph.initializer}
        for n in self.graph.node:
            if n.op_type == "Constant" and n.domain in ("", "ai.onnx"):
                v = _attr(n, "value")
                if isinstance(v, TensorProto):
                    self.consts[n.output[0]] = numpy_helper.to_array(v)

        self.graph_outputs = {o.name for o in self.graph.output}
        self.uses: dict[str, int] = {}
        for n in self.graph.node:
            for i in list(n.input) + sorted(subgraph_inputs(n)):
                if i:
                    self.uses[i] = self.uses.get(i, 0) + 1
        for o in self.graph_outputs:
            self.uses[o] = self.uses.get(o, 0) + 1

        self.taken: set[str] = set()
        for n in self.graph.node:
            self.taken.update(n.input)
            self.taken.update(n.output)
            if n.name:
                self.taken.add(n.name)
        self.taken.update(t.name for t in self.graph.initializer)
        self.taken.update(i.name for i in self.graph.input)

        self.blk: dict[str, _Blocked] = {}
        self.nchw_ready: set[str] = set()  # blocked tensors whose NCHW form was materialised
        self.reordered_in: dict[str, str] = {}  # NCHW tensor -> its ReorderInput output
        self.out_nodes: list[onnx.NodeProto] = []
        self.new_inits: list[TensorProto] = []
        self.packed_cache: dict[tuple, tuple[str, Optional[str], int]] = {}
        self.maybe_unused: set[str] = set()

    # ---- naming -----------------------------------------------------------------------------
    def fresh(self, base: str) -> str:
        name, k = base, 1
        while name in self.taken:
            name = f"{base}_{k}"
            k += 1
        self.taken.add(name)
        return name

    def add_init(self, base: str, array: np.ndarray) -> str:
        name = self.fresh(base)
        self.new_inits.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    # ---- layout access ----------------------------------------------------------------------
    def nchw(self, tensor: str) -> str:
        """Name of ``tensor`` in NCHW layout, inserting a shared ReorderOutput if needed."""
        b = self.blk.get(tensor)
        if b is None or tensor in self.nchw_ready:
            return tensor
        node = helper.make_node("ReorderOutput", [b.name], [tensor], name=self.fresh(f"{tensor}.reorder_out"),
                                domain=NCHWC_DOMAIN, channels=int(b.channels))
        self.out_nodes.append(node)
        self.nchw_ready.add(tensor)
        self.info.reorder_outputs.append(tensor)
        return tensor

    def blocked(self, tensor: str, channels: int) -> str:
        """Name of ``tensor`` in NCHWc layout, inserting a shared (Pad+)ReorderInput if needed."""
        b = self.blk.get(tensor)
        if b is not None:
            return b.name
        if tensor in self.reordered_in:
            return self.reordered_in[tensor]
        src = tensor
        if channels % 4:
            src = self._pad_channels(tensor, channels)
        out = self.fresh(f"{tensor}.nchwc")
        self.out_nodes.append(helper.make_node("ReorderInput", [src], [out], name=self.fresh(f"{tensor}.reorder_in"),
                                               domain=NCHWC_DOMAIN))
        self.reordered_in[tensor] = out
        self.info.reorder_inputs.append(tensor)
        return out

    def _pad_channels(self, tensor: str, channels: int) -> str:
        extra = round_up(channels, 4) - channels
        pads = [0, 0, 0, 0, 0, extra, 0, 0]
        out = self.fresh(f"{tensor}.pad_c")
        name = self.fresh(f"{tensor}.pad_c")
        if self.opset >= 11:
            pads_name = self.add_init(f"{tensor}.pad_c_pads", np.array(pads, np.int64))
            node = helper.make_node("Pad", [tensor, pads_name], [out], name=name, mode="constant")
        else:
            node = helper.make_node("Pad", [tensor], [out], name=name, mode="constant", pads=pads, value=0.0)
        self.out_nodes.append(node)
        self.info.channel_pads.append(tensor)
        return out

    def single_use(self, tensor: str) -> bool:
        return self.uses.get(tensor, 0) == 1 and tensor not in self.graph_outputs

    def same_shape(self, names: Sequence[str]) -> bool:
        shapes = [self.shapes.get(n) for n in names]
        if any(s is None or len(s) != 4 or any(d is None for d in s) for s in shapes):
            return False
        return all(s == shapes[0] for s in shapes[1:])

    # ---- node handlers ----------------------------------------------------------------------
    def passthrough(self, node: onnx.NodeProto) -> None:
        for name in sorted(subgraph_inputs(node)):
            self.nchw(name)
        new = onnx.NodeProto()
        new.CopyFrom(node)
        del new.input[:]
        new.input.extend(self.nchw(i) if i else i for i in node.input)
        self.out_nodes.append(new)

    def emit_blocked(self, node: onnx.NodeProto, inputs: Sequence[str], channels: int,
                     domain: Optional[str] = None) -> None:
        out = self.fresh(f"{node.output[0]}.nchwc")
        new = onnx.NodeProto()
        new.CopyFrom(node)
        del new.input[:]
        new.input.extend(inputs)
        del new.output[:]
        new.output.append(out)
        if domain is not None:
            new.domain = domain
        self.out_nodes.append(new)
        self.blk[node.output[0]] = _Blocked(out, channels)
        self.info.blocked_ops.append(node.name or node.output[0])

    def conv(self, node: onnx.NodeProto) -> None:
        name = node.name
        if self.layouts.get(name, NCHW) != NCHWC:
            return self.passthrough(node)
        reason = self.conv_reason(node)
        if reason is not None:
            if self.strict:
                raise ValueError(f"Conv {name!r} cannot run as NCHWc: {reason}")
            self.info.fallback[name] = reason
            return self.passthrough(node)

        x, w_name = node.input[0], node.input[1]
        b_name = node.input[2] if len(node.input) > 2 and node.input[2] else None
        w = self.consts[w_name].astype(np.float32)
        b = self.consts[b_name].astype(np.float32) if b_name else None
        group = int(_attr(node, "group", 1))
        cout, cin_g = w.shape[0], w.shape[1]
        cin = cin_g * group

        xb = self.blk.get(x)
        if xb is not None:
            if xb.channels != cin:
                raise ValueError(f"Conv {name!r}: input has {xb.channels} channels, weights expect {cin}")
            x_in, blocked_input = xb.name, True
        elif conv_takes_blocked_input(cin, group, self.block):
            x_in, blocked_input = self.blocked(x, cin), True
        else:
            x_in, blocked_input = self.nchw(x), False
        cin_phys = round_up(cin, self.block) if blocked_input else cin

        key = (w_name, b_name, group, blocked_input, cin_phys)
        if key not in self.packed_cache:
            packed = pack_conv(w, b, group, self.block, blocked_input, cin_phys)
            new_w = self.add_init(f"{w_name}.nchwc", packed.weight)
            if packed.bias is None:
                new_b = None
            elif packed.bias_padded:
                new_b = self.add_init(f"{b_name}.nchwc", packed.bias)
            else:
                new_b = b_name
            self.packed_cache[key] = (new_w, new_b, packed.group)
            self.maybe_unused.add(w_name)
            if b_name:
                self.maybe_unused.add(b_name)
        new_w, new_b, new_group = self.packed_cache[key]

        out = self.fresh(f"{node.output[0]}.nchwc")
        inputs = [x_in, new_w] + ([new_b] if new_b else [])
        new = helper.make_node("Conv", inputs, [out], name=name, domain=NCHWC_DOMAIN)
        for a in node.attribute:
            if a.name != "group":
                new.attribute.append(a)
        if new_group != 1:
            new.attribute.append(helper.make_attribute("group", int(new_group)))
        self.out_nodes.append(new)
        # A FusedConv (ORT_ENABLE_EXTENDED output) brings its activation attributes along.
        state = _ConvState(new, has_activation=_attr(node, "activation") is not None)
        self.blk[node.output[0]] = _Blocked(out, int(cout), state)
        self.info.nchwc_convs.append(name)

    def conv_reason(self, node: onnx.NodeProto) -> Optional[str]:
        if len(node.input) < 2 or len(node.output) != 1:
            return "unexpected Conv signature"
        if len(node.input) > 3 and any(node.input[3:]):
            return "FusedConv with a Z (sum) input"
        w = self.consts.get(node.input[1])
        if w is None:
            return "weights are not a constant initializer"
        if w.dtype != np.float32:
            return f"weights are {w.dtype}, not float32"
        if w.ndim != 4:
            return f"weights are {w.ndim}-D (only 2-D convs)"
        if len(node.input) > 2 and node.input[2]:
            b = self.consts.get(node.input[2])
            if b is None or b.dtype != np.float32 or b.shape != (w.shape[0],):
                return "bias is not a constant float32 vector of the output channels"
        x_shape = self.shapes.get(node.input[0])
        if x_shape is not None and len(x_shape) != 4:
            return f"input rank {len(x_shape)}"
        return conv_nchwc_unsupported(w.shape, int(_attr(node, "group", 1)), self.block)

    def activation_params(self, node: onnx.NodeProto) -> Optional[list[float]]:
        """MLAS activation_params for a fusable activation node, None if it cannot be fused."""
        op = node.op_type
        if op in ("Relu", "Sigmoid", "Tanh"):
            return []
        if op == "LeakyRelu":
            return [float(_attr(node, "alpha", 0.01))]
        if op == "HardSigmoid":
            return [float(_attr(node, "alpha", 0.2)), float(_attr(node, "beta", 0.5))]
        if op == "Clip":
            if self.opset < 11:
                return [float(_attr(node, "min", -_FLT_MAX)), float(_attr(node, "max", _FLT_MAX))]
            bounds = []
            for idx, default in ((1, -_FLT_MAX), (2, _FLT_MAX)):
                if len(node.input) > idx and node.input[idx]:
                    v = self.consts.get(node.input[idx])
                    if v is None or v.size != 1:
                        return None
                    bounds.append(float(v.reshape(())))
                else:
                    bounds.append(default)
            return bounds
        return None

    def activation(self, node: onnx.NodeProto) -> None:
        x = node.input[0]
        xb = self.blk.get(x)
        if xb is None:
            return self.passthrough(node)
        params = self.activation_params(node)
        state = xb.conv
        if (params is not None and state is not None and not state.has_activation and self.single_use(x)):
            # Fuse: the conv now produces this node's output.
            conv = state.node
            conv.attribute.append(helper.make_attribute("activation", node.op_type))
            if params:
                conv.attribute.append(helper.make_attribute("activation_params", [float(p) for p in params]))
            out = self.fresh(f"{node.output[0]}.nchwc")
            conv.output[0] = out
            state.has_activation = True
            self.maybe_unused.update(i for i in node.input[1:] if i)
            self.blk[node.output[0]] = _Blocked(out, xb.channels, state)
            self.info.fused.setdefault(conv.name, []).append(node.name or node.output[0])
            return
        inputs = [xb.name] + [self.nchw(i) if i else i for i in node.input[1:]]
        if node.op_type not in UNARY_ACTIVATIONS:
            self.info.beyond_ort.append(node.name or node.output[0])
        self.emit_blocked(node, inputs, xb.channels)

    def binary(self, node: onnx.NodeProto) -> None:
        ins = list(node.input)
        blks = [self.blk.get(i) for i in ins]
        scalars = [b is None and self.consts.get(i) is not None and self.consts[i].size == 1 for b, i in zip(blks, ins)]
        if len(ins) == 2 and sum(b is not None for b in blks) == 1 and any(scalars):
            # a blocked tensor and a scalar constant: elementwise whatever the layout
            blocked = next(b for b in blks if b is not None)
            self.info.beyond_ort.append(node.name or node.output[0])
            return self.emit_blocked(node, [b.name if b is not None else i for b, i in zip(blks, ins)], blocked.channels)
        if node.op_type in ("Sub", "Div"):
            return self.passthrough(node)
        if (len(ins) < 2 or any(b is None for b in blks) or len({b.channels for b in blks}) != 1
                or not self.same_shape(ins)):
            return self.passthrough(node)
        if node.op_type in ("Add", "Sum") and len(ins) == 2:
            for k in (0, 1):
                state = blks[k].conv
                other = blks[1 - k]
                if (state is not None and not state.has_activation and not state.has_sum
                        and self.single_use(ins[k]) and ins[0] != ins[1]):
                    conv = state.node
                    if len(conv.input) == 2:
                        conv.input.append("")
                    conv.input.append(other.name)
                    out = self.fresh(f"{node.output[0]}.nchwc")
                    conv.output[0] = out
                    state.has_sum = True
                    self.blk[node.output[0]] = _Blocked(out, blks[k].channels, state)
                    self.info.fused.setdefault(conv.name, []).append(node.name or node.output[0])
                    return
        self.emit_blocked(node, [b.name for b in blks], blks[0].channels)

    def concat(self, node: onnx.NodeProto) -> None:
        axis = int(_attr(node, "axis", 1))
        blks = [self.blk.get(i) for i in node.input]
        if (axis not in (1, -3) or not blks or any(b is None for b in blks)
                or any(b.channels % self.block for b in blks)):
            return self.passthrough(node)
        new_inputs = [b.name for b in blks]
        self.emit_blocked(node, new_inputs, sum(b.channels for b in blks))
        self.out_nodes[-1].ClearField("attribute")
        self.out_nodes[-1].attribute.append(helper.make_attribute("axis", 1))

    def pool(self, node: onnx.NodeProto) -> None:
        x = node.input[0]
        xb = self.blk.get(x)
        if xb is None or (len(node.output) > 1 and any(node.output[1:])):
            return self.passthrough(node)
        if node.op_type in ("MaxPool", "AveragePool"):
            ks = _attr(node, "kernel_shape")
            if ks is None or len(ks) != 2:
                return self.passthrough(node)
            if node.op_type == "MaxPool" and int(_attr(node, "storage_order", 0)) != 0:
                return self.passthrough(node)
        self.emit_blocked(node, [xb.name], xb.channels, domain=NCHWC_DOMAIN)
        del self.out_nodes[-1].output[1:]

    # ---- driver -------------------------------------------------------------------------------
    def run(self) -> onnx.ModelProto:
        if self.block_inputs:
            for name in _inputs_added_or_joined(self.model, self.block):
                channels = int(self.shapes[name][1])
                self.blk[name] = _Blocked(self.blocked(name, channels), channels)
                self.nchw_ready.add(name)  # the graph input itself is the NCHW form
        for node in self.graph.node:
            std = node.domain in ("", "ai.onnx")
            op = node.op_type
            if (std and op == "Conv") or (node.domain == "com.microsoft" and op == "FusedConv"):
                self.conv(node)
            elif std and op in UNARY_ACTIVATIONS + ("HardSwish",):  # HardSwish: blocked, never fused
                self.activation(node)
            elif std and op in ("Add", "Sum", "Mul", "Sub", "Div"):
                self.binary(node)
            elif std and op == "Concat":
                self.concat(node)
            elif std and op in _POOLS:
                self.pool(node)
            else:
                self.passthrough(node)
        for out in self.graph.output:
            self.nchw(out.name)
        for name, want in self.layouts.items():
            if want == NCHWC and name not in self.info.nchwc_convs and name not in self.info.fallback:
                self.info.fallback[name] = "no Conv node of that name"
        return self.finish()

    def finish(self) -> onnx.ModelProto:
        g = self.graph
        available = {i.name for i in g.input} | {t.name for t in g.initializer} | {t.name for t in self.new_inits}
        nodes = _toposort(self.out_nodes, available)
        del g.node[:]
        g.node.extend(nodes)

        referenced: set[str] = set(self.graph_outputs)
        for n in nodes:
            referenced.update(n.input)
            referenced |= subgraph_inputs(n)
        graph_input_names = {i.name for i in g.input}
        keep = [t for t in g.initializer
                if t.name in referenced or t.name not in self.maybe_unused or t.name in graph_input_names]
        del g.initializer[:]
        g.initializer.extend(keep)
        g.initializer.extend(self.new_inits)

        produced = {o for n in nodes for o in n.output} | graph_input_names
        value_info = [vi for vi in g.value_info if vi.name in produced]
        del g.value_info[:]
        g.value_info.extend(value_info)

        if any(n.domain == NCHWC_DOMAIN for n in nodes):
            if not any(op.domain == NCHWC_DOMAIN for op in self.model.opset_import):
                self.model.opset_import.append(helper.make_opsetid(NCHWC_DOMAIN, 1))
        return self.model


def _toposort(nodes: Sequence[onnx.NodeProto], available: Iterable[str]) -> list[onnx.NodeProto]:
    """Stable topological sort (keeps emission order where dependencies allow)."""
    producer: dict[str, int] = {}
    for idx, n in enumerate(nodes):
        for o in n.output:
            if o:
                producer[o] = idx
    deps: list[set[int]] = []
    for idx, n in enumerate(nodes):
        needed = {i for i in n.input if i} | subgraph_inputs(n)
        deps.append({producer[i] for i in needed if i in producer and producer[i] != idx})
    users: dict[int, list[int]] = {}
    for idx, d in enumerate(deps):
        for p in d:
            users.setdefault(p, []).append(idx)
    remaining = [len(d) for d in deps]
    heap = [idx for idx, r in enumerate(remaining) if r == 0]
    heapq.heapify(heap)
    order = []
    while heap:
        idx = heapq.heappop(heap)
        order.append(nodes[idx])
        for u in users.get(idx, []):
            remaining[u] -= 1
            if remaining[u] == 0:
                heapq.heappush(heap, u)
    if len(order) != len(nodes):
        raise RuntimeError("rewritten graph has a cycle")
    return order


def rewrite_model(model: onnx.ModelProto, layouts: Mapping[str, str], block: int, *,
                  info: Optional[dict] = None, strict: bool = False, block_inputs: bool = False) -> onnx.ModelProto:
    """Return a copy of ``model`` where the Convs marked ``"NCHWc"`` in ``layouts`` run as MLAS
    NCHWc convs (``com.microsoft.nchwc`` domain) and the blocked layout is propagated as far as
    it is free; Convs absent from ``layouts`` or marked ``"NCHW"`` stay ordinary Convs.

    Reorders are inserted only where a tensor changes layout, one per tensor and direction.
    A Conv that cannot run as NCHWc (see ``conv_nchwc_unsupported``) stays NCHW and is listed
    with the reason in ``info["fallback"]`` (or raises with ``strict=True``).  If ``info`` is a
    dict it receives the fields of ``RewriteInfo``.  Load the result with ``session_options()``
    (ORT's NchwcTransformer disabled). ``block_inputs``: graph inputs that an Add, Sum, Mul or
    Concat reads are reordered once at the start (see ``anchor_inputs``), for a model cut out of
    a larger one.
    """
    if block <= 1 and "NCHWc" not in layouts.values():
        # no NCHWc kernels here (MLAS has them on x86 only; aarch64 reports block 1) and none asked for
        unchanged = onnx.ModelProto()
        unchanged.CopyFrom(model)
        if info is not None:
            info.update(vars(RewriteInfo()))
        return unchanged
    rw = _Rewriter(model, layouts, block, strict, block_inputs)
    out = rw.run()
    if info is not None:
        info.update(vars(rw.info))
    return out


def _joins(node: onnx.NodeProto) -> bool:
    """An Add, Sum, Mul or Concat: ORT's transformer blocks it only when every input is blocked."""
    return node.op_type in ("Add", "Sum", "Mul", "Concat") and node.domain in ("", "ai.onnx")


def _inputs_added_or_joined(model: onnx.ModelProto, block: int) -> list[str]:
    """4-D graph inputs with a block-multiple channel count that an Add, Sum, Mul or Concat reads."""
    joined = {name for node in model.graph.node if _joins(node) for name in node.input}
    found = []
    for value in model.graph.input:
        dims = value.type.tensor_type.shape.dim
        if (value.name in joined and value.type.tensor_type.elem_type == TensorProto.FLOAT and len(dims) == 4
                and dims[1].HasField("dim_value") and dims[1].dim_value % block == 0):
            found.append(value.name)
    return found


def anchor_inputs(model: onnx.ModelProto, block: int) -> onnx.ModelProto:
    """For ORT's own transformer on a model cut out of a larger one (a segment of a plan across
    libraries): each graph input an Add, Sum, Mul or Concat reads (4-D, channels a block
    multiple) reaches those ops through a 1x1 MaxPool, an exact copy. ORT's transformer blocks an
    Add only when every input comes from an NCHWc node; it reorders a graph input for a Conv or
    a pool but does not record it as blocked (nchwc_transformer.cc, TransformBinary). So a
    residual branch passed in as a graph input kept its Add, the Relu after it and the reorders
    around them in NCHW down to the next downsampling conv: resnet50 cut before layer1.1 ran
    1.9 ms slower than whole, 1.8 ms of it those ops. Through the pool ORT reorders the input
    once and fuses the Add into the conv, as in the whole model."""
    if block <= 1:  # no NCHWc kernels here
        return model
    anchored = onnx.ModelProto()
    anchored.CopyFrom(model)
    graph = anchored.graph
    taken = {name for node in graph.node for name in (*node.input, *node.output)} | {i.name for i in graph.input}
    pools = []
    for name in _inputs_added_or_joined(model, block):
        copy = f"{name}.blocked"
        while copy in taken:
            copy += "_"
        taken.add(copy)
        pools.append(helper.make_node("MaxPool", [name], [copy], name=copy, kernel_shape=[1, 1]))
        for node in graph.node:
            if _joins(node):
                node.input[:] = [copy if i == name else i for i in node.input]
    nodes = pools + list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes)
    return anchored


__all__ = [
    "RewriteInfo",
    "anchor_inputs",
    "rewrite_model",
]
