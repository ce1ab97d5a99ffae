"""Fixtures only; the tests' helpers are in helpers.py (running the CLI) and graphs.py (models)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import onnx
import pytest
from graphs import small_cnn
from helpers import REPO


@pytest.fixture
def small_model_path(tmp_path) -> Path:
    path = tmp_path / "small.onnx"
    onnx.save(small_cnn(), path)
    return path


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
