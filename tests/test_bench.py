"""The end-to-end checks repeat a measurement taken while the machine stalled, and keep a plan
that switches libraries more only when it is clearly faster (logic only: the
interleaved runs are scripted; the checks on real runners are in test_mlas.py and test_crossplan.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

import kselect.core.whole_model.alone as alone_module
import kselect.core.whole_model.bench as bench_module
import kselect.core.whole_model.selection as selection_module
from kselect.core.whole_model.selection import choose_result

UNSTEADY = {"default": [10.0, 17.0, 10.0, 17.0, 10.0, 17.0], "plan": [9.0, 9.1, 9.0, 9.2, 9.1, 9.0]}
WORSE = {"default": [10.0, 30.0, 10.0, 30.0, 10.0, 30.0], "plan": [9.0, 9.1, 9.0, 9.2, 9.1, 9.0]}
STEADY = {"default": [10.0, 10.2, 10.1, 10.0, 10.3, 10.1], "plan": [9.0, 9.1, 9.0, 9.2, 9.1, 9.0]}


def scripted(monkeypatch, runs):
    calls = iter(runs)
    monkeypatch.setattr(bench_module, "interleaved", lambda *args, **kwargs: next(calls))


def test_an_unsteady_run_is_repeated_until_a_steady_one(monkeypatch):
    scripted(monkeypatch, [UNSTEADY, STEADY, WORSE])
    times, runs = bench_module.steady_interleaved({}, {}, 2, 3)
    assert times is STEADY and runs == 2


def test_after_the_last_attempt_the_steadiest_run_is_kept(monkeypatch):
    scripted(monkeypatch, [WORSE, UNSTEADY, WORSE])
    times, runs = bench_module.steady_interleaved({}, {}, 2, 3, attempts=3)
    assert times is UNSTEADY and runs == 3


def test_a_steady_run_is_not_repeated(monkeypatch):
    scripted(monkeypatch, [STEADY, UNSTEADY])
    assert bench_module.steady_interleaved({}, {}, 2, 3) == (STEADY, 1)


def test_after_each_switch_a_runner_runs_untimed_until_the_previous_ones_threads_are_quiet(monkeypatch):
    """Scripted runners of 5 ms (on a scripted clock, so a loaded machine changes nothing): with
    settle_s 0.03 each switch runs the next one untimed for at least 30 ms (XNNPack's pool spins
    that long after its work) before timing it."""
    clock = {"now": 0.0}
    monkeypatch.setattr(bench_module.time, "perf_counter", lambda: clock["now"])
    calls = {"a": 0, "b": 0}

    def runner(name):
        def run(feeds):
            calls[name] += 1
            clock["now"] += 0.005
        return run

    times = bench_module.interleaved({"a": runner("a"), "b": runner("b")}, {}, rounds=2, runs_per_round=2, warmup=0,
                                     settle=1, settle_s=0.03)
    assert all([round(v, 6) for v in values] == [5.0] * 4 for values in times.values())
    for name in calls:  # 2 switches each: at least 6 settle runs of 5 ms, plus 4 timed runs
        assert calls[name] >= 2 * 6 + 4


def result(variant: str, ms: float, segments: int, spread: float = 0.05) -> dict:
    return {"variant": variant, "plan_ms": ms, "plan_spread": spread, "segments": segments}


def test_a_plan_with_more_library_switches_is_kept_only_when_clearly_faster():
    single = result("mlas plan", 58.46, 1, spread=0.13)
    # resnet50 in a table2 run: 5% faster in the run that chose it, 8% slower in the next
    mixed = result("cross-library plan", 55.53, 4, spread=0.162)
    assert choose_result([single, mixed]) is single  # within max(2%, 16.2% / 2) of it
    clearly = result("cross-library plan", 50.0, 4, spread=0.162)
    assert choose_result([single, clearly]) is clearly  # 17% faster
    # the margin is at least 2%, even in a steady run
    assert choose_result([result("a", 19.81, 1, 0.035), result("b", 19.75, 3, 0.033)])["variant"] == "a"
    assert choose_result([result("a", 19.81, 1, 0.035), result("b", 19.0, 3, 0.033)])["variant"] == "b"


def test_among_plans_within_the_margin_the_fewest_segments_win_then_the_fastest():
    results = [result("xnnpack plan", 101.0, 1), result("mlas plan", 100.5, 1), result("three", 100.2, 3),
               result("eight", 100.0, 8)]
    assert choose_result(results)["variant"] == "mlas plan"
    assert choose_result([result("three", 100.2, 3), result("eight", 100.0, 8)])["variant"] == "three"
    # plans with the same number of segments: simply the fastest
    assert choose_result([result("mlas plan", 100.5, 1), result("xnnpack plan", 100.0, 1)])["variant"] == "xnnpack plan"


def test_a_plan_whose_threads_sleep_is_kept_only_when_clearly_faster_than_spinning_ones():
    """vgg16 (a table2 run): the MLAS plan with spinning 0 read 1.015x ONNX Runtime's
    default in the run that chose it and 0.79x in the next."""
    sleeping = {**result("mlas plan", 185.22, 1, 0.015), "sleeps": True}
    spinning = {**result("mlas plan (spinning)", 186.5, 1, 0.02), "sleeps": False}
    assert choose_result([sleeping, spinning]) is spinning
    assert choose_result([{**sleeping, "plan_ms": 170.0}, spinning])["variant"] == "mlas plan"  # 9% faster
    # among equally risky plans, simply the fastest
    assert choose_result([sleeping]) is sleeping


def test_median_bounds_are_the_sign_test_order_statistics():
    """87.5% distribution-free bounds: the extremes of 4 rounds, the 2nd values of 8, the 3rd of 12."""
    assert alone_module.median_bounds([1.0, 4.0, 2.0, 3.0]) == (1.0, 2.5, 4.0)
    assert alone_module.median_bounds(list(range(1, 9))) == (2, 4.5, 7)
    assert alone_module.median_bounds(list(range(1, 13))) == (3, 6.5, 10)


def test_a_plan_replaces_the_default_only_when_its_per_round_speedups_show_it_faster():
    verdict = selection_module.race_verdict
    assert verdict([1.02, 1.02, 1.036, 1.06]) == "faster"  # every round at least 2% faster
    assert verdict([0.907, 1.03, 1.05, 1.091]) == "undecided"  # resnet101's MLAS plan in a table2 run
    assert verdict([0.95, 0.96, 1.0, 1.01]) == "not faster"  # no round 2% faster
    assert verdict([1.05, 1.06, 1.04]) == "undecided"  # too few rounds for a verdict
    assert verdict([0.97, 1.05, 1.06, 1.04]) == "undecided"  # one round at 0.97: the lower bound is below 1
    # yolov8n's cross-library plan in one tune: median 1.029x over 10 rounds, lower bound 0.9996x;
    # the benchmark's own rounds then read it 0.977x. Not shown faster.
    assert verdict([1.5059, 1.039, 0.9635, 0.936, 1.042, 1.0301, 1.084, 1.025, 1.0278, 0.9996]) == "undecided"
    assert verdict([1.5059, 1.039, 1.0035, 1.036, 1.042, 1.0301, 1.084, 1.025, 1.0278, 1.0096]) == "faster"


def test_racing_several_plans_widens_each_plans_bounds():
    """Alone, 10 rounds give the 3rd smallest speedup as the lower bound; as the best of two
    plans raced against one baseline (Bonferroni), the 2nd smallest: a plan with two rounds below
    1.0 is then not shown faster."""
    speedups = [0.99, 0.995, 1.03, 1.04, 1.05, 1.05, 1.06, 1.06, 1.07, 1.08]
    assert selection_module.race_verdict(speedups) == "faster"
    assert selection_module.race_verdict(speedups, comparisons=2) == "undecided"
    assert alone_module.median_bounds(speedups, alone_module.family_confidence(2))[0] == 0.995
    assert alone_module.family_confidence(1) == alone_module.CONFIDENCE


def scripted_processes(monkeypatch, plan_ms_by_round):
    """``_run_alone`` answering from a script: the baseline at 10 ms in every round, each plan at
    its scripted ms in round r (the job's result file names the candidate)."""
    ran = []

    def run_alone(job, timeout_s):
        index = int(Path(job["result"]).stem.removeprefix("result"))
        name = list(plan_ms_by_round)[index]
        ran.append(name)
        ms = plan_ms_by_round[name][sum(n == name for n in ran) - 1]
        if job["outputs"]:
            np.savez(job["outputs"], np.ones(3))
        return {"times": [ms] * 3, "segments": 1}

    monkeypatch.setattr(alone_module, "_run_alone", run_alone)
    return ran


class ScriptedPlan:
    def __init__(self):
        self.extra, self.library_settings, self.libraries, self.plan_level = {}, {"mlas": {}}, {"mlas": ""}, {}
        self.tasks, self.nodes = [], {}  # an fp32 plan: no int8 ops

    def save(self, path):
        pass

    def estimated_us(self):  # its predicted time, beside the measured one (core/whole_model/prediction.py)
        return 0.0


def test_undecided_plans_run_more_rounds_with_the_default_and_decided_ones_stop(monkeypatch, tmp_path):
    """Logic only (the processes are scripted; tests/test_crossplan.py runs real ones): after 4
    rounds a plan 5% faster in each is shown faster and stops; one that alternates 0.9x and 1.1x
    runs with the default up to the maximum and is not kept; the default's configuration is."""
    from kselect.core.models.model import load_model

    model = load_model("mobilenetv2", ["input=1,3,32,32"])
    baseline = [10.0] * 10
    faster = [10 / 1.05] * 10
    erratic = [10 / 0.9, 10 / 1.1] * 5
    ran = scripted_processes(monkeypatch, {selection_module.BASELINE: baseline, "faster": faster, "erratic": erratic})
    fallback, plans = ScriptedPlan(), {"faster": ScriptedPlan(), "erratic": ScriptedPlan()}
    kept, results = selection_module.verified_across(model, list(plans.items()), rounds=4, fallback=fallback, max_rounds=8)
    by_name = {r["variant"]: r for r in results}
    assert ran.count("faster") == 4 and ran.count("erratic") == 8 and ran.count(selection_module.BASELINE) == 8
    assert by_name["faster"]["verdict"] == "faster" and by_name["erratic"]["verdict"] == "undecided"
    assert by_name["erratic"]["round_speedups"] == [0.9, 1.1] * 4
    assert kept.extra["verified"]["chosen"] == "faster" and kept.extra["verified"]["shown_faster"] == ["faster"]

    ran.clear()
    scripted_processes(monkeypatch, {selection_module.BASELINE: baseline, "erratic": erratic})
    kept, results = selection_module.verified_across(model, [("erratic", plans["erratic"])], rounds=4, fallback=fallback,
                                                 max_rounds=6)
    assert kept.extra["verified"]["chosen"] == selection_module.BASELINE
    assert results[0]["processes"] == 6
