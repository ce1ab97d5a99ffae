"""The OpenVINO plugin (PyPI openvino, its CPU plugin): a candidate is what the runtime model shows
OpenVINO ran, a hint it ignores is never a candidate; a plan runs the whole model with its hints
and exports as an IR that plain openvino loads; bf16 twins where the CPU plugin runs bf16, measured
within the half tolerance and chosen under an accuracy budget into plans that run them in bf16;
OpenVINO missing is told in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import helper
from graphs import conv, small_cnn, weights
from graphs import model as graph_model
from helpers import feeds_folder, kselect_json, plan_and_onnxruntime_outputs

import kselect
from kselect.core.contract import plugins
from kselect.core.measuring.device import this_device
from kselect.core.measuring.measure import MeasureSettings, measure_in_this_process, reference_output, task_inputs
from kselect.core.measuring.worker import MeasureWorker
from kselect.core.models.model import model_from_proto
from kselect.core.models.tasks import extract_tasks
from kselect.core.plans.plan import Plan, load_plan_file, plan_node, plan_task, reduced_nodes
from kselect.core.plans.runtime import load_plan
from kselect.plugins.openvino import ir
from kselect.plugins.openvino.library import plan_model
from kselect.core.precision.accuracy import cosine
from kselect.core.precision.calibration import Calibration, compute_ranges, quantize_qdq
from kselect.core.precision.half import half_tolerance
from kselect.core.precision.quant import int8_tolerance, quant_params
from kselect.core.whole_model.context import IN_CONTEXT

from kselect.plugins.openvino.runtime import openvino as import_openvino

try:
    openvino = import_openvino()
except ImportError:
    pytest.skip("the openvino package does not import", allow_module_level=True)

QUICK = MeasureSettings(warmup=1, min_repeats=2, min_time_s=0.001, max_time_s=0.05)
BF16_MISSING = plugins.get_library("openvino").missing_precisions().get("bf16")
needs_bf16 = pytest.mark.skipif(BF16_MISSING is not None, reason=f"no bf16 twins here: {BF16_MISSING}")


@pytest.fixture(scope="module")
def library():
    return plugins.get_library("openvino")


@pytest.fixture(scope="module")
def model():
    return model_from_proto("small_cnn", small_cnn())


def _task(model, node):
    return next(t for t in extract_tasks(model) if node in t.nodes)


def _config(impl, hinted=True, precision="f32"):
    return {"impl": impl, "hinted": hinted, "precision": precision, "threads": this_device().cores, "pinning": True}


def _plan(nodes: dict[str, dict]) -> Plan:
    return Plan(model={}, device={}, libraries={"openvino": ""}, emulated=False, tasks=[],
                plan_level={"threads": this_device().cores, "pinning": True},
                nodes={node: {"library": "openvino", "config": config} for node, config in nodes.items()})


def _twin_plan(library, twins: dict, ranges: dict) -> Plan:
    """A plan running each node of ``twins`` (node -> its task or twin) on OpenVINO's own pick,
    with the calibration ranges its int8 nodes quantize with."""
    configs = {node: library.default_config(twin, this_device()) for node, twin in twins.items()}
    return Plan(model={}, device={}, libraries={"openvino": library.version()}, emulated=False, plan_level={},
                tasks=[plan_task(twin, [node], "openvino", configs[node], 1.0, configs[node], 1.0, 1, False)
                       for node, twin in twins.items()],
                nodes={node: plan_node(twin, "openvino", configs[node]) for node, twin in twins.items()},
                extra={"precision": {"ranges": ranges}})


def _each_implementation_within_half_tolerance(library, twin) -> list[dict]:
    """Measures every config of a bf16 twin at its default threads and pinning through the core's
    measuring path, asserting each ok with an error above fp32's and within the half tolerance;
    returns those configs."""
    device = this_device()
    configs = library.space(twin, device).enumerate()
    default = library.default_config(twin, device)
    inputs = task_inputs(twin)
    tolerance = half_tolerance(twin, inputs, reference_output(twin, inputs), "bf16")
    at_defaults = [c for c in configs if (c["threads"], c["pinning"]) == (default["threads"], default["pinning"])]
    for config in at_defaults:
        result = measure_in_this_process(library, twin, config, QUICK, {})
        assert result.status == "ok", (config, result.reason)
        assert 1e-4 < result.error <= tolerance, config
    return at_defaults


def test_a_hint_openvino_takes_is_a_candidate_and_one_it_ignores_is_not(library, model):
    """The stem conv (3 input channels) takes cpu:jit_avx512 in f32; the 16-channel conv after it,
    alone in a model, does not (OpenVINO runs jit_gemm): it is not in its space, and measuring it
    anyway fails with what OpenVINO ran instead."""
    device = this_device()
    stem, conv = _task(model, "stem"), _task(model, "block.conv1")
    assert _config("jit_avx512") in library.space(stem, device)
    assert _config("jit_avx512") not in library.space(conv, device)
    with MeasureWorker(library, QUICK) as worker:
        taken = worker.measure(stem, _config("jit_avx512"))
        ignored = worker.measure(conv, _config("jit_avx512"))
    assert taken.status == "ok" and taken.error < 1e-5
    assert ignored.status == "failed"
    assert "did not run cpu:jit_avx512 in f32: it ran jit_gemm_f32" in ignored.reason


def test_the_whole_model_runner_reads_back_what_each_node_ran(library, model):
    """In the whole model the stem's hint takes effect, and a gemm_avx512 hint on the strided conv
    is dropped: the runtime model shows another implementation, which the runner reports."""
    runner = library.model_runner(model, _plan({"stem": _config("jit_avx512"), "down": _config("gemm_avx512")}))
    try:
        assert (runner.ran["stem"].impl, runner.ran["stem"].primitive) == ("jit_avx512", "jit_avx512_f32")
        assert runner.ran["down"].impl != "gemm_avx512" and runner.ran["down"].precision == "f32"
    finally:
        runner.close()


def test_a_tuned_plan_exported_as_ir_runs_in_plain_openvino(library, model, tmp_path):
    """A plan tuned for real (the stem then set to a hinted implementation from its space) written
    by ``kselect plan apply``'s library step: plain openvino, with kselect not importable, loads the
    IR with the JSON's properties, reproduces the plan's outputs and runs the stem as the plan says."""
    from kselect.core.api import tune

    result = tune(model, ["openvino"], search="random", budget=2, db=tmp_path / "records.db", settings=QUICK,
                  verify=False)
    plan = result.plan
    stem = _config("jit_avx512")
    stem.update(threads=plan.plan_level["threads"], pinning=plan.plan_level["pinning"])
    assert stem in library.space(_task(model, "stem"), this_device())
    plan.nodes["stem"]["config"] = stem
    written = library.apply(plan, model, tmp_path / "out")
    xml, _, settings = written
    feeds = {"input": np.random.default_rng(3).standard_normal((1, 3, 32, 32)).astype(np.float32)}
    np.save(tmp_path / "input.npy", feeds["input"])
    script = f"""
