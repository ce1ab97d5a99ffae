"""What real exporters write, each quirk on a tiny graph: kselect reads it, finds its tasks, and
every library's whole-model runner runs it with outputs matching ONNX Runtime's."""

from __future__ import annotations

import graphs
import numpy as np
import onnx
import pytest
from helpers import run_kselect
from onnx import helper, numpy_helper

from kselect.core.contract import plugins
from kselect.core.models.model import load_model, model_from_proto
from kselect.core.models.tasks import extract_tasks, untuned_ops
from kselect.core.plans.runtime import library_runner
from kselect.core.whole_model.bench import compare_outputs, random_feeds

RNG = np.random.default_rng(0)


def _weights(*shape) -> np.ndarray:
    return (RNG.standard_normal(shape) * 0.3).astype(np.float32)


def _model(nodes, inits, input_shape=(1, 3, 16, 16), opset=13, input_name="x") -> onnx.ModelProto:
    return graphs.model(nodes, inits, input_shape, opset=opset, name="quirk", input_name=input_name)


def _save(tmp_path, proto, name="quirk.onnx"):
    return graphs.saved(proto, tmp_path / name)


def _matches_onnxruntime(model, libraries=("xnnpack",)) -> dict:
    """Each library's default runner (ONNX Runtime for what it cannot run) against ONNX Runtime."""
    feeds = random_feeds(model)
    reference = library_runner(plugins.get_library("mlas"), model)(feeds)
    errors = {}
    for name in libraries:
        runner = library_runner(plugins.get_library(name), model)
        errors[name] = compare_outputs(reference, runner(feeds))
        runner.close()
    return errors


def test_weights_in_constant_nodes_are_tuned(tmp_path):
    """Paddle2ONNX writes every conv weight as a Constant node."""
    nodes = [helper.make_node("Constant", [], ["w"], value=numpy_helper.from_array(_weights(8, 3, 3, 3))),
             helper.make_node("Constant", [], ["b"], value=numpy_helper.from_array(_weights(8))),
             helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["y"], name="relu")]
    model = load_model(str(_save(tmp_path, _model(nodes, []))))
    tasks = extract_tasks(model)
    assert [t.nodes for t in tasks] == [["conv"]]
    assert tasks[0].weight_shape == [8, 3, 3, 3] and tasks[0].has_bias
    assert _matches_onnxruntime(model)["xnnpack"] < 1e-4


def test_batchnorm_after_conv_is_folded_into_it(tmp_path):
    scale, bias, mean = _weights(8) + 1.0, _weights(8), _weights(8)
    var = np.abs(_weights(8)) + 0.5
    inits = [numpy_helper.from_array(a, n) for a, n in
             [(_weights(8, 3, 3, 3), "w"), (scale, "s"), (bias, "bb"), (mean, "m"), (var, "v")]]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c", "s", "bb", "m", "v"], ["y"], name="bn", epsilon=1e-5)]
    path = _save(tmp_path, _model(nodes, inits))
    model = load_model(str(path))
    assert [n.op_type for n in model.proto.graph.node] == ["Conv"]
    assert extract_tasks(model)[0].has_bias  # the folded BatchNorm is the conv's bias now
    # the folded model computes what the original does
    import onnxruntime as ort

    feeds = random_feeds(model)
    original = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)
    assert compare_outputs(original, library_runner(plugins.get_library("xnnpack"), model)(feeds)) < 1e-4


