"""ONNX Runtime session options for an MLAS config (plan-level or one op's): the session config
keys kselect sets, read by the single-op candidates (library.py) and the plan sessions and files
(apply.py)."""

from __future__ import annotations

from kselect.plugins.mlas.arm import arm_config_entries
from kselect.plugins.mlas.ort_session import DISABLE_OPTIMIZERS_KEY, NCHWC_TRANSFORMER

# ONNX Runtime session config keys (checked against onnxruntime 1.32's own key list).
SPINNING_KEY = "session.intra_op.allow_spinning"
FORCE_SPINNING_STOP_KEY = "session.force_spinning_stop"
DEPTHWISE_SLIDING_KEY = "mlas.nchwc_depthwise_sliding"
POINTWISE_BATCH_KEY = "mlas.nchwc_pointwise_conv_max_input_channel_batch"
PREPACKING_KEY = "session.disable_prepacking"


def session_options(config: dict, keep_nchwc_transformer: bool = False):
    """ONNX Runtime session options for a (plan-level or op) config; keys a config lacks keep
    ONNX Runtime's defaults."""
    import onnxruntime as ort  # heavy (~0.3 s): not imported with the plugin

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    add_config_entries(options, session_config_entries(config, keep_nchwc_transformer))
    if "threads" in config:
        options.intra_op_num_threads = int(config["threads"])
    return options


def add_config_entries(options, entries: dict[str, str] | None):
    for key, value in (entries or {}).items():
        options.add_session_config_entry(key, value)
    return options


def session_config_entries(config: dict, keep_nchwc_transformer: bool = False) -> dict[str, str]:
    entries = {}
    if not keep_nchwc_transformer:  # kselect decides each node's layout itself
        entries[DISABLE_OPTIMIZERS_KEY] = NCHWC_TRANSFORMER
    if "spinning" in config:
        entries[SPINNING_KEY] = str(int(config["spinning"]))
    if "depthwise_sliding" in config:
        entries[DEPTHWISE_SLIDING_KEY] = str(int(config["depthwise_sliding"]))
    if config.get("pointwise_batch", "default") != "default":
        entries[POINTWISE_BATCH_KEY] = str(config["pointwise_batch"])
    if "prepacking" in config:
        entries[PREPACKING_KEY] = "0" if config["prepacking"] else "1"
    entries.update(arm_config_entries(config))  # KleidiAI, bf16 fast-math GEMM (arm.py)
    return entries
