"""Plugins: a third-party plugin installed with an entry point in the ``kselect`` group is
loaded like the built-ins; KSELECT_PLUGINS restricts what loads; ``kselect plugins`` reports."""

import json
import textwrap

from conftest import run_kselect

PLUGIN = textwrap.dedent('''
    from kselect.core.hookspecs import hookimpl
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


def install_fake_distribution(folder):
    (folder / "kselect_reverse.py").write_text(PLUGIN)
    info = folder / "kselect_reverse-0.3.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kselect-reverse\nVersion: 0.3.1\n")
    (info / "entry_points.txt").write_text("[kselect]\nreverse = kselect_reverse\n")
    (info / "top_level.txt").write_text("kselect_reverse\n")


def plugins_json(env):
    result = run_kselect("plugins", "--json", env=env)
    assert result.returncode == 0, result.stderr
    return {p["name"]: p for p in json.loads(result.stdout)}


def test_third_party_plugin_is_listed_and_used(tmp_path, small_model_path):
    install_fake_distribution(tmp_path)
    env = {"PYTHONPATH": str(tmp_path)}
    found = plugins_json(env)
    assert found["reverse"]["kind"] == "search" and found["reverse"]["version"] == "0.3.1"
    assert found["mlas"]["status"] == "available" and found["mlas"]["version"].startswith("onnxruntime")
    tuned = run_kselect("tune", small_model_path, "--library", "mlas", "--search", "reverse", "--budget", "2",
                        "--min-time", "0.01", "--db", tmp_path / "r.db", "-o", tmp_path / "p.json", env=env)
    assert tuned.returncode == 0, tuned.stderr


def test_kselect_plugins_env_restricts_libraries_and_third_party(tmp_path):
    install_fake_distribution(tmp_path)
    found = plugins_json({"PYTHONPATH": str(tmp_path), "KSELECT_PLUGINS": "mlas"})
    assert "mlas" in found and "reverse" not in found and "xnnpack" not in found and "acl" not in found
    assert {"random", "exhaustive", "zoo"} <= set(found)  # core plugins always load
