"""Cross-library plans: conversions measured and stored, inserted where labels change and nowhere
else, the mixed plan running end to end like ONNX Runtime, and the CLI as a user runs it."""

from __future__ import annotations

import dataclasses
import json
import shutil

import graphs
import numpy as np
import onnx
import pytest
from graphs import small_cnn
from helpers import kselect_json, run_kselect

from kselect.core.contract import plugins
from kselect.core.contract.space import config_key
from kselect.core.cross_library.conversions import (
    GRAPH_LABEL,
    RECORD_SUFFIX,
    ConversionTable,
    conversion_task,
    measure_conversions,
    sides_needed,
)
from kselect.core.cross_library.plan import plan_across
from kselect.core.cross_library.planner import Option, brute_force, solve
from kselect.core.cross_library.problem import CrossProblem
from kselect.core.errors import KselectError
from kselect.core.measuring.device import this_device
from kselect.core.measuring.measure import MeasureSettings
from kselect.core.measuring.tuning_loop import TuneOptions, library_tasks, tune_tasks
from kselect.core.models.model import load_model
from kselect.core.plans.library_plan import onnxruntime_default_plan, verified_library_plan
from kselect.core.plans.runtime import load_plan
from kselect.core.records.store import RecordDB
from kselect.core.whole_model.bench import compare_outputs, random_feeds
from kselect.plugins.mlas.apply import default_session

FAST = MeasureSettings(min_time_s=0.01, min_repeats=3, max_time_s=0.2)


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """small_cnn tuned on MLAS and XNNPack (2 configs per task), and its cross-library plan."""
    folder = tmp_path_factory.mktemp("cross")
    return tune_and_plan(folder, {name: plugins.get_library(name) for name in ("mlas", "xnnpack")})


def tune_and_plan(folder, libraries: dict) -> dict:
    """small_cnn saved in ``folder``, tuned on each library (2 configs per task), and the plan
    across them."""
    path = folder / "small.onnx"
    onnx.save(small_cnn(), path)
    model = load_model(str(path))
    device, db = this_device(), RecordDB(folder / "records.db")
    single = {}
    for name, library in libraries.items():
        tasks = library_tasks(model, library)
        outcomes = tune_tasks(tasks, library, device, db, TuneOptions("random", 2, settings=FAST))
        single[name] = verified_library_plan(model, library, device, db, tasks, outcomes, verify=False)
    measured = []
    plan = plan_across(model, device, db, libraries, single, FAST, on_measured=lambda task, result: measured.append(result))
    return {"model": model, "path": path, "db": db, "device": device, "libraries": libraries, "single": single,
            "plan": plan, "measured": measured, "folder": folder}


def test_conversions_are_measured_verified_stored_and_reused(tuned):
    assert tuned["measured"] and all(r.status == "ok" and r.error == 0.0 for r in tuned["measured"])
    db, device = tuned["db"], tuned["device"]
    for name, library in tuned["libraries"].items():
        stored = db.records(device.fingerprint, name + RECORD_SUFFIX, library.version())
        assert stored, f"no {name} conversion records"
    again = []
    plan_across(tuned["model"], device, db, tuned["libraries"], tuned["single"], FAST,
                on_measured=lambda task, result: again.append(task))
    assert again == []  # everything came from the records


def test_remeasuring_replaces_stale_records_before_planning(tuned):
    """Records from a slower period (here every XNNPack record inflated 100x) mislead the planner;
    with remeasure the configs it chooses among and the conversions are timed again first."""
    shutil.copy(tuned["db"].path, tuned["folder"] / "stale.db")
    db, device = RecordDB(tuned["folder"] / "stale.db"), tuned["device"]
    xnnpack = tuned["libraries"]["xnnpack"]
    stale = {}
    for task_json, record in db.all_records(device.fingerprint, "xnnpack", xnnpack.version()):
        if record.result.status == "ok":
            inflated = dataclasses.replace(record.result, median_us=record.result.median_us * 100)
            db.add(device.fingerprint, "xnnpack", xnnpack.version(), task_json, record.config_key, inflated, False,
                   record.is_default)
            stale[(record.task, record.config_key)] = inflated.median_us
    args = (tuned["model"], device, db, tuned["libraries"], tuned["single"], FAST)
    before = plan_across(*args).extra["cross_library"]["single_library"]["xnnpack"]["ops_us"]
    measured = []
    plan = plan_across(*args, on_measured=lambda task, result: measured.append(task.kind), remeasure=True)
    summary = plan.extra["cross_library"]
    expected = tuned["plan"].extra["cross_library"]["single_library"]["xnnpack"]["ops_us"]
    assert before > 30 * expected  # the stale records, as the planner would have used them
    assert summary["single_library"]["xnnpack"]["ops_us"] != before  # the planner used the re-timed ones
    # a re-timing far slower than the rest of the batch is taken again (core/measuring/tuning_loop.remeasure)
    assert 0 < summary["remeasured"]["configs"] <= sum(kind != "convert" for kind in measured)
    assert summary["remeasured"]["conversions"] == sum(kind == "convert" for kind in measured) > 0
    now = {(r.task, r.config_key): r.result.median_us
           for r in db.records(device.fingerprint, "xnnpack", xnnpack.version()) if r.result.status == "ok"}
    for entry in tuned["single"]["xnnpack"].tasks:  # the XNNPack plan's own configs are among those re-timed
        key = (entry["key"], config_key(entry["config"]))
        assert now[key] != stale[key]


def test_a_check_that_nothing_passes_keeps_onnxruntimes_own_configuration(tuned):
    """A cross-library tune that beats nothing end to end ships ONNX Runtime's default session as
    an MLAS plan (original model, every op at the library default), not its slowest loser."""
    from kselect.core.whole_model.selection import BASELINE, verified_across
    from kselect.plugins.mlas.apply import keeps_original_model

    model, device = tuned["model"], tuned["device"]
    fallback = onnxruntime_default_plan(model, device, tuned["db"])
    assert set(fallback.libraries) == {"mlas"} and keeps_original_model(model, fallback)
    for entry in fallback.tasks:
        assert entry["config"] == entry["default_config"]
    candidates = [("mlas plan", tuned["single"]["mlas"]), ("cross-library plan", tuned["plan"])]
    kept, results = verified_across(model, candidates, rounds=2, runs_per_process=2, fallback=fallback, min_speedup=100.0)
    assert kept.nodes == fallback.nodes and kept.extra["verified"]["chosen"] == BASELINE and len(results) == 2
    kept, results = verified_across(model, candidates, rounds=2, runs_per_process=2, fallback=fallback, min_speedup=0.0)
    # a copy of the candidate kept: the candidate itself (a library's own plan) keeps its record
    assert kept.nodes == dict(candidates)[kept.extra["verified"]["chosen"]].nodes
    assert kept is not dict(candidates)[kept.extra["verified"]["chosen"]]
    assert_kept_by_the_race(kept.extra["verified"], results, min_speedup=0.0)


