"""The ``--models`` list of a benchmark, checked before anything is measured: every name must load
and have something kselect tunes, else the benchmark stops with kselect's own one-line reason
(a real model whose weights are graph inputs, a misspelt name) instead of a traceback an hour in."""

from __future__ import annotations

import sys

from kselect.core.errors import KselectError
from kselect.core.models.model import load_model
from kselect.core.models.tasks import extract_tasks


def tunable_model_names(models: str) -> list[str]:
    """The comma-separated ``models`` as a list, each loaded (a real model is fetched into the
    cache) and its tasks extracted; on the first that fails, ``error: <reason>`` on stderr and exit status 2."""
    names = [name.strip() for name in models.split(",") if name.strip()]
    if not names:
        fail("--models names no model")
    for name in names:
        try:
            extract_tasks(load_model(name))
        except KselectError as exc:
            fail(str(exc))
    return names


def fail(reason: str) -> None:
    """A benchmark's refusal: ``error: <reason>`` on stderr, exit status 2, no traceback."""
    print(f"error: {reason}", file=sys.stderr)
    raise SystemExit(2)
