"""The one exception kselect shows to users as a single line (the CLI turns it into exit code 2),
and how a failure is told in one line."""


class KselectError(Exception):
    """A problem with the user's input or environment, explained in one line."""


def one_line(exc: BaseException) -> str:
    """``Type: first line of the message``, for reasons stored with a failed measurement."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
