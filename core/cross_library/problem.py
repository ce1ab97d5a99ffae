"""The cross-library planning problem of a model: per tuned node, one option per (library,
layout label) from that library's records, within the plan-level settings of that library's own
plan, and the data edges between them.

An untuned op runs where the producer of its first input runs (core/plans/runtime.py; ACL's engine keeps
the first input's layout the same way), so a tensor carries the label of one tuned node or model
input, its *label source*. Edges join each tuned node's data input, each further input of an
untuned op (an Add or Concat converts it to its first input's label) and each model output to
that label source.

Two costs are not between neighbours, since an untuned op passes its input's label on: a tensor
that waits across another library's segment (a residual branch around an op moved to another
library) leaves its runner and enters it again, and a tensor sent through an untuned op its
library's runner lacks goes out to ONNX Runtime and back (a fallback segment, core/plans/runtime.py).
Both are charged on the labelling as a whole (``CrossProblem.reentries``). An int8 tensor's
quantize or dequantize is done once however many ops read the tensor
(``CrossProblem.conversions_us``): the solver gets a producer's edges as one cost over it and its
readers (core/cross_library/planner.SharedEdges) where an int8 label could make them share one.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

from kselect.core.contract import plugins
from kselect.core.contract.labels import boundary_label, is_int8_label, library_of
from kselect.core.contract.space import config_key
from kselect.core.cross_library.conversions import (
    GRAPH_LABEL,
    ConversionTable,
    crossing_libraries,
    side_label,
    sides_needed,
)
from kselect.core.cross_library.planner import Edge, Option, PlanGraph, SharedEdges
from kselect.core.models.model import Model
from kselect.core.models.tasks import Task
from kselect.core.plans.plan import pick_record
from kselect.core.plans.runtime import fallback_library, plan_segments
from kselect.core.plans.spinning import spin_dims

# A producer read by more ops than this keeps its edges' costs apart (each tensor's quantize charged
# per edge): its shared cost would be a factor over labels^(readers + 1) labellings.
MAX_SHARED_NODES = 6


def _without(settings: dict, names) -> dict:
    return {k: v for k, v in settings.items() if k not in names}


@dataclass
class Choice:  # an option's payload
    library: str
    task: Task
    record: object  # core.records.store.Record
    emulated: bool
    default_us: float | None = None  # the library's own config for this task
    samples: int | None = None  # configs measured for this task on this library


class DataEdge(NamedTuple):
    """``tensor`` goes from ``producer``'s label to ``consumer``'s, converted at node ``at``: the
    consumer itself, or an untuned op that takes it into the label of its first input."""
    producer: str
    consumer: str
    tensor: str
    shape: tuple
    at: str | None = None  # None: at the consumer
    flattened: tuple | None = None  # a Flatten on the way took a 4-D tensor of this shape (H x W > 1)


@dataclass
class CrossProblem:
    options: dict[str, list[Option]] = field(default_factory=dict)
    edges: list[DataEdge] = field(default_factory=list)
    # label -> the label a Flatten in that library reads its 4-D input in (Library.flatten_label)
    flatten_reads: dict[str, str] = field(default_factory=dict)
    # (tuned node, label) -> the label the node reads its data input in, where that differs
    # (Library.input_label: MLAS's first conv writes NCHWc but reads NCHW)
    input_reads: dict[tuple[str, str], str] = field(default_factory=dict)
    crossing: frozenset = frozenset()  # libraries with a boundary cost (Library.boundary_cost)
    # for the segments a labelling cuts the model into (reentries): the model, and
    # runs_op(library, op type) as core/plans/runtime.py asks it
    model: Model | None = None
    runs_op: Callable[[str, str], bool] | None = None
    # the untuned nodes each edge's tensor passes (``untuned_paths``), and per library the op
    # types its int8 plans run on 8-bit tensors (Library.int8_passes)
    via: dict = field(default_factory=dict)
    int8_passes: dict[str, frozenset] = field(default_factory=dict)
    requantized_labels: dict[str, str] = field(default_factory=dict)  # library -> Library.requantized_label()

    def read_label(self, edge: DataEdge, a: str, b: str) -> str:
        """The label the consumer of ``edge`` (labelled ``b``) takes a tensor produced in ``a`` in:
        one that reads its input in another label than it writes (``input_reads``) takes it in
        that one, unless the tensor already comes in the consumer's own label."""
        if edge.at is None and a != b:
            return self.input_reads.get((edge.consumer, b), b)
        return b

    def steps(self, edge: DataEdge, a: str, b: str) -> list[tuple[str, str, tuple]]:
        """The label changes a tensor makes along ``edge`` when its ends have labels ``a`` and
        ``b``: a Flatten on the way runs in the producer's library, which first brings its 4-D
        input into the layout it flattens (ACL, ONNX Runtime: NCHW; XNNPack folds it into the FC)."""
        b = self.read_label(edge, a, b)
        if edge.flattened is None:
            return [(a, b, edge.shape)]
        return [(a, self.flatten_reads.get(a, a), edge.flattened), (a, b, edge.shape)]

    def requantized(self, edge: DataEdge, a: str, b: str) -> list | None:
        """``requantized_sides`` of an edge between two int8 ops of one library."""
        if a != b or a != f"{library_of(a)}:int8":
            return None
        library = library_of(a)
        return requantized_sides(self.requantized_labels.get(library, a), edge, self.via.get(edge, ()),
                                 self.int8_passes.get(library, frozenset()))

    def charges(self, table: ConversionTable, edge: DataEdge, a: str, b: str) -> tuple[list[tuple], float]:
        """The conversions ``edge`` pays with its ends labelled ``a`` and ``b``, each as (what it
        is one conversion of, side), and the library switches it pays. An int8 side is a tensor's
        quantize or dequantize, done once however many ops read that tensor (key: the tensor); a
        layout change is counted per edge."""
        requantize = self.requantized(edge, a, b)
        if requantize is not None:
            return requantize, 0.0
        charges, switch_us = [], 0.0
        for x, y, shape in self.steps(edge, a, b):
            sides = table.sides(x, y, shape)
            charges += [(edge.tensor if is_int8_label(side[0]) else edge, side) for side in sides]
            switch_us += table.switch_cost_us(x, y) if sides else 0.0
        return charges, switch_us

    def cost_us(self, table: ConversionTable, edge: DataEdge, a: str, b: str) -> float:
        """What ``edge`` costs on its own. A tensor several ops read is charged its quantize or
        dequantize on each of their edges here; ``conversions_us`` and ``shared_cost`` count it
        once."""
        charges, switch_us = self.charges(table, edge, a, b)
        return sum(table.side_us(*side) for _, side in charges) + switch_us

    def conversions_us(self, table: ConversionTable, labels: dict[str, str], edges: list[DataEdge] | None = None,
                       charges: Callable | None = None) -> float:
        """What a labelling (node -> label) pays between neighbours on ``edges`` (default: all),
        each tensor's quantize and dequantize counted once; ``charges``: (edge, a, b) -> what
        ``self.charges`` gives, e.g. a cache of it."""
        charges = charges or (lambda edge, a, b: self.charges(table, edge, a, b))
        charged, switches_us = set(), 0.0
        for edge in self.edges if edges is None else edges:
            edge_charges, switch_us = charges(edge, labels[edge.producer], labels[edge.consumer])
            charged.update(edge_charges)
            switches_us += switch_us
        return sum(table.side_us(*side) for _, side in charged) + switches_us

    def sides(self) -> set:
        """The conversions any labelling could need, reentries (of an edge's tensor) included."""
        needed = set()
        mixing = len(self.libraries()) > 1
        for edge in self.edges:
            for a in {o.label for o in self.options[edge.producer]}:
                for b in {o.label for o in self.options[edge.consumer]}:
                    needed.update(side for _, side in self.requantized(edge, a, b) or [])
                    for x, y, shape in self.steps(edge, a, b):
                        needed.update(sides_needed(x, y, shape, self.crossing))
                if mixing and library_of(a) != library_of(GRAPH_LABEL):
                    needed.update(self._reentry_sides(a, edge.shape, "out") + self._reentry_sides(a, edge.shape, "in"))
        return needed

    def libraries(self) -> set[str]:
        return {o.payload.library for options in self.options.values() for o in options if o.payload is not None}

    def _reentry_sides(self, label: str, shape: tuple, direction: str) -> list:
        library = library_of(label)
        boundary = [(boundary_label(library), direction, shape)] if library in self.crossing else []
        return [(side_label(label, len(shape)), direction, shape)] + boundary

    def reentries(self, table: ConversionTable, labels: dict[str, str], missing: set | None = None) -> list[dict]:
        """Tensors that a labelling (node -> label) sends from one segment of a library to a later
        segment of the same library. core/plans/runtime.py cuts the model wherever the library changes,
        so a residual or concatenated branch that waits across another library's segment leaves
        its runner and enters it again, which no edge between two ops of one library pays.
        Each costs its label's "out" side (unless it leaves for another library anyway, which an
        edge pays) and an "in" side per later segment reading it. Sides not in ``table`` count 0
        and are added to ``missing``."""
        tuned = {node: label for node, label in labels.items() if node in self.options
                 and library_of(label) != library_of(GRAPH_LABEL)}
        chosen = {node: library_of(label) for node, label in tuned.items()}
        fallback = fallback_library()
        fallbacks_paid = fallback in self.libraries()  # its sides can be measured with the rest
        if self.model is None or (len(set(chosen.values())) < 2 and not fallbacks_paid):
            return []
        segments = plan_segments(self.model, chosen, self.runs_op)
        source = label_sources(self.model, set(tuned))
        readers: dict[str, list[int]] = {}
        for index, segment in enumerate(segments):
            for tensor in segment.inputs:
                readers.setdefault(tensor, []).append(index)
        found = []

        def charge(tensor: str, label: str, sides: list, **where) -> None:
            if missing is not None:
                missing.update(side for side in sides if side not in table.times_us)
            found.append({"tensor": tensor, "label": label, **where,
                          "time_us": round(sum(table.times_us.get(side, 0.0) for side in sides), 3)})

        for index, segment in enumerate(segments):
            tuned_here = any(chosen.get(node) == segment.library for node in segment.nodes)
            if fallbacks_paid and segment.library == fallback and not tuned_here:
                self._fallback_crossings(segment, index, segments, readers, source, tuned, labels, charge)
                continue
            for tensor in segment.outputs:
                label = tuned.get(source(tensor))
                if label is None or library_of(label) != segment.library:
                    continue  # a model input, or an op that fell back to another library
                own = [j for j in readers.get(tensor, []) if segments[j].library == segment.library]
                if not own:
                    continue
                leaves_anyway = len(own) < len(readers[tensor])
                shape = tuple(self.model.shapes[tensor])
                sides = ([] if leaves_anyway else self._reentry_sides(label, shape, "out"))
                sides += len(own) * self._reentry_sides(label, shape, "in")
                charge(tensor, label, sides, from_segment=index + 1, to_segments=[j + 1 for j in own])
        return found

    def _fallback_crossings(self, segment, index: int, segments: list, readers: dict, source, tuned: dict,
                            labels: dict, charge) -> None:
        """A segment of untuned ops that ONNX Runtime runs because the library of their label
        source lacks them: each tensor entering it leaves its library's runner (unless an edge to
        another library pays that already) and enters ONNX Runtime; each tensor it sends back
        enters that library's runner again, once per later segment of it reading the tensor."""
        fallback = fallback_library()
        fallback_label = f"{fallback}:NCHW"
        for tensor in segment.inputs:
            label = tuned.get(source(tensor))
            if label is None or library_of(label) == fallback:
                continue
            shape = tuple(self.model.shapes[tensor])
            paid = any(edge.tensor == tensor and library_of(labels.get(edge.consumer, GRAPH_LABEL)) != library_of(label)
                       for edge in self.edges)
            sides = ([] if paid else self._reentry_sides(label, shape, "out"))
            sides += self._reentry_sides(fallback_label, shape, "in")
            origin = next((j + 1 for j, other in enumerate(segments) if tensor in other.outputs), None)
            charge(tensor, label, sides, from_segment=origin, to_segments=[index + 1], fallback=True)
        for tensor in segment.outputs:
            label = tuned.get(source(tensor))
            if label is None or library_of(label) == fallback:
                continue
            back = [j for j in readers.get(tensor, []) if segments[j].library == library_of(label)]
            if back:
                shape = tuple(self.model.shapes[tensor])
                charge(tensor, label, len(back) * self._reentry_sides(label, shape, "in"), from_segment=index + 1,
                       to_segments=[j + 1 for j in back], fallback=True)

    def reentries_us(self, table: ConversionTable, assignment: dict, missing: set | None = None) -> float:
        labels = {node: option.label for node, option in assignment.items()}
        return sum(r["time_us"] for r in self.reentries(table, labels, missing))

    def total_us(self, table: ConversionTable, assignment: dict, missing: set | None = None) -> float:
        """The labelling's time: ops, conversions between neighbours and reentries."""
        labels = {node: option.label for node, option in assignment.items()}
        return (sum(option.time_us for option in assignment.values()) + self.conversions_us(table, labels)
                + self.reentries_us(table, assignment, missing))

    def graph(self, table: ConversionTable, libraries: set[str] | None = None) -> PlanGraph:
        """The planning graph, optionally with only some libraries' options."""
        def allowed(option):
            return libraries is None or option.payload is None or option.payload.library in libraries

        options = {node: [o for o in opts if allowed(o)] for node, opts in self.options.items()}
        by_producer: dict[str, list[DataEdge]] = {}
        for edge in self.edges:
            by_producer.setdefault(edge.producer, []).append(edge)
        edges, shared = [], []
        for producer, group in by_producer.items():
            nodes = tuple(dict.fromkeys([producer, *(edge.consumer for edge in group)]))
            if (len(group) > 1 and len(nodes) <= MAX_SHARED_NODES
                    and any(is_int8_label(option.label) for node in nodes for option in options[node])):
                shared.append(SharedEdges(nodes, self.shared_cost(table, group, nodes)))
            else:
                edges += [Edge(e.producer, e.consumer, lambda a, b, e=e: self.cost_us(table, e, a, b)) for e in group]
        return PlanGraph(options, edges, shared)

    def shared_cost(self, table: ConversionTable, group: list[DataEdge], nodes: tuple[str, ...]) -> Callable:
        """The conversions ``group`` (edges from one producer) pays, given the labels of ``nodes``
        (the producer and its readers), each tensor's quantize and dequantize counted once."""
        charges = functools.cache(lambda edge, a, b: self.charges(table, edge, a, b))
        return lambda labels: self.conversions_us(table, dict(zip(nodes, labels)), group, charges)