def test_a_plan_that_runs_as_the_baseline_does_is_not_raced(tuned):
    """A library's plan that is ONNX Runtime's default session itself (MLAS kept its library
    default) is the race's baseline run again: reported as skipped, never timed; with nothing
    else left, the baseline is kept without a race."""
    import copy

    from kselect.core.whole_model.selection import BASELINE, verified_across

    model, device = tuned["model"], tuned["device"]
    fallback = onnxruntime_default_plan(model, device, tuned["db"])
    twin = copy.deepcopy(fallback)
    candidates = [("mlas plan", twin), ("cross-library plan", tuned["plan"])]
    kept, results = verified_across(model, candidates, rounds=2, runs_per_process=2, fallback=fallback, max_rounds=2)
    by_name = {result["variant"]: result for result in results}
    assert by_name["mlas plan"]["skipped"].startswith("runs as ONNX Runtime's default session")
    assert by_name["cross-library plan"]["processes"] == 2
    kept, results = verified_across(model, [("mlas plan", twin)], rounds=2, runs_per_process=2, fallback=fallback)
    verified = kept.extra["verified"]
    assert [result["variant"] for result in results] == ["mlas plan"] and "skipped" in results[0]
    assert verified["chosen"] == BASELINE and verified["rounds"] == 0 and kept.nodes == fallback.nodes


def test_a_library_kept_at_its_default_runs_its_part_of_the_plan_across_so(tuned):
    """When a library's race kept its own default run (MLAS: the original model in ONNX Runtime's
    transformer), the plan across libraries runs that library's part marked so: where its ops keep
    their default configs, MLAS runs the original model, as its race measured, not kselect's rewrite."""
    from kselect.core.plans.plan import LIBRARY_DEFAULT, LIBRARY_DEFAULT_PARTS
    from kselect.plugins.mlas.apply import keeps_original_model

    model, device, db = tuned["model"], tuned["device"], tuned["db"]
    single = {**tuned["single"], "mlas": onnxruntime_default_plan(model, device, db)}
    plan = plan_across(model, device, db, tuned["libraries"], single, FAST)
    assert ("mlas" in plan.extra.get(LIBRARY_DEFAULT_PARTS, [])) == ("mlas" in plan.libraries)
    assert "mlas" not in tuned["plan"].extra.get(LIBRARY_DEFAULT_PARTS, [])  # its MLAS plan was the tuned one
    if "mlas" in plan.libraries:
        assert plan.for_library("mlas").extra.get(LIBRARY_DEFAULT)
    only_mlas = onnxruntime_default_plan(model, device, db)  # every op on MLAS at its default, unmarked
    del only_mlas.extra[LIBRARY_DEFAULT]
    only_mlas.extra[LIBRARY_DEFAULT_PARTS] = ["mlas"]
    assert keeps_original_model(model, only_mlas.for_library("mlas"))


def test_a_plan_whose_loss_the_predictions_make_certain_is_not_raced(tuned):
    """Every plan of the race with a whole-model figure in context (as core/cross_library/plan.py
    gives them when each library's plan ran whole): a candidate predicted more than the bound
    slower than the race's fastest prediction is reported as skipped and not timed; within the
    bound, or without figures in context for all, every candidate races."""
    import copy

    from kselect.core.plans.plan import ISOLATED_US, PREDICTED_BASIS, PREDICTED_US
    from kselect.core.whole_model.context import IN_CONTEXT
    from kselect.core.whole_model.selection import PREDICTION_BOUND, certain_losses, verified_across

    model, device = tuned["model"], tuned["device"]
    fallback = copy.deepcopy(onnxruntime_default_plan(model, device, tuned["db"]))
    mlas, cross = copy.deepcopy(tuned["single"]["mlas"]), copy.deepcopy(tuned["plan"])
    for plan, us in ((fallback, 1000.0), (mlas, 1100.0), (cross, 2000.0)):
        plan.extra.update({PREDICTED_US: us, PREDICTED_BASIS: IN_CONTEXT, ISOLATED_US: us})
    candidates = [("mlas plan", mlas), ("cross-library plan", cross)]
    kept, results = verified_across(model, candidates, rounds=2, runs_per_process=2, fallback=fallback, max_rounds=2)
    by_name = {result["variant"]: result for result in results}
    assert by_name["cross-library plan"]["skipped"].startswith("predicted 2.00x the race's fastest prediction")
    assert "speedup" not in by_name["cross-library plan"] and by_name["mlas plan"]["processes"] == 2
    assert by_name["cross-library plan"] in kept.extra["verified"]["tried"]  # the plan says what was not raced

    cross.extra[PREDICTED_US] = 1000.0 * (1 + PREDICTION_BOUND) * 0.99
    assert certain_losses(candidates, fallback) == {}
    cross.extra[PREDICTED_US] = 2000.0
    del fallback.extra[PREDICTED_BASIS]  # the reference without a figure in context: nothing is certain
    assert certain_losses(candidates, fallback) == {}


def assert_kept_by_the_race(verified: dict, results: list[dict], min_speedup: float | None = None) -> None:
    """The plan a whole-model race kept (``verified``) is the one its own figures (``results``, one
    per candidate) pick: among the plans shown faster than ONNX Runtime's default session (or at
    least ``min_speedup``), the fastest, unless a plan with fewer segments or spinning threads is
    within the margin of it; ONNX Runtime's own configuration when none is shown faster."""
    from kselect.core.whole_model.selection import BASELINE, MIXED_MARGIN

    ran = [r for r in results if "failed" not in r and "skipped" not in r and r["max_relative_output_error"] <= 1e-3]
    shown = [r for r in ran if (r["verdict"] == "faster" if min_speedup is None else r["speedup"] >= min_speedup)]
    assert verified["shown_faster"] == [r["variant"] for r in shown]
    assert verified["fastest"] == max(ran, key=lambda r: r["speedup"])["variant"]
    if not shown:
        assert verified["chosen"] == BASELINE
        return
    plan_ms = {r["variant"]: r["default_ms"] / r["speedup"] for r in shown}  # on the baseline's footing
    fastest = min(shown, key=lambda r: plan_ms[r["variant"]])
    margin = max(MIXED_MARGIN, fastest["speedup_spread"] / 2)
    within = [r for r in shown if plan_ms[r["variant"]] <= plan_ms[fastest["variant"]] * (1 + margin)]
    calmest = min(within, key=lambda r: (r["segments"] + r["sleeps"], plan_ms[r["variant"]]))
    assert verified["chosen"] == calmest["variant"]


