"""The OpenVINO plugin (PyPI openvino, its CPU plugin): a candidate is what the runtime model shows
OpenVINO ran, a hint it ignores is never a candidate; a plan runs the whole model with its hints
and exports as an IR that plain openvino loads; OpenVINO missing is told in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from graphs import small_cnn
from helpers import run_kselect

from kselect.core.contract import plugins
from kselect.core.measuring.device import this_device
from kselect.core.measuring.measure import MeasureSettings
from kselect.core.measuring.worker import MeasureWorker
from kselect.core.models.model import model_from_proto
from kselect.core.models.tasks import extract_tasks
from kselect.core.plans.plan import Plan
from kselect.core.plans.runtime import load_plan

openvino = pytest.importorskip("openvino")

QUICK = MeasureSettings(warmup=1, min_repeats=2, min_time_s=0.001, max_time_s=0.05)


@pytest.fixture(scope="module")
def library():
    return plugins.get_library("openvino")


@pytest.fixture(scope="module")
def model():
    return model_from_proto("small_cnn", small_cnn())


def _task(model, node):
    return next(t for t in extract_tasks(model) if node in t.nodes)


def _config(impl, hinted=True, precision="f32"):
    return {"impl": impl, "hinted": hinted, "precision": precision, "threads": this_device().cores, "pinning": True}


def _plan(nodes: dict[str, dict]) -> Plan:
    return Plan(model={}, device={}, libraries={"openvino": ""}, emulated=False, tasks=[],
                plan_level={"threads": this_device().cores, "pinning": True},
                nodes={node: {"library": "openvino", "config": config} for node, config in nodes.items()})


def test_a_hint_openvino_takes_is_a_candidate_and_one_it_ignores_is_not(library, model):
    """The stem conv (3 input channels) takes cpu:jit_avx512 in f32; the 16-channel conv after it,
    alone in a model, does not (OpenVINO runs jit_gemm): it is not in its space, and measuring it
    anyway fails with what OpenVINO ran instead."""
    device = this_device()
    stem, conv = _task(model, "stem"), _task(model, "block.conv1")
    assert _config("jit_avx512") in library.space(stem, device)
    assert _config("jit_avx512") not in library.space(conv, device)
    with MeasureWorker(library, QUICK) as worker:
        taken = worker.measure(stem, _config("jit_avx512"))
        ignored = worker.measure(conv, _config("jit_avx512"))
    assert taken.status == "ok" and taken.error < 1e-5
    assert ignored.status == "failed"
    assert "did not run cpu:jit_avx512 in f32: it ran jit_gemm_f32" in ignored.reason


def test_the_whole_model_runner_reads_back_what_each_node_ran(library, model):
    """In the whole model the stem's hint takes effect, and a gemm_avx512 hint on the strided conv
    is dropped: the runtime model shows another implementation, which the runner reports."""
    runner = library.model_runner(model, _plan({"stem": _config("jit_avx512"), "down": _config("gemm_avx512")}))
    try:
        assert (runner.ran["stem"].impl, runner.ran["stem"].primitive) == ("jit_avx512", "jit_avx512_f32")
        assert runner.ran["down"].impl != "gemm_avx512" and runner.ran["down"].precision == "f32"
    finally:
        runner.close()


def test_a_tuned_plan_exported_as_ir_runs_in_plain_openvino(library, model, tmp_path):
    """A plan tuned for real (the stem then set to a hinted implementation from its space) written
    by ``kselect plan apply``'s library step: plain openvino, with kselect not importable, loads the
    IR with the JSON's properties, reproduces the plan's outputs and runs the stem as the plan says."""
    from kselect.core.api import tune

    result = tune(model, ["openvino"], search="random", budget=2, db=tmp_path / "records.db", settings=QUICK,
                  verify=False)
    plan = result.plan
    stem = _config("jit_avx512")
    stem.update(threads=plan.plan_level["threads"], pinning=plan.plan_level["pinning"])
    assert stem in library.space(_task(model, "stem"), this_device())
    plan.nodes["stem"]["config"] = stem
    written = library.apply(plan, model, tmp_path / "out")
    xml, _, settings = written
    feeds = {"input": np.random.default_rng(3).standard_normal((1, 3, 32, 32)).astype(np.float32)}
    np.save(tmp_path / "input.npy", feeds["input"])
    script = f"""
import json, sys
sys.modules["kselect"] = None  # plain openvino: kselect cannot be imported
import numpy as np, openvino as ov
settings = json.load(open({str(settings)!r}))
core = ov.Core()
compiled = core.compile_model(core.read_model({str(xml)!r}), settings["device"], settings["properties"])
out = compiled({{"input": np.load({str(tmp_path / "input.npy")!r})}})[compiled.outputs[0]]
np.save({str(tmp_path / "plain.npy")!r}, out)
ran = {{}}
for node in compiled.get_runtime_model().get_ordered_ops():
    info = node.get_rt_info()
    for name in info["originalLayersNames"].astype(str).split(","):
        ran[name] = info["primitiveType"].astype(str)
print(json.dumps(ran))
"""
    plain = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert plain.returncode == 0, plain.stderr
    ran = json.loads(plain.stdout)
    exported = json.loads(settings.read_text())
    assert exported["properties"]["INFERENCE_PRECISION_HINT"] == "f32"
    assert exported["nodes"]["stem"]["primitive"] == "jit_avx512_f32"
    for node, entry in exported["nodes"].items():
        assert any(ran.get(layer) == entry["primitive"] for layer in entry["layers"]), (node, entry, ran)
    runner = load_plan(plan, model)
    try:
        np.testing.assert_array_equal(np.load(tmp_path / "plain.npy"), runner(feeds)[0])
    finally:
        runner.close()


def test_kselect_plugins_lists_openvino():
    listed = run_kselect("plugins", "--json")
    assert listed.returncode == 0, listed.stderr
    row = next(info for info in json.loads(listed.stdout) if info["name"] == "openvino")
    assert row["kind"] == "library" and row["status"] == "available"
    assert row["version"].startswith(f"OpenVINO {openvino.get_version()[:6]}")


def _kselect_without_openvino(*args):
    """kselect as a user without the openvino package runs it (its import fails)."""
    script = ("import sys; sys.modules['openvino'] = None\n"
              "from kselect.cli.main import main\n"
              f"sys.exit(main({list(map(str, args))!r}))")
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "COLUMNS": "200"})


def test_openvino_missing_is_one_line_and_a_tune_naming_it_fails_before_measuring(small_model_path, tmp_path):
    listed = _kselect_without_openvino("plugins", "--json")
    assert listed.returncode == 0, listed.stderr
    row = next(info for info in json.loads(listed.stdout) if info["name"] == "openvino")
    assert row["status"].startswith("unavailable: the openvino package does not import")
    assert "\n" not in row["status"] and "pip install openvino==" in row["status"]
    db = tmp_path / "records.db"
    tuned = _kselect_without_openvino("tune", small_model_path, "--library", "openvino", "--db", db)
    assert tuned.returncode == 2
    assert "library 'openvino' is not available here" in tuned.stderr
    assert "Traceback" not in tuned.stderr
    assert not db.exists()