import json, sys
sys.modules["kselect"] = None  # plain openvino: kselect cannot be imported
import numpy as np, openvino as ov
settings = json.load(open({str(settings)!r}))
core = ov.Core()
compiled = core.compile_model(core.read_model({str(xml)!r}), settings["device"], settings["properties"])
out = compiled({{"input": np.load({str(tmp_path / "input.npy")!r})}})[compiled.outputs[0]]
np.save({str(tmp_path / "plain.npy")!r}, out)
ran = {{}}
for node in compiled.get_runtime_model().get_ordered_ops():
    info = node.get_rt_info()
    for name in info["originalLayersNames"].astype(str).split(","):
        ran[name] = info["primitiveType"].astype(str)
print(json.dumps(ran))
"""
    plain = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert plain.returncode == 0, plain.stderr
    ran = json.loads(plain.stdout)
    exported = json.loads(settings.read_text())
    assert exported["properties"]["INFERENCE_PRECISION_HINT"] == "f32"
    assert exported["nodes"]["stem"]["primitive"] == "jit_avx512_f32"
    for node, entry in exported["nodes"].items():
        assert any(ran.get(layer) == entry["primitive"] for layer in entry["layers"]), (node, entry, ran)
    runner = load_plan(plan, model)
    try:
        np.testing.assert_array_equal(np.load(tmp_path / "plain.npy"), runner(feeds)[0])
    finally:
        runner.close()


def test_kselect_plugins_lists_openvino_and_openvino_writes_nothing_into_the_users_home(tmp_path):
    """Starting OpenVINO (``kselect plugins`` imports it and lists its devices) writes nothing into
    the user's home outside the cache folder: OpenVINO's telemetry, which would create ~/intel and
    send usage events, is not started by kselect. (CI=true turns that telemetry off by itself.)"""
    home = tmp_path / "home"
    home.mkdir()
    env = {key: value for key, value in os.environ.items() if key not in ("CI", "TF_BUILD", "JENKINS_URL")}
    listed = subprocess.run([sys.executable, "-m", "kselect.cli.main", "plugins", "--json"], capture_output=True,
                            text=True, timeout=300, env={**env, "HOME": str(home), "COLUMNS": "200"})
    assert listed.returncode == 0, listed.stderr
    row = next(info for info in json.loads(listed.stdout) if info["name"] == "openvino")
    assert row["kind"] == "library" and row["status"] == "available"
    assert row["version"].startswith(f"OpenVINO {openvino.get_version()[:6]}")
    assert [path.name for path in home.iterdir()] in ([], [".cache"])


def _kselect_without_openvino(*args):
    """kselect as a user without the openvino package runs it (its import fails)."""
    script = ("import sys; sys.modules['openvino'] = None\n"
              "from kselect.cli.main import main\n"
              f"sys.exit(main({list(map(str, args))!r}))")
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "COLUMNS": "200"})


def test_openvino_missing_is_one_line_and_a_tune_naming_it_fails_before_measuring(small_model_path, tmp_path):
    listed = _kselect_without_openvino("plugins", "--json")
    assert listed.returncode == 0, listed.stderr
    row = next(info for info in json.loads(listed.stdout) if info["name"] == "openvino")
    assert row["status"].startswith("unavailable: the openvino package does not import")
    assert "\n" not in row["status"] and "pip install openvino==" in row["status"]
    db = tmp_path / "records.db"
    tuned = _kselect_without_openvino("tune", small_model_path, "--library", "openvino", "--db", db)
    assert tuned.returncode == 2
    assert "library 'openvino' is not available here" in tuned.stderr
    assert "Traceback" not in tuned.stderr
    assert not db.exists()


def test_kselect_space_lists_each_precision_exactly_where_openvino_runs_it_and_names_the_others():
    """Where OpenVINO's CPU plugin computes in bf16 (OPTIMIZATION_CAPABILITIES: on x86 a CPU with
    AVX512_BF16 or AMX) bf16 is a precision of the plugin; fp16 where it computes in f16; int8
    where it has integer kernels; each missing one is named with the capabilities it has."""
    capabilities = openvino.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    space = kselect_json("space", "resnet18", "--library", "openvino")
    runs = {"bf16": "BF16" in capabilities, "fp16": "FP16" in capabilities, "int8": "INT8" in capabilities}
    assert space["precisions"] == ["fp32"] + [precision for precision, ran in runs.items() if ran]
    missing = space["missing_precisions"]
    assert set(missing) == {precision for precision, ran in runs.items() if not ran}
    for precision in missing:
        assert missing[precision].startswith(f"OpenVINO's CPU plugin runs no "
                                             f"{ {'fp16': 'f16', 'bf16': 'bf16', 'int8': 'i8'}[precision]} "
                                             f"here (its OPTIMIZATION_CAPABILITIES: ")
    flags = set(open("/proc/cpuinfo").read().split()) if os.path.exists("/proc/cpuinfo") else set()
    if "avx512f" in flags:  # x86 with AVX-512: bf16 exactly where the CPU has bf16 arithmetic
        assert runs["bf16"] == bool({"avx512_bf16", "amx_bf16"} & flags)
    # the plan-level properties not chosen are named with why: one stream (latency), one core type here
    assert space["missing_dims"]["streams"].startswith("NUM_STREAMS is 1")
    # a per-node memory format is probed (both routes, ir.memory_formats_taken) and named with what it found
    taken = ir.memory_formats_taken()
    assert space["missing_dims"]["memory_format"].startswith("InputMemoryFormats / OutputMemoryFormats take no effect"
                                                             if not any(taken.values()) else "OpenVINO ")
    if len(this_device().clusters) == 1:
        assert space["missing_dims"]["core_type"].startswith("SCHEDULING_CORE_TYPE has nothing to choose")


needs_int8 = pytest.mark.skipif("int8" not in plugins.get_library("openvino").precisions,
                                reason="OpenVINO's CPU plugin has no integer kernels here")


@needs_int8
def test_an_int8_twin_runs_on_openvinos_integer_kernels_within_the_int8_tolerance(library, model):
    """The int8 twin of block.conv1 is the op between a dequantize of its uint8 input and a
    quantize of its output: its space holds int8 configs only, its default and a hinted
    implementation each run on an integer kernel (the runtime model says so, else the candidate
    fails) and measure ok through the core's measuring path, with an error above fp32's and within
    the int8 tolerance."""
    device = this_device()
    task = _task(model, "block.conv1")
    twin = task.at_precision("int8")
    assert library.supports(twin)
    configs = library.space(twin, device).enumerate()
    assert {c["precision"] for c in configs} == {"i8"}
    default = library.default_config(twin, device)
    hinted = next(c for c in configs if c["hinted"] and c["threads"] == device.cores)
    fp32 = measure_in_this_process(library, task, library.default_config(task, device), QUICK, {})
    with MeasureWorker(library, QUICK) as worker:
        measured = [worker.measure(twin, config) for config in (default, hinted)]
    inputs = task_inputs(twin)
    inputs["quant"] = quant_params(twin, inputs, reference_output(twin, inputs))
    tolerance = int8_tolerance(twin, inputs, reference_output(twin, inputs), inputs["quant"])
    for result in measured:
        assert result.status == "ok", result.reason
        assert fp32.error < result.error <= tolerance


@needs_int8
def test_the_ops_openvino_keeps_in_8_bits_between_int8_ops_run_on_u8(library, tmp_path):
    """Every op type of ``int8_passes``, between int8 convs of a QDQ model as
    onnxruntime.quantization writes it, runs on u8 in the runtime model (so the planner rightly
    counts no requantization around it)."""
    rng = np.random.default_rng(0)
    nodes, inits = [], []
    a = conv(nodes, inits, rng, "a", "x", 8, 16, 3)
    nodes.append(helper.make_node("MaxPool", [a], ["maxpool"], name="maxpool", kernel_shape=[2, 2], strides=[2, 2]))
    b = conv(nodes, inits, rng, "b", "maxpool", 16, 16, 3)
    c = conv(nodes, inits, rng, "c", b, 16, 16, 3)
    nodes.append(helper.make_node("Add", [b, c], ["add"], name="add"))
    d = conv(nodes, inits, rng, "d", "add", 16, 16, 3)
    nodes.append(helper.make_node("Concat", [d, "add"], ["concat"], name="concat", axis=1))
    nodes.append(helper.make_node("AveragePool", ["concat"], ["avgpool"], name="avgpool", kernel_shape=[2, 2],
                                  strides=[2, 2]))
    e = conv(nodes, inits, rng, "e", "avgpool", 32, 16, 3)
    inits.append(onnx.numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales"))
    nodes.append(helper.make_node("Resize", [e, "", "scales"], ["resize"], name="resize", mode="nearest"))
    f = conv(nodes, inits, rng, "f", "resize", 16, 16, 3)
    nodes.append(helper.make_node("GlobalAveragePool", [f], ["gap"], name="gap"))
    nodes.append(helper.make_node("Flatten", ["gap"], ["flatten"], name="flatten"))
    inits.append(onnx.numpy_helper.from_array(rng.standard_normal((4, 16)).astype(np.float32), "fc.w"))
    nodes.append(helper.make_node("Gemm", ["flatten", "fc.w"], ["y"], name="fc", transB=1))
    proto = graph_model(nodes, inits, (1, 8, 32, 32))
    feeds = [{"x": rng.standard_normal((1, 8, 32, 32)).astype(np.float32)} for _ in range(2)]
    quantize_qdq(proto, tmp_path / "qdq.onnx", feeds)
    compiled = ir.ConvertedModel(onnx.load(tmp_path / "qdq.onnx"), {}, []).compile({}, {"INFERENCE_PRECISION_HINT": "f32"})
    precision = {node.get_friendly_name(): node.get_rt_info()["runtimePrecision"].astype(str)
                 for node in compiled.get_runtime_model().get_ordered_ops()}
    passes = {node.name: node.op_type for node in proto.graph.node if node.op_type in library.int8_passes}
    assert set(passes.values()) == set(library.int8_passes)
    assert {name: precision.get(name) for name in passes} == {name: "u8" for name in passes}


@needs_int8
def test_an_int8_plans_activations_fuse_into_its_int8_convs_with_one_quantize_each(library):
    """Conv -> Clip(0, 6) three times (dense, depthwise, 1x1, as in MobileNetV2), every conv int8
    in the plan: the QDQ model the plan compiles quantizes each conv's output once, after its
    Clip (Conv -> Clip -> Q, as NNCF writes it), not also before it; OpenVINO runs each conv as
    one integer kernel with the Clip and its dequantize fused in, and the output stays near
    fp32's."""
    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "input"
    for i, (cin, cout, k, group) in enumerate([(3, 16, 3, 1), (16, 16, 3, 16), (16, 24, 1, 1)]):
        y = conv(nodes, inits, rng, f"c{i}", x, cin, cout, k, group=group, relu=False)
        inits += [onnx.numpy_helper.from_array(np.float32(0), f"c{i}.lo"),
                  onnx.numpy_helper.from_array(np.float32(6), f"c{i}.hi")]
        nodes.append(helper.make_node("Clip", [y, f"c{i}.lo", f"c{i}.hi"], [f"c{i}.clip"], name=f"c{i}.clip"))
        x = f"c{i}.clip"
    nodes.append(helper.make_node("Identity", [x], ["output"], name="out"))
    proto = graph_model(nodes, inits, (1, 3, 32, 32), outputs=["output"], name="clipped", input_name="input")
    clipped = model_from_proto("clipped", proto)
    feeds = [{"input": rng.standard_normal((1, 3, 32, 32)).astype(np.float32)} for _ in range(3)]
    ranges = compute_ranges(clipped, Calibration(calibrate=feeds[:2], held_out=feeds[2:], source="python"))
    convs = ["c0", "c1", "c2"]
    plan = _twin_plan(library, {node: _task(clipped, node).at_precision("int8") for node in convs}, ranges)
    qdq = plan_model(clipped, plan)
    quantized = [node.input[0] for node in qdq.graph.node if node.op_type == "QuantizeLinear"]
    assert sorted(quantized) == ["c0.clip", "c1.clip", "input"]  # c2.clip is the model's float output
    compiled = ir.ConvertedModel(qdq, {}, []).compile({}, {"INFERENCE_PRECISION_HINT": "f32"})
    fused = {}
    for node in compiled.get_runtime_model().get_ordered_ops():
        layers = node.get_rt_info()["originalLayersNames"].astype(str).split(",")
        for name in convs:
            if name in layers:
                fused[name] = (node.get_rt_info()["primitiveType"].astype(str), layers)
    assert set(fused) == set(convs)
    for name, (primitive, layers) in fused.items():
        assert primitive.endswith("_I8"), (name, primitive)
        assert f"{name}.y_DequantizeLinear" not in layers  # no quantize of the conv's own output
    assert "c0.clip_DequantizeLinear" in fused["c0"][1] and "c1.clip_DequantizeLinear" in fused["c1"][1]
    got, want = plan_and_onnxruntime_outputs(plan, clipped, feeds[2])
    assert cosine([[got]], [[want]], feeds[2:]) > 0.99


