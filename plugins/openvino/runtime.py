"""The ``openvino`` module, imported with OpenVINO's usage telemetry off.

``import openvino`` starts OpenVINO's telemetry (the ``openvino_telemetry`` package, a dependency
of the ``openvino`` wheel): it creates ``~/intel`` with a client id and usage counters, and sends
usage events over the network, on import and on every ``convert_model``. kselect writes no file
the user did not name and sends nothing unasked; and where name lookups hang (no network), a
measuring child waited on that send until its timeout killed it. So kselect imports OpenVINO as if
``openvino_telemetry`` were not installed, a case OpenVINO's tools handle with their own no-op
stub (``openvino.tools.ovc.telemetry_stub``), as NNCF does. A process that imported OpenVINO
before kselect keeps the telemetry it started with.
"""

from __future__ import annotations

import sys


def openvino():
    """The ``openvino`` module (imported once per process, without telemetry when first imported here)."""
    if "openvino" not in sys.modules:
        sys.modules.setdefault("openvino_telemetry", None)  # None: `import openvino_telemetry` raises ImportError
    import openvino

    return openvino
