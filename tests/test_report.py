"""`kselect report`: the page of plans made by real tunes, loaded in a real headless Chromium
(Debian's, installed by scripts/setup.sh), with nothing fetched, no script error, and every chart
drawn."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import numpy as np
import onnx
import pytest
from graphs import small_cnn
from helpers import feeds_folder, run_kselect
from PIL import Image

import kselect
from kselect.core.contract import plugins
from kselect.core.measuring.measure import MeasureSettings
from kselect.core.plans.plan import load_plan_file
from kselect.core.report.page import EMULATED_BANNER, chart_names, write_report
from kselect.plugins.acl import build

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
FAST = MeasureSettings(timeout_s=120, min_time_s=0.01, min_repeats=3, max_time_s=0.2)
EVERY_CHART = {"time-by-op-type", "time-by-library", "tuning-curves", "whole-model-check"}


def predictions_of(plan) -> list[str]:
    """The plans a tune timed end to end with a predicted time: the report's "prediction" chart."""
    tried = [t["variant"] for t in plan.extra.get("verified", {}).get("tried", []) if "prediction" in t]
    return tried + [p["name"] for p in plan.extra.get("precision", {}).get("front", []) if "prediction" in p]


def charts_of(plan) -> set[str]:
    # a race with nothing left to time (every candidate skipped) keeps the default untimed: no check chart
    untimed = plan.extra.get("verified", {}).get("rounds") == 0
    return (EVERY_CHART - ({"whole-model-check"} if untimed else set())) | ({"prediction"} if predictions_of(plan) else set())


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: `make setup` installs Debian's chromium (scripts/system-packages.txt)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("the playwright package is missing: `make setup` installs the test extra (pip install -e '.[test]')")
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


def load(browser, path: Path):
    """The report opened from its file, after checking that loading it logged no error and asked
    for nothing but the file itself."""
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    problems, requests = [], []
    page.on("console", lambda message: problems.append(f"console {message.type}: {message.text}")
            if message.type in ("error", "warning") else None)
    page.on("pageerror", lambda error: problems.append(f"page error: {error}"))
    page.on("requestfailed", lambda request: problems.append(f"failed request: {request.url}"))
    page.on("request", lambda request: requests.append(request.url))
    page.goto(path.resolve().as_uri(), wait_until="load")
    assert problems == []
    assert requests == [path.resolve().as_uri()]
    return page


def assert_charts_drawn(page, expected: set[str], screenshot: Path) -> None:
    """Each chart holds one SVG with many drawn paths, a real size on the page and, on screen,
    many colours; the whole page's screenshot is not blank."""
    names = page.eval_on_selector_all("figure.chart", "figures => figures.map(f => f.dataset.chart)")
    assert set(names) >= expected and len(names) == len(set(names))
    for name in names:
        figure = page.locator(f'figure.chart[data-chart="{name}"]')
        assert figure.locator("svg").count() == 1, name
        assert figure.locator("svg path").count() > 20, name
        box = figure.locator("svg").bounding_box()
        assert box and box["width"] > 300 and box["height"] > 150, (name, box)
        shot = screenshot.with_name(f"{screenshot.stem}.{name}.png")
        figure.screenshot(path=shot)
        pixels = np.asarray(Image.open(shot).convert("RGB")).reshape(-1, 3)
        drawn = np.any(pixels < 235, axis=1).mean()
        assert drawn > 0.02, (name, drawn)  # lines, bars and labels, not an empty frame
        assert colours(pixels) > 20, name
    page.screenshot(path=screenshot, full_page=True)
    whole = np.asarray(Image.open(screenshot).convert("RGB")).reshape(-1, 3)
    assert colours(whole) > 100 and np.any(whole < 235, axis=1).mean() > 0.03


def colours(pixels: np.ndarray) -> int:
    """How many distinct RGB colours."""
    rgb = pixels.astype(np.uint32)
    return len(np.unique(rgb[:, 0] << 16 | rgb[:, 1] << 8 | rgb[:, 2]))


def section_text(page, name: str) -> str:
    return page.locator(f"section#{name}").inner_text()


