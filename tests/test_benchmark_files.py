"""A benchmark run never writes over figures it does not own: the precision and mixed-precision
benchmarks add their models to a results file of the same device, and refuse, in one line and
before measuring, a results file of another device, an unreadable one, or a page whose results
file is missing (each would have been replaced by the new run's models alone)."""

import json
import subprocess
import sys

import pytest

from helpers import REPO
from kselect.core.measuring.device import this_device

SCRIPTS = ["precision.py", "mixed_precision.py"]


def run_benchmark(script, *args):
    return subprocess.run([sys.executable, str(REPO / "benchmarks" / script), "--models", "resnet18", *map(str, args)],
                          capture_output=True, text=True, timeout=300)


def assert_refused(result, fragment):
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith("error: ") and fragment in lines[0], lines[0]


@pytest.mark.parametrize("script", SCRIPTS)
def test_results_of_another_device_are_refused_and_kept(script, tmp_path):
    results, page = tmp_path / "results.json", tmp_path / "page.md"
    results.write_text(json.dumps({"device": "Another CPU (x86_64, 2 cores: 2)", "device_fingerprint": "0123456789abcdef",
                                   "models": [{"model": "resnet50", "sides": {}}]}))
    page.write_text("# Another CPU's page\n\n## resnet50\n")
    before = results.read_bytes(), page.read_bytes()
    result = run_benchmark(script, "--json", results, "--markdown", page, "--db", tmp_path / "r.db")
    assert_refused(result, "holds the figures of another device (Another CPU")
    assert "name a new --json and --markdown" in result.stderr
    assert (results.read_bytes(), page.read_bytes()) == before
    assert not (tmp_path / "r.db").exists()  # refused before anything was measured


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_page_without_its_results_file_is_refused(script, tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A page of eight models\n")
    result = run_benchmark(script, "--json", tmp_path / "missing.json", "--markdown", page, "--db", tmp_path / "r.db")
    assert_refused(result, "exists but its results file")
    assert page.read_text() == "# A page of eight models\n"
    assert not (tmp_path / "missing.json").exists()


def test_an_unreadable_results_file_is_refused(tmp_path):
    results = tmp_path / "results.json"
    results.write_text('{"device": "x", "models": [')
    result = run_benchmark("precision.py", "--json", results, "--markdown", tmp_path / "page.md")
    assert_refused(result, "is not a results file of this benchmark")
    assert results.read_text() == '{"device": "x", "models": ['


def test_results_of_this_device_are_kept_except_the_models_run_again(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    from results_file import earlier_results

    device = this_device()
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"device": device.summary(), "device_fingerprint": device.fingerprint,
                                   "libraries": {"mlas": "onnxruntime 1.0"},
                                   "models": [{"model": "resnet50"}, {"model": "resnet18"}]}))
    previous = earlier_results(str(results), str(tmp_path / "page.md"), device, ["resnet18"])
    assert previous["models"] == [{"model": "resnet50"}]
    assert previous["libraries"] == {"mlas": "onnxruntime 1.0"}
    assert earlier_results(str(tmp_path / "new.json"), str(tmp_path / "new.md"), device, ["resnet18"]) == {"models": []}
