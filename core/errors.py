"""The one exception kselect shows to users as a single line (the CLI turns it into exit code 2),
and how a failure is told in one line."""


class KselectError(Exception):
    """A problem with the user's input or environment, explained in one line."""


def first_line(exc: BaseException) -> str:
    """The first line of the message (the type's name when there is none)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def one_line(exc: BaseException) -> str:
    """``Type: first line of the message``, for reasons stored with a failed measurement."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


class KselectWarning(UserWarning):
    """Something kselect passed over and went on (a bad record row): the CLI shows it as one line."""


class KselectNote(UserWarning):
    """What kselect did differently from what the model says, at the user's word (a static input
    dim overridden by --input-shape): the CLI shows it as one line with the command's output."""


class OutputError(KselectError, OSError):
    """A file kselect writes could not be written (a full disk): one line naming the path and the
    cause. An OSError too, for callers that catch those: ``OutputError(errno, message)``."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()


class UnsupportedOp(KselectError):
    """A library's whole-model runner cannot run one node (``node``: its name) as the model has
    it. Runners raise it while building; core/plans/runtime.py then gives that node to ONNX Runtime."""

    def __init__(self, message: str, node: str | None = None):
        super().__init__(message)
        self.node = node