@pytest.mark.slow  # an OpenVINO tune with int8 runs by default (--precision all, test_an_int8_and_bf16_front_holds_the_whole_graph_in_bf16_and_races_it)
@needs_int8
def test_an_int8_tune_keeps_int8_ops_and_its_plan_runs_them_on_integer_kernels_in_plain_openvino(tmp_path):
    """small_cnn on 96x96 inputs (where int8 is well ahead: on 32x32 the two are within the noise
    of one-sample op times) tuned on OpenVINO with --precision fp32,int8 under a cosine budget of 0.05: the
    chosen point has int8 ops within the budget; kselect.load_plan runs exactly those nodes on
    integer kernels (the plan compiles the model's QDQ form), and the exported IR, loaded by plain
    openvino with the exported properties, runs them on the same kernels. ``kselect bench --alone``
    times the plan against OpenVINO in f32 (kselect's baseline) and OpenVINO as its users run it."""
    model_path = tmp_path / "small_cnn.onnx"
    onnx.save(small_cnn(dynamic=True), model_path)
    shape = ("--input-shape", "input=1,3,96,96")
    feeds = feeds_folder(tmp_path / "calibration", shape=(1, 3, 96, 96))
    out = tmp_path / "plan.json"
    tuned = kselect_json("tune", model_path, *shape, "--library", "openvino", "--precision", "fp32,int8", "--calibration", feeds,
                         "--metric", "cosine", "--max-accuracy-drop", "0.05", "--budget", "1", "--min-time", "0.01",
                         "--no-verify", "--db", tmp_path / "records.db", "-o", out)
    precision = tuned["libraries"][0]["precision"]
    front = {point["name"]: point for point in precision["front"]}
    chosen = front[precision["chosen"]]
    assert chosen["within_budget"] and chosen["drop"] <= 0.05 and chosen["ops_by_precision"].get("int8")
    plan = load_plan_file(out)
    in_int8 = {node for node, precision in reduced_nodes(plan).items() if precision == "int8"}
    assert in_int8 == set(chosen["precisions"]) and {plan.nodes[node]["config"]["precision"] for node in in_int8} == {"i8"}
    runner = kselect.load_plan(out, str(model_path))
    try:
        ran = {node: choice.precision for node, choice in runner.runners[0].ran.items()}
    finally:
        runner.close()
    assert ran == {node: "i8" if node in in_int8 else "f32" for node in plan.nodes}
    exported = json.loads((tmp_path / "plan.openvino.json").read_text())
    script = f"""
import json, sys
sys.modules["kselect"] = None  # plain openvino: kselect cannot be imported
import openvino as ov
settings = json.load(open({str(tmp_path / "plan.openvino.json")!r}))
core = ov.Core()
compiled = core.compile_model(core.read_model({str(tmp_path / "plan.openvino.xml")!r}), "CPU", settings["properties"])
print(json.dumps({{name: node.get_rt_info()["primitiveType"].astype(str)
                  for node in compiled.get_runtime_model().get_ordered_ops()
                  for name in node.get_rt_info()["originalLayersNames"].astype(str).split(",")}}))
"""
    plain = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert plain.returncode == 0, plain.stderr
    primitives = json.loads(plain.stdout)
    for node, entry in exported["nodes"].items():
        assert entry["precision"] == ("i8" if node in in_int8 else "f32")
        assert any(primitives.get(layer) == entry["primitive"] for layer in entry["layers"]), (node, entry)
        assert entry["primitive"].endswith("_I8") == (node in in_int8)
    benched = kselect_json("bench", model_path, *shape, "--plan", out, "--alone", "--rounds", "2", "--runs-per-round", "3")
    assert benched["baseline"] == "openvino default" and benched["plan_ms"] > 0 and benched["default_ms"] > 0
    users = benched["users_default"]
    assert users["ms"] > 0 and len(users["process_ms"]) == 2
    assert users["per_round_bounds"][0] <= users["per_round_speedup"] <= users["per_round_bounds"][1]
    assert users["max_relative_output_error"] < 0.1  # int8 and the users' default (bf16 here) both near f32


