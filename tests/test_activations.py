"""A conv with its activation is one tunable op: the patterns exporters write are found, every
library measures the same work (the activation fused where it can, run after the op where it
cannot), and the whole-model runners compute what ONNX Runtime does."""

from __future__ import annotations

import graphs
import numpy as np
import pytest
from onnx import helper, numpy_helper

from kselect.core.contract import plugins
from kselect.core.measuring.device import this_device
from kselect.core.measuring.measure import MeasureSettings, measure_in_this_process
from kselect.core.models.model import model_from_proto
from kselect.core.models.tasks import extract_tasks
from kselect.core.plans.plan import Plan
from kselect.core.plans.runtime import library_runner
from kselect.core.whole_model.bench import compare_outputs, random_feeds

RNG = np.random.default_rng(3)
QUICK = MeasureSettings(warmup=1, min_repeats=3, min_time_s=0.01, max_time_s=0.05)


def _scalar(name, value):
    return numpy_helper.from_array(np.array(value, np.float32), name)


def _conv_then(activation_nodes, extra_inits=(), channels=16, opset=17, extra_outputs=()):
    """x -> Conv(3x3, 16 channels) -> the activation nodes (reading "c", writing "y")."""
    w = (RNG.standard_normal((channels, 8, 3, 3)) * 0.2).astype(np.float32)
    b = (RNG.standard_normal(channels) * 0.1).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]), *activation_nodes]
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b"), *extra_inits]
    return model_from_proto("act", graphs.model(nodes, inits, (1, 8, 12, 12), outputs=("y", *extra_outputs), opset=opset))


PATTERNS = {
    "relu": ([helper.make_node("Relu", ["c"], ["y"])], []),
    "relu6": ([helper.make_node("Clip", ["c", "lo", "hi"], ["y"])], [_scalar("lo", 0.0), _scalar("hi", 6.0)]),
    "leaky_relu": ([helper.make_node("LeakyRelu", ["c"], ["y"], alpha=0.1)], []),
    "silu": ([helper.make_node("Sigmoid", ["c"], ["s"]), helper.make_node("Mul", ["c", "s"], ["y"])], []),
    "hard_swish": ([helper.make_node("HardSigmoid", ["c"], ["h"], alpha=1 / 6, beta=0.5),
                    helper.make_node("Mul", ["c", "h"], ["y"])], []),
    # Paddle's hard_swish: x * Clip(x + 3, 0, 6) / 6
    "hard_swish/decomposed": ([helper.make_node("Add", ["c", "three"], ["a"]),
                               helper.make_node("Clip", ["a", "lo", "hi"], ["k"]),
                               helper.make_node("Mul", ["c", "k"], ["m"]),
                               helper.make_node("Div", ["m", "six"], ["y"])],
                              [_scalar("three", 3.0), _scalar("lo", 0.0), _scalar("hi", 6.0), _scalar("six", 6.0)]),
    "prelu": ([helper.make_node("PRelu", ["c", "slope"], ["y"])],
              [numpy_helper.from_array(np.linspace(0.0, 0.3, 16, dtype=np.float32).reshape(16, 1, 1), "slope")]),
    # PP-LCNetV3's learnable affine (a scalar scale and shift) before its hard_swish
    "mul+add+hard_swish": ([helper.make_node("Mul", ["scale", "c"], ["m0"]), helper.make_node("Add", ["m0", "shift"], ["d"]),
                            helper.make_node("HardSwish", ["d"], ["y"])], [_scalar("scale", 1.3), _scalar("shift", -0.2)]),
}


@pytest.mark.parametrize("expected", list(PATTERNS))
def test_the_activation_is_part_of_the_task(expected):
    nodes, inits = PATTERNS[expected]
    task, = extract_tasks(_conv_then(nodes, inits))
    assert task.activation == expected.split("/")[0]
    assert task.describe_attrs().endswith("+" + task.activation)


def test_clip_bounds_as_attributes_before_opset_11_give_the_same_task():
    old, = extract_tasks(_conv_then([helper.make_node("Clip", ["c"], ["y"], min=0.0, max=6.0)], opset=10))
    new, = extract_tasks(_conv_then(*PATTERNS["relu6"]))
    assert old.activation == "relu6" and old.key == new.key


def test_an_activation_whose_input_is_read_elsewhere_stays_outside_the_op():
    """Squeeze-excite reads the conv output twice: the op is the conv alone."""
    nodes = [helper.make_node("GlobalAveragePool", ["c"], ["p"]), helper.make_node("Sigmoid", ["p"], ["s"]),
             helper.make_node("Mul", ["c", "s"], ["y"])]
    task, = extract_tasks(_conv_then(nodes))
    assert task.epilogue == [] and task.activation == ""
    # and a tensor inside the pattern that leaves the graph ends the epilogue before it
    silu, _ = PATTERNS["silu"]
    task, = extract_tasks(_conv_then(silu, extra_outputs=("s",)))
    assert task.epilogue == []


