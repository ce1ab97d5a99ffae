"""Shared helpers: small real ONNX models built here, and running the CLI as a user does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

REPO = Path(__file__).resolve().parents[1]


def _conv(nodes, inits, rng, name, x, cin, cout, k, stride=1, pads=None, group=1, relu=True):
    w = (rng.standard_normal((cout, cin // group, k, k)) * np.sqrt(2.0 / (cin // group * k * k))).astype(np.float32)
    b = (rng.standard_normal(cout) * 0.1).astype(np.float32)
    inits += [numpy_helper.from_array(w, f"{name}.w"), numpy_helper.from_array(b, f"{name}.b")]
    pads = pads if pads is not None else [k // 2] * 4
    nodes.append(helper.make_node("Conv", [x, f"{name}.w", f"{name}.b"], [f"{name}.y"], name=name,
                                  kernel_shape=[k, k], strides=[stride, stride], pads=pads, group=group))
    if not relu:
        return f"{name}.y"
    nodes.append(helper.make_node("Relu", [f"{name}.y"], [f"{name}.r"], name=f"{name}.relu"))
    return f"{name}.r"


def small_cnn(dynamic: bool = False, seed: int = 0) -> onnx.ModelProto:
    """A small CNN with the op kinds kselect tunes: dense 3x3 (two identical ones: one task),
    strided conv with asymmetric pads, 1x1, depthwise, a residual add, and a Gemm."""
    rng = np.random.default_rng(seed)
    nodes, inits = [], []
    x = _conv(nodes, inits, rng, "stem", "input", 3, 16, 3)
    a = _conv(nodes, inits, rng, "block.conv1", x, 16, 16, 3)
    a = _conv(nodes, inits, rng, "block.conv2", a, 16, 16, 3, relu=False)
    nodes.append(helper.make_node("Add", [a, x], ["block.sum"], name="block.add"))
    x = _conv(nodes, inits, rng, "down", "block.sum", 16, 32, 4, stride=2, pads=[1, 1, 2, 2])
    x = _conv(nodes, inits, rng, "dw", x, 32, 32, 3, group=32)
    x = _conv(nodes, inits, rng, "pw", x, 32, 48, 1)
    nodes.append(helper.make_node("GlobalAveragePool", [x], ["gap"], name="gap"))
    nodes.append(helper.make_node("Flatten", ["gap"], ["flat"], name="flatten"))
    w = (rng.standard_normal((10, 48)) * 0.2).astype(np.float32)
    inits += [numpy_helper.from_array(w, "fc.w"), numpy_helper.from_array(np.zeros(10, np.float32), "fc.b")]
    nodes.append(helper.make_node("Gemm", ["flat", "fc.w", "fc.b"], ["output"], name="fc", transB=1))
    shape = ["N", 3, "H", "W"] if dynamic else [1, 3, 32, 32]
    graph = helper.make_graph(nodes, "small_cnn", [helper.make_tensor_value_info("input", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("output", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.fixture
def small_model_path(tmp_path) -> Path:
    path = tmp_path / "small.onnx"
    onnx.save(small_cnn(), path)
    return path


def run_kselect(*args, env=None, timeout=600, cwd=None) -> subprocess.CompletedProcess:
    """Runs the installed ``kselect`` command as a user would (in ``cwd``, default this one)."""
    full_env = {**os.environ, "COLUMNS": "200", **(env or {})}
    return subprocess.run([sys.executable, "-m", "kselect.cli.main", *map(str, args)], capture_output=True, text=True,
                          env=full_env, timeout=timeout, cwd=cwd)


@pytest.fixture(scope="module")
def acl():
    """The ACL library plugin (its runner process is closed after the module's tests)."""
    from kselect.core.contract import plugins

    library = plugins.libraries()["acl"]
    ok, reason = library.availability()
    if not ok:
        pytest.skip(reason)
    yield library
    library.close()


# -- a real PostgreSQL server on loopback, for the shared record store -------------------------
@pytest.fixture(scope="session")
def postgres_server():
    """Debian's PostgreSQL in a fresh cluster on a free loopback port (scripts/local-postgres.sh);
    yields its base URL."""
    import shutil
    import socket
    import tempfile

    script = REPO / "scripts" / "local-postgres.sh"
    folder = tempfile.mkdtemp(prefix="kselect-postgres-")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    started = subprocess.run(["bash", script, "start", folder, str(port)], capture_output=True, text=True)
    if started.returncode != 0:
        pytest.fail(f"could not start PostgreSQL: {started.stderr.strip()}")
    try:
        yield started.stdout.strip()
    finally:
        subprocess.run(["bash", script, "stop", folder], capture_output=True)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def postgres_url(postgres_server, request) -> str:
    """A new, empty database on the test server."""
    import re

    import psycopg

    name = "t_" + re.sub(r"[^a-z0-9]+", "_", request.node.name.lower())[:50]
    with psycopg.connect(f"{postgres_server}/postgres", autocommit=True) as connection:
        connection.execute(f"DROP DATABASE IF EXISTS {name}")
        connection.execute(f"CREATE DATABASE {name}")
    return f"{postgres_server}/{name}"