@pytest.fixture(scope="module")
def mlas_tuned(tmp_path_factory):
    """small_cnn tuned on MLAS in fp32 and int8 (3 configs per task), its plan saved."""
    folder = tmp_path_factory.mktemp("mlas")
    model_path, db = folder / "small.onnx", folder / "records.db"
    onnx.save(small_cnn(), model_path)
    result = kselect.tune(str(model_path), "mlas", search="random", budget=3, db=db, settings=FAST,
                          precision="fp32,int8", calibration=feeds_folder(folder / "calibration"), metric="cosine",
                          max_accuracy_drop=0.02, check_rounds=2, check_max_rounds=2)
    plan_path = folder / "small.mlas.plan.json"
    result.plan.save(plan_path)
    return {"plan": result.plan, "plan_path": plan_path, "db": db, "model_path": model_path, "folder": folder}


def test_an_mlas_plan_with_int8_gets_its_page_from_the_cli(browser, mlas_tuned, tmp_path):
    shown = run_kselect("report", mlas_tuned["plan_path"], "--db", mlas_tuned["db"], "--model",
                        mlas_tuned["model_path"], "--json")
    assert shown.returncode == 0, shown.stderr
    answer = json.loads(shown.stdout)
    path = Path(answer["report"])
    assert path == mlas_tuned["folder"] / "small.mlas.report.html" and answer["charts"] == chart_names(path.read_text())
    plan = mlas_tuned["plan"]
    assert set(answer["charts"]) == charts_of(plan) | {"precision-front"}

    page = load(browser, path)
    assert_charts_drawn(page, charts_of(plan) | {"precision-front"}, tmp_path / "mlas.png")
    assert page.locator(".emulated-banner").count() == 0 and "EMULATED" not in page.content()
    summary = section_text(page, "summary")
    assert plan.libraries["mlas"] in summary and plan.device["cpu_model"] in summary
    assert plan.device["fingerprint"] in summary and "measured natively" in summary
    ops = section_text(page, "ops")
    for entry in plan.tasks:
        assert entry["id"] in ops
    node_rows = page.locator("section#ops table").nth(1).locator("tbody tr")
    assert node_rows.count() == len(plan.nodes)
    assert "Conv" in node_rows.first.inner_text()  # --model: each node's ONNX op
    curves = section_text(page, "tuning")
    assert "random" in curves or "unknown" in curves  # samples by backend (unknown: a record store without it)
    assert all(entry["id"] in curves for entry in plan.tasks)
    check = section_text(page, "check")
    assert f"kept: {plan.extra['verified']['chosen']}" in check
    precision = section_text(page, "precision")
    kept = plan.extra["precision"]["chosen"]
    assert f"{kept} (kept)" in precision and "cosine" in precision
    predicted = predictions_of(plan)  # plan variants against the library default, front points against fp32
    if predicted:
        prediction = section_text(page, "prediction")
        assert "predicted ms" in prediction and all(name in prediction for name in predicted)
    page.close()


def assert_one_line_error(result, *fragments):
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_bad_input_is_one_line_and_writes_no_page(mlas_tuned, tmp_path):
    plan_path = mlas_tuned["plan_path"]
    assert_one_line_error(run_kselect("report", tmp_path / "missing.plan.json"), "no such plan file")
    not_a_plan = tmp_path / "notes.json"
    not_a_plan.write_text('{"format": "something else"}')
    assert_one_line_error(run_kselect("report", not_a_plan), "is not a kselect plan")
    corrupt_db = tmp_path / "corrupt.db"
    corrupt_db.write_bytes(b"SQLite format 3\x00" + b"\x07" * 4000)
    assert_one_line_error(run_kselect("report", plan_path, "--db", corrupt_db, "-o", tmp_path / "r.html"), "corrupt")
    other_db = tmp_path / "other.db"
    sqlite3.connect(other_db).execute("CREATE TABLE t (x)").connection.commit()
    assert_one_line_error(run_kselect("report", plan_path, "--db", other_db, "-o", tmp_path / "r.html"),
                          "not a kselect record database")
    assert_one_line_error(run_kselect("report", plan_path, "--model", "resnet18", "-o", tmp_path / "r.html"),
                          "the plan is for model 'small'")
    assert_one_line_error(run_kselect("report", plan_path, "-o", tmp_path), "is a directory")
    assert not list(tmp_path.glob("*.html"))


