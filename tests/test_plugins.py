"""Plugins: a third-party plugin installed with an entry point in the ``kselect`` group is
loaded like the built-ins; KSELECT_PLUGINS restricts what loads; ``kselect plugins`` reports."""

import json
import textwrap

import graphs
import numpy as np
from helpers import run_kselect
from onnx import helper, numpy_helper

PLUGIN = textwrap.dedent('''
    from kselect.core.contract.hookspecs import hookimpl
    from kselect.search import Searcher


    class ReverseSearcher(Searcher):
        """Exhaustive search, last config first."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.order = list(self.space.enumerate())

        def ask(self):
            return self.pop_unmeasured(self.order)


    @hookimpl
    def register_searchers(register):
        register("reverse", ReverseSearcher)
''')


def install_plugin(folder, name: str, source: str, version: str = "1.0") -> dict:
    """A distribution ``kselect-NAME`` with module ``kselect_NAME`` and an entry point in the
    ``kselect`` group, installed in ``folder``; the environment that finds it."""
    (folder / f"kselect_{name}.py").write_text(source)
    info = folder / f"kselect_{name}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: kselect-{name}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[kselect]\n{name} = kselect_{name}\n")
    (info / "top_level.txt").write_text(f"kselect_{name}\n")
    return {"PYTHONPATH": str(folder)}


def plugins_json(env):
    result = run_kselect("plugins", "--json", env=env)
    assert result.returncode == 0, result.stderr
    return {p["name"]: p for p in json.loads(result.stdout)}


def test_third_party_plugin_is_listed_and_used(tmp_path, small_model_path):
    env = install_plugin(tmp_path, "reverse", PLUGIN, "0.3.1")
    found = plugins_json(env)
    assert found["reverse"]["kind"] == "search" and found["reverse"]["version"] == "0.3.1"
    assert found["mlas"]["status"].startswith("available") and found["mlas"]["version"].startswith("onnxruntime")
    tuned = run_kselect("tune", small_model_path, "--library", "mlas", "--search", "reverse", "--budget", "2",
                        "--min-time", "0.01", "--db", tmp_path / "r.db", "-o", tmp_path / "p.json", env=env)
    assert tuned.returncode == 0, tuned.stderr


def test_kselect_plugins_env_restricts_libraries_and_third_party(tmp_path):
    env = install_plugin(tmp_path, "reverse", PLUGIN, "0.3.1")
    found = plugins_json({**env, "KSELECT_PLUGINS": "mlas"})
    assert "mlas" in found and "reverse" not in found and "xnnpack" not in found and "acl" not in found
    assert {"random", "exhaustive", "zoo"} <= set(found)  # core plugins always load


OP_KIND_PLUGIN = textwrap.dedent('''
    import numpy as np
    from onnx import helper

    from kselect.core.contract.hookspecs import hookimpl
    from kselect.core.contract.opkind import OnnxOp, OpKind
    from kselect.core.models.tasks import Op, node_attr, tensor_shape


    class MaxPoolKind(OpKind):
        """2-D MaxPool without pads, a kind no built-in library tunes."""

        name = "maxpool"
        onnx_ops = ("MaxPool",)

        def read(self, model, node):
            if any(node_attr(node, "pads", [0])):
                return "padded MaxPool: not this kind"
            x, y = tensor_shape(model, node.input[0], node), tensor_shape(model, node.output[0], node)
            return Op(node.name, self.name, x, [], y, {"kernel": list(node_attr(node, "kernel_shape"))}, False)

        def macs(self, op):
            return int(np.prod(op.output_shape)) * int(np.prod(op.attrs["kernel"]))

        def inputs(self, task, rng):
            return {"x": rng.standard_normal(task.input_shape, dtype=np.float32)}

        def reference(self, task, inputs):
            k = task.attrs["kernel"]
            n, c, h, w = inputs["x"].shape
            return inputs["x"].astype(np.float64).reshape(n, c, h // k[0], k[0], w // k[1], k[1]).max(axis=(3, 5))

        def onnx_op(self, task, inputs, output):
            node = helper.make_node("MaxPool", ["x"], [output], kernel_shape=task.attrs["kernel"], strides=task.attrs["kernel"])
            return OnnxOp(node, task.input_shape, task.output_shape, np.zeros(0, np.float32))


    @hookimpl
    def register_op_kinds(register):
        register(MaxPoolKind())
''')