def test_each_plan_is_timed_alone_in_fresh_processes_and_a_failing_one_is_set_aside(tuned):
    """The end-to-end check runs every candidate as an app would, alone in a process of its own
    (one per round), and a candidate that fails there is reported with its reason, not kept."""
    from dataclasses import replace

    from kselect.core.whole_model.alone import timed_alone
    from kselect.core.whole_model.selection import BASELINE, verified_across

    model = tuned["model"]
    broken = replace(tuned["plan"], libraries={**tuned["plan"].libraries, "no-such-library": "0"},
                     nodes={node: {**entry, "library": "no-such-library"} for node, entry in tuned["plan"].nodes.items()})
    candidates = [("cross-library plan", tuned["plan"]), ("broken plan", broken)]
    kept, results = verified_across(model, candidates, rounds=3, runs_per_process=2, fallback=None, max_rounds=3)
    by_name = {r["variant"]: r for r in results}
    good, bad = by_name["cross-library plan"], by_name["broken plan"]
    assert good["processes"] == 3 and len(good["process_ms"]) == 3 and good["runs"] >= 6
    in_this_process = load_plan(tuned["plan"], model)
    assert len(good["default_process_ms"]) == 3 and good["segments"] == len(in_this_process.segments)
    in_this_process.close()
    assert good["max_relative_output_error"] < 1e-4
    assert "no-such-library" in bad["failed"]
    assert kept.nodes == tuned["plan"].nodes and kept.extra["verified"]["chosen"] == "cross-library plan"

    hung = timed_alone(model, {BASELINE: "mlas"}, rounds=2, timeout_s=0.05)[BASELINE]
    assert hung["failed"].startswith("timed out") and hung["times"] == []


def test_every_conversion_side_runs_real_kernels_and_keeps_values():
    device = this_device()
    libraries = {name: plugins.get_library(name) for name in ("mlas", "xnnpack")}
    sides = {(label, direction, (1, 20, 9, 7)) for label in ("mlas:NCHW", "mlas:NCHWc", "xnnpack:NHWC")
             for direction in ("in", "out")}
    sides |= {(label, direction, (1, 10)) for label in ("mlas:flat", "xnnpack:flat") for direction in ("in", "out")}
    results = []
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        table = measure_conversions(sides, libraries, device, RecordDB(f"{folder}/r.db"), FAST,
                                    on_measured=lambda task, result: results.append((task.id, result)))
    assert len(results) == len(sides)
    for task_id, result in results:
        assert result.status == "ok" and result.error == 0.0, (task_id, result)
    assert table.side_us("mlas:NCHW", "out", (1, 20, 9, 7)) == 0.0  # leaving ONNX Runtime in NCHW is free
    assert table.side_us("xnnpack:NHWC", "in", (1, 20, 9, 7)) > 0.0
    assert table.cost_us("xnnpack:NHWC", "xnnpack:NHWC", (1, 20, 9, 7)) == 0.0
    assert table.cost_us("mlas:NCHWc", "mlas:NCHW", (1, 10)) == 0.0  # layouts of a 2-D tensor do not differ


def test_conversions_are_recorded_exactly_where_labels_change(tuned):
    """At a tuned op's input, and where an untuned Add or Concat takes a further input into its
    first input's label (it runs where that input's producer runs)."""
    plan = tuned["plan"]
    labels = {node: entry["label"] for node, entry in plan.nodes.items()}
    labels["input:input"] = GRAPH_LABEL
    model = tuned["model"]
    from kselect.core.cross_library.problem import label_sources

    source = label_sources(model, set(plan.nodes))

    def differ(a, b, shape):
        return (a if len(shape) == 4 else a.split(":")[0]) != (b if len(shape) == 4 else b.split(":")[0])

    for node in model.proto.graph.node:
        if node.name in plan.nodes:
            tensor = node.input[0]
            expected = {source(tensor)} if differ(labels[source(tensor)], labels[node.name], model.shapes[tensor]) else set()
            assert {c["from"] for c in plan.nodes[node.name]["conversions"]} == expected, node.name
    untuned = plan.extra["cross_library"]["untuned_conversions"]
    expected = set()
    for node in model.proto.graph.node:
        data = [t for t in node.input if t and t not in model.initializers]
        if node.name not in plan.nodes and len(data) > 1:
            first = source(data[0])
            expected |= {(node.name, t) for t in data[1:]
                         if source(t) != first and differ(labels[source(t)], labels[first], model.shapes[t])}
    assert {(c["at"], c["tensor"]) for c in untuned} == expected
    assert all(c["time_us"] > 0 for c in untuned)


def test_mixed_plan_runs_like_onnxruntime_and_saves(tuned):
    import kselect

    plan, model = tuned["plan"], tuned["model"]
    path = tuned["folder"] / "cross.plan.json"
    plan.save(path)
    data = json.loads(path.read_text())
    for entry in data["nodes"].values():
        assert {"library", "config", "label", "time_us", "emulated", "conversions"} <= set(entry)
    runner = kselect.load_plan(str(path), str(tuned["path"]))
    reference = plugins.get_library("mlas").model_runner(model, None)
    feeds = random_feeds(model, seed=3)
    assert compare_outputs(reference(feeds), runner.run(feeds)) < 1e-4
    runner.close()


def test_planner_pays_conversions_that_greedy_ignores():
    """A chain input -> a -> b -> c -> output: b is a bit faster on 'y', but getting there and
    back costs more than it saves; the exact plan stays on 'x', greedy does not."""
    from kselect.core.cross_library.labelling import labelling_summary
    from kselect.core.cross_library.problem import Choice, DataEdge

    problem = CrossProblem()
    problem.options = {"input:x": [Option(GRAPH_LABEL, 0.0)], "output:y": [Option(GRAPH_LABEL, 0.0)]}
    times = {"a": (100, 300), "b": (100, 90), "c": (100, 300)}
    for node, (x_us, y_us) in times.items():
        problem.options[node] = [Option("x:NCHW", x_us, Choice("x", None, None, False)),
                                 Option("y:NHWC", y_us, Choice("y", None, None, False))]
    shape = (1, 8, 4, 4)
    problem.edges = [DataEdge("input:x", "a", "t0", shape), DataEdge("a", "b", "t1", shape),
                     DataEdge("b", "c", "t2", shape), DataEdge("c", "output:y", "t3", shape)]
    table = ConversionTable({(label, direction, shape): 10.0 for label in ("x:NCHW", "y:NHWC")
                             for direction in ("in", "out")})
    graph = problem.graph(table)
    assignment, total = solve(graph)
    assert {n: o.label for n, o in assignment.items() if n in times} == {n: "x:NCHW" for n in times}
    assert total == pytest.approx(brute_force(graph)[1])
    from kselect.core.cross_library.planner import greedy

    greedy_assignment, greedy_total = greedy(graph)
    assert greedy_assignment["b"].label == "y:NHWC" and greedy_total > total
    assert labelling_summary(problem, table, assignment)["conversions_us"] == pytest.approx(20.0)  # into and out of x: NCHW at the ends