@needs_bf16
def test_a_bf16_twin_is_measured_in_bf16_within_the_half_tolerance(library, model):
    """The bf16 twin of block.conv1: its space holds bf16 configs only (the fp32 task's f32 only),
    its default is OpenVINO's own pick in bf16, and each implementation measured through the core's
    measuring path is ok, with an error well above fp32's and within the half tolerance."""
    device = this_device()
    task = _task(model, "block.conv1")
    twin = task.at_precision("bf16")
    assert twin.id == f"{task.id}.bf16" and library.supports(twin)
    assert {c["precision"] for c in library.space(task, device).enumerate()} == {"f32"}
    configs = library.space(twin, device).enumerate()
    assert {c["precision"] for c in configs} == {"bf16"}
    default = library.default_config(twin, device)
    assert default["precision"] == "bf16" and not default["hinted"] and default in configs
    fp32 = measure_in_this_process(library, task, library.default_config(task, device), QUICK, {})
    assert fp32.status == "ok" and fp32.error < 1e-5
    # the own pick and at least one hinted implementation
    assert len(_each_implementation_within_half_tolerance(library, twin)) > 1


def _upsampling_model() -> onnx.ModelProto:
    """stem conv -> ConvTranspose "up" (2x2, stride 2) -> head conv: a decoder's upsampling, as
    in centerface."""
    rng = np.random.default_rng(0)
    nodes, inits = [], []
    x = conv(nodes, inits, rng, "stem", "x", 3, 24, 3)
    inits.append(weights(rng, "up.w", (24, 24, 2, 2)))
    nodes.append(helper.make_node("ConvTranspose", [x, "up.w"], ["up.y"], name="up", strides=[2, 2], kernel_shape=[2, 2]))
    y = conv(nodes, inits, rng, "head", "up.y", 24, 8, 3, relu=False)
    nodes.append(helper.make_node("Identity", [y], ["y"], name="out"))
    return graph_model(nodes, inits, input_shape=(1, 3, 32, 32), name="upsampling")


