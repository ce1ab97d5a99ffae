"""Turning an MLAS plan into what plain ONNX Runtime runs: an ONNX model whose convs are in the
layout the plan chose (kselect writes the com.microsoft.nchwc nodes and the reorders between
layouts; where the plan's layouts are exactly ORT's own choice, the original model is kept and
ORT converts it) and a session-options file with the plan-level knobs.

Loading the result anywhere::

    options = json.load(open("model.kselect.session.json"))
    so = onnxruntime.SessionOptions()
    so.intra_op_num_threads = options["intra_op_num_threads"]
    for key, value in options["config_entries"].items():
        so.add_session_config_entry(key, value)
    session = onnxruntime.InferenceSession("model.kselect.onnx", so)
"""

from __future__ import annotations

import json
from pathlib import Path

import onnx

from kselect.core.plans.plan import LIBRARY_DEFAULT, int8_nodes, reduced_nodes, write_atomically
from kselect.plugins.mlas.half import half_region, to_half
from kselect.plugins.mlas.int8 import quantized_model
from kselect.plugins.mlas.layout import nchwc_block_size
from kselect.plugins.mlas.ort_session import ort_nchwc_convs
from kselect.plugins.mlas.rewrite import anchor_inputs, rewrite_model
from kselect.plugins.mlas.session_config import add_config_entries, session_config_entries, session_options


def layouts_are_onnxruntimes(model, plan) -> bool:
    """Whether the plan puts exactly the convs in NCHWc that ORT's own transformer would, and
    kselect's rewrite would block no node that ORT's reorders around (HardSwish, arithmetic with a
    scalar: the ops were measured blocked): then the original model is kept and ORT converts it
    itself (the baseline's graph, bit for bit)."""
    chosen = {node for node, entry in plan.nodes.items() if entry["config"].get("layout") == "NCHWc"}
    if chosen != ort_nchwc_convs(model.proto):
        return False
    info: dict = {}
    rewrite_model(model.proto, dict.fromkeys(chosen, "NCHWc"), nchwc_block_size(), info=info)
    return not info["beyond_ort"]


def keeps_original_model(model, plan) -> bool:
    """Whether the plan runs on the original model, ORT laying it out itself: a plan with int8
    nodes (the quantizer's QDQ model), the library-default plan (ORT's default session is what it
    means, whatever kselect's rewrite would block; core/plans/plan.plan_variants), or one whose layouts
    are ORT's own (``layouts_are_onnxruntimes``). The library-default mark holds while every node
    keeps its default config: a plan edited by hand is written as it says."""
    return (bool(int8_nodes(plan)) or (plan.extra.get(LIBRARY_DEFAULT, False) and _at_defaults(plan))
            or layouts_are_onnxruntimes(model, plan))


def _at_defaults(plan) -> bool:
    return all(plan.nodes[node]["config"] == entry["default_config"]
               for entry in plan.tasks for node in entry["nodes"] if node in plan.nodes)


def original_model(model, segment: bool = False) -> onnx.ModelProto:
    """What ORT's own transformer gets: the model, or for ``segment`` (a segment of a plan across
    libraries, whose residual branches come in as graph inputs) the model with them anchored
    (rewrite.anchor_inputs)."""
    return anchor_inputs(model.proto, nchwc_block_size()) if segment else model.proto


def rewritten_model(model, plan, keep_original: bool, segment: bool = False) -> onnx.ModelProto:
    """``segment``: see ``original_model``; kselect's rewriter blocks those inputs itself. A plan
    with int8 nodes is the QDQ model onnxruntime.quantization writes (int8.py), whose float ops
    ORT lays out itself; a plan's fp16 nodes run in float16 (half.py)."""
    fp16 = {node for node, precision in reduced_nodes(plan).items() if precision == "fp16"}
    if int8_nodes(plan):
        proto = quantized_model(model, plan)
    elif keep_original:
        proto = original_model(model, segment)
    else:
        layouts = {node: entry["config"]["layout"] for node, entry in plan.nodes.items()
                   if "layout" in entry["config"]}
        proto = rewrite_model(model.proto, layouts, nchwc_block_size(), block_inputs=segment)
    # the plan's fp16 ops, with their activation steps, in float16 between casts (half.py)
    return to_half(proto, half_region(model, fp16)) if fp16 else proto


def session_settings(plan, keep_original: bool) -> dict:
    config = dict(plan.plan_level)
    return {
        "graph_optimization_level": "ORT_ENABLE_ALL",
        "intra_op_num_threads": int(config.get("threads", 0)),
        "config_entries": session_config_entries(config, keep_nchwc_transformer=keep_original),
    }


def write_optimized_model(plan, model, out_dir: Path, stem: str) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    model_path = out_dir / f"{stem}.kselect.onnx"
    options_path = out_dir / f"{stem}.kselect.session.json"
    keep_original = keeps_original_model(model, plan)
    write_atomically(model_path, rewritten_model(model, plan, keep_original).SerializeToString())
    write_atomically(options_path, json.dumps(session_settings(plan, keep_original), indent=2) + "\n")
    return [model_path, options_path]


def load_session(model_path: str | Path, options_path: str | Path):
    """Plain onnxruntime loading of what ``write_optimized_model`` wrote."""
    import onnxruntime as ort  # heavy (~0.3 s): not imported with the plugin

    settings = json.loads(Path(options_path).read_text())
    options = ort.SessionOptions()
    options.intra_op_num_threads = settings["intra_op_num_threads"]
    for key, value in settings["config_entries"].items():
        options.add_session_config_entry(key, value)
    return ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])


def default_session(model, extra_entries: dict | None = None, segment: bool = False, profile_prefix: str | None = None):
    """The baseline: ONNX Runtime's default session (ORT_ENABLE_ALL, all cores, its defaults);
    ``extra_entries``: session config entries added to it; ``segment``: see ``original_model``;
    ``profile_prefix``: ONNX Runtime's profiler on, writing there (profiling.py)."""
    import onnxruntime as ort  # heavy (~0.3 s): not imported with the plugin

    options = _profiling(add_config_entries(ort.SessionOptions(), extra_entries), profile_prefix)
    return ort.InferenceSession(original_model(model, segment).SerializeToString(), options,
                                providers=["CPUExecutionProvider"])


def plan_session(model, plan, extra_entries: dict | None = None, segment: bool = False, profile_prefix: str | None = None):
    import onnxruntime as ort  # heavy (~0.3 s): not imported with the plugin

    keep_original = keeps_original_model(model, plan)
    options = add_config_entries(session_options(plan.plan_level, keep_nchwc_transformer=keep_original), extra_entries)
    options = _profiling(options, profile_prefix)
    return ort.InferenceSession(rewritten_model(model, plan, keep_original, segment).SerializeToString(), options,
                                providers=["CPUExecutionProvider"])


def _profiling(options, prefix: str | None):
    if prefix is not None:
        options.enable_profiling = True
        options.profile_file_prefix = prefix
    return options