def test_an_mlas_nchwc_conv_with_fewer_input_channels_than_a_block_is_charged_no_reorder_into_it(small_model_path):
    """A model's first conv (3 input channels) in NCHWc reads the NCHW tensor directly, as ORT
    runs it and as its NCHWc records are measured: entering it costs what entering MLAS in NCHW
    costs, not a ReorderInput. Charged the reorder, the planner put mobilenetv2's first conv in
    NCHW (+104 us) against ORT's choice, and that plan ran 4% slower than ORT's default."""
    from kselect.core.cross_library.problem import Choice, DataEdge
    from kselect.plugins.mlas.layout import conv_takes_blocked_input, nchwc_block_size

    mlas = plugins.get_library("mlas")
    tasks = {task.nodes[0]: task for task in library_tasks(load_model(str(small_model_path)), mlas)}
    stem, dense = tasks["stem"], tasks["block.conv1"]  # 3 and 16 input channels
    assert mlas.input_label(stem, "mlas:NCHWc") == "mlas:NCHW"
    assert mlas.input_label(dense, "mlas:NCHWc") == "mlas:NCHWc"
    assert mlas.input_label(stem, "mlas:NCHW") == "mlas:NCHW"

    # as measured: the NCHWc candidate of the stem is fed the NCHW tensor and runs
    rng = np.random.default_rng(0)
    inputs = {"x": rng.standard_normal(stem.input_shape).astype(np.float32),
              "w": rng.standard_normal(stem.weight_shape).astype(np.float32)}
    candidate = mlas.prepare(stem, {"layout": "NCHWc", "threads": 1, "spinning": 0}, inputs)
    assert list(candidate.feeds.values())[0].shape == tuple(stem.input_shape)
    candidate.run()
    assert candidate.output().shape == tuple(stem.output_shape)

    # input -> stem -> next: NCHWc saves 40 us on the stem; a reorder into NCHWc costs 80 at the
    # input, 20 between stem and next
    shape, inner = tuple(stem.input_shape), tuple(stem.output_shape)
    problem = CrossProblem()
    problem.options = {"input:input": [Option(GRAPH_LABEL, 0.0)], "output:y": [Option(GRAPH_LABEL, 0.0)],
                       "stem": [Option("mlas:NCHWc", 100.0, Choice("mlas", stem, None, False)),
                                Option("mlas:NCHW", 140.0, Choice("mlas", stem, None, False))],
                       "next": [Option("mlas:NCHWc", 100.0, Choice("mlas", dense, None, False))]}
    problem.edges = [DataEdge("input:input", "stem", "input", shape), DataEdge("stem", "next", "s", inner),
                     DataEdge("next", "output:y", "y", inner)]
    sides = {("mlas:NCHWc", "in"): 80.0, ("mlas:NCHWc", "out"): 30.0, ("mlas:NCHW", "in"): 5.0, ("mlas:NCHW", "out"): 0.0}
    table = ConversionTable({(label, direction, s): us for (label, direction), us in sides.items() for s in (shape, inner)})
    table.times_us[("mlas:NCHWc", "in", inner)] = 20.0
    assert conv_takes_blocked_input(3, 1, nchwc_block_size()) is False
    charged_reorder = solve(problem.graph(table))[0]["stem"].label
    problem.input_reads = {("stem", "mlas:NCHWc"): mlas.input_label(stem, "mlas:NCHWc")}
    assignment, total = solve(problem.graph(table))
    assert charged_reorder == "mlas:NCHW" and assignment["stem"].label == "mlas:NCHWc"
    assert total == pytest.approx(5.0 + 100.0 + 100.0 + 30.0)  # enter in NCHW, stem, next, leave NCHWc
    assert problem.cost_us(table, problem.edges[0], GRAPH_LABEL, "mlas:NCHWc") == pytest.approx(5.0)


def test_a_tensor_crossing_into_or_out_of_acl_pays_its_runner_boundary_and_nowhere_else():
    """ACL's segments exchange tensors with its runner process as files: that boundary is charged
    where a tensor passes between ACL and another library (a model input or output included), not
    where it changes layout inside ACL, and never for libraries without one."""
    shape = (1, 8, 4, 4)
    table = ConversionTable({("acl:NHWC", "in", shape): 5.0, ("acl:NHWC", "out", shape): 6.0,
                             ("acl:NCHW", "in", shape): 0.0, ("acl:NCHW", "out", shape): 0.0,
                             ("acl:boundary", "in", shape): 100.0, ("acl:boundary", "out", shape): 200.0,
                             ("mlas:NCHW", "in", shape): 20.0, ("mlas:NCHW", "out", shape): 0.0,
                             ("xnnpack:NHWC", "in", shape): 3.0, ("xnnpack:NHWC", "out", shape): 4.0,
                             ("acl:flat", "out", (1, 10)): 1.0, ("acl:boundary", "out", (1, 10)): 50.0},
                            crossing=frozenset({"acl"}))
    assert table.cost_us("acl:NCHW", "acl:NHWC", shape) == 5.0  # the permute inside the engine
    assert table.cost_us("acl:NHWC", "acl:NCHW", shape) == 6.0
    assert table.cost_us("mlas:NCHW", "acl:NCHW", shape) == 100.0
    assert table.cost_us("acl:NHWC", "xnnpack:NHWC", shape) == 6.0 + 200.0 + 3.0
    assert table.cost_us(GRAPH_LABEL, "acl:NCHW", shape) == 100.0
    assert table.cost_us("acl:NCHW", GRAPH_LABEL, (1, 10)) == 1.0 + 50.0  # a 2-D tensor out to the model's output
    assert table.cost_us("mlas:NCHW", "xnnpack:NHWC", shape) == 3.0
    assert set(sides_needed("acl:NCHW", "acl:NHWC", shape, {"acl"})) == {("acl:NCHW", "out", shape),
                                                                        ("acl:NHWC", "in", shape)}
    assert ("acl:boundary", "in", shape) in sides_needed("mlas:NCHW", "acl:NCHW", shape, {"acl"})
    assert not any("boundary" in side[0] for side in sides_needed("mlas:NCHW", "xnnpack:NHWC", shape, {"acl"}))