def _first_data_input(node, produced, graph_inputs: set) -> str | None:
    """The input whose producer's library runs ``node`` when it is untuned (runtime.assign_libraries):
    the first one some node produces, else the first model input."""
    return next((t for t in node.input if t in produced), None) or next((t for t in node.input if t in graph_inputs), None)


class _BackWalk:
    """Walks a tensor back to the tuned node or model input whose label it carries: through each
    untuned producer, along that producer's first data input."""

    def __init__(self, model: Model, tuned: set[str]):
        self.model = model
        self.producer = {out: node for node in model.proto.graph.node for out in node.output}
        self.graph_inputs = {i.name for i in model.proto.graph.input} - set(model.initializers)
        self.tuned = tuned
        self._sources: dict[str, str | None] = {}

    def first_input(self, node) -> str | None:
        return _first_data_input(node, self.producer, self.graph_inputs)

    def steps(self, tensor: str) -> tuple[list, str | None]:
        """The untuned nodes from ``tensor`` back, each with the input the walk goes on through,
        and the tensor it ends at (None: an untuned node with no data input)."""
        steps = []
        while tensor in self.producer and self.producer[tensor].name not in self.tuned:
            node = self.producer[tensor]
            first = self.first_input(node)
            if not first:
                return steps, None
            steps.append((node, first))
            tensor = first
        return steps, tensor

    def source(self, tensor: str) -> str | None:
        """The tuned node or model input (``input:NAME``) whose label ``tensor`` carries; None for
        constants."""
        if tensor not in self._sources:
            _, end = self.steps(tensor)
            if end in self.graph_inputs:
                self._sources[tensor] = f"input:{end}"
            else:
                self._sources[tensor] = self.producer[end].name if end in self.producer else None
        return self._sources[tensor]

    def flattened(self, tensor: str) -> tuple | None:
        """The 4-D shape a Flatten took on the way from ``tensor``'s source (H x W > 1: where the
        layout decides the element order), else None."""
        for node, first in self.steps(tensor)[0]:
            shape = tuple(self.model.shapes.get(first, ()))
            if node.op_type in ("Flatten", "Reshape") and len(shape) == 4 and shape[2] * shape[3] > 1:
                return shape
        return None


def label_sources(model: Model, tuned: set[str]) -> callable:
    """tensor -> the tuned node or model input (``input:NAME``) whose label it carries; None for
    constants."""
    return _BackWalk(model, tuned).source


def data_edges(model: Model, tuned: set[str]) -> list[DataEdge]:
    walk = _BackWalk(model, tuned)
    source, flattened = walk.source, walk.flattened

    def edge(tensor: str, consumer: str, at: str | None = None) -> DataEdge:
        return DataEdge(source(tensor), consumer, tensor, tuple(model.shapes[tensor]), at, flattened(tensor))

    edges = []
    for node in model.proto.graph.node:
        if node.name in tuned:
            tensor = node.input[0]
            if source(tensor):
                edges.append(edge(tensor, node.name))
            continue
        first = walk.first_input(node)
        target = source(first) if first else None
        for tensor in node.input:
            if tensor and tensor != first and (tensor in walk.producer or tensor in walk.graph_inputs):
                if target and source(tensor) and source(tensor) != target:
                    edges.append(edge(tensor, target, node.name))
    for output in model.proto.graph.output:
        if source(output.name):
            edges.append(edge(output.name, f"output:{output.name}"))
    return edges


def untuned_paths(model: Model, tuned: set[str], edges: list[DataEdge]) -> dict[DataEdge, tuple]:
    """Per edge, the untuned nodes its tensor passes on its way from the producer, in order, each
    as (op type, the input it takes there, that input's shape): those between the producer and
    the edge's tensor, then the edge's ``at`` node (the join), if any. The producer's library runs
    them."""
    walk = _BackWalk(model, tuned)
    op_types = {node.name: node.op_type for node in model.proto.graph.node}

    def path(tensor: str) -> tuple:
        steps = walk.steps(tensor)[0]
        return tuple((node.op_type, first, tuple(model.shapes.get(first, ()))) for node, first in reversed(steps))

    return {edge: path(edge.tensor) + (((op_types[edge.at], edge.tensor, edge.shape),) if edge.at in op_types else ())
            for edge in edges}


