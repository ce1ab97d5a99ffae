"""From a solved labelling to a Plan: per node its library, config, label and the conversions
into it; per (task, library, config) group a plan task; and the evidence the planner used
(predicted totals, greedy and single-library alternatives, reentries, switches).
"""

from __future__ import annotations

from kselect.core.contract.labels import library_of
from kselect.core.contract.space import config_key
from kselect.core.cross_library.conversions import GRAPH_LABEL, ConversionTable
from kselect.core.cross_library.labelling import (
    choose_spinner,
    in_place_labelling,
    labelling_summary,
    library_settings,
    solve_labelling,
    wake_up_us,
)
from kselect.core.cross_library.planner import greedy
from kselect.core.cross_library.problem import Choice, CrossProblem
from kselect.core.models.model import Model
from kselect.core.plans.plan import PLAN_FORMAT, PREDICTED_US, Plan, plan_node, plan_task
from kselect.core.plans.spinning import spin_dims


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
            own = alone_assignments[name] = solve_labelling(restricted)[0]
            alone[name] = labelling_summary(problem, table, own, problem.reentries_us(table, own, missing))
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

    settings = library_settings(assignment, plan_level, spinner)
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
        nodes[node] = plan_node(choice.task, choice.library, config, label=option.label,
                                time_us=round(option.time_us, 3), emulated=choice.emulated, conversions=conversions)
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
        tasks.append(plan_task(task, group_nodes, name, config, choice.record.result.median_us,
                               defaults[name][task.key], choice.default_us, choice.samples, choice.emulated))
    used = {entry["library"] for entry in nodes.values()}
    versions = {name: libraries[name].version() for name in libraries if name in used}
    reentries = problem.reentries(table, labels)
    chosen = labelling_summary(problem, table, assignment, sum(r["time_us"] for r in reentries), wake_up_us(table, assignment, spinner))
    greedy_spinner = choose_spinner(table, greedy_assignment, spinners)
    extra = {"cross_library": {
        "predicted": chosen, "method": method,
        "greedy": labelling_summary(problem, table, greedy_assignment, problem.reentries_us(table, greedy_assignment),
                           wake_up_us(table, greedy_assignment, greedy_spinner)),
        "single_library": alone,
        "reentries": {"tensors": reentries, "us": round(sum(r["time_us"] for r in reentries), 3),
                      "segments_moved": islands_moved},
        "ops_ceiling_us": round(ceiling, 3), "ops_ceiling_by_library_us": ceiling_by_library,
        "output_conversions": output_conversions, "untuned_conversions": untuned_conversions,
        "switch_us": {f"{a}->{b}": round(us, 3) for (a, b), us in sorted(table.switch_us.items())},
        "sleep_us": {name: round(us, 3) for name, us in sorted(table.sleep_us.items())},
        "switches": library_switches(problem, table, labels),
        "note": "sums over tuned ops and conversions, measured in isolation; the ops in between are not included"},
        PREDICTED_US: chosen["total_us"]}
    return Plan(model={"name": model.name, "fingerprint": model.fingerprint(), "inputs": model.input_shapes},
                device=device.to_json(), libraries=versions, emulated=any(libraries[n].emulated for n in used),
                plan_level={} if len(used) > 1 else settings[next(iter(used))], tasks=tasks, nodes=nodes,
                format=PLAN_FORMAT, extra=extra, library_settings={n: settings[n] for n in used})


def library_switches(problem: CrossProblem, table: ConversionTable, labels: dict) -> dict:
    """The edges of the labelling that change library between two ops, and their switch cost."""
    changes = [(labels[e.producer], labels[e.consumer]) for e in problem.edges
               if GRAPH_LABEL not in (labels[e.producer], labels[e.consumer])
               and library_of(labels[e.producer]) != library_of(labels[e.consumer])]
    return {"edges": len(changes), "us": round(sum(table.switch_cost_us(a, b) for a, b in changes), 3)}


def planned_conversions(plan: Plan) -> list[dict]:
    """The conversions between ops a plan from here counts: into its tuned ops, and where an
    untuned Add or Concat takes an input into its first input's label (model outputs aside)."""
    into_ops = [c for entry in plan.nodes.values() for c in entry.get("conversions", [])]
    return into_ops + plan.extra.get("cross_library", {}).get("untuned_conversions", [])