@pytest.mark.emulated
def test_acls_runner_boundary_is_measured_through_its_engine_and_stored(acl, tmp_path):
    device, db = this_device(), RecordDB(tmp_path / "r.db")
    into_acl, out_of_acl = (1, 8, 6, 6), (1, 10)
    sides = set(sides_needed("mlas:NCHW", "acl:NCHW", into_acl, {"acl"}))
    sides |= set(sides_needed("acl:flat", "mlas:flat", out_of_acl, {"acl"}))
    results = []
    table = measure_conversions(sides, {"acl": acl, "mlas": plugins.get_library("mlas")}, device, db, FAST,
                                on_measured=lambda task, result: results.append((task.attrs["label"], result)))
    assert len(results) == len(sides)
    assert all(r.status == "ok" and r.error == 0.0 for _, r in results)  # values unchanged
    assert all(r.median_us > 0 for label, r in results if label == "acl:boundary")
    assert table.crossing == {"acl"}
    entering = table.side_us("acl:boundary", "in", into_acl)
    layouts = table.side_us("mlas:NCHW", "out", into_acl) + table.side_us("acl:NCHW", "in", into_acl)
    assert table.cost_us("mlas:NCHW", "acl:NCHW", into_acl) == pytest.approx(entering + layouts)
    leaving = table.side_us("acl:boundary", "out", out_of_acl)
    layouts = table.side_us("acl:flat", "out", out_of_acl) + table.side_us("mlas:flat", "in", out_of_acl)
    assert table.cost_us("acl:flat", "mlas:flat", out_of_acl) == pytest.approx(leaving + layouts)
    stored = db.records(device.fingerprint, "acl" + RECORD_SUFFIX, acl.version())
    assert {r.task for r in stored} and all(r.emulated == acl.emulated for r in stored)


@pytest.mark.emulated
def test_the_boards_cross_library_flow_plans_acl_with_its_boundary_counted(acl, tmp_path):
    """What `kselect tune --library acl,mlas` does on an aarch64 board, run here through the API
    to exercise that code path (the CLI refuses it on x86_64, where ACL is emulated: these
    timings mean nothing). ACL alone pays its runner boundary at the model's input and output."""
    tuned = tune_and_plan(tmp_path, {"acl": acl, "mlas": plugins.get_library("mlas")})
    model, db, device, plan = tuned["model"], tuned["db"], tuned["device"], tuned["plan"]
    summary = plan.extra["cross_library"]
    input_shape, = model.input_shapes.values()
    output_shape = model.shapes[model.proto.graph.output[0].name]
    entering, leaving = (conversion_task("acl:boundary", "in", input_shape).key,
                         conversion_task("acl:boundary", "out", output_shape).key)
    stored = {r.task: r.result.median_us for r in db.records(device.fingerprint, "acl" + RECORD_SUFFIX, acl.version())}
    assert stored.get(entering, 0) > 0 and stored.get(leaving, 0) > 0, stored
    assert "acl" in summary["single_library"], summary  # ACL ran every tuned op
    # the summary is rounded to 0.001 us
    assert summary["single_library"]["acl"]["conversions_us"] >= stored[entering] + stored[leaving] - 0.0005, \
        (summary, stored)
    assert plan.emulated == ("acl" in plan.libraries and acl.emulated)
    runner = load_plan(plan, model)
    try:
        feeds = random_feeds(model)
        assert compare_outputs(default_session(model).run(None, feeds), runner(feeds)) < 1e-4
    finally:
        runner.close()


def test_the_planner_charges_each_switch_of_library_and_stays_when_a_switch_costs_more_than_it_saves():
    """input -> a -> b -> output: b runs 30 us faster on 'y', the conversions are free, a switch
    x -> y or back costs 20 us: worth one switch (b on y to the end) only when the switch back
    is not needed, so with an op after b on 'x' the plan stays on 'x'."""
    from kselect.core.cross_library.problem import Choice, DataEdge

    def plan(nodes: list[str], y_faster: set[str], switch_us: float) -> dict:
        problem = CrossProblem()
        problem.options = {"input:x": [Option(GRAPH_LABEL, 0.0)], "output:y": [Option(GRAPH_LABEL, 0.0)]}
        for node in nodes:
            problem.options[node] = [Option("x:NCHW", 100.0, Choice("x", None, None, False)),
                                     Option("y:NCHW", 70.0 if node in y_faster else 1000.0, Choice("y", None, None, False))]
        chain = ["input:x", *nodes, "output:y"]
        problem.edges = [DataEdge(a, b, f"t{i}", (1, 8, 4, 4)) for i, (a, b) in enumerate(zip(chain, chain[1:]))]
        table = ConversionTable({(label, d, (1, 8, 4, 4)): 0.0 for label in ("x:NCHW", "y:NCHW") for d in ("in", "out")},
                                switch_us={("x", "y"): switch_us, ("y", "x"): switch_us})
        assignment, total = solve(problem.graph(table))
        assert total == pytest.approx(brute_force(problem.graph(table))[1])
        return {node: assignment[node].label for node in nodes}

    assert plan(["a", "b"], {"b"}, 20.0) == {"a": "x:NCHW", "b": "y:NCHW"}  # one switch, 20 < 30
    assert plan(["a", "b", "c"], {"b"}, 20.0) == {n: "x:NCHW" for n in "abc"}  # two switches, 40 > 30
    assert plan(["a", "b", "c"], {"b"}, 10.0)["b"] == "y:NCHW"  # two switches, 20 < 30


def test_the_ops_of_a_library_that_does_not_spin_pay_its_sleep_cost_and_the_library_that_would_pay_most_spins():
    """input -> a -> b -> c -> output, conversions and switches free. Only one library's workers
    spin in a mixed plan; waking the other's costs x 50 us and y 5 us per op. y is faster on the
    ops in ``y_saves`` by that many us: a mix pays when y's ops save more than 5 us each, with x
    spinning; with most ops on y, x's sleeping ops would pay 50 each, so x still spins."""
    from kselect.core.cross_library.labelling import in_place_labelling
    from kselect.core.cross_library.problem import Choice, DataEdge

    def planned(y_saves: dict[str, float]) -> tuple[dict, str | None]:
        problem = CrossProblem()
        problem.options = {"input:x": [Option(GRAPH_LABEL, 0.0)], "output:y": [Option(GRAPH_LABEL, 0.0)]}
        for node in "abc":
            problem.options[node] = [Option("x:NCHW", 100.0, Choice("x", None, None, False)),
                                     Option("y:NCHW", 100.0 - y_saves.get(node, -900.0), Choice("y", None, None, False))]
        chain = ["input:x", "a", "b", "c", "output:y"]
        problem.edges = [DataEdge(a, b, f"t{i}", (1, 8, 4, 4)) for i, (a, b) in enumerate(zip(chain, chain[1:]))]
        table = ConversionTable({(label, d, (1, 8, 4, 4)): 0.0 for label in ("x:NCHW", "y:NCHW") for d in ("in", "out")},
                                sleep_us={"x": 50.0, "y": 5.0})
        alone = {"x": solve(problem.graph(table, {"x"}))[0]}
        assignment, spinner, _, _ = in_place_labelling(problem, table, ["x", "y"], list(alone.values()), alone)
        return {node: assignment[node].label.split(":")[0] for node in "abc"}, spinner

    assert planned({"c": 30.0}) == ({"a": "x", "b": "x", "c": "y"}, "x")  # saves 30, pays 5
    assert planned({"c": 3.0}) == ({"a": "x", "b": "x", "c": "x"}, "x")  # saves 3, would pay 5: one library
    assert planned({"c": 6.0}) == ({"a": "x", "b": "x", "c": "x"}, "x")  # saves 1 us of 300: within resolution
    # y faster on b and c: x spins (a asleep would pay 50), y's two ops pay 5 each
    assert planned({"b": 30.0, "c": 30.0}) == ({"a": "x", "b": "y", "c": "y"}, "x")
    # y faster everywhere but by less on a than x's sleep cost: all on y, which spins (alone: no charge)
    assert planned({"a": 20.0, "b": 30.0, "c": 30.0}) == ({"a": "y", "b": "y", "c": "y"}, "y")


