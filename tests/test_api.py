"""The Python API (kselect.tune, kselect.bench) as a script would use it: the same flow the CLI
runs, on real kernels."""

from __future__ import annotations

import pytest

import kselect
from kselect.core import api
from kselect.core.errors import KselectError
from kselect.core.measuring.measure import MeasureSettings
from kselect.core.whole_model.selection import switching_margin

FAST = MeasureSettings(timeout_s=120, min_time_s=0.01, min_repeats=3, max_time_s=0.2)


class Recorder(api.TuneEvents):
    def __init__(self):
        self.calls = []

    def library_started(self, model, library, tasks, options, device, db):
        self.calls.append(("library_started", library.name, len(tasks)))

    def measured(self, task, config, result, outcome):
        self.calls.append(("measured", task.id, result.status))

    def library_tuned(self, tuning):
        self.calls.append(("library_tuned", tuning.library.name))


def test_tune_from_python_returns_the_plan_and_its_evidence(small_model_path, tmp_path):
    events = Recorder()
    result = kselect.tune(str(small_model_path), "mlas", budget=2, db=tmp_path / "r.db", settings=FAST, events=events)
    tuning = result.tunings["mlas"]
    assert result.plan is tuning.plan
    # the end-to-end check keeps the first variant, most tuned first, that computes what the library
    # default does and is not slower than it; if none is, the last that computes the same
    tried = result.plan.extra["verified"]["tried"]
    kept_at = [t["variant"] for t in tried].index(result.kept)
    assert tried[kept_at]["max_relative_output_error"] <= 1e-3
    for rejected in tried[:kept_at]:
        assert rejected["max_relative_output_error"] > 1e-3 or rejected["speedup"] < 1 + switching_margin(rejected)
    for later in tried[kept_at + 1:]:  # tried only when none passed
        assert later["max_relative_output_error"] > 1e-3
    assert {node for task in tuning.tasks for node in task.nodes} == set(result.plan.nodes)
    assert all(o.default is not None and o.default.status == "ok" for o in tuning.outcomes)
    assert events.calls[0] == ("library_started", "mlas", len(tuning.tasks))
    assert events.calls[-1] == ("library_tuned", "mlas")
    measured = [c for c in events.calls if c[0] == "measured"]
    assert len(measured) == sum(o.samples for o in tuning.outcomes)
    summary = result.to_json()
    assert summary["kept"] == result.kept and summary["libraries"][0]["library"] == "mlas"

    written = api.save(result, tmp_path / "small.plan.json")
    assert (tmp_path / "small.plan.json").exists() and all(p.exists() for p in written)
    figures = kselect.bench(str(small_model_path), tmp_path / "small.plan.json", rounds=2, runs_per_round=2)
    assert figures["baseline"] == "mlas default" and figures["max_relative_output_error"] <= 1e-3
    assert figures["plan_ms"] > 0 and figures["default_ms"] > 0


def test_bad_arguments_are_refused_before_anything_is_measured(small_model_path, tmp_path):
    db = tmp_path / "never.db"
    with pytest.raises(KselectError, match="unknown library"):
        kselect.tune(str(small_model_path), "nosuchlib", db=db)
    with pytest.raises(KselectError, match="unknown search"):
        kselect.tune(str(small_model_path), "mlas", search="nosuch", db=db)
    assert not db.exists()
