"""An OpenVINO plan as what plain OpenVINO loads, with no kselect installed: the model as an IR
(``<model>.openvino.xml`` / ``.bin``) whose layers carry the plan's ``primitives_priority`` and
``precise`` attributes, and ``<model>.openvino.json`` with the compile properties (precision,
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
from kselect.plugins.openvino.library import plan_compilation


def write_ir(plan, model, out_dir) -> list[Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    converted = ir.ConvertedModel(model.proto, model.input_shapes, list(plan.nodes))
    hints, properties = plan_compilation(plan)
    ran = converted.runtime_choices(converted.compile(hints, properties))
    xml_path, bin_path = out_dir / f"{model.name}.openvino.xml", out_dir / f"{model.name}.openvino.bin"
    settings_path = out_dir / f"{model.name}.openvino.json"
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
