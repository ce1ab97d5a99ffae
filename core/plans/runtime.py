"""Running a plan whose nodes use several libraries: ``kselect.load_plan(plan, model)(feeds)``.

A plan names the library of every tuned node. Every other node is given one too: the library of
the node producing its first computed input, if that library runs this op type
(``Library.runs_op``: XNNPack's executor and ACL's engine have fixed op sets), else the baseline
library (``Library.baseline``: MLAS, since ONNX Runtime runs any op). A node fed only by graph
inputs goes with the first tuned node after it.

The graph is then cut into segments, runs of nodes of one library, along a topological order
that, among the nodes ready to run, takes one of the current segment's library first: parallel
branches (inception blocks) then switch libraries only where the plan makes them. Each segment
becomes an ONNX sub-model (its nodes, the weights they use; inputs: graph inputs and tensors of
earlier segments; outputs: tensors later segments or the caller read) run by its library's own
``model_runner`` with the part of the plan covering that segment. A plan whose model is one
segment runs on the original model, exactly as a single-library plan always has.

Segment boundaries are where layouts are converted: every runner takes and returns NCHW arrays.
XNNPack's executor transposes NCHW <-> NHWC at its inputs and outputs, ONNX Runtime reorders
NCHW <-> NCHWc inside its session, ACL's runner exchanges NCHW files. So each tensor crossing a
boundary leaves one library's layout, passes through Python as an NCHW array and enters the next
library's layout: fewer boundaries, fewer conversions.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper

from kselect.core.contract import plugins
from kselect.core.contract.library import Library
from kselect.core.errors import KselectError, UnsupportedOp
from kselect.core.measuring.device import this_device
from kselect.core.models.model import Model, load_model, model_from_proto
from kselect.core.models.tasks import extract_tasks, find_ops
from kselect.core.plans.plan import Plan, load_plan_file, validate_plan


def fallback_library() -> str:
    """The library that runs any node: the baseline library (``Library.baseline``)."""
    return plugins.baseline_library().name


@dataclass
class Segment:
    library: str
    nodes: list[str]
    inputs: list[str]  # graph inputs and tensors of earlier segments it reads
    outputs: list[str]  # tensors it hands to later segments or to the caller


class PlanRunner:
    """``runner(feeds) -> [outputs]`` in graph output order, like ``session.run(None, feeds)``."""

    def __init__(self, plan: Plan | None, model: Model, segments: list[Segment], runners: list[Callable]):
        self.plan = plan  # None: a library's defaults (``library_runner``)
        self.model = model
        self.segments = segments
        self.runners = runners  # one per segment, each ``runner(feeds) -> [outputs]``
        self.output_names = [o.name for o in model.proto.graph.output]
        self.refused: list[str] = []  # nodes their library's runner could not build (run by ONNX Runtime)

    def run(self, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        expected = [i.name for i in self.model.proto.graph.input]
        unknown = sorted(set(inputs) - set(expected))
        if unknown:
            raise KselectError(f"the model has no input {unknown[0]!r} (its inputs: {', '.join(expected)})")
        missing = [name for segment in self.segments for name in segment.inputs
                   if name in expected and name not in inputs and name not in self.model.initializers]
        if missing:
            raise KselectError(f"no value for the model's input {missing[0]!r} (its inputs: {', '.join(expected)})")
        values = dict(inputs)
        for segment, runner in zip(self.segments, self.runners):
            results = runner({name: values[name] for name in segment.inputs})
            values.update(zip(segment.outputs, results))
        return [values[name] for name in self.output_names]

    __call__ = run

    def describe(self) -> list[str]:
        """One line per segment: its library, nodes, and the tensors crossing its boundaries."""
        lines = []
        for index, s in enumerate(self.segments, 1):
            nodes = s.nodes[0] if len(s.nodes) == 1 else f"{len(s.nodes)} nodes, {s.nodes[0]} .. {s.nodes[-1]}"
            lines.append(f"{index}. {s.library}: {nodes}; in: {', '.join(s.inputs)}; out: {', '.join(s.outputs)}")
        return lines

    def close(self) -> None:
        for runner in self.runners:
            if hasattr(runner, "close"):
                runner.close()
        self.runners = []


def load_plan(plan: Plan | str | Path, model: Model | str) -> PlanRunner:
    """``plan``: a Plan or a plan file; ``model``: a Model, or a file or built-in name, loaded with
    the plan's input shapes."""
    if not isinstance(plan, Plan):
        plan = load_plan_file(plan)
    if not isinstance(model, Model):
        shapes = [f"{name}={','.join(map(str, shape))}" for name, shape in plan.model.get("inputs", {}).items()]
        model = load_model(str(model), shapes)
    validate_plan(plan, model, this_device())
    chosen = {node: entry["library"] for node, entry in plan.nodes.items()}
    return _segmented_runner(model, chosen, plan)


