"""What a plan pays each time it switches library, beyond converting tensors: the next library's
worker threads must wake and take the cores, the last one's stop spinning (core/plans/runtime.py).

Measured per ordered pair of libraries (A, B) on a chain of identical small convs whose nodes
alternate between A and B, each with its library's default config, run as a plan would
(``load_plan``): for each segment of B, its time right after A's segment minus its time right after
itself, the two taken in the same rounds. Each spinning variant of that plan is measured
(core/plans/spinning.spinning_variants, the end-to-end check keeps the best one), and a pair's cost is
its cost in the variant with the smaller total. The planner adds it to every edge whose ends run
in different libraries; a tensor read by several nodes of the next segment is then charged more
than once, a bound the planner errs on the safe side of (fewer switches).

A plan that mixes libraries lets only one library's workers spin (core/cross_library/labelling.py); every
parallel op of the others waits for its workers to wake. What that costs per op is measured per
library on the same chain run alone in that library, its workers sleeping against spinning
(``measure_sleep_costs``), and the planner charges it on every op of a library that does not spin.

On this machine (x86_64 VM, 2 vCPUs, a calm period) a switch between MLAS and XNNPack read 8-21 us
on the chain (32 channels, 28 x 28) and 0-190 us with 64 channels at 56 x 56; inside alexnet's
mixed plan the extra time per segment read -1.0 to +1.0 ms from one run to the next. The chain is
a floor: what a switch costs a large model depends on what the previous segment left in the caches.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from kselect.core.contract import plugins
from kselect.core.measuring.device import this_device
from kselect.core.measuring.tuning_loop import library_tasks
from kselect.core.models.model import Model, model_from_proto
from kselect.core.plans.plan import Plan, plan_node, plan_task
from kselect.core.plans.runtime import load_plan
from kselect.core.plans.spinning import spin_dims, spinning_variants, with_spinner

CHAIN = dict(channels=32, size=28, convs=6)
ROUNDS = 60
SLEEP_BLOCK = 5  # runs timed back to back per round


def defaults_plan(model: Model, library_of: dict[str, str]) -> Plan:
    """A plan running each node of ``library_of`` in that library with the library's default
    config, in the format ``build_plan`` writes."""
    device = this_device()
    libraries, settings, tasks, nodes = {}, {}, [], {}
    for name in dict.fromkeys(library_of.values()):
        library = plugins.get_library(name)
        libraries[name], settings[name] = library.version(), {}
        for task in library_tasks(model, library):
            mine = [node for node in task.nodes if library_of.get(node) == name]
            if not mine:
                continue
            config = library.default_config(task, device)
            settings[name].update({dim: config[dim] for dim in library.plan_level_dims if dim in config})
            tasks.append(plan_task(task, mine, name, config, 1.0, config, 1.0, 1, library.emulated))
            nodes.update({node: plan_node(task, name, config) for node in mine})
    plan_level = next(iter(settings.values())) if len(settings) == 1 else {}
    return Plan({"name": model.name, "fingerprint": model.fingerprint(), "inputs": model.input_shapes},
                device.to_json(), libraries, any(plugins.get_library(n).emulated for n in libraries), plan_level,
                tasks, nodes, library_settings=settings)


def chain_model(channels: int, size: int, convs: int) -> Model:
    """``convs`` 3x3 convs (pad 1, each followed by a Relu) on a 1 x channels x size x size map."""
    rng = np.random.default_rng(0)
    nodes, weights, x = [], [], "x"
    for i in range(convs):
        w = (rng.standard_normal((channels, channels, 3, 3)) * (2.0 / (9 * channels)) ** 0.5).astype(np.float32)
        weights.append(numpy_helper.from_array(w, f"w{i}"))
        nodes += [helper.make_node("Conv", [x, f"w{i}"], [f"c{i}"], name=f"conv{i}", pads=[1, 1, 1, 1]),
                  helper.make_node("Relu", [f"c{i}"], [f"r{i}"], name=f"relu{i}")]
        x = f"r{i}"
    shape = [1, channels, size, size]
    graph = helper.make_graph(nodes, "switch_chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, shape)], weights)
    return model_from_proto("switch_chain", helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                                                              ir_version=8))


def segment_entry_us(runner, feeds: dict, rounds: int = ROUNDS) -> list[float]:
    """Per segment of a plan runner (``core.plans.runtime.PlanRunner``): the median of its time in
    sequence minus its time right after itself, in microseconds (the first segment: 0)."""
    segments, runners = runner.segments, runner.runners
    in_sequence = [[] for _ in segments]
    again = [[] for _ in segments]
    inputs = []
    for round_index in range(rounds + 3):
        values = dict(feeds)
        for k, (segment, run) in enumerate(zip(segments, runners)):
            args = {name: values[name] for name in segment.inputs}
            start = time.perf_counter()
            results = run(args)
            elapsed = time.perf_counter() - start
            if round_index >= 3:
                in_sequence[k].append(elapsed)
            values.update(zip(segment.outputs, results))
            if round_index == 0:
                inputs.append(args)
        for k, run in enumerate(runners):
            run(inputs[k])
            start = time.perf_counter()
            run(inputs[k])
            if round_index >= 3:
                again[k].append(time.perf_counter() - start)
    return [0.0] + [1e6 * (statistics.median(a) - statistics.median(b)) for a, b in zip(in_sequence[1:], again[1:])]


def _chain() -> tuple[Model, dict, list[str]]:
    """The measuring chain (CHAIN), its input and its convs' names."""
    model = chain_model(**CHAIN)
    feeds = {"x": np.random.default_rng(1).standard_normal(model.input_shapes["x"], dtype=np.float32)}
    return model, feeds, [node.name for node in model.proto.graph.node if node.op_type == "Conv"]


