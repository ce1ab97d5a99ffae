"""``kselect report``: one self-contained HTML page about a plan (docs/report.md).

It shows the model, the device and the libraries; per op its library, config, plan and default
time and the conversions around it; where the time goes, by op type and by library; each task's
tuning curve from the record database; the whole-model check that chose the plan; and, for a
mixed-precision plan, its latency / accuracy front. Charts are static SVG from matplotlib
(core/report/charts.py) inside the page: it loads nothing when viewed, and says so in its
Content-Security-Policy.
"""

from __future__ import annotations

import html
import re
import time
from collections import defaultdict
from datetime import datetime
from pathlib import Path

from kselect import __version__
from kselect.core.errors import KselectError
from kselect.core.models.model import Model
from kselect.core.models.tasks import Task, model_stats, untuned_ops
from kselect.core.paths import check_output
from kselect.core.plans.plan import Plan, load_plan_file, write_atomically
from kselect.core.records import store as records
from kselect.core.records.sql import is_server_url
from kselect.core.report import charts

EMULATED_BANNER = "EMULATED: timed under qemu user-mode emulation; not Arm performance"


def write_report(plan: Plan | str | Path, db: str | Path | None = None, output: str | Path | None = None,
                 model: Model | None = None) -> Path:
    """Writes the report of ``plan`` (a Plan or a plan file) to ``output`` (default: beside the
    plan file, ``NAME.report.html``) and returns its path. Tuning curves come from ``db`` (a
    record database path or URL; default ``core.records.store.DEFAULT_DB``); a database that is missing
    or holds no records of the plan is said so on the page. With ``model`` the plan is checked
    against it and the page names each node's ONNX op."""
    plan_path = None if isinstance(plan, Plan) else Path(plan)
    if plan_path is not None:
        plan = load_plan_file(plan_path)

    reads = {"the plan": plan_path, "the model": model.source if model is not None else None,
             "the record database": records.database_location(db)}
    path = check_output(default_report_path(plan, plan_path) if output is None else output, "-o", "the report",
                        reads, kind="a report file")
    if model is not None and plan.model.get("fingerprint") != model.fingerprint():
        raise KselectError(f"the plan is for model {plan.model.get('name')!r} ({plan.model.get('fingerprint')}), "
                           f"not this {model.name!r} ({model.fingerprint()})")
    store, store_note = open_records(db)
    try:
        page = Page(plan, store, store_note, model).render()
    except (KeyError, TypeError) as exc:  # a field missing or of the wrong type
        where = plan_path or "the plan"
        raise KselectError(f"{where} is not a valid kselect plan ({type(exc).__name__}: {exc})") from None
    finally:
        if store is not None and hasattr(store, "close"):
            store.close()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, page)
    return path


def default_report_path(plan: Plan, plan_path: Path | None) -> Path:
    """``x.mlas.plan.json`` -> ``x.mlas.report.html`` beside it; a Plan without a file:
    ``MODEL.report.html`` here."""
    if plan_path is None:
        return Path(f"{plan.model.get('name', 'plan')}.report.html")
    stem = plan_path.name.removesuffix(".json").removesuffix(".plan")
    return plan_path.with_name(f"{stem}.report.html")


def chart_names(page: str) -> list[str]:
    """The ``data-chart`` names of the charts in a report's HTML, in page order."""
    return re.findall(r'<figure class="chart" data-chart="([^"]+)"', page)


def open_records(db) -> tuple[object | None, str]:
    """(the record database, where it is), or (None, why there is none). A local database is only
    read: a path with no database is reported, not created. A postgresql:// URL is opened as
    ``kselect tune`` opens it."""
    location = str(records.database_location(db))
    if is_server_url(location):
        store = records.RecordDB(location)
        return store, store.location  # shown without its password
    path = Path(location).expanduser()
    if not path.exists():
        return None, f"no record database at {path}"
    if path.is_file() and path.stat().st_size == 0:
        return None, f"the record database {path} is empty"
    return records.RecordDB(path), str(path)


# -- formatting ----------------------------------------------------------------------------
def esc(value) -> str:
    return html.escape(str(value), quote=True)


def _us(value, emulated: bool) -> str:
    if value is None:
        return "-"
    return f"{value:,.1f}" + (' <span class="emulated-tag">emulated</span>' if emulated else "")


def _ms(value, emulated: bool) -> str:
    return "-" if value is None else f"{value:.3f}" + (' <span class="emulated-tag">emulated</span>' if emulated else "")


def _speedup(default_us, plan_us) -> str:
    return f"{default_us / plan_us:.2f}x" if default_us and plan_us else "-"


def _config(config: dict, hidden: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in config.items() if k not in hidden) or "(plan-level settings only)"


def _shape(shape) -> str:
    return "x".join(str(d) for d in shape)


def _when(created) -> str:
    return "-" if created is None else datetime.fromtimestamp(created).strftime("%Y-%m-%d %H:%M")


NOWRAP_COLUMNS = {"task", "op", "input", "node", "layout", "plan"}


def _table(columns: list[str], rows: list[list[str]], numeric: set[str] = frozenset()) -> str:
    """Cells are HTML already (escaped by the caller)."""
    kind = {c: "num" if c in numeric else "nowrap" if c in NOWRAP_COLUMNS else "" for c in columns}
    head = "".join(f'<th class="{kind[c]}">{esc(c)}</th>' for c in columns)
    body = "".join("<tr>" + "".join(f'<td class="{kind[c]}">{cell}</td>' for c, cell in zip(columns, row)) + "</tr>"
                   for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _figure(name: str, svg: str, caption: str) -> str:
    return f'<figure class="chart" data-chart="{esc(name)}">{svg}<figcaption>{esc(caption)}</figcaption></figure>'


def _note(text: str) -> str:
    return f'<p class="note">{esc(text)}</p>'


def op_type(entry: dict) -> str:
    """A plan task's kind of op, for the time breakdown: ``conv 3x3``, ``depthwise conv 3x3``,
    ``pointwise conv 1x1``, ``grouped conv``, ``conv 1-D k5``, ``deconv 4x4``, ``fc``; int8 ops
    apart."""
    task = Task.from_json(entry)
    suffix = f" {task.precision}" if task.precision != "fp32" else ""
    if task.kind not in ("conv", "deconv"):
        return task.kind + suffix
    kernel = task.attrs.get("kernel", [])
    if task.conv1d:
        return f"conv 1-D k{kernel[1]}{suffix}"
    size = "x".join(str(k) for k in kernel)
    if task.kind == "deconv":
        return f"deconv {size}{suffix}"
    if task.is_depthwise:
        return f"depthwise conv {size}{suffix}"
    if task.is_pointwise:
        return f"pointwise conv 1x1{suffix}"
    if task.attrs.get("group", 1) > 1:
        return f"grouped conv {size}{suffix}"
    return f"conv {size}{suffix}"


def describe(entry: dict) -> str:
    task = Task.from_json(entry)
    try:
        return f"{task.kind} {task.describe_attrs()}".strip()
    except Exception:  # an op kind whose plugin is not installed here: its name says enough
        return task.kind


# -- the page --------------------------------------------------------------------------------
class Page:
    def __init__(self, plan: Plan, store, store_note: str, model: Model | None):
        self.plan, self.store, self.store_note, self.model = plan, store, store_note, model
        self.emulated = bool(plan.emulated)
        self.unit_note = ", emulated" if self.emulated else ""
        self.entry_of = {}  # node -> its task entry
        for entry in plan.tasks:
            for node in entry["nodes"]:
                self.entry_of[node] = entry

    def render(self) -> str:
        plan = self.plan
        title = f"kselect report: {plan.model.get('name', '?')} on {'+'.join(plan.libraries)}"
        sections = [self.summary(), self.ops(), self.time_breakdown(), self.tuning(), self.check(), self.precision(),
                    self.prediction()]
        banner = (f'<div class="emulated-banner" role="alert">{esc(EMULATED_BANNER)}</div>' if self.emulated else "")

        return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'; img-src data:">
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,">
<title>{esc(title)}</title>
<style>{STYLE}</style>
</head>
<body>
<h1>{esc(title)}</h1>
{banner}
{''.join(s for s in sections if s)}
<footer>made by kselect {esc(__version__)} on {esc(time.strftime('%Y-%m-%d %H:%M'))}; times are microseconds of
isolated ops unless marked ms (whole model). Everything on this page is inline: it loads nothing.</footer>
</body>
</html>
"""

    # -- model, device, libraries ------------------------------------------------------------
    def summary(self) -> str:
        plan, device = self.plan, self.plan.device
        inputs = "; ".join(f"{name} {_shape(shape)}" for name, shape in plan.model.get("inputs", {}).items())
        rows = [("model", f"{plan.model.get('name')} (fingerprint {plan.model.get('fingerprint')}), inputs {inputs}")]
        if self.model is not None:
            params, macs = model_stats(self.model)
            rows.append(("model file", f"{self.model.name}: {params / 1e6:.2f} M parameters, {macs / 1e9:.3f} GMACs "
                                       f"in tuned ops, {len(untuned_ops(self.model))} conv-like ops left untuned"))
        clusters = " + ".join(str(len(c)) for c in device.get("clusters", []))
        rows.append(("device", f"{device.get('cpu_model')} ({device.get('arch')}, {device.get('cores')} cores"
                               f"{': ' + clusters if clusters else ''}), fingerprint {device.get('fingerprint')}"))
        rows.append(("ISA features", ", ".join(device.get("features", [])) or "-"))
        for name, version in plan.libraries.items():
            settings = plan.library_settings.get(name, plan.plan_level if len(plan.libraries) == 1 else {})
            shown = ", ".join(f"{k}={v}" for k, v in settings.items()) or "none"
            rows.append((f"library {name}", f"{version}; plan-level settings: {shown}"))
        rows.append(("timings", "EMULATED (qemu user-mode), not Arm performance" if self.emulated
                     else "measured natively on the device"))
        ops_us = sum(self.node_time(node) for node in plan.nodes)
        conversions_us = sum(c.get("time_us", 0) for c in self.all_conversions())
        rows.append(("sum over tuned ops", f"{ops_us / 1000:.3f} ms ops + {conversions_us / 1000:.3f} ms conversions, "
                                           f"isolated{' (emulated)' if self.emulated else ''}; "
                                           f"{len(plan.nodes)} ops in {len({e['key'] for e in plan.tasks})} tasks"))
        verified = plan.extra.get("verified")
        if verified:
            rows.append(("kept", f"{verified.get('chosen')} (the whole-model check below)"))
        items = "".join(f"<dt>{esc(k)}</dt><dd>{esc(v)}</dd>" for k, v in rows)
        return f'<section id="summary"><h2>Model, device, libraries</h2><dl>{items}</dl></section>'

    # -- per op ----------------------------------------------------------------------------
    def node_time(self, node: str) -> float:
        entry = self.plan.nodes[node]
        return entry["time_us"] if entry.get("time_us") is not None else self.entry_of[node]["time_us"]

    def node_emulated(self, node: str) -> bool:
        entry = self.plan.nodes[node]
        return bool(entry.get("emulated", self.entry_of[node].get("emulated", self.emulated)))

    def all_conversions(self) -> list[dict]:
        summary = self.plan.extra.get("cross_library", {})
        into_ops = [c for entry in self.plan.nodes.values() for c in entry.get("conversions", [])]
        return into_ops + summary.get("output_conversions", []) + summary.get("untuned_conversions", [])

    def ops(self) -> str:
        plan = self.plan
        numeric = {"ops", "default µs", "plan µs", "speedup", "samples", "op µs"}
        task_rows = []
        for entry in plan.tasks:
            hidden = plan.library_settings.get(entry["library"], plan.plan_level)
            emulated = bool(entry.get("emulated", self.emulated))
            task_rows.append([esc(entry["id"]), esc(describe(entry)), esc(_shape(entry["input"])),
                              str(len(entry["nodes"])), esc(entry["library"]),
                              esc(entry.get("precision", "fp32")), esc(_config(entry["config"], hidden)),
                              _us(entry.get("default_us"), emulated), _us(entry.get("time_us"), emulated),
                              _speedup(entry.get("default_us"), entry.get("time_us")), esc(entry.get("samples", "-"))])
        tasks = _table(["task", "op", "input", "ops", "library", "precision", "config", "default µs", "plan µs",
                        "speedup", "samples"], task_rows, numeric)

        leaving = defaultdict(list)  # node -> conversions of what it produces
        for conversion in self.all_conversions():
            leaving[conversion.get("from", "")].append(conversion)
        with_layouts = any("label" in entry for entry in plan.nodes.values())
        onnx_ops = {n.name: n.op_type for n in self.model.proto.graph.node} if self.model is not None else {}
        columns = ["node"] + (["ONNX op"] if onnx_ops else []) + ["task", "library"]
        columns += (["layout"] if with_layouts else []) + ["plan µs", "default µs", "speedup"]
        columns += ["conversions in", "conversions out"] if with_layouts else []
        node_rows = []
        for node, entry in plan.nodes.items():
            task, emulated = self.entry_of[node], self.node_emulated(node)
            row = [esc(node)] + ([esc(onnx_ops.get(node, "?"))] if onnx_ops else [])
            row += [esc(task["id"]), esc(entry["library"])] + ([esc(entry.get("label", "-"))] if with_layouts else [])
            row += [_us(self.node_time(node), emulated), _us(task.get("default_us"), emulated),
                    _speedup(task.get("default_us"), self.node_time(node))]
            if with_layouts:
                row += [self.conversion_list(entry.get("conversions", []), emulated, "from"),
                        self.conversion_list(leaving.get(node, []), emulated, "to")]
            node_rows.append(row)
        nodes = _table(columns, node_rows, numeric)
        untuned = self.plan.extra.get("cross_library", {}).get("untuned_conversions", [])
        untuned_html = ""
        if untuned:
            untuned_html = "<h3>Conversions where an untuned op (Add, Concat) takes a further input</h3>" + _table(
                ["at", "tensor", "from", "to", "µs"],
                [[esc(c.get("at", "")), esc(c.get("tensor", "")), esc(c.get("from_label", "")),
                  esc(c.get("to_label", "")), _us(c.get("time_us"), self.emulated)] for c in untuned], {"µs"})
        return (f'<section id="ops"><h2>Per op</h2><h3>Per task (ops of one shape share a task)</h3>{tasks}'
                f"<h3>Per node</h3>{nodes}{untuned_html}{self.cross_summary()}</section>")

    def conversion_list(self, conversions: list[dict], emulated: bool, end: str) -> str:
        if not conversions:
            return "-"
        items = []
        for c in conversions:
            other = c.get("from", "") if end == "from" else next(
                (node for node, entry in self.plan.nodes.items() if c in entry.get("conversions", [])), "model output")
            items.append(f"{esc(c.get('tensor', ''))} {esc(c.get('from_label', ''))} → {esc(c.get('to_label', ''))} "
                         f"({end} {esc(other)}): {_us(c.get('time_us'), emulated)} µs")
        return "<br>".join(items)

    def cross_summary(self) -> str:
        summary = self.plan.extra.get("cross_library")
        if not summary or "predicted" not in summary:
            return ""
        rows = [("as planned", summary["predicted"]), ("greedy per op", summary.get("greedy"))]
        rows += [(f"{name} alone", value) for name, value in summary.get("single_library", {}).items()]
        cells = [[esc(name), _ms(v["ops_us"] / 1000, self.emulated), _ms(v["conversions_us"] / 1000, self.emulated),
                  _ms(v.get("sleeping_us", 0) / 1000, self.emulated), _ms(v["total_us"] / 1000, self.emulated)]
                 for name, v in rows if v]
        table = _table(["choice", "ops ms", "conversions ms", "workers asleep ms", "total ms"], cells,
                       {"ops ms", "conversions ms", "workers asleep ms", "total ms"})
        return ("<h3>What the planner minimised (sums of isolated op and conversion times; the ops in between are "
                f"not included)</h3>{table}")

    # -- where the time goes ------------------------------------------------------------------
    def time_breakdown(self) -> str:
        by_type, by_library = defaultdict(lambda: [0.0, 0.0]), defaultdict(lambda: [0.0, 0.0])
        for node, entry in self.plan.nodes.items():
            task = self.entry_of[node]
            plan_us, default_us = self.node_time(node), task.get("default_us") or 0.0
            for key, table in ((op_type(task), by_type), (entry["library"], by_library)):
                table[key][0] += plan_us
                table[key][1] += default_us
        conversions_us = sum(c.get("time_us", 0) for c in self.all_conversions())
        figures = []
        for name, table, caption in (
                ("time-by-op-type", by_type, "Time by op type: the plan's ops against the same ops at their library's "
                                             "default"),
                ("time-by-library", by_library, "Time by library (conversions between layouts and libraries apart)")):
            categories = sorted(table, key=lambda k: -table[k][0])
            plan_us = [table[k][0] for k in categories]
            default_us: list = [table[k][1] or None for k in categories]
            if name == "time-by-library" and conversions_us:
                categories.append("conversions")
                plan_us.append(conversions_us)
                default_us.append(None)
            svg = charts.time_bars(categories, plan_us, default_us, caption + (" [EMULATED]" if self.emulated else ""),
                                   "library default", self.unit_note)
            figures.append(_figure(name, svg, caption))
        return f'<section id="time"><h2>Where the time goes</h2>{"".join(figures)}</section>'

    # -- tuning curves ----------------------------------------------------------------------
    def tuning(self) -> str:
        head = '<section id="tuning"><h2>Tuning curves</h2>'
        if self.store is None:
            return head + _note(f"{self.store_note}: no tuning curves (pass --db the database the plan was tuned "
                                "with)") + "</section>"
        device = self.plan.device.get("fingerprint", "")
        entries_of_key: dict[str, list[dict]] = {}
        for entry in self.plan.tasks:
            entries_of_key.setdefault(entry["key"], []).append(entry)
        panels, rows, missing, emulated = [], [], [], False
        for key, entries in entries_of_key.items():
            panel = charts.TuningPanel(f"{entries[0]['id']} {describe(entries[0])}",
                                       plan_us=min(e["time_us"] for e in entries))
            found = {name: self.store.records(device, name, version, key) for name, version in self.plan.libraries.items()}
            found = {name: rs for name, rs in found.items() if rs}
            if not found:
                missing.append(entries[0]["id"])
                continue
            for library, library_records in found.items():
                prefix = f"{library}: " if len(found) > 1 else ""
                for search, samples in curves(library_records).items():
                    panel.curves[prefix + search] = samples
                default = [r for r in library_records if r.is_default and r.result.status == "ok"]
                if default:
                    panel.default_us[library] = default[-1].result.median_us
                emulated = emulated or any(r.emulated for r in library_records)
                rows.append(self.records_row(entries[0]["id"], library, library_records))
            panels.append(panel)
        if not panels:
            return head + _note(f"{self.store_note} holds no records of this plan's tasks for device {device} and "
                                f"{', '.join(f'{k} {v}' for k, v in self.plan.libraries.items())}") + "</section>"
        note = " [EMULATED]" if emulated else ""
        caption = ("Best time so far against samples, per search backend: records of one task in the order they were "
                   "stored, every tune of it on this device and the plan's library builds; each curve starts at the "
                   "library default (sample 1), which every tune measures first; dashed: the library default; dotted: "
                   f"the plan's choice{note}")
        svg = charts.tuning_curves(panels, ", emulated" if emulated else "")
        table = _table(["task", "library", "samples", "by backend", "failed / invalid", "first stored", "last stored"],
                       rows, {"samples", "failed / invalid"})
        absent = _note(f"no records of {', '.join(missing)} in {self.store_note}") if missing else ""
        return head + _figure("tuning-curves", svg, caption) + table + absent + "</section>"

    def records_row(self, task_id: str, library: str, library_records: list) -> list[str]:
        by_search = defaultdict(int)
        for record in library_records:
            by_search["default" if record.is_default else (record.search or "unknown")] += 1
        bad = sum(r.result.status != "ok" for r in library_records)
        created = [r.created for r in library_records if r.created is not None]
        return [esc(task_id), esc(library), str(len(library_records)),
                esc(", ".join(f"{name} {count}" for name, count in by_search.items())), str(bad),
                esc(_when(min(created) if created else None)), esc(_when(max(created) if created else None))]

    # -- the whole-model check -----------------------------------------------------------------
    def check(self) -> str:
        head = '<section id="check"><h2>Whole-model check</h2>'
        verified = self.plan.extra.get("verified")
        if not verified or not verified.get("tried"):
            return head + _note("this plan holds no whole-model check (tuned with --no-verify, or the plan across "
                                "libraries before its check): `kselect bench --alone` times it") + "</section>"
        tried = verified["tried"]
        # a race in rounds, or one whose every candidate was skipped (nothing left to time)
        untimed = verified.get("rounds") == 0
        in_rounds = untimed or any("round_speedups" in t for t in tried)
        emulated = bool(verified.get("emulated", self.emulated))
        if in_rounds:
            baseline = verified.get("baseline", "onnxruntime default")
            faster, slower = 1 + verified.get("margin", 0.02), verified.get("slower_limit", 0.98)
            thresholds = [(faster, f"shown faster: median >= {faster:.2f}x"),
                          (slower, f"and lower bound >= {slower:.2f}x")]
            if verified.get("min_speedup") is not None:
                thresholds = [(verified["min_speedup"], f"kept at a median >= {verified['min_speedup']}x")]
            how = (f"each plan alone in a fresh process per round, {baseline} in the same rounds; points: per-round "
                   f"speedups, diamond: their median, bars: its {verified.get('confidence', 0.875):.1%} bounds")
        else:
            baseline = f"{self.plan.library} default"
            thresholds = [(verified.get("min_speedup", 0.99), f"kept at >= {verified.get('min_speedup', 0.99)}x")]
            how = ("plan and library default interleaved in one process; the speedup is the ratio of their median "
                   "whole-model times (the plan variants are tried most tuned first, the first not slower is kept)")
        rows = [charts.CheckRow(t["variant"], t["speedup"], list(t.get("round_speedups", [])),
                                tuple(t["speedup_bounds"]) if t.get("speedup_bounds") else None,
                                t["variant"] == verified.get("chosen"))
                for t in tried if "failed" not in t and "skipped" not in t]
        title = f"Whole model: speedup over {baseline}" + (" [EMULATED]" if emulated else "")
        figure = _figure("whole-model-check", charts.check_chart(rows, baseline, thresholds, title), how) if rows else ""
        cells = []
        for t in tried:
            if "failed" in t or "skipped" in t:
                why = f"failed: {t['failed']}" if "failed" in t else f"skipped: {t['skipped']}"
                cells.append([esc(t["variant"]), "-", "-", "-", "-", "-", esc(why), "-"])
                continue
            bounds = t.get("speedup_bounds")
            cells.append([esc(t["variant"]) + (" <strong>(kept)</strong>" if t["variant"] == verified.get("chosen") else ""),
                          esc(t.get("processes", t.get("runs", "-"))), _ms(t.get("default_ms"), emulated),
                          _ms(t.get("plan_ms"), emulated), f"{t['speedup']:.3f}x",
                          esc(f"{bounds[0]:.3f}-{bounds[1]:.3f}") if bounds else "-", esc(t.get("verdict", "-")),
                          esc(f"{t.get('max_relative_output_error', float('nan')):.1e}")])
        table = _table(["plan", "rounds" if in_rounds else "runs", f"{baseline} ms", "plan ms", "speedup", "bounds",
                        "verdict", "max output error"], cells, {"rounds", "runs", f"{baseline} ms", "plan ms", "speedup"})
        kept = verified.get("chosen")
        if untimed:
            note = _note(f"kept: {kept}, untimed: no plan was left to race (each was skipped, as the table says)")
        else:
            note = _note(f"kept: {kept}" + ("" if kept in {t['variant'] for t in tried} else
                                            f" (no plan was shown faster, so {baseline}'s own configuration)"))
        return head + figure + table + note + "</section>"

    # -- mixed precision ------------------------------------------------------------------------
    def precision(self) -> str:
        precision = self.plan.extra.get("precision")
        if not precision or not precision.get("front"):
            return ""
        front, metric, kept = precision["front"], precision.get("metric") or "metric", precision.get("chosen")
        usable = [p for p in front if not p.get("failed")]
        reference = next((p["score"] + p["drop"] for p in usable if p["score"] is not None), None)
        budget = reference - precision["max_drop"] if reference is not None and "max_drop" in precision else None
        points = [charts.FrontPoint(p["name"], p["predicted_us"] / 1000, p["score"], bool(p.get("within_budget")),
                                    p["name"] == kept) for p in usable]
        calibration = precision.get("calibration", {})
        caveat = calibration.get("caveat") or ("SYNTHETIC" if calibration.get("synthetic") else "")
        synthetic = f" [calibration data: {caveat}]" if caveat else ""
        title = (f"Latency / accuracy front: {metric}, budget drop <= {precision.get('max_drop')}{synthetic}"
                 + (" [EMULATED]" if self.emulated else ""))
        svg = charts.precision_front(points, metric, budget, title, self.unit_note)
        caption = (f"Each point is a plan with some ops in a reduced precision (fp32: none; the second point: every op "
                   f"in the least precise form it has kernels for, e.g. int8, then ops climbing toward fp32); "
                   f"{metric} on {calibration.get('held_out_feeds', '?')} held-out feeds; the star is the point kept")
        cells = [[esc(p["name"]) + (" <strong>(kept)</strong>" if p["name"] == kept else ""), esc(_ops_by_precision(p)),
                  _ms(p["predicted_us"] / 1000, self.emulated), _ms(p.get("measured_ms"), self.emulated),
                  esc("-" if p.get("score") is None else f"{p['score']:.4f}"),
                  esc("-" if p.get("drop") is None else f"{p['drop']:.4f}"), f"{p.get('weight_bytes', 0) / 1e6:.2f}",
                  esc(p.get("failed") or ("yes" if p.get("within_budget") else "no"))] for p in front]
        table = _table(["point", "reduced ops", "predicted ms", "measured ms", metric, "drop", "weights MB",
                        "within budget"], cells, {"reduced ops", "predicted ms", "measured ms", metric, "drop", "weights MB"})
        check = precision.get("check")
        if check and "skipped" in check:
            said = f"not timed end to end: {check['skipped']['reason']}; kept: {check.get('kept')}"
        elif check and "failed" in check:
            said = f"the end-to-end check against the fp32 plan failed ({check['failed']}); kept: {check.get('kept')}"
        elif check:
            said = (f"end to end against the fp32 plan, each alone in fresh processes: {check['per_round_speedup']:.3f}x "
                    f"median per-round speedup over {check['rounds']} rounds (bounds {check['bounds'][0]:.3f}-"
                    f"{check['bounds'][1]:.3f}x, {check['verdict']}); kept: {check['kept']}")
        else:
            said = f"not timed end to end; kept on predicted latency: {kept}"
        return (f'<section id="precision"><h2>Mixed precision</h2>{_figure("precision-front", svg, caption)}{table}'
                f"{_note(said + (' (emulated)' if self.emulated else ''))}</section>")


    # -- prediction -------------------------------------------------------------------------------
    def prediction(self) -> str:
        """Predicted against measured whole-model time of every plan the tune timed end to end
        (core/whole_model/prediction.py): the plan variants or plans across libraries of the
        whole-model check, and the points of the precision front."""
        found = [(t["variant"], t["prediction"]) for t in self.plan.extra.get("verified", {}).get("tried", [])
                 if "prediction" in t]
        found += [(p["name"], p["prediction"]) for p in self.plan.extra.get("precision", {}).get("front", [])
                  if "prediction" in p]
        if not found:
            return ""
        title = "Predicted against measured whole-model time" + (" [EMULATED]" if self.emulated else "")
        svg = charts.prediction_scatter([(name, p["predicted_ms"], p["measured_ms"]) for name, p in found], title,
                                        self.unit_note)
        caption = ("Each plan's predicted time is a plan timed in the same race (its reference) plus the difference "
                   "of their summed isolated op and conversion times, or times the ratio of their figures where both "
                   "were corrected in context; measured: the median of its processes")
        cells = [[esc(name), esc(p["reference"]), _ms(p["summed_ms"], self.emulated), esc(p["summed_covers"]),
                  _ms(p["predicted_ms"], self.emulated), _ms(p["measured_ms"], self.emulated), esc(f"{p['error']:+.1%}")]
                 for name, p in found]
        table = _table(["plan", "reference", "summed ms", "summed over", "predicted ms", "measured ms", "error"], cells,
                       {"summed ms", "predicted ms", "measured ms", "error"})
        return (f'<section id="prediction"><h2>Prediction</h2>{_figure("prediction", svg, caption)}{table}'
                "</section>")


def curves(library_records: list) -> dict[str, list[float | None]]:
    """Best-so-far time after each sample, per search backend, records in the order stored. Every
    tune measures the library default first, so each curve starts there (sample 1) and goes on
    with the configs its backend proposed. Records without a backend (made before records named
    it) form one curve, "records"."""
    default = next((r for r in library_records if r.is_default), None)
    start = _time(default) if default is not None else None
    best: dict[str, float | None] = {}
    result: dict[str, list[float | None]] = {}
    for record in library_records:
        if record.is_default:
            continue
        name = record.search or "records"
        if name not in result:
            best[name] = start
            result[name] = [start] if default is not None else []
        measured = _time(record)
        if measured is not None:
            best[name] = measured if best[name] is None else min(best[name], measured)
        result[name].append(best[name])
    if not result and default is not None:  # only the default measured: a curve of one sample
        result["default only"] = [start]
    return result


def _time(record) -> float | None:
    return record.result.median_us if record.result.status == "ok" else None


STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 1.5rem auto; max-width: 1200px;
       padding: 0 1rem; color: #222; }
h1 { font-size: 1.5rem; } h2 { font-size: 1.2rem; border-bottom: 1px solid #ddd; padding-bottom: .2rem; margin-top: 2rem; }
h3 { font-size: 1rem; margin-top: 1.2rem; }
.emulated-banner { background: #fff3cd; border: 2px solid #d39e00; color: #6b4f00; font-weight: bold; padding: .8rem 1rem;
                   font-size: 1.1rem; margin: 1rem 0; }
.emulated-tag { background: #fff3cd; color: #6b4f00; border: 1px solid #d39e00; border-radius: 3px; font-size: .7rem;
                padding: 0 .25rem; margin-left: .2rem; text-transform: uppercase; }
dl { display: grid; grid-template-columns: max-content 1fr; gap: .25rem 1rem; }
dt { font-weight: bold; } dd { margin: 0; }
table { border-collapse: collapse; margin: .5rem 0 1rem; font-size: .85rem; }
th, td { border: 1px solid #ddd; padding: .25rem .5rem; vertical-align: top; text-align: left; }
th { background: #f4f4f4; } td.num, th.num { text-align: right; white-space: nowrap; }
.nowrap { white-space: nowrap; }
figure.chart { margin: 1rem 0; } figure.chart svg { max-width: 100%; height: auto; }
figcaption { font-size: .85rem; color: #555; }
.note { color: #555; font-style: italic; }
footer { margin-top: 2rem; font-size: .8rem; color: #777; }
"""


def _ops_by_precision(point: dict) -> str:
    """A front point's ops per reduced precision, e.g. "int8 12, bf16 3" (a front stored before
    half precision counts its int8 ops only)."""
    counts = point.get("ops_by_precision")
    if counts is None:
        return str(point.get("int8_ops", "-"))
    return ", ".join(f"{precision} {count}" for precision, count in counts.items()) or "-"
