"""Random search: valid configs in a seeded random order, each at most once."""

import random as _random

from kselect.core.contract.hookspecs import hookimpl
from kselect.search import Searcher


class RandomSearcher(Searcher):
    name = "random"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.order = list(self.space.enumerate())
        _random.Random(self.seed).shuffle(self.order)

    def ask(self):
        return self.pop_unmeasured(self.order)


@hookimpl
def register_searchers(register):
    register("random", RandomSearcher)