@pytest.mark.slow  # a cross-library tune runs by default (test_crossplan.py)
def test_a_cross_library_plan_shows_its_conversions_and_the_check_that_kept_it(browser, small_model_path, tmp_path):
    db = tmp_path / "records.db"
    result = kselect.tune(str(small_model_path), "mlas,xnnpack", search="random", budget=2, db=db, settings=FAST,
                          remeasure=False, check_rounds=2, check_max_rounds=2)

    # the plan across libraries as planned: each op's layout and the conversions into it
    planned = write_report(result.cross_plan, db=db, output=tmp_path / "planned.html")
    page = load(browser, planned)
    assert_charts_drawn(page, EVERY_CHART - {"whole-model-check"}, tmp_path / "planned.png")
    ops = section_text(page, "ops")
    assert "conversions in" in ops and "What the planner minimised" in ops and "greedy per op" in ops
    conversions = [c for entry in result.cross_plan.nodes.values() for c in entry["conversions"]]
    assert conversions and all(f"{c['from_label']} → {c['to_label']}" in ops for c in conversions)
    for name in result.cross_plan.libraries:
        assert name in section_text(page, "summary")
    assert "no whole-model check" in section_text(page, "check")
    page.close()

    # the plan kept: every plan of the check against ONNX Runtime's default, round by round
    kept = write_report(result.plan, db=db, output=tmp_path / "kept.html")
    page = load(browser, kept)
    assert_charts_drawn(page, charts_of(result.plan), tmp_path / "kept.png")
    check = section_text(page, "check")
    verified = result.plan.extra["verified"]
    for tried in verified["tried"]:
        assert tried["variant"] in check
    assert f"kept: {verified['chosen']}" in check and "rounds" in check
    if verified.get("rounds") == 0:  # every candidate skipped: the baseline kept untimed, and said so
        assert "untimed: no plan was left to race" in check
    page.close()

    # a record database that is not there: the page says so where the curves would be
    elsewhere = write_report(result.cross_plan, db=tmp_path / "missing.db", output=tmp_path / "no-records.html")
    assert not (tmp_path / "missing.db").exists()
    assert "tuning-curves" not in chart_names(elsewhere.read_text())
    assert f"no record database at {tmp_path / 'missing.db'}" in elsewhere.read_text()


def test_an_emulated_acl_plan_says_so_on_every_time(browser, small_model_path, tmp_path):
    acl = plugins.libraries()["acl"]
    available, reason = acl.availability()
    assert available, f"ACL is not available ({reason}): `make setup` installs it (scripts/system-packages.txt)"
    try:
        result = kselect.tune(str(small_model_path), "acl", search="random", budget=2, db=tmp_path / "records.db",
                              settings=MeasureSettings(timeout_s=120, min_time_s=0.005, min_repeats=3, max_time_s=0.1))
    finally:
        acl.close()
    plan_path = tmp_path / "small.acl.plan.json"
    result.plan.save(plan_path)
    path = write_report(plan_path, db=tmp_path / "records.db")
    assert path == tmp_path / "small.acl.report.html"
    page = load(browser, path)
    assert_charts_drawn(page, charts_of(result.plan), tmp_path / "acl.png")
    assert load_plan_file(plan_path).emulated == acl.emulated == build.is_emulated()
    if not acl.emulated:  # an arm64 board: real Arm timings
        assert page.locator(".emulated-banner").count() == 0
        return
    banner = page.locator(".emulated-banner")
    assert banner.is_visible() and banner.inner_text() == EMULATED_BANNER
    assert banner.bounding_box()["y"] < 200  # at the top, not below the fold
    # every time in every table (µs of ops, ms of whole models) carries the EMULATED tag
    unlabelled = page.evaluate("""() => {
        const missing = [];
        for (const table of document.querySelectorAll("table")) {
            const heads = [...table.querySelectorAll("thead th")].map(th => th.textContent);
            for (const row of table.querySelectorAll("tbody tr")) {
                [...row.children].forEach((cell, i) => {
                    const timed = /µs|(^| )ms$/.test(heads[i]) && /\\d/.test(cell.textContent);
                    if (timed && !cell.querySelector(".emulated-tag")) missing.push(heads[i] + ": " + cell.textContent);
                });
            }
        }
        return missing;
    }""")
    assert unlabelled == []
    assert page.locator(".emulated-tag").count() >= 2 * len(result.plan.tasks)
    page.close()