def test_a_switch_between_libraries_is_measured_on_real_kernels_for_both_directions(tuned):
    switch_us = tuned["plan"].extra["cross_library"]["switch_us"]
    assert set(switch_us) == {"mlas->xnnpack", "xnnpack->mlas"}
    assert all(0.0 <= us < 50_000 for us in switch_us.values())
    switches = tuned["plan"].extra["cross_library"]["switches"]
    # both are rounded to 0.001 us
    assert 0.0 <= switches["us"] <= switches["edges"] * max(switch_us.values()) + 0.0005 * (switches["edges"] + 1)


def test_what_sleeping_workers_cost_is_measured_on_real_kernels_and_charged_to_the_libraries_that_do_not_spin(tuned):
    plan = tuned["plan"]
    summary = plan.extra["cross_library"]
    assert set(summary["sleep_us"]) == {"mlas", "xnnpack"}
    assert all(0.0 <= us < 10_000 for us in summary["sleep_us"].values())
    if not plan.cross_library:
        assert summary["predicted"]["sleeping_us"] == 0.0
        return
    spinner = next(name for name, values in plan.library_settings.items() if values.get("spinning") == 1)
    asleep = sum(summary["sleep_us"][entry["library"]] for entry in plan.nodes.values() if entry["library"] != spinner)
    assert summary["predicted"]["sleeping_us"] == pytest.approx(asleep, abs=0.01 * len(plan.nodes))


def test_select_libraries_refuses_to_mix_emulated_with_native():
    acl = plugins.libraries()["acl"]
    if not acl.availability()[0]:
        pytest.skip("acl not available")
    if acl.emulated:
        with pytest.raises(KselectError, match="cannot mix acl"):
            plugins.select_libraries("mlas,acl")
        assert "acl" not in [lib.name for lib in plugins.select_libraries("all")]
    assert {lib.name for lib in plugins.select_libraries("all")} >= {"mlas", "xnnpack"}


def test_cli_tunes_across_libraries_and_benches_the_plan(tmp_path, small_model_path):
    from kselect.core.whole_model.selection import BASELINE

    plan_path = tmp_path / "small.cross.plan.json"
    tuned = kselect_json("tune", small_model_path, "--library", "mlas,xnnpack", "--budget", "2", "--search", "random",
                         "--min-time", "0.01", "--db", tmp_path / "r.db", "-o", plan_path, "--check-rounds", "2",
                         "--check-max-rounds", "3")
    cross = tuned["cross_library"]
    assert cross["greedy"]["total_us"] > 0 and set(cross["single_library"]) == {"mlas", "xnnpack"}
    assert set(cross["switch_us"]) == {"mlas->xnnpack", "xnnpack->mlas"}  # a switch of library, measured just now
    assert all(us >= 0 for us in cross["switch_us"].values())
    assert cross["remeasured"]["configs"] > 0  # the plan compares timings from one period
    plan = json.loads(plan_path.read_text())
    assert tuned["plan_file"] == str(plan_path) and set(plan["libraries"]) <= {"mlas", "xnnpack"}
    verified = plan["extra"]["verified"]
    assert tuned["kept"] == verified["chosen"] and verified["baseline"] == BASELINE
    assert verified["protocol"].startswith("each alone in a fresh process")
    assert verified["margin"] == 0.02 and verified["slower_limit"] == 1.0  # median >= 1.02x, lower bound >= 1.00x
    # each library's plan is raced or, its loss certain by the predictions in context, skipped
    assert {"mlas plan", "xnnpack plan"} <= {check["variant"] for check in tuned["checks"]}
    timed = [check for check in tuned["checks"] if "failed" not in check and "skipped" not in check]
    assert all(2 <= check["processes"] <= 3 for check in timed)
    if timed:
        assert_kept_by_the_race(verified, tuned["checks"])
    else:  # the MLAS plan is the baseline's own session, the others' loss certain by prediction: none raced
        assert all(check["skipped"] for check in tuned["checks"])
        assert verified["chosen"] == verified["fastest"] == BASELINE and verified["rounds"] == 0
    for check in timed:  # each plan predicted through ONNX Runtime's default session of the same race
        assert check["prediction"]["reference"] == BASELINE
        assert {"library": "mlas+xnnpack", "plan": check["variant"], **check["prediction"]} in tuned["predictions"]
    if verified["chosen"] == BASELINE:  # nothing beat it: ONNX Runtime's own configuration, as an MLAS plan
        assert set(plan["libraries"]) == {"mlas"}
        assert all(entry["config"] == entry["default_config"] for entry in plan["tasks"])
    bench = kselect_json("bench", small_model_path, "--plan", plan_path, "--rounds", "2", "--runs-per-round", "2")
    assert bench["max_relative_output_error"] < 1e-4
    benched = kselect_json("bench", small_model_path, "--plan", plan_path, "--alone", "--rounds", "2",
                           "--runs-per-round", "3")
    assert benched["alone"] and benched["processes"] == 2  # 2 fresh processes per side
    low, high = benched["per_round_bounds"]
    assert low <= benched["per_round_speedup"] <= high  # round by round: the median and its bounds
    assert benched["max_relative_output_error"] < 1e-4 and benched["runs"] >= 6
    assert len(benched["default_process_ms"]) == len(benched["plan_process_ms"]) == 2
    shown = kselect_json("plan", "show", plan_path)
    assert shown["verified"] == verified and {t["id"] for t in shown["tasks"]} == {t["id"] for t in plan["tasks"]}


def test_cli_refuses_an_emulated_library_among_native_ones(small_model_path, tmp_path):
    acl = plugins.libraries()["acl"]
    if not (acl.availability()[0] and acl.emulated):
        pytest.skip("acl is not emulated here")
    result = run_kselect("tune", small_model_path, "--library", "mlas,acl", "--db", tmp_path / "r.db")
    assert result.returncode != 0
    assert result.stderr.strip().count("\n") == 0 and "cannot mix acl" in result.stderr
    assert "Traceback" not in result.stderr


