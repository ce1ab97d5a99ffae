"""Exhaustive search: every valid config, in the space's enumeration order."""

from kselect.core.contract.hookspecs import hookimpl
from kselect.search import Searcher


class ExhaustiveSearcher(Searcher):
    name = "exhaustive"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.order = list(reversed(self.space.enumerate()))

    def ask(self):
        return self.pop_unmeasured(self.order)


@hookimpl
def register_searchers(register):
    register("exhaustive", ExhaustiveSearcher)
