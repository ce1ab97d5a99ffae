"""Costs in context (core/whole_model/context.py): each library's runner times the nodes of a whole
run, every tuned op of a real model is found in those times, and the corrections a precision front
learns from its fp32 and least precise runs reproduce both runs."""

import numpy as np
import pytest

from kselect.core.contract import plugins
from kselect.core.models.model import load_model
from kselect.core.models.tasks import find_ops
from kselect.core.whole_model.alone import node_times_alone
from kselect.core.whole_model.context import IN_CONTEXT, ContextCorrection, InContext, in_context, owners, resolve

REAL_MODEL = "pplcnet-doc-orientation"  # PP-LCNet: 33 convs and an fc, each with HardSwish / ReLU / SE around it


@pytest.mark.parametrize("library_name", ["mlas", "onednn", "xnnpack"])
def test_every_tuned_op_of_a_real_model_is_found_in_a_whole_run_timed_per_node(library_name):
    library = plugins.get_library(library_name)
    if not library.availability()[0]:
        pytest.skip(f"{library_name} is not available")
    model = load_model(REAL_MODEL)
    feeds = [{name: np.random.default_rng(0).random(shape, np.float32) for name, shape in model.input_shapes.items()}]
    whole_us, per_node = library.node_times(model, None, feeds, 5)
    run = in_context(model, whole_us, per_node)
    assert set(run.ops_us) == {op.node for op in find_ops(model)}  # each op, its activation with it
    assert all(us > 0 for us in run.ops_us.values())
    assert whole_us > 0
    assert run.conversions_us == 0  # an fp32 run converts nothing


def test_a_plan_is_timed_per_node_in_a_fresh_process(tmp_path):
    """The front's two runs are timed as the rounds protocol times a plan: in a process of their
    own, with only that plan's threads."""
    import kselect
    from kselect.core.measuring.measure import MeasureSettings

    model = load_model(REAL_MODEL)
    result = kselect.tune(model, "onednn", budget=1, verify=False, db=tmp_path / "r.db",
                          settings=MeasureSettings(min_time_s=0.01, max_time_s=0.1))
    whole_us, per_node = node_times_alone(model, "onednn", result.plan, 3)
    assert whole_us > 0 and set(in_context(model, whole_us, per_node).ops_us) == set(result.plan.nodes)


def test_runtime_names_resolve_to_the_models_nodes():
    """ONNX Runtime names an NCHWc conv after its output tensor with "_nchwc", a QDQ-fused one with
    "_quant", a dequantize after the tensor it reads; a reorder it made up is none of the model's."""
    model = load_model(REAL_MODEL)
    names = owners(model)
    first = find_ops(model)[0]
    output = next(n for n in model.proto.graph.node if n.name == first.node).output[0]
    assert resolve(first.node, names) == first.node
    assert resolve(f"{output}_nchwc", names) == first.node
    assert resolve(f"{first.node}_token_7", names) == first.node
    assert resolve(f"{output}_DequantizeLinear", names) == first.node
    for activation in first.epilogue_nodes:
        assert resolve(activation, names) == first.node
    assert resolve("ReorderOutput_token_71", names) is None


def test_the_corrections_reproduce_the_two_runs_they_were_learned_from():
    """A front's fp32 run and its all-int8 run, per node; the planner's isolated times and the
    conversions it counts for the int8 run. The corrected prediction of each run is that run
    (its ops, conversions and untuned nodes); a point between them takes each op's ratio in its
    precision and the untuned time in proportion."""
    isolated = {("a", "fp32"): 100.0, ("b", "fp32"): 200.0, ("a", "int8"): 80.0, ("b", "int8"): 60.0}
    fp32_run = InContext(500.0, {"a": 90.0, "b": 250.0}, 0.0, 100.0)
    int8_run = InContext(600.0, {"a": 120.0, "b": 90.0}, 40.0, 70.0)
    correction = ContextCorrection.learn(fp32_run, int8_run, isolated, {"a": "int8", "b": "int8"}, 20.0)
    assert correction.ratio("a", "int8") == pytest.approx(1.5) and correction.conversion_ratio == pytest.approx(2.0)
    fp32_ops = {"a": ("fp32", 100.0), "b": ("fp32", 200.0)}
    int8_ops = {"a": ("int8", 80.0), "b": ("int8", 60.0)}
    assert correction.predicted_us(fp32_ops, 0.0) == pytest.approx(90 + 250 + 100)
    assert correction.predicted_us(int8_ops, 20.0) == pytest.approx(120 + 90 + 40 + 70)
    mixed = correction.predicted_us({"a": ("int8", 80.0), "b": ("fp32", 200.0)}, 10.0)
    assert mixed == pytest.approx(120 + 250 + 2.0 * 10 + (100 + 70) / 2)
    assert correction.ratio("c", "bf16") == pytest.approx(np.median([0.9, 1.25]))  # unseen: the median fp32 ratio