@needs_bf16
def test_a_deconvs_bf16_twin_is_measured_in_bf16_and_a_plan_runs_it_in_bf16(library):
    """OpenVINO keeps a graph's tail in f32 under bf16 up to the last conv, and a lone
    ConvTranspose is all tail: its twin is measured with its output in bf16, so the plugin runs it
    in bf16 as inside a model. Each implementation of the twin is ok in bf16 within the half
    tolerance, and a plan with every op in bf16 runs the deconv in bf16."""
    device = this_device()
    upsampling = model_from_proto("upsampling", _upsampling_model())
    tasks = extract_tasks(upsampling)
    twin = next(t for t in tasks if t.kind == "deconv").at_precision("bf16")
    assert library.supports(twin)
    default = library.default_config(twin, device)
    assert default["precision"] == "bf16" and default in library.space(twin, device).enumerate()
    assert default in _each_implementation_within_half_tolerance(library, twin)
    configs = {node: library.default_config(task.at_precision("bf16"), device) for task in tasks for node in task.nodes}
    runner = library.model_runner(upsampling, _plan(configs))
    try:
        ran = {node: choice.precision for node, choice in runner.ran.items()}
    finally:
        runner.close()
    assert ran == {"stem": "bf16", "up": "bf16", "head": "bf16"}