def test_same_conv_with_and_without_activation_are_two_tasks():
    nodes = [helper.make_node("Relu", ["c"], ["r"]), helper.make_node("Conv", ["r", "w2"], ["y"], name="conv2", pads=[1, 1, 1, 1])]
    w2 = numpy_helper.from_array((RNG.standard_normal((16, 16, 3, 3)) * 0.1).astype(np.float32), "w2")
    tasks = extract_tasks(_conv_then(nodes, [w2]))
    assert [t.activation for t in tasks] == ["relu", ""]


@pytest.mark.parametrize("library_name", ["mlas", "xnnpack"])
@pytest.mark.parametrize("expected", ["silu", "hard_swish/decomposed", "mul+add+hard_swish", "relu6", "prelu"])
def test_every_config_of_an_op_with_its_activation_matches_the_reference(library_name, expected):
    """Measured in-process on real kernels, across the layouts / paths of the space."""
    library = plugins.get_library(library_name)
    task, = extract_tasks(_conv_then(*PATTERNS[expected]))
    device = this_device()
    space = library.space(task, device)
    configs = [library.default_config(task, device)]
    for layout_dim in ("layout", "path"):
        if layout_dim in {d.name for d in space.dims}:
            configs += [c for c in space.enumerate() if c[layout_dim] != configs[0].get(layout_dim)][:1]
    for config in configs:
        result = measure_in_this_process(library, task, config, QUICK, {})
        assert result.status == "ok", (config, result.reason)
        assert result.error < 1e-4


@pytest.mark.parametrize("library_name", ["mlas", "xnnpack"])
def test_a_prelu_with_a_slope_per_channel_is_part_of_the_op_and_runs_as_in_the_whole_model(library_name):
    """12 channels (not a multiple of MLAS's block): MLAS reorders an NCHWc conv's output before
    the PRelu, as ORT and kselect's rewrite do; XNNPack runs its PReLU operator. Slopes differing
    only in value give one task."""
    slopes = [numpy_helper.from_array(np.linspace(0.0, top, 12, dtype=np.float32).reshape(1, 12, 1, 1), "slope")
              for top in (0.3, 0.6)]
    models = [_conv_then([helper.make_node("PRelu", ["c", "slope"], ["y"])], [slope], channels=12) for slope in slopes]
    (task,), (other,) = extract_tasks(models[0]), extract_tasks(models[1])
    assert task.key == other.key and task.activation == "prelu"
    library, device = plugins.get_library(library_name), this_device()
    for config in library.space(task, device).enumerate():
        result = measure_in_this_process(library, task, config, QUICK, {})
        assert result.status == "ok" and result.error < 1e-4, (config, result.reason)
    feeds = random_feeds(models[0])
    reference = library_runner(plugins.get_library("mlas"), models[0])(feeds)
    config = {"layout": "NCHWc", "threads": 2, "spinning": 1} if library_name == "mlas" else library.default_config(task, device)
    plan = Plan(model={"name": "act"}, device={}, libraries={library_name: ""}, emulated=False,
                plan_level={k: v for k, v in config.items() if k in library.plan_level_dims},
                tasks=[{**task.to_json(), "library": library_name}],
                nodes={"conv": {"library": library_name, "task": task.id, "config": config}})
    assert compare_outputs(reference, library_runner(library, models[0], plan)(feeds)) < 1e-4


@pytest.mark.parametrize("expected", ["silu", "hard_swish/decomposed", "mul+add+hard_swish"])
def test_whole_model_plans_with_blocked_activations_match_onnxruntime(expected):
    """MLAS's NCHWc rewrite keeps HardSwish and scalar arithmetic blocked; XNNPack runs them as
    operators of its own. Both compute what ONNX Runtime's default session does."""
    from kselect.plugins.mlas.layout import nchwc_block_size
    from kselect.plugins.mlas.rewrite import rewrite_model

    model = _conv_then(*PATTERNS[expected])
    info: dict = {}
    rewrite_model(model.proto, {"conv": "NCHWc"}, nchwc_block_size(), info=info)
    activation_nodes = [n.name for n in model.proto.graph.node if n.name != "conv"]
    assert set(info["blocked_ops"]) == set(activation_nodes)  # no reorder between the conv and its activation
    feeds = random_feeds(model)
    reference = library_runner(plugins.get_library("mlas"), model)(feeds)
    task, = extract_tasks(model)
    for name, config in (("mlas", {"layout": "NCHWc", "threads": 2, "spinning": 1}), ("xnnpack", None)):
        library = plugins.get_library(name)
        config = config or library.default_config(task, this_device())
        plan = Plan(model={"name": model.name}, device={}, libraries={name: ""}, emulated=False,
                    plan_level={k: v for k, v in config.items() if k in library.plan_level_dims},
                    tasks=[{**task.to_json(), "library": name}], nodes={"conv": {"library": name, "task": task.id, "config": config}})
        runner = library_runner(library, model, plan)
        assert compare_outputs(reference, runner(feeds)) < 1e-4, name


def test_acl_measures_only_the_activations_it_fuses():
    library = plugins.get_library("acl")
    silu, = extract_tasks(_conv_then(*PATTERNS["silu"]))
    relu6, = extract_tasks(_conv_then(*PATTERNS["relu6"]))
    assert library.fused_activation(silu) == (False, None)
    assert library.fused_activation(relu6) == (True, {"fn": "LU_BOUNDED_RELU", "a": 6.0, "b": 0.0})
