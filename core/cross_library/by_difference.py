"""Figures in context for the race's combined plans, by difference from a plan whose whole run
was timed.

The race of a reduced-precision tune (core/cross_library/keep.py) holds plans no runner timed
whole: the plan across libraries with one library's reduced-precision ops put in, one library's
mixed plan with another library's ops where it runs fp32, the plan across libraries with each
op's precision chosen per op. Each is predicted from the nearest plan that has a figure in
context (the plan across libraries, or a library's fp32 plan, whose whole runs the planner timed):
that figure plus, for every node the two plans run differently, the difference of the node's
costs in context.

A node's cost in context is its isolated time times its ratio in its library's whole run, plus
the conversions into it the planner counted: in fp32, the ratio of the planner's run of the
library's plan (core/cross_library/plan.py); in a reduced precision, the ratio its library's
precision front learned (core/whole_model/context.py), times the planner's run of the library's
fp32 plan over the front's run of it (the two sets of runs may meet the machine at other speeds).
"""

from __future__ import annotations

from dataclasses import dataclass

from kselect.core.cross_library.plan import ratio_of
from kselect.core.plans.plan import ISOLATED_US, PREDICTED_BASIS, PREDICTED_US, Plan, reduced_nodes
from kselect.core.whole_model.context import IN_CONTEXT, ContextCorrection


@dataclass
class NodeCosts:
    fp32_ratios: dict[str, dict[str, float]]  # library -> node -> ratio in the planner's run of its plan
    reduced: dict[str, tuple[ContextCorrection, float]]  # library -> (its front's correction, scale to the planner's runs)

    @classmethod
    def of_race(cls, evidence: dict, tunings: dict) -> "NodeCosts":
        """From the planner's runs (``evidence``: the plan across libraries' ``in_context``) and each
        tuned library's precision front."""
        reduced = {}
        for name, tuning in tunings.items():
            correction = tuning.precision.correction if tuning.precision is not None else None
            front_fp32_us = correction.runs.get("fp32", {}).get("whole_us") if correction is not None else None
            if front_fp32_us and name in evidence["whole_us"]:
                reduced[name] = (correction, evidence["whole_us"][name] / front_fp32_us)
        return cls(evidence["ratios"], reduced)

    def cost_us(self, plan: Plan, node: str, precision: str) -> float:
        entry = plan.nodes[node]
        library, isolated_us = entry["library"], isolated_time(plan, node)
        conversions_us = sum(c.get("time_us", 0.0) for c in entry.get("conversions", []))
        if precision != "fp32" and library in self.reduced:
            correction, scale = self.reduced[library]
            return isolated_us * correction.ratio(node, precision) * scale + conversions_us
        return isolated_us * ratio_of(self.fp32_ratios, library, node) + conversions_us


def isolated_time(plan: Plan, node: str) -> float | None:
    """The node's isolated time: its own entry's (a plan across libraries), else its task's."""
    entry = plan.nodes[node]
    if entry.get("time_us") is not None:
        return entry["time_us"]
    return next((task.get("time_us") for task in plan.tasks
                 if task["id"] == entry["task"] and task["library"] == entry["library"] and node in task["nodes"]), None)


def runs_differently(node: str, plan: Plan, base: Plan) -> bool:
    a, b = plan.nodes[node], base.nodes.get(node)
    return (b is None or a["library"] != b["library"] or a.get("task") != b.get("task")
            or a.get("config") != b.get("config"))


def figure_by_difference(plan: Plan, bases: list[Plan], costs: NodeCosts) -> bool:
    """Makes ``plan``'s figure one in context, from the base (a plan with a figure in context and
    entries of isolated times) it runs the fewest nodes differently from; False when no base
    has such a figure or some node has no isolated time (the plan keeps its isolated sum)."""
    def isolated_times_known(p: Plan) -> bool:
        return all(isolated_time(p, node) is not None for node in p.nodes)

    bases = [b for b in bases if b.extra.get(PREDICTED_BASIS) == IN_CONTEXT and isolated_times_known(b)]
    if not bases or not isolated_times_known(plan):
        return False
    base = min(bases, key=lambda b: sum(runs_differently(node, plan, b) for node in plan.nodes))
    precision, base_precision = reduced_nodes(plan), reduced_nodes(base)
    figure = base.extra[PREDICTED_US]
    for node in plan.nodes:
        if runs_differently(node, plan, base):
            figure += costs.cost_us(plan, node, precision.get(node, "fp32"))
            if node in base.nodes:
                figure -= costs.cost_us(base, node, base_precision.get(node, "fp32"))
    if not (plan.extra.get(PREDICTED_BASIS) == IN_CONTEXT and ISOLATED_US in plan.extra):
        plan.extra[ISOLATED_US] = round(plan.extra.get(PREDICTED_US, plan.estimated_us()), 3)
    plan.extra[PREDICTED_US] = round(figure, 3)
    plan.extra[PREDICTED_BASIS] = IN_CONTEXT
    return True
