"""The end-to-end checks repeat a measurement taken while the machine stalled (logic only: the
interleaved runs are scripted; the checks on real runners are in test_mlas.py and test_crossplan.py)."""

from __future__ import annotations

import kselect.core.bench as bench_module

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


def test_after_each_switch_a_runner_runs_untimed_until_the_previous_ones_threads_are_quiet():
    """Scripted runners of 5 ms: with settle_s 0.03 each switch runs the next one untimed for at
    least 30 ms (XNNPack's pool spins that long after its work) before timing it."""
    import time

    calls = {"a": 0, "b": 0}

    def runner(name):
        def run(feeds):
            calls[name] += 1
            time.sleep(0.005)
        return run

    times = bench_module.interleaved({"a": runner("a"), "b": runner("b")}, {}, rounds=2, runs_per_round=2, warmup=0,
                                     settle=1, settle_s=0.03)
    assert all(len(values) == 4 for values in times.values())
    for name in calls:  # 2 switches each: at least 6 settle runs of 5 ms, plus 4 timed runs
        assert calls[name] >= 2 * 6 + 4