def library_runner(library: Library, model: Model, plan: Plan | None = None) -> PlanRunner:
    """The whole model on one library: ``plan``'s configs, or with ``plan`` None the library's
    defaults. Nodes the library's runner cannot run go to ONNX Runtime, in segments of their own
    (one segment, the library's ``model_runner`` on the model as it is, when it runs them all)."""
    if plan is not None:
        return load_plan(plan, model)

    tasks = extract_tasks(model) if find_ops(model) else []
    chosen = {node: library.name for task in tasks if library.supports(task) for node in task.nodes}
    if not chosen:  # nothing tunable: every node the library runs is its
        chosen = {node.name: library.name for node in model.proto.graph.node if library.runs_op(node.op_type)}
    return _segmented_runner(model, chosen, None)


def _segmented_runner(model: Model, chosen: dict[str, str], plan: Plan | None) -> PlanRunner:
    """Segments of ``chosen``'s libraries (tuned node -> library), each run by its library with its
    part of ``plan`` (None: defaults). A node a runner refuses while building (``UnsupportedOp``)
    goes to ONNX Runtime and the model is cut again."""
    libraries: dict[str, Library] = {}

    def library(name: str) -> Library:
        if name not in libraries:
            libraries[name] = plugins.get_library(name)
        return libraries[name]

    refused: set[str] = set()
    while True:
        library_of = assign_libraries(model, chosen, lambda name, op_type: library(name).runs_op(op_type), refused)
        segments = describe_segments(model, cut_segments(model, library_of))
        if len(segments) == 1:  # run on the model itself, which returns its outputs in graph order
            segments[0].outputs = [o.name for o in model.proto.graph.output]
        runners: list[Callable] = []
        try:
            for index, segment in enumerate(segments):
                segment_model = model if len(segments) == 1 else sub_model(model, segment, index)
                own_plan = segment_plan(plan, segment) if plan is not None else None
                runners.append(library(segment.library).model_runner(segment_model, own_plan,
                                                                     in_mixed_plan=len(segments) > 1))
        except UnsupportedOp as exc:
            PlanRunner(plan, model, segments, runners).close()
            if exc.node is None or exc.node in refused or library_of.get(exc.node) == fallback_library():
                raise
            refused.add(exc.node)
            continue
        except BaseException:
            PlanRunner(plan, model, segments, runners).close()
            raise
        runner = PlanRunner(plan, model, segments, runners)
        runner.refused = sorted(refused)
        return runner


def plan_segments(model: Model, chosen: dict[str, str], runs_op: Callable[[str, str], bool]) -> list[Segment]:
    """The segments a plan runs in; ``chosen``: tuned node -> its library, ``runs_op(library, op_type)``."""
    return describe_segments(model, cut_segments(model, assign_libraries(model, chosen, runs_op)))


def assign_libraries(model: Model, chosen: dict[str, str], runs_op: Callable[[str, str], bool],
                     refused: set[str] = frozenset()) -> dict[str, str]:
    """node name -> the library that runs it; ``chosen``: tuned node -> its library; ``refused``:
    nodes their library's runner cannot build as the model has them (ONNX Runtime runs them)."""
    nodes = list(model.proto.graph.node)
    producer = {name: node.name for node in nodes for name in node.output if name}
    fallback = fallback_library()
    library_of: dict[str, str] = {}
    for index, node in enumerate(nodes):  # ONNX lists nodes in topological order
        if node.name in refused:
            library_of[node.name] = fallback
            continue
        if node.name in chosen:
            library_of[node.name] = chosen[node.name]
            continue
        feeding = next((producer[name] for name in node.input if name in producer), None)
        candidate = library_of[feeding] if feeding else _first_tuned_after(index, nodes, chosen)
        library_of[node.name] = candidate if candidate and runs_op(candidate, node.op_type) else fallback
    return library_of