def test_silu_and_hardswish_patterns_and_squeeze_excite_run_in_xnnpack(tmp_path):
    """SiLU as Sigmoid*Mul (PyTorch, Ultralytics), HardSwish as HardSigmoid*Mul (Paddle), a
    squeeze-excite gate (ReduceMean, HardSigmoid, Mul), Split, Slice, bilinear Resize."""
    inits = [numpy_helper.from_array(_weights(16, 3, 3, 3), "w1"), numpy_helper.from_array(_weights(16, 16, 1, 1), "w2"),
             numpy_helper.from_array(np.array([8, 8], np.int64), "split"),
             numpy_helper.from_array(np.array([2], np.int64), "start"), numpy_helper.from_array(np.array([10], np.int64), "end"),
             numpy_helper.from_array(np.array([1], np.int64), "axis"), numpy_helper.from_array(np.array([], np.float32), "roi"),
             numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales")]
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Sigmoid", ["c1"], ["s1"], name="sigmoid"),
             helper.make_node("Mul", ["c1", "s1"], ["a1"], name="silu"),
             helper.make_node("Conv", ["a1", "w2"], ["c2"], name="conv2"),
             helper.make_node("HardSigmoid", ["c2"], ["h2"], name="hardsigmoid", alpha=1 / 6, beta=0.5),
             helper.make_node("Mul", ["c2", "h2"], ["a2"], name="hardswish"),
             helper.make_node("ReduceMean", ["a2"], ["pooled"], name="se_pool", axes=[2, 3], keepdims=1),
             helper.make_node("HardSigmoid", ["pooled"], ["gate"], name="se_gate"),
             helper.make_node("Mul", ["a2", "gate"], ["se"], name="se_scale"),
             helper.make_node("Split", ["se", "split"], ["p1", "p2"], name="split", axis=1),
             helper.make_node("LeakyRelu", ["p1"], ["l1"], name="leaky", alpha=0.1),
             helper.make_node("Concat", ["l1", "p2"], ["cat"], name="cat", axis=1),
             helper.make_node("Slice", ["cat", "start", "end", "axis"], ["sliced"], name="slice"),
             helper.make_node("Resize", ["sliced", "roi", "scales"], ["y"], name="resize", mode="linear")]
    model = load_model(str(_save(tmp_path, _model(nodes, inits))))
    runner = library_runner(plugins.get_library("xnnpack"), model)
    assert len(runner.segments) == 1 and runner.refused == []  # every node in XNNPack
    assert _matches_onnxruntime(model)["xnnpack"] < 1e-4


def test_ops_a_library_lacks_run_in_onnxruntime_segments(tmp_path):
    """A Transpose / Reshape head (YOLO-style) after the convs: XNNPack runs the convs, ONNX Runtime
    the rest, in one runner whose outputs match."""
    inits = [numpy_helper.from_array(_weights(8, 3, 3, 3), "w"), numpy_helper.from_array(np.array([1, 8, -1], np.int64), "shape")]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Reshape", ["c", "shape"], ["r"], name="reshape"),
             helper.make_node("Transpose", ["r"], ["t"], name="transpose", perm=[0, 2, 1]),
             helper.make_node("Softmax", ["t"], ["y"], name="softmax", axis=-1)]
    model = load_model(str(_save(tmp_path, _model(nodes, inits))))
    runner = library_runner(plugins.get_library("xnnpack"), model)
    assert [s.library for s in runner.segments] == ["xnnpack", "mlas"]
    assert _matches_onnxruntime(model)["xnnpack"] < 1e-4


def test_shape_subgraphs_fold_once_input_dims_are_fixed(tmp_path):
    """Shape -> Gather -> Unsqueeze -> Concat -> Reshape, on a dynamic input resolved by --input-shape."""
    inits = [numpy_helper.from_array(_weights(8, 3, 3, 3), "w"), numpy_helper.from_array(np.array(0, np.int64), "zero"),
             numpy_helper.from_array(np.array([-1], np.int64), "minus_one"), numpy_helper.from_array(np.array([0], np.int64), "axes")]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Shape", ["c"], ["shape"], name="shape"),
             helper.make_node("Gather", ["shape", "zero"], ["batch"], name="gather", axis=0),
             helper.make_node("Unsqueeze", ["batch", "axes"], ["batch1"], name="unsqueeze"),
             helper.make_node("Concat", ["batch1", "minus_one"], ["target"], name="concat", axis=0),
             helper.make_node("Reshape", ["c", "target"], ["y"], name="reshape")]
    path = _save(tmp_path, _model(nodes, inits, input_shape=("N", 3, "H", "W")))
    model = load_model(str(path), ["x=1,3,20,24"])
    assert model.shapes["y"] == [1, 8 * 20 * 24]
    assert {n.op_type for n in model.proto.graph.node} == {"Conv", "Reshape"}
    result = run_kselect("tasks", path)  # no --input-shape: one line naming the input
    assert result.returncode == 2 and "input 'x' dim 0 ('N') is unknown: pass --input-shape x=N,3,N,N" in result.stderr


