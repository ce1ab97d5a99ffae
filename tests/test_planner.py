"""The cross-op planner is exact: on chains and branching graphs, with conversions several readers
share, it matches brute force, and it never does worse than choosing each op alone."""

import random

import pytest

from kselect.core.cross_library.planner import Edge, Option, PlanGraph, SharedEdges, brute_force, greedy, solve

LABELS = ["mlas:NCHWc", "mlas:NCHW", "xnnpack:NHWC"]


def random_graph(rng: random.Random, nodes: int, extra_edges: int, fan_outs: int = 0) -> PlanGraph:
    names = [f"n{i}" for i in range(nodes)]
    graph = PlanGraph()
    for name in names:
        graph.options[name] = [Option(rng.choice(LABELS), rng.uniform(10, 100), payload=k) for k in range(rng.randint(1, 4))]
    conversion = {(a, b): (0.0 if a == b else rng.uniform(1, 40)) for a in LABELS for b in LABELS}
    cost = lambda a, b: conversion[(a, b)]  # noqa: E731
    for i in range(1, nodes):  # a chain ...
        graph.edges.append(Edge(names[i - 1], names[i], cost))
    for _ in range(extra_edges):  # ... plus skip connections and fan-outs, as in ResNet and GoogLeNet
        i, j = sorted(rng.sample(range(nodes), 2))
        graph.edges.append(Edge(names[i], names[j], cost))
    for _ in range(fan_outs):  # a tensor converted once per label its readers take it in
        producer, *readers = rng.sample(names, min(len(names), rng.randint(3, 4)))
        once = lambda labels: sum(conversion[(labels[0], b)] for b in set(labels[1:]))  # noqa: E731
        graph.shared.append(SharedEdges((producer, *readers), once))
    return graph


@pytest.mark.parametrize("seed", range(40))
def test_solve_matches_brute_force(seed):
    rng = random.Random(seed)
    graph = random_graph(rng, nodes=rng.randint(2, 7), extra_edges=rng.randint(0, 4), fan_outs=rng.randint(0, 2))
    _, exact = brute_force(graph)
    assignment, total = solve(graph)
    assert total == pytest.approx(exact)
    assert graph.total_us(assignment) == pytest.approx(total)
    assert total <= greedy(graph)[1] + 1e-9


def test_conversions_steer_the_choice_on_a_chain():
    """The middle op is faster alone in another layout, but two conversions cost more than it saves."""
    convert = lambda a, b: 0.0 if a == b else 30.0  # noqa: E731
    graph = PlanGraph(
        options={"a": [Option("NCHWc", 100)], "b": [Option("NCHWc", 100), Option("NHWC", 80)], "c": [Option("NCHWc", 100)]},
        edges=[Edge("a", "b", convert), Edge("b", "c", convert)])
    assignment, total = solve(graph)
    assert assignment["b"].label == "NCHWc" and total == 300
    greedy_assignment, greedy_total = greedy(graph)
    assert greedy_assignment["b"].label == "NHWC" and greedy_total == 340


def test_large_chain_is_solved_quickly():
    rng = random.Random(0)
    graph = random_graph(rng, nodes=300, extra_edges=0)
    _, total = solve(graph)
    assert total <= greedy(graph)[1]


@pytest.mark.parametrize("seed", range(10))
def test_local_search_never_worsens_its_start_and_stops_at_a_local_optimum(seed):
    from kselect.core.cross_library.planner import improve

    rng = random.Random(seed)
    graph = random_graph(rng, nodes=8, extra_edges=6, fan_outs=2)
    start, start_total = greedy(graph)
    assignment, total = improve(graph, start)
    assert total <= start_total + 1e-9
    assert total >= brute_force(graph)[1] - 1e-9
    for node in graph.options:  # no single change helps
        for option in graph.options[node]:
            assert graph.total_us({**assignment, node: option}) >= total - 1e-9


def test_a_conversion_its_readers_share_is_paid_once():
    """a's output is converted once for b and c: charged per edge, two conversions would outweigh
    what NHWC saves on b and c; shared, one does not."""
    convert = lambda a, b: 0.0 if a == b else 30.0  # noqa: E731
    options = {"a": [Option("NCHWc", 100)], "b": [Option("NCHWc", 100), Option("NHWC", 80)],
               "c": [Option("NCHWc", 100), Option("NHWC", 80)]}
    per_edge = PlanGraph(options, edges=[Edge("a", "b", convert), Edge("a", "c", convert)])
    assert {o.label for o in solve(per_edge)[0].values()} == {"NCHWc"}
    once = lambda labels: sum(convert(labels[0], b) for b in set(labels[1:]))  # noqa: E731
    shared = PlanGraph(options, shared=[SharedEdges(("a", "b", "c"), once)])
    assignment, total = solve(shared)
    assert [assignment[n].label for n in "bc"] == ["NHWC", "NHWC"] and total == 100 + 2 * 80 + 30
