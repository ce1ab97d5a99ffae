"""Measuring in a child process, so that a candidate kernel that crashes, aborts or hangs is
recorded as failed instead of taking the tuner down.

The child is a plain ``python -m kselect.core.measuring.worker`` process (no multiprocessing start-method
caveats for apps that embed kselect); it talks to the parent over two pipes of its own, so
whatever a native library prints cannot corrupt the protocol.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import traceback
from dataclasses import asdict
from multiprocessing.connection import Connection

from kselect.core.contract import plugins
from kselect.core.contract.runner import Runner
from kselect.core.measuring.device import available_memory, proc_bytes
from kselect.core.measuring.measure import MeasureSettings, Result, measure_in_this_process
from kselect.core.models.tasks import Task


def signal_name(returncode: int | None) -> str:
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return signal.Signals(-returncode).name
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"


@contextlib.contextmanager
def memory_cap(allowance: int | None):
    """While inside, this process may allocate ``allowance`` bytes beyond what it holds now: past
    that an allocation fails (MemoryError, std::bad_alloc), so a candidate that asks for too much
    fails alone instead of swapping the machine or waking the OOM killer."""
    in_use = proc_bytes("/proc/self/status", "VmData")  # what RLIMIT_DATA counts: heap, private writable maps
    if allowance is None or in_use is None:
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    limit = in_use + allowance if hard == resource.RLIM_INFINITY else min(in_use + allowance, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


def candidate_allowance(settings: MeasureSettings) -> int | None:
    if settings.candidate_memory_mb is not None:
        return int(settings.candidate_memory_mb) << 20
    available = available_memory()
    return None if available is None else available * 3 // 4


def die_with_parent() -> None:
    """In a child process (before exec): get SIGKILL when the process that started it dies, so a
    killed tuner never leaves a measuring child (or a hung candidate in it) running."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - best effort (not Linux)
        pass


class MeasureWorker(Runner):
    """Runs candidates one at a time in a child process, replacing it after a crash or hang.
    ``library``: a Library (the child builds an instance of the same class) or a registered
    library's name."""

    def __init__(self, library, settings: MeasureSettings):
        if isinstance(library, str):
            self.library_name, self.library_class = library, ""
        else:
            self.library_name, self.library_class = library.name, class_path(type(library))
        self.settings = settings
        self.process: subprocess.Popen | None = None
        self.to_child: Connection | None = None
        self.from_child: Connection | None = None

    def _start(self) -> None:
        child_reads, parent_writes = os.pipe()
        parent_reads, child_writes = os.pipe()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kselect.core.measuring.worker", str(child_reads), str(child_writes), self.library_name,
             self.library_class, json.dumps(asdict(self.settings))],
            pass_fds=(child_reads, child_writes), stdin=subprocess.DEVNULL, start_new_session=True,
            preexec_fn=die_with_parent if sys.platform.startswith("linux") else None)
        os.close(child_reads)
        os.close(child_writes)
        self.to_child = Connection(parent_writes, readable=False)
        self.from_child = Connection(parent_reads, writable=False)

    def measure(self, task: Task, config: dict) -> Result:
        if self.process is None or self.process.poll() is not None:
            self.stop(kill=True)
            self._start()
        try:
            self.to_child.send((task.to_json(), config))
            if self.from_child.poll(self.settings.timeout_s):
                return Result(**self.from_child.recv())
            self.stop(kill=True)
            return Result("failed", reason=f"timed out after {self.settings.timeout_s:g} s (killed)")
        except (EOFError, OSError):
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            reason = f"crashed ({signal_name(self.process.returncode)})"
            self.stop(kill=True)
            return Result("failed", reason=reason)

    def stop(self, kill: bool = False) -> None:
        if self.process is None:
            return
        if not kill:
            try:
                self.to_child.send(None)
                self.process.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        for connection in (self.to_child, self.from_child):
            connection.close()
        self.process = self.to_child = self.from_child = None

    def __exit__(self, *exc):
        self.stop(kill=exc[0] is not None)


def class_path(cls) -> str:
    """``module:qualname:file`` of ``cls``, or of its nearest base a fresh process can import: a
    class defined inside a function cannot be rebuilt there, so its base's methods are measured
    (such a class can only change what the parent asks: spaces, defaults)."""
    import inspect

    for klass in cls.__mro__:
        if "<locals>" not in klass.__qualname__ and klass.__module__ != "__main__":
            module = sys.modules.get(klass.__module__)
            return f"{klass.__module__}:{klass.__qualname__}:{getattr(module, '__file__', '') or ''}"
    raise ValueError(f"no importable class in {inspect.getmro(cls)}")


def child_library(library_name: str, library_class: str):
    """The library the parent measures with: the registered instance when it is of the class
    the parent used (``class_path``), else a new instance of that class. A module the parent
    imported from a folder on its own path (a test module) is imported from that folder here."""
    import importlib


    registered = plugins.libraries().get(library_name)
    if not library_class:
        return registered if registered is not None else plugins.get_library(library_name)
    module_name, qualname, file = library_class.split(":", 2)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError:
        if not file:
            raise
        sys.path.insert(0, os.path.dirname(file))
        module = importlib.import_module(module_name)
    cls = module
    for part in qualname.split("."):
        cls = getattr(cls, part)
    return registered if type(registered) is cls else cls()


def child_main(read_fd: int, write_fd: int, library_name: str, library_class: str, settings_json: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    incoming, outgoing = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    library = child_library(library_name, library_class)
    settings = MeasureSettings(**json.loads(settings_json))
    allowance = candidate_allowance(settings)
    cache: dict = {}
    while True:
        try:
            message = incoming.recv()
        except EOFError:
            return
        if message is None:
            return
        task_json, config = message
        try:
            result = measure_in_this_process(library, Task.from_json(task_json), config, settings, cache,
                                             limits=lambda: memory_cap(allowance))
        except Exception:
            result = Result("failed", reason="internal error: " + traceback.format_exc().strip().splitlines()[-1])
        try:
            outgoing.send(result.to_json())
        except BrokenPipeError:  # the parent is gone (killed or stopped): nothing to report to
            return


if __name__ == "__main__":
    child_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])
