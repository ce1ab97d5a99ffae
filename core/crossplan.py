"""Plans across libraries: per op, the library and config that minimise the whole model's time,
layout and library changes included.

Every tuned node gets one option per (library, layout label) from that library's records, within
the plan-level settings of that library's own plan. An untuned op runs where the producer of its
first input runs (core/runtime.py; ACL's engine keeps the first input's layout the same way), so a
tensor carries the label of one tuned node or model input, its *label source*. Edges join each
tuned node's data input, each further input of an untuned op (an Add or Concat converts it to its
first input's label) and each model output to that label source. planner.py finds the cheapest
labelling exactly, and what greedy per-op choice and each library alone would have given.

Two costs are not between neighbours, since an untuned op passes its input's label on: a tensor
that waits across another library's segment (a residual branch around an op moved to another
library) leaves its runner and enters it again, and a tensor sent through an untuned op its
library's runner lacks goes out to ONNX Runtime and back (a fallback segment, core/runtime.py).
Both are charged on the labelling as a whole (``CrossProblem.reentries``), and a segment that does
not pay for what it costs goes back to the plan's main library (``_without_unpaid_islands``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple

from kselect.core.conversions import (GRAPH_LABEL, ConversionTable, boundary_label, crossing_libraries, library_of,
                                      side_label, sides_needed)
from kselect.core.model import Model
from kselect.core.plan import PLAN_FORMAT, Plan, pick_record
from kselect.core.planner import Edge, Option, PlanGraph, greedy, improve, solve
from kselect.core.runtime import fallback_library, plan_segments
from kselect.core.space import config_key
from kselect.core.spinning import spin_dims
from kselect.core.switches import measure_sleep_costs, measure_switch_costs
from kselect.core.tasks import Task, extract_tasks
from kselect.core.tune import library_defaults, library_tasks, remeasure as remeasure_configs, stored_outcomes




# A mix must save more than this share of the best library alone. Below it the difference is within
# the spread of isolated timings taken minutes apart, and a mix adds switches whose cost varies more
# than one library's speed (mobilenetv2 on the AVX2 EPYC: one op on XNNPack saved 0.17 us of 4,500
# on paper and cost 3% end to end).
MIX_RESOLUTION = 0.005


def _without(settings: dict, names) -> dict:
    return {k: v for k, v in settings.items() if k not in names}


@dataclass
class Choice:  # an option's payload
    library: str
    task: Task
    record: object  # core.records.Record
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
    # runs_op(library, op type) as core/runtime.py asks it
    model: Model | None = None
    runs_op: Callable[[str, str], bool] | None = None

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

    def cost_us(self, table: ConversionTable, edge: DataEdge, a: str, b: str) -> float:
        return sum(table.cost_us(x, y, shape) for x, y, shape in self.steps(edge, a, b))

    def sides(self) -> set:
        """The conversions any labelling could need, reentries (of an edge's tensor) included."""
        needed = set()
        mixing = len(self.libraries()) > 1
        for edge in self.edges:
            for a in {o.label for o in self.options[edge.producer]}:
                for b in {o.label for o in self.options[edge.consumer]}:
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
        segment of the same library. core/runtime.py cuts the model wherever the library changes,
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
        source = _label_sources(self.model, set(tuned))
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

    def total_us(self, graph: PlanGraph, table: ConversionTable, assignment: dict, missing: set | None = None) -> float:
        """The labelling's time: ops, conversions between neighbours and reentries."""
        return graph.total_us(assignment) + self.reentries_us(table, assignment, missing)

    def graph(self, table: ConversionTable, libraries: set[str] | None = None) -> PlanGraph:
        """The planning graph, optionally with only some libraries' options."""
        def allowed(option):
            return libraries is None or option.payload is None or option.payload.library in libraries

        options = {node: [o for o in opts if allowed(o)] for node, opts in self.options.items()}
        edges = [Edge(e.producer, e.consumer, lambda a, b, e=e: self.cost_us(table, e, a, b)) for e in self.edges]
        return PlanGraph(options, edges)


def _first_data_input(node, produced, graph_inputs: set) -> str | None:
    """The input whose producer's library runs ``node`` when it is untuned (runtime.assign_libraries):
    the first one some node produces, else the first model input."""
    return next((t for t in node.input if t in produced), None) or next((t for t in node.input if t in graph_inputs), None)


def _label_sources(model: Model, tuned: set[str]) -> callable:
    """tensor -> the tuned node or model input (``input:NAME``) whose label it carries; None for
    constants."""
    producer = {out: node for node in model.proto.graph.node for out in node.output}
    graph_inputs = {i.name for i in model.proto.graph.input} - set(model.initializers)
    memo: dict[str, str | None] = {}

    def source(tensor: str) -> str | None:
        if tensor not in memo:
            if tensor in graph_inputs:
                memo[tensor] = f"input:{tensor}"
            elif tensor not in producer:
                memo[tensor] = None
            elif producer[tensor].name in tuned:
                memo[tensor] = producer[tensor].name
            else:
                first = _first_data_input(producer[tensor], producer, graph_inputs)
                memo[tensor] = source(first) if first else None
        return memo[tensor]
    return source


def _flattened(model: Model, tuned: set[str]) -> callable:
    """tensor -> the 4-D shape a Flatten took on its way from its label's source (H x W > 1:
    where the layout decides the element order), else None."""
    producer = {out: node for node in model.proto.graph.node for out in node.output}
    produced = set(producer)
    graph_inputs = {i.name for i in model.proto.graph.input} - set(model.initializers)

    def flattened(tensor: str) -> tuple | None:
        while tensor in producer and producer[tensor].name not in tuned:
            node = producer[tensor]
            first = _first_data_input(node, produced, graph_inputs)
            shape = tuple(model.shapes.get(first, ())) if first else ()
            if node.op_type in ("Flatten", "Reshape") and len(shape) == 4 and shape[2] * shape[3] > 1:
                return shape
            if not first:
                return None
            tensor = first
        return None
    return flattened


def _data_edges(model: Model, tuned: set[str]) -> list[DataEdge]:
    source = _label_sources(model, tuned)
    flattened = _flattened(model, tuned)
    produced = {out for node in model.proto.graph.node for out in node.output}
    graph_inputs = {i.name for i in model.proto.graph.input} - set(model.initializers)

    def edge(tensor: str, consumer: str, at: str | None = None) -> DataEdge:
        return DataEdge(source(tensor), consumer, tensor, tuple(model.shapes[tensor]), at, flattened(tensor))

    edges = []
    for node in model.proto.graph.node:
        if node.name in tuned:
            tensor = node.input[0]
            if source(tensor):
                edges.append(edge(tensor, node.name))
            continue
        first = _first_data_input(node, produced, graph_inputs)
        target = source(first) if first else None
        for tensor in node.input:
            if tensor and tensor != first and (tensor in produced or tensor in graph_inputs):
                if target and source(tensor) and source(tensor) != target:
                    edges.append(edge(tensor, target, node.name))
    for output in model.proto.graph.output:
        if source(output.name):
            edges.append(edge(output.name, f"output:{output.name}"))
    return edges


def cross_problem(model: Model, libraries: dict, tasks: list[Task], records: dict[str, dict],
                  defaults: dict[str, dict], plan_level: dict[str, dict]) -> CrossProblem:
    """``records[library][task key]``, ``defaults[library][task key]``, ``plan_level[library]``."""
    from kselect.core import plugins

    problem = CrossProblem(crossing=crossing_libraries(libraries), model=model,
                           runs_op=lambda name, op_type: (libraries.get(name) or plugins.get_library(name)).runs_op(op_type))
    task_of = {node: task for task in tasks for node in task.nodes}
    for name, library in libraries.items():
        for task in tasks:
            if task.key not in defaults[name]:
                continue  # a task this library does not support
            measured = records[name].get(task.key, [])
            task_records = [r for r in measured if r.result.status == "ok"]
            default_key = config_key(defaults[name][task.key])
            default_us = next((r.result.median_us for r in task_records if r.config_key == default_key), None)
            by_label: dict[str, list] = {}
            for record in task_records:
                by_label.setdefault(library.layout_label(record.config), []).append(record)
            for label, label_records in by_label.items():
                picked = pick_record(label_records, default_key, _without(plan_level[name], spin_dims(name)))
                if picked is None:
                    continue
                reads = library.input_label(task, label)
                for node in task.nodes:
                    problem.options.setdefault(node, []).append(
                        Option(label, picked.result.median_us,
                               Choice(name, task, picked, picked.emulated, default_us, len(measured))))
                    if reads != label:
                        problem.input_reads[(node, label)] = reads
    problem.edges = _data_edges(model, set(problem.options))
    for option in (o for options in problem.options.values() for o in options if o.payload is not None):
        problem.flatten_reads[option.label] = libraries[option.payload.library].flatten_label(option.label)
    for edge in problem.edges:
        for pseudo in (edge.producer, edge.consumer):
            if pseudo not in problem.options:
                problem.options[pseudo] = [Option(GRAPH_LABEL, 0.0)]
    # a node of a task none of the libraries supports runs as an untuned op does
    missing = [n for n, task in task_of.items()
               if n not in problem.options and any(task.key in defaults[name] for name in libraries)]
    if missing:
        raise ValueError(f"no measured option for nodes {', '.join(missing[:5])}")
    return problem


def _summary(graph: PlanGraph, assignment: dict, reentries_us: float = 0.0, sleeping_us: float = 0.0) -> dict:
    """Ops and conversions, reentries (``CrossProblem.reentries_us``) counted with the conversions,
    and what the ops of libraries that do not spin pay for waking their workers."""
    ops = sum(o.time_us for o in assignment.values())
    conversions = graph.total_us(assignment) + reentries_us - ops
    return {"ops_us": round(ops, 3), "conversions_us": round(conversions, 3), "sleeping_us": round(sleeping_us, 3),
            "total_us": round(ops + conversions + sleeping_us, 3)}


def _sleeping_us(table: ConversionTable, assignment: dict, spinner: str | None) -> float:
    """What the ops of every library but ``spinner`` pay for waking their workers."""
    return sum(table.sleep_us.get(o.payload.library, 0.0) for o in assignment.values()
               if o.payload is not None and o.payload.library != spinner)


def _spinner(table: ConversionTable, assignment: dict, spinners: list[str]) -> str | None:
    """Of the libraries the labelling uses that could spin, the one whose ops would pay the most
    asleep (with no sleep costs measured: the one with the most op time)."""
    used = [name for name in spinners if any(o.payload is not None and o.payload.library == name
                                             for o in assignment.values())]
    if not used:
        return None
    if not table.sleep_us:
        main = _main_library(assignment)
        return main if main in used else used[0]
    return min(used, key=lambda name: _sleeping_us(table, assignment, name))


def _charged(graph: PlanGraph, table: ConversionTable, spinner: str | None) -> tuple[PlanGraph, dict]:
    """The graph with every option of a library other than ``spinner`` charged its sleep cost, and
    a map from each charged option's id back to the option it came from."""
    back, options = {}, {}
    for node, node_options in graph.options.items():
        options[node] = []
        for option in node_options:
            charge = 0.0 if option.payload is None or option.payload.library == spinner else \
                table.sleep_us.get(option.payload.library, 0.0)
            charged = Option(option.label, option.time_us + charge, option.payload)
            back[id(charged)] = option
            options[node].append(charged)
    return PlanGraph(options, graph.edges), back


def _main_library(assignment: dict) -> str | None:
    """The library with the most op time in the labelling."""
    op_time: dict[str, float] = {}
    for option in assignment.values():
        if option.payload is not None:
            op_time[option.payload.library] = op_time.get(option.payload.library, 0.0) + option.time_us
    return max(op_time, key=op_time.get) if op_time else None


def in_place_labelling(problem: CrossProblem, table: ConversionTable, spinners: list[str], starts: list[dict],
                       alone: dict[str, dict], missing: set | None = None) -> tuple[dict, str | None, str, int]:
    """The labelling with the least time in place: ops, conversions, reentries and what the ops of
    the libraries that do not spin pay for waking their workers. Solved once per library of
    ``spinners`` as the one that spins (with no sleep costs measured: once, uncharged), then kept
    only if it beats every library ``alone`` by more than MIX_RESOLUTION. Returns (labelling, its
    spinner, method, segments moved back to the main library)."""
    graph = problem.graph(table)

    def in_place_us(assignment: dict) -> float:
        sleeping = _sleeping_us(table, assignment, _spinner(table, assignment, spinners))
        return problem.total_us(graph, table, assignment, missing) + sleeping

    solved = []
    for spinner in (spinners if table.sleep_us and spinners else [None]):
        charged, back = _charged(graph, table, spinner)
        forth = {id(back[id(option)]): option for options in charged.options.values() for option in options}
        assignment, method = _solve(charged, [{node: forth[id(o)] for node, o in start.items()} for start in starts])
        assignment = {node: back[id(option)] for node, option in assignment.items()}
        assignment, islands_moved = _without_unpaid_islands(problem, in_place_us, assignment, alone)
        solved.append((in_place_us(assignment), assignment, method, islands_moved))
    _, assignment, method, islands_moved = min(solved, key=lambda entry: entry[0])
    best_alone = min(alone.values(), key=in_place_us, default=None)
    if best_alone is not None and in_place_us(assignment) >= (1 - MIX_RESOLUTION) * in_place_us(best_alone):
        assignment = best_alone
    return assignment, _spinner(table, assignment, spinners), method, islands_moved


def _without_unpaid_islands(problem: CrossProblem, total_us: Callable[[dict], float], assignment: dict,
                            alone: dict[str, dict]) -> tuple[dict, int]:
    """The solver is exact for costs between neighbours, but reentries depend on how the whole
    labelling cuts the model. So each segment of another library than the plan's main one is
    tried with its ops as in the main library's plan alone, and left there when that lowers the
    total with reentries, until no segment does. Returns the labelling and the segments moved."""
    main = _main_library(assignment)
    if main not in alone or problem.model is None:
        return assignment, 0
    best, best_us, moved = assignment, total_us(assignment), 0
    while True:
        chosen = {node: option.payload.library for node, option in best.items() if option.payload is not None}
        trials = []
        for segment in plan_segments(problem.model, chosen, problem.runs_op):
            if segment.library != main:
                trial = {**best, **{node: alone[main][node] for node in segment.nodes if node in chosen}}
                trials.append((total_us(trial), trial))
        better = min(trials, key=lambda t: t[0], default=None)
        if better is None or better[0] >= best_us - 1e-6:
            return best, moved
        best_us, best, moved = better[0], better[1], moved + 1


def build_cross_plan(model: Model, device, libraries: dict, problem: CrossProblem, table: ConversionTable,
                     plan_level: dict[str, dict], defaults: dict[str, dict], missing: set | None = None) -> Plan:
    """``missing`` gets the reentry sides the table lacked (counted 0): measure them and build again."""
    missing = set() if missing is None else missing
    graph = problem.graph(table)
    greedy_assignment, _ = greedy(graph)
    alone, alone_assignments = {}, {}
    for name in libraries:
        restricted = problem.graph(table, {name})
        if all(restricted.options.values()):  # the library runs every tuned node
            own = alone_assignments[name] = _solve(restricted)[0]
            alone[name] = _summary(graph, own, problem.reentries_us(table, own, missing))
    spinners = [name for name in libraries if any(dim in plan_level[name] for dim in spin_dims(name))]
    assignment, spinner, method, islands_moved = in_place_labelling(
        problem, table, spinners, [greedy_assignment, *alone_assignments.values()], alone_assignments, missing)
    ceiling = sum(min(o.time_us for o in options) for node, options in graph.options.items())
    ceiling_by_library = {}
    for name in libraries:
        per_node = [[o.time_us for o in options if o.payload is not None and o.payload.library == name]
                    for options in graph.options.values() if any(o.payload is not None for o in options)]
        if all(per_node):
            ceiling_by_library[name] = round(sum(min(times) for times in per_node), 3)

    settings = _library_settings(assignment, plan_level, spinner)
    labels = {node: option.label for node, option in assignment.items()}
    nodes, groups = {}, {}
    for node, option in assignment.items():
        choice: Choice | None = option.payload
        if choice is None:  # a model input or output
            continue
        conversions = []
        for edge in problem.edges:
            if edge.consumer == node and edge.at is None:
                cost = problem.cost_us(table, edge, labels[edge.producer], option.label)
                if cost:
                    conversions.append({"from": edge.producer, "tensor": edge.tensor, "from_label": labels[edge.producer],
                                        "to_label": problem.read_label(edge, labels[edge.producer], option.label),
                                        "time_us": round(cost, 3)})
        config = {**choice.record.config, **{k: v for k, v in settings[choice.library].items() if k in choice.record.config}}
        nodes[node] = {"task": choice.task.id, "library": choice.library, "config": config,
                       "label": option.label, "time_us": round(option.time_us, 3), "emulated": choice.emulated,
                       "conversions": conversions}
        group = (choice.task.key, choice.library, config_key(config))
        groups.setdefault(group, (choice, config, []))[2].append(node)
    output_conversions = [{"from": e.producer, "tensor": e.tensor, "from_label": labels[e.producer], "to_label": GRAPH_LABEL,
                           "time_us": round(problem.cost_us(table, e, labels[e.producer], GRAPH_LABEL), 3)}
                          for e in problem.edges if e.consumer.startswith("output:")]
    untuned_conversions = []
    for e in problem.edges:
        cost = problem.cost_us(table, e, labels[e.producer], labels[e.consumer]) if e.at is not None else 0.0
        if cost:
            untuned_conversions.append({"at": e.at, "from": e.producer, "tensor": e.tensor, "from_label": labels[e.producer],
                                        "to_label": labels[e.consumer], "time_us": round(cost, 3)})

    tasks = []
    for (_, name, _), (choice, config, group_nodes) in groups.items():
        task = choice.task
        tasks.append({"id": task.id, "key": task.key, "kind": task.kind, "input": task.input_shape,
                      "weight": task.weight_shape, "output": task.output_shape, "attrs": task.attrs,
                      "bias": task.has_bias, "nodes": group_nodes, "library": name, "config": config,
                      "time_us": round(choice.record.result.median_us, 3),
                      "default_config": defaults[name][task.key],
                      "default_us": round(choice.default_us, 3) if choice.default_us else None,
                      "samples": choice.samples, "emulated": choice.emulated})
    used = {entry["library"] for entry in nodes.values()}
    versions = {name: libraries[name].version() for name in libraries if name in used}
    reentries = problem.reentries(table, labels)
    chosen = _summary(graph, assignment, sum(r["time_us"] for r in reentries), _sleeping_us(table, assignment, spinner))
    greedy_spinner = _spinner(table, greedy_assignment, spinners)
    extra = {"cross_library": {
        "predicted": chosen, "method": method,
        "greedy": _summary(graph, greedy_assignment, problem.reentries_us(table, greedy_assignment),
                           _sleeping_us(table, greedy_assignment, greedy_spinner)),
        "single_library": alone,
        "reentries": {"tensors": reentries, "us": round(sum(r["time_us"] for r in reentries), 3),
                      "segments_moved": islands_moved},
        "ops_ceiling_us": round(ceiling, 3), "ops_ceiling_by_library_us": ceiling_by_library,
        "output_conversions": output_conversions, "untuned_conversions": untuned_conversions,
        "switch_us": {f"{a}->{b}": round(us, 3) for (a, b), us in sorted(table.switch_us.items())},
        "sleep_us": {name: round(us, 3) for name, us in sorted(table.sleep_us.items())},
        "switches": _switches(problem, table, labels),
        "note": "sums over tuned ops and conversions, measured in isolation; the ops in between are not included"}}
    return Plan(model={"name": model.name, "fingerprint": model.fingerprint(), "inputs": model.input_shapes},
                device=device.to_json(), libraries=versions, emulated=any(libraries[n].emulated for n in used),
                plan_level={} if len(used) > 1 else settings[next(iter(used))], tasks=tasks, nodes=nodes,
                format=PLAN_FORMAT, extra=extra, library_settings={n: settings[n] for n in used})


def _switches(problem: CrossProblem, table: ConversionTable, labels: dict) -> dict:
    """The edges of the labelling that change library between two ops, and their switch cost."""
    changes = [(labels[e.producer], labels[e.consumer]) for e in problem.edges
               if GRAPH_LABEL not in (labels[e.producer], labels[e.consumer])
               and library_of(labels[e.producer]) != library_of(labels[e.consumer])]
    return {"edges": len(changes), "us": round(sum(table.switch_cost_us(a, b) for a, b in changes), 3)}


def _solve(graph: PlanGraph, starts: list | None = None) -> tuple[dict, str]:
    """Exact when the graph allows (planner.solve), else local search from the best start."""
    try:
        return solve(graph)[0], "exact"
    except ValueError:
        starts = starts or [greedy(graph)[0]]
        return improve(graph, min(starts, key=graph.total_us))[0], "local search"


def _library_settings(assignment: dict, plan_level: dict[str, dict], spinner: str | None) -> dict[str, dict]:
    """Each library's plan-level settings; with several libraries, ``spinner`` spins
    (its ``Library.spin_dim``) and the others do not."""
    used = {option.payload.library for option in assignment.values() if option.payload is not None}
    settings = {name: dict(values) for name, values in plan_level.items()}
    if len(used) > 1:
        for name in used:
            settings[name].update({dim: int(name == spinner) for dim in spin_dims(name) if dim in settings[name]})
    return settings


REMEASURE_ROUNDS = 3  # a re-timed pick can lose its place to another stored record; re-time that one too


def plan_across(model: Model, device, db, libraries: dict, single_plans: dict, settings, on_measured=None,
                remeasure: bool = False) -> Plan:
    """The cross-library plan from stored records: each library keeps the plan-level settings of
    its own plan (``single_plans``); conversions not yet stored are measured now. With
    ``remeasure``, every config the planner chooses among (and each library default) and every
    conversion it needs is timed again first, so that the choice and the prediction rest on
    timings from one period, not on records from hours apart. What switching between each pair of
    natively running libraries costs is measured now (core/switches.py) and charged on every edge
    between them."""
    from kselect.core.conversions import measure_conversions

    task_lists, defaults, plan_level = {}, {}, {}
    for name, library in libraries.items():
        task_lists[name] = library_tasks(model, library)
        defaults[name] = library_defaults(task_lists[name], library, device)
        plan_level[name] = dict(single_plans[name].plan_level)
    tasks = extract_tasks(model)

    def current() -> tuple[dict, CrossProblem]:
        records = {name: stored_outcomes(task_lists[name], library, device, db) for name, library in libraries.items()}
        return records, cross_problem(model, libraries, tasks, records, defaults, plan_level)

    records, problem = current()
    remeasured: set = set()
    for _ in range(REMEASURE_ROUNDS if remeasure else 0):
        contenders = _contenders(problem, libraries, defaults, single_plans, task_lists)
        wanted = {key: entry for key, entry in contenders.items() if key not in remeasured}
        if not wanted:
            break
        remeasure_configs(list(wanted.values()), defaults, device, db, settings, on_measured)
        remeasured |= set(wanted)
        records, problem = current()
    table = measure_conversions(problem.sides(), libraries, device, db, settings, on_measured, again=remeasure)
    if len(libraries) > 1:
        native = [name for name, library in libraries.items() if not library.emulated]
        table.switch_us = measure_switch_costs(native)
        table.sleep_us = measure_sleep_costs(native)
    missing: set = set()
    plan = build_cross_plan(model, device, libraries, problem, table, plan_level, defaults, missing)
    if missing:  # reentries of tensors no edge could convert
        table.times_us.update(measure_conversions(missing, libraries, device, db, settings, on_measured).times_us)
        plan = build_cross_plan(model, device, libraries, problem, table, plan_level, defaults)
    summary = plan.extra["cross_library"]
    summary["default_ops_us"] = {name: _default_ops_us(tasks, records[name], defaults[name]) for name in libraries}
    if remeasure:
        summary["remeasured"] = {"configs": len(remeasured), "conversions": len(problem.sides())}
    return plan


def _contenders(problem: CrossProblem, libraries: dict, defaults: dict, single_plans: dict, task_lists: dict) -> dict:
    """(library, task, config) of every option the planner chooses among, of each library's
    default for those tasks and of each library's own plan, keyed by (library, task key, config key)."""
    wanted = {}
    for options in problem.options.values():
        for option in options:
            choice: Choice | None = option.payload
            if choice is None:
                continue
            for config in (choice.record.config, defaults[choice.library][choice.task.key]):
                wanted[(choice.library, choice.task.key, config_key(config))] = (libraries[choice.library], choice.task, config)
    for name, plan in single_plans.items():
        task_of = {task.key: task for task in task_lists[name]}
        for entry in plan.tasks:
            if entry["key"] in task_of:
                wanted[(name, entry["key"], config_key(entry["config"]))] = (libraries[name], task_of[entry["key"]], entry["config"])
    return wanted


def _default_ops_us(tasks: list[Task], records: dict, defaults: dict) -> float | None:
    """The summed time of every tuned op with the library's own configs (None if one is missing)."""
    total = 0.0
    for task in tasks:
        if task.key not in defaults:
            return None
        key = config_key(defaults[task.key])
        record = next((r for r in records.get(task.key, []) if r.config_key == key and r.result.status == "ok"), None)
        if record is None:
            return None
        total += record.result.median_us * len(task.nodes)
    return round(total, 3)


def planned_conversions(plan: Plan) -> list[dict]:
    """The conversions between ops a plan from here counts: into its tuned ops, and where an
    untuned Add or Concat takes an input into its first input's label (model outputs aside)."""
    into_ops = [c for entry in plan.nodes.values() for c in entry.get("conversions", [])]
    return into_ops + plan.extra.get("cross_library", {}).get("untuned_conversions", [])
