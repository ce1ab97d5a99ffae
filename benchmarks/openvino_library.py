"""OpenVINO as a library, per model: ONNX Runtime's default, OpenVINO's default (bf16 on a CPU
with AVX512_BF16 or AMX), OpenVINO in f32 and OpenVINO INT8 (NNCF), against kselect's OpenVINO
plan (per-node implementation and precision, ``--library openvino --precision all``) and its plan
across every library with OpenVINO in it (``--library all --precision all``), at each
``--budgets`` accuracy drop. The sides, the rounds protocol and the accuracy figures are the
precision benchmark's (benchmarks/precision.py, which this runs with other defaults); the page
adds, per model and budget, kselect's OpenVINO plan against OpenVINO's default and its plan
across libraries against the faster of the two defaults, and names the implementation types the
OpenVINO plan chose where they differ from OpenVINO's own pick. (Not named openvino.py: Python
puts a script's folder first on its path, and that file would then be what ``import openvino``
finds.)

    .venv/bin/python benchmarks/openvino_library.py --models pplcnet-doc-orientation,yolov8n-nudenet-320
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import precision  # noqa: E402  (benchmarks/ is not a package)

if __name__ == "__main__":
    np.seterr(all="ignore")
    precision.main({"tunes": "all;openvino", "json": "benchmarks/results/openvino.json",
                    "markdown": "docs/openvino-benchmark.md"},
                   title="OpenVINO as a library: kselect against OpenVINO's and ONNX Runtime's defaults",
                   description=__doc__)
