"""The report's charts (core/report/page.py), drawn with matplotlib as static SVG that the page holds
inline: no script, nothing fetched when the page is viewed, text drawn as paths (no fonts).

Each function takes plain data and returns the SVG markup of one chart."""

from __future__ import annotations

import io
import itertools
import math
import re
from dataclasses import dataclass, field

from matplotlib.figure import Figure  # the object API: no pyplot state, no display backend

COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22"]
PLAN_COLOUR, DEFAULT_COLOUR, CHOSEN_COLOUR = "#1f77b4", "#b0b0b0", "#d62728"
_chart_ids = itertools.count(1)


def _svg(figure: Figure) -> str:
    """The figure as an <svg> element to put in HTML: without the XML prologue and DOCTYPE, and
    with its ids prefixed, so that several charts on one page never share an id."""
    buffer = io.StringIO()
    figure.savefig(buffer, format="svg", bbox_inches="tight", metadata={"Date": None})
    text = buffer.getvalue()
    text = text[text.index("<svg"):]
    prefix = f"c{next(_chart_ids)}-"
    text = re.sub(r'id="([^"]+)"', rf'id="{prefix}\1"', text)
    text = re.sub(r'href="#([^"]+)"', rf'href="#{prefix}\1"', text)
    return re.sub(r"url\(#([^)]+)\)", rf"url(#{prefix}\1)", text)


def _figure(width: float, height: float) -> Figure:
    figure = Figure(figsize=(width, height), layout="constrained")
    figure.set_facecolor("white")
    return figure


# -- where the time goes --------------------------------------------------------------------
def time_bars(categories: list[str], plan_us: list[float], default_us: list[float | None], title: str,
              default_label: str, unit_note: str = "") -> str:
    """Horizontal bars per category: the plan's time beside the default's (None: not measured)."""
    height = 1.2 + 0.45 * len(categories)
    figure = _figure(7.5, height)
    axes = figure.add_subplot()
    rows = range(len(categories))
    axes.barh([r - 0.2 for r in rows], plan_us, height=0.4, color=PLAN_COLOUR, label="plan")
    defaults = [d if d is not None else 0.0 for d in default_us]
    if any(d is not None for d in default_us):
        axes.barh([r + 0.2 for r in rows], defaults, height=0.4, color=DEFAULT_COLOUR, label=default_label)
    axes.set_yticks(list(rows), categories)
    axes.invert_yaxis()
    axes.set_xlabel(f"time, sum over ops (µs{unit_note})")
    axes.set_title(title, fontsize=10)
    axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    axes.grid(axis="x", alpha=0.3)
    return _svg(figure)


# -- tuning curves ----------------------------------------------------------------------------
@dataclass
class TuningPanel:
    """One task's records: best-so-far curves (name -> best time after each sample, None before
    the first valid one), the library default's time and the plan's time."""
    title: str
    curves: dict[str, list[float | None]] = field(default_factory=dict)
    default_us: dict[str, float] = field(default_factory=dict)  # library -> its default's time
    plan_us: float | None = None


