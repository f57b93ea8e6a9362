"""`specpipe web` as a real process: it migrates, keeps a secret key, gives the built-in admin a
first password, serves, and stops."""

from __future__ import annotations

import http.cookiejar
import os
import re
import subprocess
import sys
import urllib.parse
import urllib.request

from models.migrate import current, heads
from specpipe.ops.redis_server import free_port
from tests.waiting import wait_until


def test_web_command_serves(fresh_database_url, tmp_path):
    port = free_port()
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
        assert current(fresh_database_url) == heads()[0]
        key_file = tmp_path / "secret_key"
        assert len(key_file.read_text().strip()) == 64
        password_file = tmp_path / "admin_password"
        assert password_file.stat().st_mode & 0o777 == 0o600

        # A fresh user: the home page asks for a login, and the first password opens it.
        browser = urllib.request.build_opener(
            urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar())
        )
        with browser.open(f"http://127.0.0.1:{port}/", timeout=5) as r:
            page = r.read().decode()
            assert r.url.endswith("/login?next=/") and "Log in" in page
        token = re.search(r'name="csrf_token"[^>]*value="([^"]+)"', page).group(1)
        form = {
            "csrf_token": token,
            "username": "admin",
            "next": "/",
            "password": password_file.read_text().strip(),
        }
        body = urllib.parse.urlencode(form).encode()
        with browser.open(f"http://127.0.0.1:{port}/login", data=body, timeout=10) as r:
            assert r.url == f"http://127.0.0.1:{port}/" and b"New job" in r.read()
    finally:
        process.terminate()
        process.wait(timeout=10)
    assert f"with the password in {tmp_path / 'admin_password'}" in process.stdout.read()


def test_a_malformed_setting_is_one_line(tmp_path):
    from click.testing import CliRunner

    from specpipe.cli import cli

    env = {"SPECPIPE_HOME": str(tmp_path), "SPECPIPE_TRUSTED_PROXIES": "one"}
    result = CliRunner().invoke(cli, ["web", "--no-migrate"], env=env)
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        "Error: SPECPIPE_TRUSTED_PROXIES must be an integer >= 0, got 'one'"
    ]
