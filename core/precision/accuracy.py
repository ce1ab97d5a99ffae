"""How close a plan's outputs stay to the fp32 model's, on held-out feeds.

A metric is ``metric(outputs, reference, feeds) -> float``, higher is better: ``outputs`` and
``reference`` are per feed the list of the model's outputs (the plan's, the fp32 model's). The
fp32 model scores itself; a plan's *drop* is that score minus the plan's, and
``--max-accuracy-drop X`` bounds it. Built in (registered like a plugin's, through
``register_metrics``):

- ``top1`` / ``top5``: the share of feeds whose top-1 class (top-1 within the fp32 top-5) agrees
  with the fp32 model's, on the first output, read as (batch, classes) scores;
- ``cosine``: the mean cosine similarity of each output with the fp32 one;
- ``sqnr``: the mean signal-to-quantization-noise ratio in dB (a drop of 3 is half the SNR).

``default_metric`` picks top1 for a classifier (a first output of shape (N, C), C > 1), cosine
otherwise. From Python, ``kselect.tune(..., metric=callable)`` takes a task-specific metric
written as ``evaluate(outputs, feeds) -> float``: kselect scores the fp32 model with it too.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from kselect.core.contract import plugins
from kselect.core.contract.hookspecs import hookimpl
from kselect.core.errors import KselectError

Metric = Callable[[list, list, list], float]


def _scores(outputs: list) -> np.ndarray:
    first = np.asarray(outputs[0], np.float64)
    return first.reshape(first.shape[0], -1) if first.ndim > 1 else first.reshape(1, -1)


def top1(outputs: list, reference: list, feeds: list) -> float:
    agree = [np.mean(_scores(o).argmax(axis=1) == _scores(r).argmax(axis=1)) for o, r in zip(outputs, reference)]
    return float(np.mean(agree))


def top5(outputs: list, reference: list, feeds: list) -> float:
    hits = []
    for o, r in zip(outputs, reference):
        best, top = _scores(o).argmax(axis=1), np.argsort(-_scores(r), axis=1)[:, :5]
        hits.append(np.mean([b in t for b, t in zip(best, top)]))
    return float(np.mean(hits))


def _pairs(outputs: list, reference: list):
    for per_feed, reference_feed in zip(outputs, reference):
        for o, r in zip(per_feed, reference_feed):
            yield np.asarray(o, np.float64).ravel(), np.asarray(r, np.float64).ravel()


def cosine(outputs: list, reference: list, feeds: list) -> float:
    values = [float(o @ r / max(np.linalg.norm(o) * np.linalg.norm(r), 1e-30)) for o, r in _pairs(outputs, reference)]
    return float(np.mean(values))


def sqnr(outputs: list, reference: list, feeds: list) -> float:
    values = [10 * np.log10(max(float(r @ r), 1e-30) / max(float((o - r) @ (o - r)), 1e-30))
              for o, r in _pairs(outputs, reference)]
    return float(np.mean(values))


@hookimpl
def register_metrics(register):
    for name, metric in (("top1", top1), ("top5", top5), ("cosine", cosine), ("sqnr", sqnr)):
        register(name, metric)


def metrics() -> dict[str, Metric]:
    return plugins.metrics()


def get_metric(name: str) -> Metric:
    found = metrics()
    if name not in found:
        raise KselectError(f"unknown --metric {name!r} (choose from: {', '.join(sorted(found))})")
    return found[name]


def default_metric(reference: list) -> str:
    first = np.asarray(reference[0][0])
    return "top1" if first.ndim == 2 and first.shape[1] > 1 else "cosine"


def user_metric(evaluate: Callable[[list, list], float]) -> Metric:
    """A task-specific ``evaluate(outputs, feeds) -> float`` as a metric."""
    return lambda outputs, reference, feeds: float(evaluate(outputs, feeds))


def run_outputs(runner: Callable[[dict], list], feeds: list[dict]) -> list:
    return [[np.asarray(o) for o in runner(feed)] for feed in feeds]