def _first_tuned_after(index: int, nodes: list[onnx.NodeProto], chosen: dict[str, str]) -> str | None:
    """The library of the first tuned node downstream of ``nodes[index]``."""
    reached = set(nodes[index].output)
    for node in nodes[index + 1:]:
        if reached.intersection(node.input):
            if node.name in chosen:
                return chosen[node.name]
            reached.update(node.output)
    return None


def cut_segments(model: Model, library_of: dict[str, str]) -> list[tuple[str, list[onnx.NodeProto]]]:
    """(library, nodes) runs of a topological order that prefers the current library."""
    nodes = list(model.proto.graph.node)
    producer = {name: i for i, node in enumerate(nodes) for name in node.output if name}
    waiting_on = [{producer[name] for name in node.input if name in producer} for node in nodes]
    users: list[list[int]] = [[] for _ in nodes]
    for i, dependencies in enumerate(waiting_on):
        for dependency in dependencies:
            users[dependency].append(i)
    ready = [i for i, dependencies in enumerate(waiting_on) if not dependencies]
    groups: list[tuple[str, list[onnx.NodeProto]]] = []
    while ready:
        current = groups[-1][0] if groups else None
        same = [i for i in ready if library_of[nodes[i].name] == current]
        i = min(same) if same else min(ready)  # the earliest in graph order: deterministic
        ready.remove(i)
        if library_of[nodes[i].name] != current:
            groups.append((library_of[nodes[i].name], []))
        groups[-1][1].append(nodes[i])
        for user in users[i]:
            waiting_on[user].discard(i)
            if not waiting_on[user]:
                ready.append(user)
    return groups


def describe_segments(model: Model, groups: list[tuple[str, list[onnx.NodeProto]]]) -> list[Segment]:
    """Each group's inputs (read, not produced in it, not weights) and outputs (read by another
    group, or graph outputs)."""
    graph_outputs = {o.name for o in model.proto.graph.output}
    read_by: dict[str, set[int]] = {}
    for index, (_, nodes) in enumerate(groups):
        for node in nodes:
            for name in node.input:
                read_by.setdefault(name, set()).add(index)
    segments = []
    for index, (library, nodes) in enumerate(groups):
        produced = [name for node in nodes for name in node.output if name]
        read = dict.fromkeys(name for node in nodes for name in node.input if name)
        inputs = [name for name in read if name not in produced and name not in model.initializers]
        outputs = [name for name in produced if name in graph_outputs or read_by.get(name, set()) - {index}]
        segments.append(Segment(library, [node.name for node in nodes], inputs, outputs))
    return segments


def sub_model(model: Model, segment: Segment, index: int) -> Model:
    """The segment as an ONNX model of its own (same opsets and IR version as the whole)."""
    graph = model.proto.graph
    names = set(segment.nodes)
    nodes = [node for node in graph.node if node.name in names]
    elem_types = {v.name: v.type.tensor_type.elem_type for v in [*graph.input, *graph.value_info, *graph.output]}

    def value_info(name: str) -> onnx.ValueInfoProto:
        if name not in model.shapes:
            raise KselectError(f"the shape of {name!r} is unknown, so it cannot pass from one library to another")
        return helper.make_tensor_value_info(name, elem_types.get(name, TensorProto.FLOAT), model.shapes[name])

    weights = dict.fromkeys(name for node in nodes for name in node.input if name in model.initializers)
    name = f"{model.name}.{index + 1}.{segment.library}"
    sub_graph = helper.make_graph(nodes, name, [value_info(n) for n in segment.inputs],
                                  [value_info(n) for n in segment.outputs], [model.initializers[n] for n in weights])
    proto = helper.make_model(sub_graph, opset_imports=model.proto.opset_import, functions=model.proto.functions,
                              ir_version=model.proto.ir_version)
    return model_from_proto(name, proto)


def segment_plan(plan: Plan, segment: Segment) -> Plan | None:
    """The plan's entries for the segment's nodes, with its library's plan-level settings; None
    (the library's defaults) for a library the plan does not use, which runs only untuned ops.
    Restricted to the segment because MLAS compares the plan's NCHWc convs with ONNX Runtime's
    own choice on the model it is given: a node outside that model would spoil the comparison."""
    if segment.library not in plan.libraries:
        return None
    own = plan.for_library(segment.library)
    return replace(own, nodes={node: entry for node, entry in own.nodes.items() if node in segment.nodes})
