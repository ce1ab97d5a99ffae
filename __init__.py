"""kselect: select the best existing native kernel configuration per op."""

__version__ = "0.1.0"


def load_plan(plan, model):
    """A runner of ``plan`` (a Plan or a plan file) on ``model`` (a Model, an ONNX file or a
    built-in name): ``runner(feeds) -> [outputs]``, even when the plan mixes libraries (see
    ``kselect.core.plans.runtime``)."""
    from kselect.core.plans.runtime import load_plan as load

    return load(plan, model)


def tune(model, libraries="mlas", config=None, **options):
    """Tunes ``model`` on ``libraries`` and returns a ``TuneResult`` whose ``plan`` is the one
    kept; ``config`` is a ``kselect.TuneConfig`` (core/config.py), or give its fields as keywords
    (``budget=8, db="records.db"``); ``events=`` takes a ``kselect.core.api.TuneEvents``."""
    from kselect.core.api import tune as run

    return run(model, libraries, config, **options)


def __getattr__(name):
    if name == "TuneConfig":  # imported when asked for: ``import kselect`` stays light
        from kselect.core.config import TuneConfig

        return TuneConfig
    raise AttributeError(f"module 'kselect' has no attribute {name!r}")


def bench(model, plan, **options):
    """Times ``model`` with ``plan`` against its baseline (``kselect.core.api.bench``)."""
    from kselect.core.api import bench as run

    return run(model, plan, **options)
