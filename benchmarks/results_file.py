"""A benchmark's results file (``--json``) and its page (``--markdown``), read before anything is
measured. A run adds its models to the figures an earlier run on the same device wrote (a model
run again replaces its entry), and the page is written again from the whole file. A file of
another device, an unreadable file, or a page whose results file is missing would be replaced by
this run's models alone: each is refused in one line, exit status 2, so that a run on a new machine
never writes over another machine's figures."""

from __future__ import annotations

import json
from pathlib import Path

from model_names import fail  # benchmarks/model_names.py: the script's folder is on sys.path


def earlier_results(json_path: str, markdown_path: str, device, models: list[str]) -> dict:
    """The results file as an earlier run on ``device`` left it, without the entries of ``models``
    (which this run measures again); ``{"models": []}`` where neither file exists yet."""
    results, page = Path(json_path), Path(markdown_path)
    if not results.is_file():
        if page.is_file():
            fail(f"{page} exists but its results file {results} does not: this run would replace the page "
                 "with its own models only; name a new --markdown, or give the page's results file as --json")
        return {"models": []}
    try:
        previous = json.loads(results.read_text())
        fingerprint, entries = previous["device_fingerprint"], previous["models"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        fail(f"{results} is not a results file of this benchmark ({type(exc).__name__}: {exc}); "
             "name a new --json and --markdown")
    if fingerprint != device.fingerprint:
        fail(f"{results} holds the figures of another device ({previous.get('device', '?')} [{fingerprint}]), "
             f"not this one ({device.summary()} [{device.fingerprint}]): name a new --json and --markdown "
             "for this device")
    return {**previous, "models": [entry for entry in entries if entry.get("model") not in models]}