def test_a_plugin_registers_an_op_kind_and_kselect_finds_measures_and_checks_its_ops(tmp_path):
    """A new kind of op is one OpKind in a plugin: ``kselect tasks`` lists the model's MaxPool as
    a task of that kind, and the core's reference for it (used to check every candidate) comes
    from the kind and matches ONNX Runtime running the kind's own one-op model."""
    env = install_plugin(tmp_path, "maxpool", OP_KIND_PLUGIN)
    model_path = tmp_path / "conv_pool.onnx"
    weights = numpy_helper.from_array(np.random.default_rng(0).standard_normal((8, 3, 3, 3)).astype(np.float32), "w")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("MaxPool", ["c"], ["y"], name="pool", kernel_shape=[2, 2], strides=[2, 2])]
    graphs.saved(graphs.model(nodes, [weights], (1, 3, 16, 16), name="conv_pool"), model_path)
    found = plugins_json(env)
    assert found["maxpool"]["kind"] == "op kinds" and found["maxpool"]["provides"] == ["maxpool"]
    assert found["ops"]["provides"] == ["conv", "deconv", "fc", "convert"]

    script = textwrap.dedent(f'''
        import json, numpy as np, onnxruntime as ort
        from kselect.core.measuring.measure import reference_output, task_inputs, task_model
        from kselect.core.models.model import load_model
        from kselect.core.models.tasks import extract_tasks
        tasks = extract_tasks(load_model({str(model_path)!r}))
        pool = [t for t in tasks if t.kind == "maxpool"]
        inputs = task_inputs(pool[0])
        session = ort.InferenceSession(task_model(pool[0], inputs).SerializeToString())
        ran = session.run(None, {{"x": inputs["x"]}})[0]
        print(json.dumps({{"kinds": sorted({{t.kind for t in tasks}}), "pools": len(pool), "macs": pool[0].macs,
                           "error": float(np.abs(ran - reference_output(pool[0], inputs)).max())}}))
    ''')
    import os
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env={**os.environ, **env}, timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report == {"kinds": ["conv", "maxpool"], "pools": 1, "macs": 8 * 8 * 8 * 4, "error": 0.0}
    listed = run_kselect("tasks", model_path, "--json", env=env)
    assert listed.returncode == 0, listed.stderr
    assert [task["kind"] for task in json.loads(listed.stdout)["tasks"]] == ["conv", "maxpool"]


WRONG_LIBRARY_PLUGIN = textwrap.dedent('''
    from kselect.core.contract.hookspecs import hookimpl
    from kselect.plugins.mlas.library import MlasLibrary


    class NeverRightLibrary(MlasLibrary):
        """MLAS's kernels under another name, every output judged wrong (a tolerance no error meets)."""

        name = "neverright"

        def tolerance(self, task, config):
            return -1.0


    @hookimpl
    def register_libraries(register):
        register(NeverRightLibrary())
''')


def test_a_library_with_no_valid_config_is_left_out_of_a_tune_of_several(tmp_path, small_model_path):
    """One library that cannot plan (no config of an op measured right) does not end a tune of
    several libraries: it is named in one line and the others are planned without it."""
    env = install_plugin(tmp_path, "neverright", WRONG_LIBRARY_PLUGIN)
    tuned = run_kselect("tune", small_model_path, "--library", "mlas,neverright", "--budget", "2", "--min-time", "0.01",
                        "--no-verify", "--db", tmp_path / "r.db", "-o", tmp_path / "p.json", "--json", env=env)
    assert tuned.returncode == 0, tuned.stderr
    result = json.loads(tuned.stdout)
    assert list(result["left_out"]) == ["neverright"] and "no config of" in result["left_out"]["neverright"]
    assert [lib["library"] for lib in result["libraries"]] == ["mlas"]
    assert "neverright is left out of this tune's plans" in tuned.stderr
    plan = json.loads((tmp_path / "p.json").read_text())
    assert set(plan["libraries"]) == {"mlas"}
    alone = run_kselect("tune", small_model_path, "--library", "neverright", "--budget", "2", "--min-time", "0.01",
                        "--db", tmp_path / "r.db", "-o", tmp_path / "q.json", env=env)
    assert alone.returncode != 0 and "no plan: no config of" in alone.stderr