def test_with_a_half_precision_run_the_corrections_reproduce_all_three_runs():
    """A front whose least precise plan mixes int8 (a) and bf16 (b) learns from a third run, every
    op in bf16: its bf16 ratios come from that run (a's, which neither other run has), and the
    untuned time moves at its own rate per share of bf16 ops and of int8 ops, and b's bf16 ratio
    from the half run's to the reduced run's with the share of int8 ops, so each of the three runs
    is predicted as it was measured."""
    isolated = {("a", "fp32"): 100.0, ("b", "fp32"): 200.0, ("a", "int8"): 80.0, ("a", "bf16"): 90.0,
                ("b", "bf16"): 150.0}
    fp32_run = InContext(500.0, {"a": 90.0, "b": 250.0}, 0.0, 100.0)
    reduced_run = InContext(300.0, {"a": 120.0, "b": 60.0}, 40.0, 70.0)
    half_run = InContext(200.0, {"a": 45.0, "b": 75.0}, 0.0, 40.0)
    correction = ContextCorrection.learn(fp32_run, reduced_run, isolated, {"a": "int8", "b": "bf16"}, 20.0,
                                         half=(half_run, {"a": "bf16", "b": "bf16"}))
    assert correction.ratio("a", "bf16") == pytest.approx(0.5)  # from the half run
    assert correction.ratio("b", "bf16") == pytest.approx(0.4)  # the reduced run's, beside a's int8
    assert correction.half_ratios == {("b", "bf16"): pytest.approx(0.5)}
    assert correction.untuned_rates == pytest.approx((-60.0, 0.0))
    assert correction.predicted_us({"a": ("fp32", 100.0), "b": ("fp32", 200.0)}, 0.0) == pytest.approx(90 + 250 + 100)
    assert correction.predicted_us({"a": ("int8", 80.0), "b": ("bf16", 150.0)}, 20.0) == \
        pytest.approx(120 + 60 + 40 + 70)
    assert correction.predicted_us({"a": ("bf16", 90.0), "b": ("bf16", 150.0)}, 0.0) == pytest.approx(45 + 75 + 40)
    assert correction.to_json()["untuned_us_per_share"] == {"half": -60.0, "int8": 0.0}
    assert set(correction.runs) == {"fp32", "reduced", "half"}


def test_a_plan_is_never_predicted_below_zero_when_a_default_timing_inflated_the_reference_sum():
    """The difference rule (reference measured + difference of isolated sums) gives way to the ratio
    of the sums when the sums lie further apart than the reference's whole run (a mobilenetv2
    oneDNN variant had been predicted at -14.8 ms against a library default whose sum a noisy
    timing had inflated)."""
    from kselect.core.plans.plan import Plan
    from kselect.core.plans.plan import ISOLATED_US, PREDICTED_BASIS, PREDICTED_US
    from kselect.core.whole_model.prediction import predicted_ms, prediction

    def plan(us: float) -> Plan:
        return Plan({}, {}, {"onednn": "x"}, False, {}, [{"id": "T0", "nodes": ["Conv_0"], "time_us": us}],
                    {"Conv_0": {"task": "T0", "library": "onednn", "config": {}}})

    assert predicted_ms(plan(1_000), plan(2_000), 7.0) == pytest.approx(6.0)  # the difference, as before
    assert predicted_ms(plan(1_000), plan(23_000), 7.0) == pytest.approx(7.0 * 1_000 / 23_000)
    # the isolated-sums figure beside a prediction in context follows the same rule
    in_context, reference = plan(1_000), plan(1_000)
    in_context.extra.update({PREDICTED_US: 11_287.5, PREDICTED_BASIS: IN_CONTEXT, ISOLATED_US: 4_000.0})
    reference.extra.update({PREDICTED_US: 27_012.0, PREDICTED_BASIS: IN_CONTEXT, ISOLATED_US: 37_000.0})
    figure = prediction(in_context, "fp32 plan", reference, 24.7, 9.56)
    assert figure["isolated_predicted_ms"] == pytest.approx(24.7 * 4_000 / 37_000, abs=1e-4)
    assert figure["predicted_ms"] == pytest.approx(24.7 * 11_287.5 / 27_012.0, abs=1e-4)
