"""Layout and library changes between neighbouring ops, measured like kernels.

A tensor passing from an op labelled A (``Library.layout_label``, e.g. ``"xnnpack:NHWC"``) to an
op labelled B costs nothing when A == B. Otherwise A's library takes it out of A's layout
("out") and B's library takes it into B's ("in"), as their runners do at a segment boundary
(core/plans/runtime.py). Each side is a candidate of its library (``Library.conversion``), measured in
the worker child per tensor shape, checked (a conversion never changes values) and stored in the
records database under the library name plus ``/convert``, so later plans reuse it.

A library whose runner charges a tensor for crossing into or out of it beyond its layout changes
(``Library.boundary_cost``; ACL: a file exchange with its runner process) also has a side labelled
``<library>:boundary``, counted only where the tensor passes between two libraries.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kselect.core.contract.labels import FLAT, GRAPH, Label, boundary_label, library_of
from kselect.core.contract.space import config_key
from kselect.core.errors import KselectError
from kselect.core.measuring.device import Device
from kselect.core.measuring.measure import MeasureSettings
from kselect.core.measuring.worker import MeasureWorker
from kselect.core.models.tasks import Task, task_key
from kselect.core.records.store import RecordDB

GRAPH_LABEL = GRAPH
RECORD_SUFFIX = "/convert"


def side_label(label: str, rank: int) -> str:
    """Layouts only matter for 4-D tensors; any other tensor is ``<library>:flat``. A boundary
    side, and the int8 side (``<library>:int8``: quantize in, dequantize out), is one whatever
    the rank."""
    label = Label(label)
    return label if rank == 4 or label.is_int8 or label.is_boundary else label.with_form(FLAT)


def conversion_task(label: str, direction: str, shape) -> Task:
    shape = [int(d) for d in shape]
    signature = {"kind": "convert", "label": label, "direction": direction, "shape": shape}
    task_id = f"{direction} {label} {'x'.join(map(str, shape))}"
    return Task(task_id, task_key(signature), "convert", shape, [], shape, {"label": label, "direction": direction},
                False)


Side = tuple  # (label, direction, shape tuple)


def _crossings(a: str, b: str, crossing) -> list[tuple[str, str]]:
    """(boundary label, direction) a tensor pays passing from label ``a`` to ``b`` (already side
    labels) between two libraries, for the libraries in ``crossing``."""
    if library_of(a) == library_of(b):
        return []
    ends = ((library_of(a), "out"), (library_of(b), "in"))
    return [(boundary_label(library), direction) for library, direction in ends if library in crossing]


@dataclass
class ConversionTable:
    times_us: dict[Side, float] = field(default_factory=dict)  # inf when the conversion failed
    crossing: frozenset = frozenset()  # libraries with a boundary cost (Library.boundary_cost)
    switch_us: dict = field(default_factory=dict)  # (from library, to library) -> µs (core/cross_library/switches.py)
    sleep_us: dict = field(default_factory=dict)  # library -> µs per op while its workers sleep (core/cross_library/switches.py)

    def side_us(self, label: str, direction: str, shape) -> float:
        if library_of(label) == library_of(GRAPH_LABEL):
            return 0.0
        return self.times_us[(side_label(label, len(shape)), direction, tuple(shape))]

    def sides(self, producer: str, consumer: str, shape) -> list[Side]:
        """The sides ``cost_us`` charges a tensor of ``shape`` between these two labels."""
        a, b = side_label(producer, len(shape)), side_label(consumer, len(shape))
        if a == b:
            return []
        # entering a runner's plain side (NCHW, or flat) stands for one more call of that runner:
        # none is made when the change stays inside one library
        stays = a.library == b.library and b.is_plain
        sides = [(a, "out")] + ([] if stays else [(b, "in")]) + _crossings(a, b, self.crossing)
        return [(label, direction, tuple(shape)) for label, direction in sides
                if library_of(label) != library_of(GRAPH_LABEL)]

    def cost_us(self, producer: str, consumer: str, shape) -> float:
        sides = self.sides(producer, consumer, shape)
        return sum(self.side_us(*side) for side in sides) + (self.switch_cost_us(producer, consumer) if sides else 0.0)

    def switch_cost_us(self, a: str, b: str) -> float:
        return self.switch_us.get((library_of(a), library_of(b)), 0.0)


def sides_needed(producer: str, consumer: str, shape, crossing=frozenset()) -> list[Side]:
    """The conversion sides a tensor of ``shape`` needs between these two labels; ``crossing``:
    the libraries with a boundary cost."""
    a, b = side_label(producer, len(shape)), side_label(consumer, len(shape))
    if a == b:
        return []
    sides = [(label, direction) for label, direction in ((a, "out"), (b, "in")) if library_of(label) != library_of(GRAPH_LABEL)]
    return [(label, direction, tuple(shape)) for label, direction in sides + _crossings(a, b, crossing)]


def crossing_libraries(libraries: dict) -> frozenset:
    """The libraries whose runner boundary a plan across ``libraries`` pays (none on one library:
    every op of its plan runs in one runner)."""
    if len(libraries) < 2:
        return frozenset()
    return frozenset(name for name, library in libraries.items() if library.boundary_cost)


def measure_conversions(sides: set[Side], libraries: dict, device: Device, db: RecordDB,
                        settings: MeasureSettings, on_measured=None, again: bool = False) -> ConversionTable:
    """Stored results are reused (unless ``again``: then every side is measured now and a result
    that is not ok keeps the stored one); the rest are measured now, grouped by library."""
    table = ConversionTable(crossing=crossing_libraries(libraries))
    db.add_device(device.fingerprint, device.to_json())
    by_library: dict[str, list[Side]] = {}
    for side in sorted(sides, key=lambda s: (s[0], s[1], s[2])):
        by_library.setdefault(library_of(side[0]), []).append(side)
    for name, wanted in by_library.items():
        library = libraries.get(name)
        if library is None:
            raise KselectError(f"no library {name!r} to measure conversions into {wanted[0][0]}")
        version, record_library = library.version(), name + RECORD_SUFFIX
        stored = {r.task: r for r in db.records(device.fingerprint, record_library, version)}
        to_measure = []
        for side in wanted:
            task = conversion_task(*side)
            if task.key in stored:
                table.times_us[side] = _time_of(stored[task.key].result)
            if again or task.key not in stored:
                to_measure.append((side, task))
        if not to_measure:
            continue
        with MeasureWorker(name, settings) as worker:
            for side, task in to_measure:
                result = worker.measure(task, {})
                if on_measured:
                    on_measured(task, result)
                if task.key in stored and result.status != "ok":
                    continue
                db.add(device.fingerprint, record_library, version, task.to_json(), config_key({}), result,
                       library.emulated, True)
                table.times_us[side] = _time_of(result)
    return table


def _time_of(result) -> float:
    return result.median_us if result.status == "ok" else float("inf")
