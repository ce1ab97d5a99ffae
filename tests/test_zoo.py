"""Tests for the built-in model zoo (kselect.core.models.zoo)."""

from __future__ import annotations

import functools

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, shape_inference

from kselect.core.models.zoo import BUILTIN_MODELS, build_model

ALL_MODELS = [
    "resnet18", "resnet50", "resnet101", "alexnet", "vgg16", "googlenet", "mobilenetv2", "resnetxy",
]
EXPENSIVE = {"vgg16", "resnetxy"}
ALLOWED_OPS = {
    "Conv", "Relu", "Clip", "MaxPool", "AveragePool", "GlobalAveragePool",
    "Add", "Concat", "Flatten", "Gemm", "Softmax",
}


@functools.lru_cache(maxsize=1)
def _model(name: str) -> onnx.ModelProto:
    # Cache only the most recent model: vgg16 alone is >500 MB of weights.
    return build_model(name, seed=0)


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _shapes(model: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    """Shapes of all tensors by strict onnx shape inference.

    Inference runs on a weight-free skeleton (initializers turned into typed graph
    inputs) so that the hundreds of MB of VGG/ResNetXY weights are not copied.
    """
    g = model.graph
    weights = [
        helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in g.initializer
    ]
    skeleton = helper.make_model(
        helper.make_graph(list(g.node), g.name, [*g.input, *weights], list(g.output)),
        opset_imports=list(model.opset_import),
        ir_version=model.ir_version,
    )
    g = shape_inference.infer_shapes(skeleton, strict_mode=True).graph
    return {
        vi.name: tuple(d.dim_value for d in vi.type.tensor_type.shape.dim)
        for vi in [*g.input, *g.value_info, *g.output]
    }


def _params_and_macs(model: onnx.ModelProto) -> tuple[int, int]:
    """Parameters = all initializer elements; MACs of Conv and Gemm only."""
    shapes = _shapes(model)
    weights = {t.name: tuple(t.dims) for t in model.graph.initializer}
    params = sum(int(np.prod(d)) for d in weights.values())
    macs = 0
    for node in model.graph.node:
        if node.op_type == "Conv":
            # out_elements * (in_channels / group) * kh * kw == out_elements * prod(W.shape[1:])
            macs += int(np.prod(shapes[node.output[0]])) * int(np.prod(weights[node.input[1]][1:]))
        elif node.op_type == "Gemm":
            n_out, n_in = weights[node.input[1]]
            macs += n_in * n_out
    return params, macs


def _run(model: onnx.ModelProto, batch: int = 1) -> np.ndarray:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(123).standard_normal((batch, 3, 224, 224), dtype=np.float32)
    (out,) = sess.run(["output"], {"input": x})
    return out


def test_builtin_models_listed_in_order_with_descriptions():
    assert list(BUILTIN_MODELS) == ALL_MODELS
    for name, desc in BUILTIN_MODELS.items():
        assert isinstance(desc, str) and desc and "\n" not in desc, name


def test_unknown_model_raises_key_error():
    with pytest.raises(KeyError):
        build_model("resnet9000")


@pytest.mark.parametrize("name", ALL_MODELS)
def test_model_is_valid_onnx(name):
    model = _model(name)
    onnx.checker.check_model(model, full_check=False)
    assert {(o.domain, o.version) for o in model.opset_import} == {("", 17)}

    g = model.graph
    assert [i.name for i in g.input] == ["input"]
    assert [o.name for o in g.output] == ["output"]
    if name not in EXPENSIVE:  # the real model too (skipped where it means copying >300 MB)
        shape_inference.infer_shapes(model, strict_mode=True)
    shapes = _shapes(model)
    assert shapes["input"] == (1, 3, 224, 224)
    assert shapes["output"] == (1, 1000)

    ops = [n.op_type for n in g.node]
    assert set(ops) <= ALLOWED_OPS, set(ops) - ALLOWED_OPS
    assert ops[-1] == "Softmax" and g.node[-1].output[0] == "output"
    names = [n.name for n in g.node]
    assert all(names) and len(set(names)) == len(names)

    init_names = {t.name for t in g.initializer}
    assert all(t.data_type == onnx.TensorProto.FLOAT for t in g.initializer)
    for node in g.node:
        if node.op_type == "Conv":
            assert len(node.input) == 3 and set(node.input[1:]) <= init_names, node.name
        elif node.op_type == "Gemm":
            assert _attrs(node).get("transB") == 1 and set(node.input[1:]) <= init_names, node.name
        elif node.op_type == "Clip":
            bounds = {t.name: onnx.numpy_helper.to_array(t) for t in g.initializer if t.name in node.input[1:]}
            assert all(v.shape == () for v in bounds.values()), node.name  # scalars per the spec
            assert sorted(float(v) for v in bounds.values()) == [0.0, 6.0], node.name


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.slow) if n in EXPENSIVE else n for n in ALL_MODELS],
)
def test_model_runs_in_onnxruntime(name):
    out = _run(_model(name))
    assert out.shape == (1, 1000)
    assert np.isfinite(out).all()
    assert (out >= 0).all()
    np.testing.assert_allclose(out.sum(axis=1), 1.0, rtol=1e-4)


