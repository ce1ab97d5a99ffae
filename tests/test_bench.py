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