def measure_switch_costs(names: list[str], rounds: int = ROUNDS) -> dict[tuple[str, str], float]:
    """(from library, to library) -> microseconds per switch, for every ordered pair of ``names``
    (a negative difference counts as 0)."""
    model, feeds, convs = _chain()
    costs: dict[tuple[str, str], float] = {}
    for i, first in enumerate(names):
        for second in names[i + 1:]:
            plan = defaults_plan(model, {node: (first, second)[k % 2] for k, node in enumerate(convs)})
            best = None
            for _, variant in spinning_variants(plan):
                runner = load_plan(variant, model)
                try:
                    entries = segment_entry_us(runner, feeds, rounds)
                    libraries = [segment.library for segment in runner.segments]
                finally:
                    runner.close()
                pair = {(a, b): statistics.mean(e for e, x, y in zip(entries[1:], libraries, libraries[1:]) if (x, y) == (a, b))
                        for a, b in ((first, second), (second, first))}
                if best is None or sum(pair.values()) < sum(best.values()):
                    best = pair
            costs.update({pair: max(0.0, value) for pair, value in best.items()})
    return costs


def measure_sleep_costs(names: list[str], rounds: int = ROUNDS) -> dict[str, float]:
    """Library -> microseconds per conv that its workers sleeping between parallel ops costs:
    the chain run alone in that library with its default configs, sleeping minus spinning (medians
    of interleaved runs), over its convs. Only libraries with a spinning setting are measured
    (a negative difference counts as 0)."""
    model, feeds, convs = _chain()
    costs: dict[str, float] = {}
    for name in names:
        spinning = defaults_plan(model, {node: name for node in convs})
        if not any(dim in spinning.library_settings[name] for dim in spin_dims(name)):
            continue
        runners = [load_plan(plan, model) for plan in (spinning, with_spinner(spinning, None))]
        try:
            times: list[list[float]] = [[], []]
            for round_index in range(rounds + 3):
                for k, runner in enumerate(runners):
                    runner.run(feeds)  # the other runner's workers may still hold the cores
                    start = time.perf_counter()
                    for _ in range(SLEEP_BLOCK):
                        runner.run(feeds)
                    if round_index >= 3:
                        times[k].append((time.perf_counter() - start) / SLEEP_BLOCK)
        finally:
            for runner in runners:
                runner.close()
        costs[name] = max(0.0, 1e6 * (statistics.median(times[1]) - statistics.median(times[0])) / len(convs))
    return costs
