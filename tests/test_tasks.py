"""Models become tasks: loading, dynamic input dims, grouping identical ops, MACs."""

from pathlib import Path

import onnx
import pytest
from graphs import small_cnn

from kselect.core.errors import KselectError
from kselect.core.models.model import load_model
from kselect.core.models.tasks import extract_tasks, model_stats


def test_resnet101_has_104_convs_in_23_tasks():
    tasks = extract_tasks(load_model("resnet101"))
    conv = [t for t in tasks if t.kind == "conv"]
    assert sum(len(t.nodes) for t in conv) == 104
    assert len(conv) == 23


def test_identical_ops_share_a_task_and_an_activation_makes_another_op(small_model_path):
    tasks = extract_tasks(load_model("resnet18"))
    assert [len(t.nodes) for t in tasks if t.describe_attrs() == "k3x3 s1 p1"] == [2, 2, 2, 2]
    tasks = extract_tasks(load_model(str(small_model_path)))
    by_nodes = {tuple(t.nodes): t for t in tasks}
    # same shapes and attributes, but the first conv's Relu is part of its op
    assert by_nodes[("block.conv1",)].activation == "relu" and by_nodes[("block.conv2",)].activation == ""
    assert [t.kind for t in tasks].count("fc") == 1
    down = next(t for t in tasks if t.nodes == ["down"])
    assert down.attrs["pads"] == [1, 1, 2, 2] and down.output_shape == [1, 32, 16, 16]
    dw = next(t for t in tasks if t.nodes == ["dw"])
    assert dw.is_depthwise and not down.is_depthwise
    assert dw.macs == 32 * 16 * 16 * 9


def test_dynamic_dims_need_input_shape(tmp_path):
    path = tmp_path / "dynamic.onnx"
    onnx.save(small_cnn(dynamic=True), path)
    with pytest.raises(KselectError, match=r"input 'input' dim 0 \('N'\) is unknown"):
        load_model(str(path))
    model = load_model(str(path), ["input=1,3,64,64"])
    tasks = extract_tasks(model)
    assert tasks[0].input_shape == [1, 3, 64, 64]
    with pytest.raises(KselectError, match="has 3 dims"):
        load_model(str(path), ["input=1,3,64"])
    with pytest.raises(KselectError, match="model's inputs are: input"):
        load_model(str(path), ["image=1,3,64,64"])


def test_resnet50_figures():
    params, macs = model_stats(load_model("resnet50"))
    assert params == pytest.approx(25.6e6, rel=0.05)
    assert macs == pytest.approx(4.1e9, rel=0.05)


@pytest.mark.slow
def test_resnetxy_figures():
    params, macs = model_stats(load_model("resnetxy"))
    assert params == pytest.approx(86.6e6, rel=0.05)
    assert macs == pytest.approx(16.35e9, rel=0.05)


LIGHT_MODELS = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"


@pytest.mark.parametrize("name, convs, fcs", [("light_zfnet512", 5, 3), ("light_resnet50", 53, 1),
                                              ("light_inception_v2", 60, 1), ("light_shufflenet", 49, 1)])
def test_caffe2_exports_in_the_onnx_wheel_load(name, convs, fcs):
    """IR 3 models whose weights come from ConstantOfShape nodes and whose initializers are graph
    inputs too; zfnet512 and resnet50 also have an initializer nothing reads, which ONNX Runtime
    refused once kselect had taken the initializers out of the inputs."""
    tasks = extract_tasks(load_model(str(LIGHT_MODELS / f"{name}.onnx")))
    assert sum(len(t.nodes) for t in tasks if t.kind == "conv") == convs
    assert sum(len(t.nodes) for t in tasks if t.kind == "fc") == fcs
