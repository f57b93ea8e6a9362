"""`specpipe web` as a real process: it migrates, keeps a secret key, serves, and stops."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request

from models.migrate import current, heads


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
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
                    assert r.status == 200
                    break
            except OSError:
                assert process.poll() is None, process.stdout.read()
                assert time.monotonic() < deadline, "specpipe web did not start in 30 s"
                time.sleep(0.2)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as r:
            assert b"New job" in r.read()
        assert current(fresh_database_url) == heads()[0]
        key_file = tmp_path / "secret_key"
        assert len(key_file.read_text().strip()) == 64
    finally:
        process.terminate()
        process.wait(timeout=10)
