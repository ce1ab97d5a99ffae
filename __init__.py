"""kselect: select the best existing native kernel configuration per op."""

__version__ = "0.1.0"