def requantized_sides(label: str, edge: DataEdge, via: tuple, passes: frozenset) -> list | None:
    """The conversions (labelled ``label``: Library.requantized_label) an 8-bit tensor pays
    between two int8 ops of one library when a node on its way (``via``) is one the library runs
    in float only (not in ``passes``):
    the input of that node dequantized ("out"), and the edge's tensor quantized again ("in") into
    the consumer, unless that node is the edge's join (an Add in float: its output's own edges pay
    the quantize). Each as (the tensor converted, side), since a tensor is converted once however
    many ops read it. None when the tensor stays 8-bit all the way."""
    for index, (op_type, tensor, shape) in enumerate(via):
        if op_type not in passes:
            at_join = edge.at is not None and index == len(via) - 1
            return [(tensor, (label, "out", shape))] + ([] if at_join else [(edge.tensor, (label, "in", edge.shape))])
    return None


def cross_problem(model: Model, libraries: dict, tasks: list[Task], records: dict[str, dict],
                  defaults: dict[str, dict], plan_level: dict[str, dict],
                  reduced_nodes: dict[str, frozenset] | None = None) -> CrossProblem:
    """``records[library][task key]``, ``defaults[library][task key]``, ``plan_level[library]``.
    A twin among ``tasks`` in a reduced precision offers its records on its nodes in
    ``reduced_nodes[precision]`` only: those ops may run in that precision on any library that
    measured them, or in fp32. An int8 twin's records are labelled ``<library>:int8`` (the quantize /
    dequantize labels of core/precision/mixed.py); a half-precision twin's, by their layout, as the
    fp32 ones (its op reads and writes float tensors)."""
    reduced_nodes = reduced_nodes or {}
    problem = CrossProblem(crossing=crossing_libraries(libraries), model=model,
                           runs_op=lambda name, op_type: (libraries.get(name) or plugins.get_library(name)).runs_op(op_type))
    task_of = {node: task for task in tasks if task.precision == "fp32" for node in task.nodes}
    for name, library in libraries.items():
        for task in tasks:
            if task.key not in defaults[name]:
                continue  # a task this library does not support
            int8 = task.precision == "int8"
            if task.precision == "fp32":
                nodes = task.nodes
            else:
                nodes = [node for node in task.nodes if node in reduced_nodes.get(task.precision, ())]
            if not nodes:
                continue
            measured = records[name].get(task.key, [])
            task_records = [r for r in measured if r.result.status == "ok"]
            default_key = config_key(defaults[name][task.key])
            default_us = next((r.result.median_us for r in task_records if r.config_key == default_key), None)
            by_label: dict[str, list] = {}
            for record in task_records:
                by_label.setdefault(f"{name}:int8" if int8 else library.layout_label(record.config), []).append(record)
            for label, label_records in by_label.items():
                picked = pick_record(label_records, default_key, _without(plan_level[name], spin_dims(name)))
                if picked is None:
                    continue
                reads = label if int8 else library.input_label(task, label)
                for node in nodes:
                    problem.options.setdefault(node, []).append(
                        Option(label, picked.result.median_us,
                               Choice(name, task, picked, picked.emulated, default_us, len(measured))))
                    if reads != label:
                        problem.input_reads[(node, label)] = reads
    for option in (o for options in problem.options.values() for o in options if o.payload is not None):
        problem.flatten_reads[option.label] = libraries[option.payload.library].flatten_label(option.label)
    connect(problem, model, libraries)
    # a node of a task none of the libraries supports runs as an untuned op does
    missing = [n for n, task in task_of.items()
               if n not in problem.options and any(task.key in defaults[name] for name in libraries)]
    if missing:
        raise ValueError(f"no measured option for nodes {', '.join(missing[:5])}")
    return problem


def connect(problem: CrossProblem, model: Model, libraries: dict) -> None:
    """The data edges between ``problem.options``' nodes, the untuned nodes on them, what each
    library keeps 8-bit among those, and an option in the model's own label for each model input
    and output."""
    problem.edges = data_edges(model, set(problem.options))
    problem.via = untuned_paths(model, set(problem.options), problem.edges)
    problem.int8_passes = {name: library.int8_passes for name, library in libraries.items()}
    problem.requantized_labels = {name: library.requantized_label() for name, library in libraries.items()}
    for edge in problem.edges:
        for pseudo in (edge.producer, edge.consumer):
            if pseudo not in problem.options:
                problem.options[pseudo] = [Option(GRAPH_LABEL, 0.0)]