def test_conv_transpose_is_a_task_that_xnnpack_runs_itself(tmp_path):
    """A ConvTranspose with explicit pads, output_padding and groups is a "deconv" task with its
    Relu; XNNPack's whole-model runner runs it as its own deconvolution operator, no ONNX Runtime
    segment, and matches ONNX Runtime."""
    inits = [numpy_helper.from_array(_weights(8, 3, 3, 3), "w"), numpy_helper.from_array(_weights(8, 3, 3, 3), "wt"),
             numpy_helper.from_array(_weights(6), "bt")]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("ConvTranspose", ["c", "wt", "bt"], ["d"], name="deconv", strides=[2, 2], group=2,
                              pads=[1, 0, 1, 2], output_padding=[1, 1]),
             helper.make_node("Relu", ["d"], ["y"], name="relu")]
    model = load_model(str(_save(tmp_path, _model(nodes, inits))))
    conv, deconv = extract_tasks(model)
    assert (deconv.kind, deconv.nodes, deconv.activation) == ("deconv", ["deconv"], "relu")
    assert deconv.output_shape == [1, 6, 32, 32] and deconv.describe_attrs() == "k3x3 s2 p1,0,1,2 g2 op1x1 +relu"
    assert untuned_ops(model) == []
    runner = library_runner(plugins.get_library("xnnpack"), model)
    assert [s.library for s in runner.segments] == ["xnnpack"] and runner.refused == []
    assert _matches_onnxruntime(model)["xnnpack"] < 1e-4


@pytest.mark.parametrize("library_name", ["mlas", "xnnpack"])
def test_every_config_of_a_conv_transpose_matches_the_reference(library_name):
    """waifu2x's 4x4/s2 deconvolution to 3 channels, and CenterFace's 2x2/s2 one with its Relu,
    measured in-process on real kernels in every config of the library's space."""
    from kselect.core.measuring.device import this_device
    from kselect.core.measuring.measure import MeasureSettings, measure_in_this_process

    library = plugins.get_library(library_name)
    cases = [([numpy_helper.from_array(_weights(16, 3, 4, 4), "wt"), numpy_helper.from_array(_weights(3), "bt")],
              [helper.make_node("ConvTranspose", ["x", "wt", "bt"], ["y"], name="deconv", strides=[2, 2], pads=[3, 3, 3, 3])]),
             ([numpy_helper.from_array(_weights(16, 24, 2, 2), "wt")],
              [helper.make_node("ConvTranspose", ["x", "wt"], ["d"], name="deconv", strides=[2, 2]),
               helper.make_node("LeakyRelu", ["d"], ["y"], name="act", alpha=0.1)])]
    quick = MeasureSettings(warmup=1, min_repeats=2, min_time_s=0.0, max_time_s=0.05)
    for inits, nodes in cases:
        task, = extract_tasks(model_from_proto("deconv", _model(nodes, inits, input_shape=(1, 16, 12, 12))))
        configs = list(library.space(task, this_device()).enumerate())
        assert library.default_config(task, this_device()) in configs and len(configs) >= 3
        for config in configs:
            result = measure_in_this_process(library, task, config, quick, {})
            assert result.status == "ok" and result.error < 1e-4, (config, result.reason)


def test_1d_convs_are_tuned_as_2d_convs_of_height_one(tmp_path):
    """Conv1d (audio CNNs, sequence heads): a 1-D conv, a strided depthwise one with SiLU and a
    pointwise one are tasks of height 1; MLAS and XNNPack measure every config of them against the
    reference, XNNPack runs the model alone (its tensors copied into height-1 NHWC buffers around
    each conv), and ACL, which has no 1-D conv, leaves them to its defaults."""
    from kselect.core.measuring.device import this_device
    from kselect.core.measuring.measure import MeasureSettings, measure_in_this_process

    inits = [numpy_helper.from_array(_weights(16, 4, 5), "w1"), numpy_helper.from_array(_weights(16), "b1"),
             numpy_helper.from_array(_weights(16, 1, 3), "w2"), numpy_helper.from_array(_weights(8, 16, 1), "w3")]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv", pads=[2, 2]),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu"),
             helper.make_node("Conv", ["r1", "w2"], ["c2"], name="depthwise", pads=[1, 1], group=16, strides=[2]),
             helper.make_node("Sigmoid", ["c2"], ["s"], name="sigmoid"),
             helper.make_node("Mul", ["c2", "s"], ["m"], name="mul"),
             helper.make_node("Conv", ["m", "w3"], ["y"], name="pointwise")]
    model = load_model(str(_save(tmp_path, _model(nodes, inits, input_shape=(1, 4, 64)))))
    tasks = extract_tasks(model)
    assert [(t.input_shape, t.describe_attrs()) for t in tasks] == [
        ([1, 4, 1, 64], "1-D k5 s1 p2 +relu"), ([1, 16, 1, 64], "1-D k3 s2 p1 g16 +silu"), ([1, 16, 1, 32], "1-D k1 s1 p0")]
    assert untuned_ops(model) == []
    quick = MeasureSettings(warmup=1, min_repeats=2, min_time_s=0.0, max_time_s=0.05)
    for name in ("mlas", "xnnpack"):
        library = plugins.get_library(name)
        for task in tasks:
            for config in library.space(task, this_device()).enumerate():
                result = measure_in_this_process(library, task, config, quick, {})
                assert result.status == "ok" and result.error < 1e-4, (name, task.id, config, result.reason)
    assert not any(plugins.get_library("acl").supports(task) for task in tasks)
    runner = library_runner(plugins.get_library("xnnpack"), model)
    assert [s.library for s in runner.segments] == ["xnnpack"]
    assert _matches_onnxruntime(model)["xnnpack"] < 1e-4


