"""`specpipe web` as a real process: it migrates, keeps a secret key, serves, and stops."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import urllib.request

from models.migrate import current, heads
from tests.waiting import wait_until


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_web_command_serves(fresh_database_url, tmp_path):
    port = _free_port()
    env = {**os.environ, "DATABASE_URL": fresh_database_url, "SPECPIPE_HOME": str(tmp_path)}
    env.pop("SECRET_KEY", None)
    process = subprocess.Popen(
        [sys.executable, "-m", "specpipe", "web", "--port", str(port)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )

    def healthy() -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
                assert r.status == 200
                return True
        except OSError:
            assert process.poll() is None, process.stdout.read()
            return False

    try:
        wait_until(healthy, 30, "specpipe web to answer /healthz", interval_s=0.2)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as r:
            assert b"New job" in r.read()
        assert current(fresh_database_url) == heads()[0]
        key_file = tmp_path / "secret_key"
        assert len(key_file.read_text().strip()) == 64
    finally:
        process.terminate()
        process.wait(timeout=10)
