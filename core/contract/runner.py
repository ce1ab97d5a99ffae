"""The one interface the tuning loop measures through.

A ``Runner`` turns (task, config) into a ``Result``; core/measuring/tuning_loop.py asks it and stores what it
answers, nothing more. Two implementations share it, so every search backend runs unchanged on
either (TVM MetaSchedule's Runner, Kernel Tuner's live and simulation runners):

- ``kselect.core.measuring.worker.MeasureWorker``: the live runner. The library's kernels run in a child
  process, verified against the reference and timed with the core protocol; a crash, an abort or
  a hang there becomes a failed result.
- ``kselect.search.replay.ReplayWorker``: answers from tables recorded on a device, so a search
  backend can be evaluated offline, thousands of times, at no measuring cost.
"""

from __future__ import annotations

from kselect.core.measuring.measure import Result
from kselect.core.models.tasks import Task


class Runner:
    """``with runner: result = runner.measure(task, config)``. Entering starts what the runner
    needs (a child process), leaving stops it; ``measure`` never raises for a bad candidate: it
    returns a result whose status says what happened (``ok``, ``invalid``: wrong output,
    ``failed``: crashed, timed out, refused)."""

    def measure(self, task: Task, config: dict) -> Result:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass
