"""Solving a cross-library problem (core/cross_library/problem.py): the labelling with the least time in
place, found exactly by core/cross_library/planner.py where the graph allows, with the one-spinning-library
policy (core/plans/spinning.py) charged on the others' ops, a segment that does not pay for what it
costs moved back to the plan's main library, and a mix kept only when it clearly beats every
library alone.
"""

from __future__ import annotations

from typing import Callable

from kselect.core.cross_library.conversions import ConversionTable
from kselect.core.cross_library.planner import Option, PlanGraph, greedy, improve, solve
from kselect.core.cross_library.problem import CrossProblem
from kselect.core.plans.runtime import plan_segments
from kselect.core.plans.spinning import spin_dims

# A mix must save more than this share of the best library alone. Below it the difference is within
# the spread of isolated timings taken minutes apart, and a mix adds switches whose cost varies more
# than one library's speed (history/table2-runs.md).
MIX_RESOLUTION = 0.005


def labelling_summary(problem: CrossProblem, table: ConversionTable, assignment: dict, reentries_us: float = 0.0,
                      sleeping_us: float = 0.0) -> dict:
    """Ops and conversions, reentries (``CrossProblem.reentries_us``) counted with the conversions,
    and what the ops of libraries that do not spin pay for waking their workers."""
    ops = sum(o.time_us for o in assignment.values())
    conversions = problem.conversions_us(table, {node: o.label for node, o in assignment.items()}) + reentries_us
    return {"ops_us": round(ops, 3), "conversions_us": round(conversions, 3), "sleeping_us": round(sleeping_us, 3),
            "total_us": round(ops + conversions + sleeping_us, 3)}


def wake_up_us(table: ConversionTable, assignment: dict, spinner: str | None) -> float:
    """What the ops of every library but ``spinner`` pay for waking their workers."""
    return sum(table.sleep_us.get(o.payload.library, 0.0) for o in assignment.values()
               if o.payload is not None and o.payload.library != spinner)


def choose_spinner(table: ConversionTable, assignment: dict, spinners: list[str]) -> str | None:
    """Of the libraries the labelling uses that could spin, the one whose ops would pay the most
    asleep (with no sleep costs measured: the one with the most op time)."""
    used = [name for name in spinners if any(o.payload is not None and o.payload.library == name
                                             for o in assignment.values())]
    if not used:
        return None
    if not table.sleep_us:
        main = main_library(assignment)
        return main if main in used else used[0]
    return min(used, key=lambda name: wake_up_us(table, assignment, name))


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
    return PlanGraph(options, graph.edges, graph.shared), back


def main_library(assignment: dict) -> str | None:
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
        sleeping = wake_up_us(table, assignment, choose_spinner(table, assignment, spinners))
        return problem.total_us(table, assignment, missing) + sleeping

    solved = []
    for spinner in (spinners if table.sleep_us and spinners else [None]):
        charged, back = _charged(graph, table, spinner)
        forth = {id(back[id(option)]): option for options in charged.options.values() for option in options}
        assignment, method = solve_labelling(charged, [{node: forth[id(o)] for node, o in start.items()} for start in starts])
        assignment = {node: back[id(option)] for node, option in assignment.items()}
        assignment, islands_moved = without_unpaid_islands(problem, in_place_us, assignment, alone)
        solved.append((in_place_us(assignment), assignment, method, islands_moved))
    _, assignment, method, islands_moved = min(solved, key=lambda entry: entry[0])
    best_alone = min(alone.values(), key=in_place_us, default=None)
    if best_alone is not None and in_place_us(assignment) >= (1 - MIX_RESOLUTION) * in_place_us(best_alone):
        assignment = best_alone
    return assignment, choose_spinner(table, assignment, spinners), method, islands_moved


def without_unpaid_islands(problem: CrossProblem, total_us: Callable[[dict], float], assignment: dict,
                            alone: dict[str, dict]) -> tuple[dict, int]:
    """The solver is exact for costs between neighbours, but reentries depend on how the whole
    labelling cuts the model. So each segment of another library than the plan's main one is
    tried with its ops as in the main library's plan alone, and left there when that lowers the
    total with reentries, until no segment does. Returns the labelling and the segments moved."""
    main = main_library(assignment)
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


def solve_labelling(graph: PlanGraph, starts: list | None = None) -> tuple[dict, str]:
    """Exact when the graph allows (planner.solve), else local search from the best start."""
    try:
        return solve(graph)[0], "exact"
    except ValueError:
        starts = starts or [greedy(graph)[0]]
        return improve(graph, min(starts, key=graph.total_us))[0], "local search"


def library_settings(assignment: dict, plan_level: dict[str, dict], spinner: str | None) -> dict[str, dict]:
    """Each library's plan-level settings; with several libraries, ``spinner`` spins
    (its ``Library.spin_dim``) and the others do not."""
    used = {option.payload.library for option in assignment.values() if option.payload is not None}
    settings = {name: dict(values) for name, values in plan_level.items()}
    if len(used) > 1:
        for name in used:
            settings[name].update({dim: int(name == spinner) for dim in spin_dims(name) if dim in settings[name]})
    return settings
