"""kselect: select the best existing native kernel configuration per op."""

__version__ = "0.1.0"


def load_plan(plan, model):
    """A runner of ``plan`` (a Plan or a plan file) on ``model`` (a Model, an ONNX file or a
    built-in name): ``runner(feeds) -> [outputs]``, even when the plan mixes libraries (see
    ``kselect.core.runtime``)."""
    from kselect.core.runtime import load_plan as load

    return load(plan, model)