@needs_bf16
def test_a_plan_keeps_in_f32_the_conv_a_residual_add_is_fused_into(library, model):
    """Every op of small_cnn in bf16 but block.conv2, whose output OpenVINO sums with the residual
    inside the conv: the plan compiles (the fused Add is kept in f32 with the conv) and runs
    block.conv2 in f32, the others in bf16."""
    device = this_device()
    configs = {}
    for task in extract_tasks(model):
        twin = task if "block.conv2" in task.nodes else task.at_precision("bf16")
        configs.update({node: library.default_config(twin, device) for node in task.nodes})
    runner = library.model_runner(model, _plan(configs))
    try:
        ran = {node: choice.precision for node, choice in runner.ran.items()}
        output = runner({"input": np.ones((1, 3, 32, 32), np.float32)})[0]
    finally:
        runner.close()
    assert ran == {node: "f32" if node == "block.conv2" else "bf16" for node in configs}
    assert output.shape == (1, 10) and np.all(np.isfinite(output))


@needs_bf16
@needs_int8
def test_a_bf16_plan_keeps_in_f32_a_conv_reading_an_int8_ops_output(library, model):
    """block.conv1 int8, block.conv2 after it f32, the others bf16 or f32: compiling for f32, the
    plugin fuses the dequantize of block.conv1's output into block.conv2 as a layer it made (no
    IR layer to mark ``precise``). The plan compiles and runs each node in its precision (it had
    failed with a KeyError on that layer's name)."""
    rng = np.random.default_rng(0)
    feeds = [{"input": rng.standard_normal((1, 3, 32, 32)).astype(np.float32)} for _ in range(3)]
    ranges = compute_ranges(model, Calibration(calibrate=feeds[:2], held_out=feeds[2:], source="python"))
    wanted = {"stem": "fp32", "block.conv1": "int8", "block.conv2": "fp32", "down": "bf16", "dw": "fp32",
              "pw": "bf16", "fc": "bf16"}
    twins = {node: _task(model, node) if p == "fp32" else _task(model, node).at_precision(p)
             for node, p in wanted.items()}
    runner = library.model_runner(model, _twin_plan(library, twins, ranges))
    try:
        ran = {node: choice.precision for node, choice in runner.ran.items()}
        output = runner(feeds[2])[0]
    finally:
        runner.close()
    assert ran == {node: {"fp32": "f32", "int8": "i8"}.get(p, p) for node, p in wanted.items()}
    assert output.shape == (1, 10) and np.all(np.isfinite(output))


@needs_bf16
def test_a_bf16_tune_chooses_the_fastest_point_within_the_budget_and_its_plan_runs_its_bf16_ops_in_bf16(tmp_path):
    """small_cnn on 96x96 inputs (on 32x32 the whole runs that correct the front's costs in context
    read the two precisions within their noise) tuned on OpenVINO with --precision fp32,bf16 under
    a cosine budget of 0.05: the front's second point runs ops in bf16 alone, the chosen point is
    the fastest predicted within the budget (bf16 ops or not: on some CPUs with AVX512_BF16,
    e.g. a Xeon without AMX, OpenVINO's bf16 convolutions of few channels are slower than its
    f32 ones), the plan file holds the bf16 twins of its bf16 ops, and kselect.load_plan runs
    those nodes in bf16 and the others in f32."""
    model_path = tmp_path / "small_cnn.onnx"
    onnx.save(small_cnn(dynamic=True), model_path)
    feeds = feeds_folder(tmp_path / "calibration", shape=(1, 3, 96, 96))
    out = tmp_path / "plan.json"
    tuned = kselect_json("tune", model_path, "--input-shape", "input=1,3,96,96", "--library", "openvino", "--precision", "fp32,bf16", "--calibration", feeds,
                         "--metric", "cosine", "--max-accuracy-drop", "0.05", "--budget", "1", "--min-time", "0.01",
                         "--no-verify", "--db", tmp_path / "records.db", "-o", out)
    precision = tuned["libraries"][0]["precision"]
    front = {point["name"]: point for point in precision["front"]}
    # "bf16": the ops faster in bf16 alone (on a Xeon without AMX a few of small_cnn's, in some runs
    # none: then no such point); "all-bf16": every op with a bf16 config (no such point where that
    # is every op: the same as "bf16")
    assert list(front)[0] == "fp32" and list(front)[1] in ("bf16", "all-bf16")
    assert set(front[list(front)[1]]["ops_by_precision"]) == {"bf16"}
    every_op = front.get("all-bf16", front.get("bf16"))
    assert every_op["ops_by_precision"]["bf16"] == len(load_plan_file(out).nodes)
    chosen = front[precision["chosen"]]
    assert chosen["within_budget"] and chosen["drop"] <= 0.05
    assert chosen["predicted_us"] == min(p["predicted_us"] for p in front.values() if p["within_budget"])

    plan = load_plan_file(out)
    in_bf16 = reduced_nodes(plan)
    assert in_bf16 == chosen["precisions"] and set(in_bf16.values()) <= {"bf16"}
    assert {t.get("precision", "fp32") for t in plan.tasks if set(t["nodes"]) & set(in_bf16)} <= {"bf16"}
    assert {plan.nodes[node]["config"]["precision"] for node in in_bf16} <= {"bf16"}
    runner = kselect.load_plan(out, str(model_path))
    try:
        ran = {node: choice.precision for node, choice in runner.runners[0].ran.items()}
        runner.run({"input": np.random.default_rng(1).standard_normal((1, 3, 96, 96), dtype=np.float32)})
    finally:
        runner.close()
    assert ran == {node: "bf16" if node in in_bf16 else "f32" for node in plan.nodes}