def test_spinning_variants_let_exactly_one_library_spin_and_keep_node_configs_consistent():
    from kselect.core.plans.plan import Plan
    from kselect.core.plans.spinning import spinning_variants

    nodes = {"a": {"task": "T01", "library": "mlas", "config": {"layout": "NCHWc", "threads": 2, "spinning": 1}},
             "b": {"task": "T02", "library": "xnnpack", "config": {"ukernel": "default", "spinning": 0}}}
    tasks = [{"id": "T01", "library": "mlas", "config": dict(nodes["a"]["config"]), "nodes": ["a"]},
             {"id": "T02", "library": "xnnpack", "config": dict(nodes["b"]["config"]), "nodes": ["b"]}]
    plan = Plan({"name": "m"}, {}, {"mlas": "1", "xnnpack": "2"}, False, {}, tasks, nodes,
                library_settings={"mlas": {"threads": 2, "spinning": 1}, "xnnpack": {"spinning": 0}})
    variants = spinning_variants(plan)
    assert [name for name, _ in variants] == ["cross-library plan (mlas spinning)", "cross-library plan (xnnpack spinning)"]
    assert variants[0][1] is plan
    for _, variant in variants:
        spinning = {name: values["spinning"] for name, values in variant.library_settings.items()}
        assert sum(spinning.values()) == 1
        for entry in [*variant.nodes.values(), *variant.tasks]:
            assert entry["config"]["spinning"] == spinning[entry["library"]]
    assert plan.nodes["b"]["config"]["spinning"] == 0  # the original is left as it was


def residual_model(branch: list[str]):
    """input -> a -> relu -> the branch's convs (named ``branch``, each output t<name>);
    add(last branch output, relu) -> c -> output, on a 1 x 4 x 8 x 8 map."""
    from onnx import helper, numpy_helper

    from kselect.core.models.model import model_from_proto

    conv = {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}
    nodes = [helper.make_node("Conv", ["x", "wa"], ["ta"], name="a", **conv),
             helper.make_node("Relu", ["ta"], ["tr"], name="relu")]
    x = "tr"
    for name in branch:
        nodes.append(helper.make_node("Conv", [x, f"w{name}"], [f"t{name}"], name=name, **conv))
        x = f"t{name}"
    nodes += [helper.make_node("Add", [x, "tr"], ["ts"], name="add"),
              helper.make_node("Conv", ["ts", "wc"], ["y"], name="c", **conv)]
    weights = [numpy_helper.from_array(np.ones((4, 4, 3, 3), np.float32), f"w{name}") for name in ["a", *branch, "c"]]
    return model_from_proto("residual", graphs.model(nodes, weights, (1, 4, 8, 8)))


def test_an_add_takes_its_second_input_into_its_first_inputs_label():
    """input -> a -> relu -> b; add(b, relu) -> c: the Add runs where b runs, so the skip tensor
    goes from a's label to b's at the Add, and c reads b's label."""
    from kselect.core.cross_library.problem import DataEdge, data_edges

    model = residual_model(["b"])
    shape = (1, 4, 8, 8)
    assert set(data_edges(model, {"a", "b", "c"})) == {
        DataEdge("input:x", "a", "x", shape), DataEdge("a", "b", "tr", shape), DataEdge("a", "b", "tr", shape, "add"),
        DataEdge("b", "c", "ts", shape), DataEdge("c", "output:y", "y", shape)}


