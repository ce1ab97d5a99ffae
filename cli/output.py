"""How kselect prints: rich consoles that never parse markup (names of files, nodes and kernels are
untrusted text and print as they are), and ``styled``, the one way to add kselect's own colours."""

from __future__ import annotations

from rich.console import Console
from rich.text import Text

err_console = Console(stderr=True, markup=False)


def styled(*parts) -> Text:
    """``parts`` are plain strings, printed as they are, or (string, style) pairs, such as
    ``styled(("error:", "bold red"), " ", message)``."""
    return Text.assemble(*parts)
