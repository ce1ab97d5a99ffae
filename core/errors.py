"""The one exception kselect shows to users as a single line (the CLI turns it into exit code 2)."""


class KselectError(Exception):
    """A problem with the user's input or environment, explained in one line."""
