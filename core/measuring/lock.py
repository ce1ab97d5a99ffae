"""One measuring process per machine at a time: timings taken while another tune measures on the
same cores are not the device's (two concurrent resnet18 tunes read 1.09-4.86x their isolated
times and chose other plans). A tune or bench holds an exclusive lock on a file named after the
device fingerprint while it measures; a second one waits for it, says so, and then reuses every
record the first one stored instead of measuring it again.

The lock is ``flock`` on a local file, so it is released by the kernel when its holder dies,
however it dies."""

from __future__ import annotations

import fcntl
import os
import time
from contextlib import contextmanager
from pathlib import Path

from kselect.core.paths import cache_root


def lock_path(device_fingerprint: str) -> Path:
    return cache_root() / "locks" / f"measuring-{device_fingerprint}.lock"


@contextmanager
def measuring_lock(device_fingerprint: str, on_wait=None):
    """Holds the device's measuring lock; ``on_wait(holder)`` is called once if another process
    holds it (``holder``: what that process wrote: its pid and command)."""
    path = lock_path(device_fingerprint)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                handle.seek(0)
                on_wait(handle.read().strip() or "another process")
            fcntl.flock(handle, fcntl.LOCK_EX)
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} since {time.strftime('%H:%M:%S')}")
        handle.flush()
        try:
            yield
        finally:
            handle.seek(0)
            handle.truncate()
            fcntl.flock(handle, fcntl.LOCK_UN)