def tuning_curves(panels: list[TuningPanel], unit_note: str = "") -> str:
    columns = min(3, len(panels))
    rows = math.ceil(len(panels) / columns)
    figure = _figure(4.3 * columns, 2.9 * rows)
    names = sorted({name for panel in panels for name in panel.curves})
    colour_of = {name: COLOURS[i % len(COLOURS)] for i, name in enumerate(names)}
    for index, panel in enumerate(panels):
        axes = figure.add_subplot(rows, columns, index + 1)
        for name, best in panel.curves.items():
            axes.step(range(1, len(best) + 1), [math.nan if b is None else b for b in best], where="post",
                      color=colour_of[name], label=name, linewidth=1.6, marker="o", markersize=3)
        for library, us in panel.default_us.items():
            label = "library default" if len(panel.default_us) == 1 else f"{library} default"
            axes.axhline(us, color=DEFAULT_COLOUR, linestyle="--", linewidth=1.2, label=label)
        if panel.plan_us is not None:
            axes.axhline(panel.plan_us, color=CHOSEN_COLOUR, linestyle=":", linewidth=1.4, label="plan")
        samples = max((len(best) for best in panel.curves.values()), default=1)
        axes.set_xlim(0.5, samples + 0.5)
        axes.set_title(panel.title, fontsize=8)
        axes.set_xlabel("samples", fontsize=8)
        axes.set_ylabel(f"best so far (µs{unit_note})", fontsize=8)
        axes.tick_params(labelsize=7)
        axes.xaxis.get_major_locator().set_params(integer=True)
        axes.grid(alpha=0.3)
    legend = {}  # one legend for every panel: label -> handle
    for axes in figure.axes:
        for handle, label in zip(*axes.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    figure.legend(legend.values(), legend.keys(), loc="outside upper center", ncols=min(6, len(legend)), fontsize=8)
    return _svg(figure)


# -- the whole-model check --------------------------------------------------------------------
@dataclass
class CheckRow:
    """One plan of the whole-model check: its speedups over the baseline."""
    name: str
    speedup: float  # the median per-round speedup (or, interleaved, the ratio of medians)
    rounds: list[float] = field(default_factory=list)  # per-round speedups, when timed in rounds
    bounds: tuple[float, float] | None = None  # confidence bounds of the median
    chosen: bool = False


def check_chart(rows: list[CheckRow], baseline: str, thresholds: list[tuple[float, str]], title: str) -> str:
    figure = _figure(7.5, 1.4 + 0.6 * len(rows))
    axes = figure.add_subplot()
    for index, row in enumerate(rows):
        colour = CHOSEN_COLOUR if row.chosen else PLAN_COLOUR
        if row.rounds:
            offsets = [0.18 * ((i % 5) - 2) / 2 for i in range(len(row.rounds))]
            axes.scatter(row.rounds, [index + o for o in offsets], s=14, color=colour, alpha=0.45,
                         label="per-round speedup" if index == 0 else None)
        if row.bounds is not None:
            low, high = row.bounds
            axes.errorbar([row.speedup], [index], xerr=[[row.speedup - low], [high - row.speedup]], fmt="none",
                          ecolor=colour, elinewidth=2, capsize=5, label="bounds of the median" if index == 0 else None)
        axes.scatter([row.speedup], [index], s=70, marker="D", color=colour, zorder=3, edgecolor="black",
                     label="median" if index == 0 and row.rounds else ("speedup" if index == 0 else None))
    axes.axvline(1.0, color="black", linewidth=1, label=f"{baseline} (1.0x)")
    for value, label in thresholds:
        axes.axvline(value, color="grey", linestyle="--", linewidth=1, label=label)
    axes.set_yticks(range(len(rows)), [f"{row.name} (kept)" if row.chosen else row.name for row in rows])
    axes.set_ylim(len(rows) - 0.5, -0.5)
    axes.set_xlabel(f"speedup over {baseline} (x)")
    axes.set_title(title, fontsize=10)
    axes.grid(axis="x", alpha=0.3)
    axes.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _svg(figure)


# -- mixed precision ------------------------------------------------------------------------
@dataclass
class FrontPoint:
    name: str
    latency_ms: float
    score: float
    within_budget: bool
    chosen: bool = False


def precision_front(points: list[FrontPoint], metric: str, budget_score: float | None, title: str,
                    unit_note: str = "") -> str:
    figure = _figure(7.0, 4.2)
    axes = figure.add_subplot()
    for within, colour, label in ((True, "#2ca02c", "within the budget"), (False, "#7f7f7f", "over the budget")):
        chosen = [p for p in points if p.within_budget == within]
        if chosen:
            axes.scatter([p.latency_ms for p in chosen], [p.score for p in chosen], s=40, color=colour, label=label,
                         zorder=2)
    ordered = sorted(points, key=lambda p: p.latency_ms)
    axes.plot([p.latency_ms for p in ordered], [p.score for p in ordered], color="#cccccc", linewidth=1, zorder=1)
    for point in points:
        axes.annotate(point.name, (point.latency_ms, point.score), textcoords="offset points", xytext=(5, 5), fontsize=7)
        if point.chosen:
            axes.scatter([point.latency_ms], [point.score], s=260, marker="*", color=CHOSEN_COLOUR, edgecolor="black",
                         zorder=3, label=f"kept: {point.name}")
    if budget_score is not None:
        axes.axhline(budget_score, color=CHOSEN_COLOUR, linestyle="--", linewidth=1, label="accuracy budget")
    axes.set_xlabel(f"predicted latency, sum over ops (ms{unit_note})")
    axes.set_ylabel(metric)
    axes.set_title(title, fontsize=10)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=7)
    return _svg(figure)


# -- prediction -----------------------------------------------------------------------------
def prediction_scatter(points: list[tuple[str, float, float]], title: str, unit_note: str = "") -> str:
    """Predicted against measured whole-model time per plan ((name, predicted ms, measured ms)),
    with the line where they agree and the band of 10% around it."""
    figure = _figure(6.0, 4.6)
    axes = figure.add_subplot()
    measured = [m for _, _, m in points]
    predicted = [p for _, p, _ in points]
    low, high = 0.9 * min(measured + predicted), 1.1 * max(measured + predicted)
    line = [low, high]
    axes.plot(line, line, color="black", linewidth=1, label="predicted = measured")
    axes.fill_between(line, [0.9 * x for x in line], [1.1 * x for x in line], color="#2ca02c", alpha=0.15,
                      label="within 10%")
    axes.scatter(measured, predicted, s=36, color=PLAN_COLOUR, zorder=3, label="plan timed end to end")
    for name, p, m in points:
        axes.annotate(name, (m, p), textcoords="offset points", xytext=(5, 4), fontsize=7)
    axes.set_xlim(low, high)
    axes.set_ylim(low, high)
    axes.set_xlabel(f"measured, whole model (ms{unit_note})")
    axes.set_ylabel(f"predicted (ms{unit_note})")
    axes.set_title(title, fontsize=10)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=7, loc="upper left")
    return _svg(figure)
