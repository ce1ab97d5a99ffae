"""kselect: select the best existing native kernel configuration per op."""

__version__ = "0.1.0"


def load_plan(plan, model):
    """A runner of ``plan`` (a Plan or a plan file) on ``model`` (a Model, an ONNX file or a
    built-in name): ``runner(feeds) -> [outputs]``, even when the plan mixes libraries (see
    ``kselect.core.plans.runtime``)."""
    from kselect.core.plans.runtime import load_plan as load

    return load(plan, model)


def tune(model, libraries="mlas", **options):
    """Tunes ``model`` on ``libraries`` and returns a ``TuneResult`` whose ``plan`` is the one
    kept; the options are ``kselect.core.api.tune``'s (budget, search, db, ...)."""
    from kselect.core.api import tune as run

    return run(model, libraries, **options)


def bench(model, plan, **options):
    """Times ``model`` with ``plan`` against its baseline (``kselect.core.api.bench``)."""
    from kselect.core.api import bench as run

    return run(model, plan, **options)
