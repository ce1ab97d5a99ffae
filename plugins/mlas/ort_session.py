"""ONNX Runtime's side of MLAS's NCHWc layout: the names ORT uses for it, the session options a
model rewritten by kselect needs (``session_options``), the MLAS session config keys
(``CONFIG_KEYS``), and what ORT's own optimiser makes of a model (``ort_optimized``, and
``ort_nchwc_convs``: which convs its NchwcTransformer converts).

Written for onnxruntime 1.32 (the venv's build) and checked against its sources
(nchwc_transformer.cc, graph_transformer_utils.cc, onnxruntime_session_options_config_keys.h) and
by running it.

ORT session settings for a rewritten model
------------------------------------------
* Disable ORT's transformer, else it converts the remaining NCHW convs too::

      so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
      so.add_session_config_entry("optimization.disable_specified_optimizers", "NchwcTransformer")
      # or: ort.InferenceSession(path, so, disabled_optimizers=["NchwcTransformer"])

  ``NchwcTransformer`` is the registered name (graph_transformer_utils.cc, Level3).  The config
  value is a **';'-separated** list in 1.32 (the header says comma, but
  "ConvActivationFusion,NchwcTransformer" is taken as one unknown name and disables nothing).
  Unknown names are ignored silently.  ``session_options()`` below applies this.
* At ORT_ENABLE_ALL with the transformer disabled the model still gets every level-1/2 fusion
  (constant folding, ConvActivationFusion -> FusedConv for the NCHW convs, Gemm fusions, ...)
  and the level-3 ConvAddActivationFusion for NCHW Conv+Add(+act).  ORT_ENABLE_EXTENDED also
  works without disabling anything (NchwcTransformer is level 3) but loses that level-3 fusion.
  Nodes in the ``com.microsoft.nchwc`` domain are left alone by all of these.
* Serialising such a model (``optimized_model_filepath``) bakes in the block size: it only runs
  on CPUs with the same ``nchwc_block_size()``.

MLAS session config keys (present in 1.32's onnxruntime_session_options_config_keys.h and in the
binary; unknown keys and bad values are accepted silently, except that a non-integer value for
the pointwise key aborts the process):

=====================================================  =========  ==================================
key                                                     default    applies to
=====================================================  =========  ==================================
``mlas.nchwc_depthwise_sliding``                        "1"        NCHWc depthwise convs only, on
                                                                   AVX-512; the sliding-window
                                                                   kernel covers stride 1, dilation
                                                                   1, kernel width 3/5/7 (others use
                                                                   the asm kernel); "0" = always the
                                                                   asm kernel; bitwise identical
``mlas.nchwc_pointwise_conv_max_input_channel_batch``   "0"=128    NCHWc pointwise (1x1) convs only:
                                                                   input channels accumulated per
                                                                   kernel call, rounded up to the
                                                                   block; "0"/unset = MLAS default
                                                                   128
``session.intra_op.allow_spinning``                     "1"        every multi-threaded op, both
                                                                   layouts ("0" in client-package
                                                                   builds).  Also
                                                                   ``session.intra_op.spin_duration_us``
                                                                   (unset = iteration-count spin)
                                                                   and ``..spin_backoff_max`` ("1")
``session.disable_prepacking``                          "0"        prepacking on; neither NCHW Conv
                                                                   nor NCHWc Conv prepacks in 1.32
                                                                   (checked with
                                                                   session.save_external_prepacked_
                                                                   constant_initializers: only the
                                                                   MatMul/Gemm weights get a
                                                                   prepacked blob), so it matters
                                                                   for the Gemm/MatMul, not convs
=====================================================  =========  ==================================

So for NCHW convs only the session-wide knobs (threads, spinning) matter; the two ``mlas.nchwc_*``
keys only change NCHWc convs.  ``mlas.disable_kleidiai`` / ``mlas.kleidiai.conv_igemm_max_work``
are Arm64 knobs (arm.py), as is ``mlas.enable_gemm_fastmath_arm64_bfloat16``.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import onnx

NCHWC_DOMAIN = "com.microsoft.nchwc"
NCHWC_TRANSFORMER = "NchwcTransformer"
DISABLE_OPTIMIZERS_KEY = "optimization.disable_specified_optimizers"

#: Verified config keys of onnxruntime 1.32 and their defaults (see the module docstring).
CONFIG_KEYS: dict[str, str] = {
    "mlas.nchwc_depthwise_sliding": "1",
    "mlas.nchwc_pointwise_conv_max_input_channel_batch": "0",  # 0/unset -> MLAS default 128
    "session.intra_op.allow_spinning": "1",
    "session.intra_op.spin_duration_us": "",  # unset -> iteration-count based spinning
    "session.intra_op.spin_backoff_max": "1",
    "session.disable_prepacking": "0",
}

# Elementwise unary ops that may run on a blocked tensor and be fused into an NCHWc conv.
UNARY_ACTIVATIONS = ("Relu", "Clip", "Sigmoid", "Tanh", "LeakyRelu", "HardSigmoid")


def session_options(so: Any = None, *, level: Any = None) -> Any:
    """Session options suitable for a model written by ``rewrite_model``.

    Sets ORT_ENABLE_ALL (or ``level``) and disables ORT's NchwcTransformer (appending to any
    names already listed under ``optimization.disable_specified_optimizers``).
    """
    import onnxruntime as ort

    if so is None:
        so = ort.SessionOptions()
    so.graph_optimization_level = level if level is not None else ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    existing = so.get_session_config_entry(DISABLE_OPTIMIZERS_KEY) if _has_entry(so, DISABLE_OPTIMIZERS_KEY) else ""
    names = [n for n in existing.split(";") if n]
    if NCHWC_TRANSFORMER not in names:
        names.append(NCHWC_TRANSFORMER)
    so.add_session_config_entry(DISABLE_OPTIMIZERS_KEY, ";".join(names))
    return so


def _has_entry(so: Any, key: str) -> bool:
    try:
        so.get_session_config_entry(key)
        return True
    except Exception:  # ORT raises when the key is absent
        return False


def ort_optimized(model: onnx.ModelProto, level: str = "ORT_ENABLE_ALL") -> onnx.ModelProto:
    """The graph ONNX Runtime's default session (ORT_ENABLE_ALL, or another optimisation ``level``)
    actually runs."""
    import onnxruntime as ort

    with tempfile.TemporaryDirectory(prefix="kselect_nchwc_") as tmp:
        path = os.path.join(tmp, "optimized.onnx")
        so = ort.SessionOptions()
        so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
        so.optimized_model_filepath = path
        so.log_severity_level = 3
        so.intra_op_num_threads = 1
        ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        return onnx.load(path)


def ort_nchwc_convs(model: onnx.ModelProto, optimized: onnx.ModelProto | None = None) -> set[str]:
    """Names of the Conv nodes ONNX Runtime's own NchwcTransformer turns into NCHWc convs.

    Its choice depends on the graph around a conv (e.g. a conv whose input channels are not a
    block multiple is converted only when its producer already is), so ORT is asked: the model
    is optimised as a default session would, and each NCHWc conv, which ORT names after its
    output tensor + "_nchwc" (the conv's, or that of the activation fused into it), is traced
    back to the original node. ``optimized``: ``ort_optimized(model)``, when already made.
    """
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    conv_of_tensor: dict[str, str] = {}
    for node in model.graph.node:
        if node.op_type == "Conv":
            conv_of_tensor[node.output[0]] = node.name
            readers = consumers.get(node.output[0], [])
            if len(readers) == 1 and readers[0].op_type in UNARY_ACTIVATIONS:
                conv_of_tensor[readers[0].output[0]] = node.name
    converted = set()
    for node in (optimized or ort_optimized(model)).graph.node:
        if node.domain == NCHWC_DOMAIN and node.op_type == "Conv" and node.name.endswith("_nchwc"):
            original = conv_of_tensor.get(node.name[: -len("_nchwc")])
            if original is not None:
                converted.add(original)
    return converted


def ort_matmul_nodes(optimized: onnx.ModelProto) -> set[str]:
    """Names of the MatMul nodes ONNX Runtime runs as MatMul in ``optimized`` (``ort_optimized``):
    it fuses a MatMul followed by a bias Add into a Gemm (a node of another name)."""
    return {node.name for node in optimized.graph.node if node.op_type == "MatMul" and node.domain in ("", "ai.onnx")}


__all__ = [
    "CONFIG_KEYS",
    "DISABLE_OPTIMIZERS_KEY",
    "NCHWC_DOMAIN",
    "NCHWC_TRANSFORMER",
    "UNARY_ACTIVATIONS",
    "ort_matmul_nodes",
    "ort_nchwc_convs",
    "ort_optimized",
    "session_options",
]
