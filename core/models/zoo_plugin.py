"""Registers the built-in model zoo (kselect.core.models.zoo) through the plugin hooks."""

from functools import partial

from kselect.core.contract.hookspecs import hookimpl
from kselect.core.models import zoo


@hookimpl
def register_models(register):
    for name, description in zoo.BUILTIN_MODELS.items():
        register(name, description, partial(zoo.build_model, name))