@pytest.mark.parametrize("how", [{"auto_pad": "SAME_UPPER"}, {"auto_pad": "SAME_LOWER"}, {"output_shape": [31, 31]}])
def test_a_conv_transpose_sized_by_auto_pad_or_output_shape_gets_the_pads_onnxruntime_crops(tmp_path, how):
    """An odd total padding (3x3, stride 2, 16 -> 32 or 31): XNNPack runs the task's explicit pads
    and matches ONNX Runtime, which runs the node as the model has it."""
    inits = [numpy_helper.from_array(_weights(8, 3, 3, 3), "w"), numpy_helper.from_array(_weights(8, 4, 3, 3), "wt")]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("ConvTranspose", ["c", "wt"], ["y"], name="deconv", strides=[2, 2], **how)]
    model = load_model(str(_save(tmp_path, _model(nodes, inits))))
    deconv = next(t for t in extract_tasks(model) if t.kind == "deconv")
    assert untuned_ops(model) == [] and deconv.output_shape[2:] == ([31, 31] if "output_shape" in how else [32, 32])
    assert _matches_onnxruntime(model)["xnnpack"] < 1e-4


def test_3d_convs_are_listed_as_untuned_with_the_reason(tmp_path):
    inits = [numpy_helper.from_array(_weights(8, 3, 3, 3, 3), "w")]
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], name="conv3d", pads=[1, 1, 1, 1, 1, 1])]
    path = _save(tmp_path, _model(nodes, inits, input_shape=(1, 3, 8, 8, 8)), "conv3d.onnx")
    assert untuned_ops(load_model(str(path))) == [("conv3d", "Conv", "3-D Conv: only 1-D and 2-D convolutions and "
                                                   "2-D transposed convolutions are tuned")]
    result = run_kselect("tasks", path)
    assert result.returncode == 2
    assert "nothing to tune" in result.stderr and "3-D Conv" in result.stderr


def test_an_op_onnxruntime_cannot_run_is_refused_before_anything_is_measured(tmp_path):
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("FancyOp", ["c"], ["y"], name="fancy", domain="com.example")]
    proto = _model(nodes, [numpy_helper.from_array(_weights(8, 3, 3, 3), "w")])
    proto.opset_import.append(helper.make_opsetid("com.example", 1))
    path = _save(tmp_path, proto)
    db = tmp_path / "records.db"
    result = run_kselect("tune", path, "--library", "xnnpack", "--budget", "2", "--db", db)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "ONNX Runtime cannot load quirk" in lines[0] and "FancyOp" in lines[0]
    assert not db.exists() or db.stat().st_size == 0 or _records(db) == 0


def _records(db) -> int:
    import sqlite3

    with sqlite3.connect(db) as connection:
        return connection.execute("select count(*) from records").fetchone()[0]


@pytest.mark.parametrize("opset", [9, 11, 21])
def test_opsets_9_to_21(tmp_path, opset):
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["y"], name="relu")]
    model = load_model(str(_save(tmp_path, _model(nodes, [numpy_helper.from_array(_weights(8, 3, 3, 3), "w")], opset=opset))))
    assert len(extract_tasks(model)) == 1
    assert _matches_onnxruntime(model)["xnnpack"] < 1e-4