@needs_bf16
def test_an_int8_and_bf16_front_holds_the_whole_graph_in_bf16_and_races_it(tmp_path):
    """small_cnn on 96x96 inputs tuned on OpenVINO with --precision all: beside the back-off from
    every op in int8, the front holds "all-bf16" (and "all-fp16" where OpenVINO has fp16), every op with a bf16 config measured in bf16
    (also those left off the ladders as slower than fp32 alone), marked uniform; within the
    budget, it is timed end to end in the race whatever its predicted latency."""
    model_path = tmp_path / "small_cnn.onnx"
    onnx.save(small_cnn(dynamic=True), model_path)
    feeds = feeds_folder(tmp_path / "calibration", shape=(1, 3, 96, 96))
    tuned = kselect_json("tune", model_path, "--input-shape", "input=1,3,96,96", "--library", "openvino",
                         "--precision", "all", "--calibration", feeds, "--metric", "cosine",
                         "--max-accuracy-drop", "0.05", "--budget", "1", "--min-time", "0.01",
                         "--check-rounds", "1", "--check-max-rounds", "1", "--db", tmp_path / "records.db",
                         "-o", tmp_path / "plan.json")
    precision = tuned["libraries"][0]["precision"]
    front = {point["name"]: point for point in precision["front"]}
    uniform = [point for point in precision["front"] if point.get("uniform")]
    halves = [p for p in ("bf16", "fp16") if p in plugins.get_library("openvino").plan_precisions]
    assert [point["name"] for point in uniform] == [f"all-{p}" for p in halves]  # fp16 where the CPU has AVX512_FP16
    for point in uniform:
        assert set(point["precisions"].values()) == {point["name"].removeprefix("all-")}
    in_bf16 = front["all-bf16"]["precisions"]
    with_bf16 = set(load_plan_file(tmp_path / "plan.json").nodes)
    left_out = {node for node, why in precision.get("left_out", {}).items() if "bf16" in why
                and why["bf16"].startswith("slower")}
    assert left_out <= set(in_bf16) <= with_bf16
    assert front["all-bf16"]["within_budget"] and front["all-bf16"]["measured_ms"] > 0


def test_openvino_shares_plans_with_other_libraries_its_crossings_measured(library, model, tmp_path):
    """``--library mlas,openvino``: the tune measures what a tensor pays entering and leaving
    OpenVINO's runner and what switching to and from it costs, plans across both on op times in
    context, and a plan
    whose ops alternate between the two runs end to end with ONNX Runtime's outputs."""
    from kselect.core.api import tune
    from kselect.core.cross_library.switches import defaults_plan
    from kselect.core.whole_model.bench import compare_outputs, random_feeds
    from kselect.plugins.mlas.apply import default_session

    assert "openvino" in [lib.name for lib in plugins.select_libraries("all")]
    result = tune(model, ["mlas", "openvino"], search="random", budget=1, db=tmp_path / "records.db",
                  settings=QUICK, verify=False)
    cross = result.plan.extra["cross_library"]
    assert set(cross["switch_us"]) == {"mlas->openvino", "openvino->mlas"}
    assert set(cross["single_library"]) == {"mlas", "openvino"}
    assert cross["single_library"]["openvino"]["total_us"] > 0
    # the ops were ranked by their times in a whole run of each library's own plan; the plan keeps
    # the isolated times the race predicts from
    context = cross["in_context"]
    assert set(context["ratio_median"]) == {"mlas", "openvino"}
    assert all(ratio > 0 for ratio in context["ratio_median"].values())
    # each library's own plan and ONNX Runtime's default (the race's reference) were run whole, so
    # the plan's figure is a whole-model time in context, its isolated sum kept beside it
    assert set(context["whole_us"]) == {"mlas", "openvino", "baseline default"}
    assert result.plan.extra["predicted_basis"] == IN_CONTEXT
    assert result.plan.extra["predicted_us"] > 0 and result.plan.extra["isolated_us"] > 0
    for node, entry in result.plan.nodes.items():
        task = next(t for t in result.plan.tasks if node in t["nodes"] and t["library"] == entry["library"])
        assert entry["time_us"] == pytest.approx(task["time_us"], rel=1e-3)

    convs = [node.name for node in model.proto.graph.node if node.op_type in ("Conv", "Gemm")]
    alternating = defaults_plan(model, {node: ("mlas", "openvino")[index % 2] for index, node in enumerate(convs)})
    runner = load_plan(alternating, model)
    try:
        assert {s.library for s in runner.segments} == {"mlas", "openvino"} and len(runner.segments) >= 4
        feeds = random_feeds(model)
        assert compare_outputs(default_session(model).run(None, feeds), runner(feeds)) < 1e-4
    finally:
        runner.close()
