"""Choosing, per op, among ways to run it (a library, a config, the layout its tensors are in)
to minimise the whole model's time, conversions included.

Each node has options with a measured time and a *label*: what a neighbour must match to avoid
a conversion (e.g. ``"mlas:NCHWc"``, ``"xnnpack:NHWC"``). Each edge (a tensor from producer to
consumer) costs a conversion when the two labels differ. Since edge costs depend on labels only,
a node keeps its fastest option per label, and the problem is a min-sum labelling of the graph:
solved exactly by variable elimination (exact on chains, where it is the usual dynamic program,
and on every graph whose elimination keeps factors small -- ResNet's residual adds and GoogLeNet's
concatenations have treewidth 2-4). A graph whose elimination would need a factor over more than
MAX_FACTOR_VARIABLES nodes gets ``improve`` (local search from a given start) instead.
``greedy`` gives what picking each op alone would.

A conversion several edges share (a tensor quantized once however many ops read it) is not a sum
over edges: such edges are one ``SharedEdges`` cost over the labels of all the nodes they join,
a factor of its own in the elimination.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

MAX_FACTOR_VARIABLES = 12


@dataclass
class Option:
    label: str
    time_us: float
    payload: Any = None  # what the caller needs to apply the choice (library, config, ...)


@dataclass
class Edge:
    producer: str
    consumer: str
    conversion_us: Callable[[str, str], float]  # (producer label, consumer label) -> cost; 0 if equal


@dataclass
class SharedEdges:
    """Edges whose conversions are partly shared: one cost over the labels of every node they join."""
    nodes: tuple[str, ...]
    conversion_us: Callable[[tuple[str, ...]], float]  # the nodes' labels, in the order of ``nodes``

    def cost_us(self, assignment: dict[str, Option]) -> float:
        return self.conversion_us(tuple(assignment[node].label for node in self.nodes))


@dataclass
class PlanGraph:
    options: dict[str, list[Option]] = field(default_factory=dict)  # node -> its options
    edges: list[Edge] = field(default_factory=list)
    shared: list[SharedEdges] = field(default_factory=list)

    def best_per_label(self, node: str) -> list[Option]:
        best: dict[str, Option] = {}
        for option in self.options[node]:
            if option.label not in best or option.time_us < best[option.label].time_us:
                best[option.label] = option
        return list(best.values())

    def total_us(self, assignment: dict[str, Option]) -> float:
        total = sum(option.time_us for option in assignment.values())
        for edge in self.edges:
            total += edge.conversion_us(assignment[edge.producer].label, assignment[edge.consumer].label)
        return total + sum(shared.cost_us(assignment) for shared in self.shared)


@dataclass
class _Factor:
    scope: tuple[str, ...]
    table: np.ndarray  # one axis per scope variable


def solve(graph: PlanGraph) -> tuple[dict[str, Option], float]:
    """The assignment of one option per node with the least total time (exact)."""
    domains = {node: graph.best_per_label(node) for node in graph.options}
    factors = [_Factor((node,), np.array([o.time_us for o in domain])) for node, domain in domains.items()]
    for edge in graph.edges:
        table = np.array([[edge.conversion_us(a.label, b.label) for b in domains[edge.consumer]]
                          for a in domains[edge.producer]])
        factors.append(_Factor((edge.producer, edge.consumer), table))
    for shared in graph.shared:
        labels = [[option.label for option in domains[node]] for node in shared.nodes]
        table = np.array([shared.conversion_us(combination) for combination in itertools.product(*labels)])
        factors.append(_Factor(shared.nodes, table.reshape([len(choices) for choices in labels])))

    eliminated: list[tuple[str, _Factor]] = []  # (variable, the combined factor it was minimised out of)
    remaining = set(domains)
    while remaining:
        variable = min(remaining, key=lambda v: (len(_neighbours(v, factors)), v))
        involved = [f for f in factors if variable in f.scope]
        factors = [f for f in factors if variable not in f.scope]
        combined = _combine(involved, domains)
        if len(combined.scope) > MAX_FACTOR_VARIABLES:
            raise ValueError(f"graph too entangled for exact elimination ({len(combined.scope)} variables in one factor)")
        axis = combined.scope.index(variable)
        factors.append(_Factor(combined.scope[:axis] + combined.scope[axis + 1:], combined.table.min(axis=axis)))
        eliminated.append((variable, combined))
        remaining.remove(variable)

    chosen: dict[str, int] = {}
    for variable, combined in reversed(eliminated):
        index = tuple(slice(None) if v == variable else chosen[v] for v in combined.scope)
        chosen[variable] = int(np.argmin(combined.table[index]))
    assignment = {node: domains[node][i] for node, i in chosen.items()}
    return assignment, graph.total_us(assignment)


def _neighbours(variable: str, factors: list[_Factor]) -> set[str]:
    return {v for f in factors if variable in f.scope for v in f.scope} - {variable}


def _combine(factors: list[_Factor], domains: dict[str, list]) -> _Factor:
    scope = tuple(sorted({v for f in factors for v in f.scope}))
    table = np.zeros([len(domains[v]) for v in scope])
    for factor in factors:
        # align the factor's axes with the combined scope, broadcasting over the others
        order = sorted(range(len(factor.scope)), key=lambda i: scope.index(factor.scope[i]))
        aligned = np.transpose(factor.table, order)
        shape = [len(domains[v]) if v in factor.scope else 1 for v in scope]
        table = table + aligned.reshape(shape)
    return _Factor(scope, table)


def improve(graph: PlanGraph, start: dict[str, Option]) -> tuple[dict[str, Option], float]:
    """Local search for graphs too entangled for ``solve``: change one node at a time to the
    option cheapest given its neighbours' choices, until no change helps. Never worse than
    ``start`` (e.g. the better of greedy and each library alone)."""
    incident: dict[str, list[Edge]] = {node: [] for node in graph.options}
    for edge in graph.edges:
        incident[edge.producer].append(edge)
        incident[edge.consumer].append(edge)
    incident_shared: dict[str, list[SharedEdges]] = {node: [] for node in graph.options}
    for shared in graph.shared:
        for node in shared.nodes:
            incident_shared[node].append(shared)
    assignment = dict(start)

    def local_cost(node: str, option: Option) -> float:
        cost = option.time_us
        for edge in incident[node]:
            producer = option if edge.producer == node else assignment[edge.producer]
            consumer = option if edge.consumer == node else assignment[edge.consumer]
            cost += edge.conversion_us(producer.label, consumer.label)
        for shared in incident_shared[node]:
            cost += shared.conversion_us(tuple((option if other == node else assignment[other]).label
                                               for other in shared.nodes))
        return cost

    changed = True
    while changed:
        changed = False
        for node in graph.options:
            best = min(graph.best_per_label(node), key=lambda o: local_cost(node, o))
            if local_cost(node, best) < local_cost(node, assignment[node]) - 1e-9:
                assignment[node], changed = best, True
    return assignment, graph.total_us(assignment)


def greedy(graph: PlanGraph) -> tuple[dict[str, Option], float]:
    """Each op's fastest option on its own, conversions paid as they fall."""
    assignment = {node: min(options, key=lambda o: o.time_us) for node, options in graph.options.items()}
    return assignment, graph.total_us(assignment)


def brute_force(graph: PlanGraph) -> tuple[dict[str, Option], float]:
    """Every combination (for checking ``solve`` on small graphs)."""
    nodes = list(graph.options)
    best = None
    for combination in itertools.product(*(graph.options[n] for n in nodes)):
        assignment = dict(zip(nodes, combination))
        total = graph.total_us(assignment)
        if best is None or total < best[1]:
            best = (assignment, total)
    return best
