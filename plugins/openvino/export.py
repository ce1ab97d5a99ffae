"""An OpenVINO plan as what plain OpenVINO loads, with no kselect installed: the model as an IR
(``<stem>.openvino.xml`` / ``.bin``, the stem the plan file's name) whose layers carry the plan's ``primitives_priority`` and
``precise`` attributes, and ``<stem>.openvino.json`` with the compile properties (precision,
threads, streams, pinning) and the implementation each planned node ran with when kselect
compiled it. Loading it in Python::

    import json, openvino as ov
    settings = json.load(open("model.openvino.json"))
    core = ov.Core()
    compiled = core.compile_model(core.read_model("model.openvino.xml"), settings["device"], settings["properties"])

(C++: ``core.compile_model(core.read_model("model.openvino.xml"), "CPU", properties)`` with the same
properties.)
"""

from __future__ import annotations

import json
from pathlib import Path

from kselect.core.plans.plan import write_atomically
from kselect.plugins.openvino import ir


def write_ir(plan, model, proto, out_dir, hints: dict, properties: dict, stem: str | None = None) -> list[Path]:
    """The plan's IR and compile properties in ``out_dir``, named after ``stem`` (default: the
    model's name); ``proto`` is the ONNX model the plan compiles (its QDQ form when it has int8
    nodes), ``hints`` and ``properties`` are the plan's (library.plan_compilation)."""
    out_dir, stem = Path(out_dir), stem or model.name
    out_dir.mkdir(parents=True, exist_ok=True)
    converted = ir.ConvertedModel(proto, model.input_shapes, list(plan.nodes))
    ran = converted.runtime_choices(converted.compile(hints, properties))
    xml_path, bin_path = out_dir / f"{stem}.openvino.xml", out_dir / f"{stem}.openvino.bin"
    settings_path = out_dir / f"{stem}.openvino.json"
    settings = {
        "device": "CPU",
        "properties": properties,
        "nodes": {node: {"layers": list(converted.layers[node]), "implementation": choice.impl,
                         "precision": choice.precision, "primitive": choice.primitive}
                  for node, choice in ran.items()},
    }
    write_atomically(bin_path, converted.weights)
    write_atomically(xml_path, converted.hinted_xml(hints))
    write_atomically(settings_path, json.dumps(settings, indent=2) + "\n")
    return [xml_path, bin_path, settings_path]