@pytest.mark.parametrize("name", ["resnet18", "mobilenetv2", "googlenet"])
def test_same_seed_gives_identical_bytes(name):
    a = build_model(name, seed=7).SerializeToString()
    b = build_model(name, seed=7).SerializeToString()
    c = build_model(name, seed=8).SerializeToString()
    assert a == b
    assert a != c


def test_resnet50_size():
    params, macs = _params_and_macs(_model("resnet50"))
    assert params == pytest.approx(25.6e6, rel=0.05)
    assert macs == pytest.approx(4.1e9, rel=0.05)


def test_resnetxy_size_matches_acltuner_figures():
    params, macs = _params_and_macs(_model("resnetxy"))
    assert params == pytest.approx(86.6e6, rel=0.05)
    assert macs == pytest.approx(16.35e9, rel=0.05)


def test_resnetxy_layout():
    model = _model("resnetxy")
    shapes = _shapes(model)
    convs = {n.name: n for n in model.graph.node if n.op_type == "Conv"}
    assert _attrs(convs["conv1"])["kernel_shape"] == [14, 14]
    assert shapes["conv1"] == (1, 51, 112, 112)
    for stage, (c, hw, blocks) in enumerate(
        [(77, 56, 3), (97, 28, 4), (279, 14, 6), (511, 7, 3)], start=1
    ):
        for j in range(blocks):
            p = f"layer{stage}.{j}"
            assert _attrs(convs[f"{p}.conv1"])["kernel_shape"] == [4, 4]
            assert _attrs(convs[f"{p}.conv2"])["kernel_shape"] == [6, 6]
            assert _attrs(convs[f"{p}.conv3"])["kernel_shape"] == [1, 1]
            assert shapes[f"{p}.conv3"] == (1, 2 * c, hw, hw)
        assert f"layer{stage}.0.downsample" in convs


@pytest.mark.parametrize(
    "name,params,macs",
    [
        ("resnet18", 11.7e6, 1.82e9),
        ("alexnet", 61.1e6, 0.71e9),
        ("googlenet", 7.0e6, 1.58e9),
        ("mobilenetv2", 3.5e6, 0.30e9),
        pytest.param("resnet101", 44.5e6, 7.8e9, marks=pytest.mark.slow),
        pytest.param("vgg16", 138.4e6, 15.5e9, marks=pytest.mark.slow),
    ],
)
def test_other_model_sizes(name, params, macs):
    p, m = _params_and_macs(_model(name))
    assert p == pytest.approx(params, rel=0.05)
    assert m == pytest.approx(macs, rel=0.05)


def test_resnet101_convs():
    model = _model("resnet101")
    shapes = _shapes(model)
    weights = {t.name: tuple(t.dims) for t in model.graph.initializer}
    convs = [n for n in model.graph.node if n.op_type == "Conv"]
    assert len(convs) == 104
    groups = {
        (
            shapes[n.input[0]],
            shapes[n.output[0]],
            weights[n.input[1]],
            tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in _attrs(n).items())),
        )
        for n in convs
    }
    assert len(groups) == 23


@pytest.mark.parametrize("name", ["resnet18", "googlenet", "mobilenetv2"])
def test_a_model_without_its_weights_values_counts_what_the_full_model_counts(name):
    """`kselect models` counts parameters and MACs on the graph built without weight values."""
    from kselect.core.models.model import load_model, model_from_proto
    from kselect.core.models.tasks import model_stats

    skeleton = build_model(name, weights=False)
    assert all(not t.raw_data and not t.float_data for t in skeleton.graph.initializer if t.dims)
    assert model_stats(model_from_proto(name, skeleton, "builtin")) == model_stats(load_model(name))