def test_a_flatten_before_an_fc_pays_for_its_input_layout():
    """conv -> pool -> Flatten -> fc: the Flatten runs in the conv's library and reads NCHW order,
    so a conv in a blocked layout pays to leave it there even when the fc is in the same library;
    XNNPack folds the Flatten into its FC and pays nothing. A 1x1 map needs no reorder."""
    from onnx import helper, numpy_helper

    from kselect.core.cross_library.problem import Choice, data_edges
    from kselect.core.models.model import model_from_proto

    def model_with_map(size: int):
        nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
                 helper.make_node("MaxPool", ["c"], ["p"], name="pool", kernel_shape=[2, 2], strides=[2, 2]),
                 helper.make_node("Flatten", ["p"], ["f"], name="flatten", axis=1),
                 helper.make_node("Gemm", ["f", "wf"], ["y"], name="fc", transB=1)]
        weights = [numpy_helper.from_array(np.ones((8, 4, 3, 3), np.float32), "w"),
                   numpy_helper.from_array(np.ones((10, 8 * (size // 2) ** 2), np.float32), "wf")]
        return model_from_proto(f"flat{size}", graphs.model(nodes, weights, (1, 4, size, size)))

    edges = data_edges(model_with_map(8), {"conv", "fc"})
    into_fc = next(e for e in edges if e.consumer == "fc")
    assert (into_fc.producer, into_fc.tensor, into_fc.shape, into_fc.flattened) == ("conv", "f", (1, 128), (1, 8, 4, 4))
    assert next(e for e in data_edges(model_with_map(2), {"conv", "fc"}) if e.consumer == "fc").flattened is None

    mlas, xnnpack = plugins.get_library("mlas"), plugins.get_library("xnnpack")
    problem = CrossProblem(edges=[into_fc])
    problem.flatten_reads = {label: library.flatten_label(label)
                             for library, label in ((mlas, "mlas:NCHWc"), (mlas, "mlas:NCHW"), (xnnpack, "xnnpack:NHWC"))}
    table = ConversionTable({("mlas:NCHWc", "out", (1, 8, 4, 4)): 7.0, ("mlas:flat", "out", (1, 128)): 0.0,
                             ("xnnpack:flat", "in", (1, 128)): 3.0, ("xnnpack:flat", "out", (1, 128)): 2.0,
                             ("mlas:flat", "in", (1, 128)): 5.0})
    assert problem.cost_us(table, into_fc, "mlas:NCHWc", "mlas:NCHW") == pytest.approx(7.0)  # the reorder only
    assert problem.cost_us(table, into_fc, "mlas:NCHW", "mlas:NCHW") == 0.0
    assert problem.cost_us(table, into_fc, "xnnpack:NHWC", "xnnpack:NHWC") == 0.0  # folded into the FC
    assert problem.cost_us(table, into_fc, "mlas:NCHWc", "xnnpack:NHWC") == pytest.approx(7.0 + 3.0)
    problem.options = {"conv": [Option("mlas:NCHWc", 1.0, Choice("mlas", None, None, False))],
                       "fc": [Option("xnnpack:NHWC", 1.0, Choice("xnnpack", None, None, False))]}
    assert ("mlas:NCHWc", "out", (1, 8, 4, 4)) in problem.sides()


def test_a_flat_tensor_into_or_out_of_an_int8_op_pays_its_quantize_or_dequantize():
    """An fc's 2-D input is quantized like a 4-D one: the int8 side keeps its label at any rank
    (only layouts collapse to ``flat``); leaving int8 for a float op of the same library makes no
    runner call."""
    shape = (1, 128)
    assert sides_needed("mlas:NCHW", "mlas:int8", shape) == [("mlas:flat", "out", shape), ("mlas:int8", "in", shape)]
    table = ConversionTable({("mlas:flat", "out", shape): 0.0, ("mlas:flat", "in", shape): 5.0,
                             ("mlas:int8", "in", shape): 4.0, ("mlas:int8", "out", shape): 3.0})
    assert table.cost_us("mlas:NCHW", "mlas:int8", shape) == pytest.approx(4.0)
    assert table.cost_us("mlas:int8", "mlas:NCHW", shape) == pytest.approx(3.0)


def test_a_branch_waiting_across_another_librarys_segment_pays_its_reentry_and_an_island_that_cannot_pay_it_goes_back():
    """input -> a -> relu -> b -> b2; add(b2, relu) -> c. With b alone on library 'y', the model
    runs in three segments (x: a, relu | y: b | x: b2, add, c), so the skip tensor leaves x's
    runner and enters it again though no edge changes its label (leaving it, the edge into b pays).
    b saves 45 us on 'y' and the two edges around it cost 40: worth it between neighbours, not
    with the 10 us reentry; saving 70 us it is, and the plan's total counts the reentry."""
    from kselect.core.cross_library.labelling import without_unpaid_islands
    from kselect.core.cross_library.problem import Choice, data_edges

    model = residual_model(["b", "b2"])
    shape = (1, 4, 8, 8)
    table = ConversionTable({(label, d, shape): 10.0 for label in ("x:NCHWc", "y:NHWC") for d in ("in", "out")})

    def planned(b_on_y_us: float):
        problem = CrossProblem(model=model, runs_op=lambda library, op_type: True)
        problem.options = {node: [Option("x:NCHWc", 100.0, Choice("x", None, None, False)),
                                  Option("y:NHWC", b_on_y_us if node == "b" else 1000.0, Choice("y", None, None, False))]
                           for node in ("a", "b", "b2", "c")}
        problem.options.update({"input:x": [Option(GRAPH_LABEL, 0.0)], "output:y": [Option(GRAPH_LABEL, 0.0)]})
        problem.edges = data_edges(model, {"a", "b", "b2", "c"})
        graph = problem.graph(table)
        exact, _ = solve(graph)
        assert exact["b"].label == "y:NHWC"  # between neighbours, b on 'y' always pays
        alone = {"x": solve(problem.graph(table, {"x"}))[0]}
        missing = set()
        assignment, moved = without_unpaid_islands(problem, lambda a: problem.total_us(table, a, missing),
                                                    exact, alone)
        assert not missing
        labels = {node: option.label for node, option in assignment.items()}
        return labels["b"], moved, problem.reentries(table, labels), problem.total_us(table, assignment)

    into_and_out_of_the_model = 20.0
    label, moved, reentries, total = planned(55.0)
    assert (label, moved, reentries) == ("x:NCHWc", 1, []) and total == pytest.approx(400.0 + into_and_out_of_the_model)
    label, moved, reentries, total = planned(30.0)
    assert (label, moved) == ("y:NHWC", 0)
    assert [(r["tensor"], r["from_segment"], r["to_segments"], r["time_us"]) for r in reentries] == [("tr", 1, [3], 10.0)]
    assert total == pytest.approx(330.0 + into_and_out_of_the_model + 40.0 + 10.0)


def test_a_tensor_sent_through_an_op_its_library_lacks_pays_the_way_to_onnxruntime_and_back():
    """input -> a -> tanh -> b -> output, with a Tanh that library 'xnnpack' does not run: with a
    and b on it, the model runs in three segments (xnnpack: a | mlas: tanh | xnnpack: b) though
    no edge changes a label. The tensor into the Tanh leaves XNNPack (10 us) and enters ONNX
    Runtime (5 us); its result enters XNNPack again (10 us). At 30 us saved per op that is worth
    it; at 10 us it is not, and the plan stays on ONNX Runtime."""
    from onnx import helper, numpy_helper

    from kselect.core.cross_library.labelling import in_place_labelling
    from kselect.core.cross_library.problem import Choice, data_edges
    from kselect.core.models.model import model_from_proto

    conv = {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}
    nodes = [helper.make_node("Conv", ["x", "wa"], ["ta"], name="a", **conv),
             helper.make_node("Tanh", ["ta"], ["tt"], name="tanh"),
             helper.make_node("Conv", ["tt", "wb"], ["y"], name="b", **conv)]
    weights = [numpy_helper.from_array(np.ones((4, 4, 3, 3), np.float32), name) for name in ("wa", "wb")]
    model = model_from_proto("tanh", graphs.model(nodes, weights, (1, 4, 8, 8)))
    shape = (1, 4, 8, 8)
    table = ConversionTable({("xnnpack:NHWC", "in", shape): 10.0, ("xnnpack:NHWC", "out", shape): 10.0,
                             ("mlas:NCHW", "in", shape): 5.0, ("mlas:NCHW", "out", shape): 0.0})

    def planned(saved_us: float):
        problem = CrossProblem(model=model, runs_op=lambda library, op_type: library == "mlas" or op_type != "Tanh")
        problem.options = {node: [Option("mlas:NCHW", 100.0, Choice("mlas", None, None, False)),
                                  Option("xnnpack:NHWC", 100.0 - saved_us, Choice("xnnpack", None, None, False))]
                           for node in ("a", "b")}
        problem.options.update({"input:x": [Option(GRAPH_LABEL, 0.0)], "output:y": [Option(GRAPH_LABEL, 0.0)]})
        problem.edges = data_edges(model, {"a", "b"})
        graph = problem.graph(table)
        exact, _ = solve(graph)
        assert exact["a"].label == exact["b"].label == "xnnpack:NHWC"  # between neighbours XNNPack always pays
        alone = {name: solve(problem.graph(table, {name}))[0] for name in ("mlas", "xnnpack")}
        missing = set()
        assignment, *_ = in_place_labelling(problem, table, [], [exact], alone, missing)
        assert not missing
        labels = {node: option.label for node, option in assignment.items()}
        return labels, problem.reentries(table, labels), problem.total_us(table, assignment)

    labels, crossings, total = planned(30.0)
    assert labels["a"] == labels["b"] == "xnnpack:NHWC"
    assert [(r["tensor"], r["from_segment"], r["to_segments"], r["time_us"], r["fallback"]) for r in crossings] == [
        ("ta", 1, [2], 15.0, True), ("tt", 2, [3], 10.0, True)]
    into_and_out_of_xnnpack = 20.0
    assert total == pytest.approx(140.0 + into_and_out_of_xnnpack + 25.0)
    labels, crossings, total = planned(10.0)
    assert labels["a"] == labels["b"] == "mlas:NCHW" and crossings == []
