"""Labels: the form a tensor is in where an op reads or writes it.

A label names a library and a form, written ``<library>:<form>``:

- a memory layout the library's kernels take (``NCHW``, ``NHWC``, ``NCHWc16``...);
- ``flat``: any tensor that is not 4-D, where layouts do not matter;
- ``int8``: quantized, between a float op and an int8 op (quantize in, dequantize out), or another
  int8 form of a library (``int8-in-place``: a library that requantizes int8 ops' outputs itself);
- ``boundary``: crossing into or out of a library's runner (a library with a ``boundary_cost``).

``Label`` is a ``str`` (plans and records store labels as text, and plan files written before it
existed load unchanged) parsed once, with typed parts, so no caller splits the text itself.
``Library.layout_label`` returns one; the cross-library planner (core/cross_library/) compares
them to know which conversions a tensor needs between two ops.
"""

from __future__ import annotations

PLAIN_LAYOUTS = ("NCHW", "flat")  # what runners take and return at their boundaries
BOUNDARY = "boundary"
INT8 = "int8"
FLAT = "flat"


class Label(str):
    """``Label("xnnpack", "NHWC")`` or ``Label("xnnpack:NHWC")``: ``.library``, ``.form``."""

    __slots__ = ()

    def __new__(cls, library: str, form: str | None = None) -> "Label":
        text = str(library) if form is None else f"{library}:{form}"
        library_part, colon, form_part = text.partition(":")
        if not colon or not library_part or not form_part:
            raise ValueError(f"a label is <library>:<form>, not {text!r}")
        return super().__new__(cls, text)

    @property
    def library(self) -> str:
        return self.partition(":")[0]

    @property
    def form(self) -> str:
        return self.partition(":")[2]

    @property
    def is_int8(self) -> bool:
        """``<library>:int8`` or another int8 form of a library (``int8-in-place``)."""
        return self.form.startswith(INT8)

    @property
    def is_boundary(self) -> bool:
        return self.form == BOUNDARY

    @property
    def is_plain(self) -> bool:
        """A form runners take and return at their boundaries (NCHW, or flat)."""
        return self.form in PLAIN_LAYOUTS

    def with_form(self, form: str) -> "Label":
        return Label(self.library, form)


GRAPH = Label("onnx", "NCHW")  # the model's own inputs and outputs


def library_of(label: str) -> str:
    return Label(label).library


def is_int8_label(label: str) -> bool:
    return Label(label).is_int8


def boundary_label(library: str) -> Label:
    return Label(library, BOUNDARY)
