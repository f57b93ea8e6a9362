"""`specpipe db` and `specpipe token`, run through click's CliRunner on a real database."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from models.migrate import current, heads
from specpipe.cli.db import db
from specpipe.cli.token import token


@pytest.fixture
def runner(monkeypatch, db_url, tmp_path):
    monkeypatch.setenv("DATABASE_URL", db_url)
    monkeypatch.setenv("SPECPIPE_HOME", str(tmp_path))
    return CliRunner()


def test_token_create_list_revoke(runner, app, client):
    created = runner.invoke(token, ["create", "ci", "--user", "admin"])
    assert created.exit_code == 0, created.output
    plaintext = created.stdout.strip().splitlines()[0]
    assert plaintext.startswith("sp_") and len(plaintext) > 40
    headers = {"Authorization": f"Bearer {plaintext}"}
    assert client.get("/api/v1/jobs", headers=headers).status_code == 200

    listed = runner.invoke(token, ["list"])
    assert "ci\tactive" in listed.stdout and plaintext not in listed.stdout

    again = runner.invoke(token, ["create", "ci", "--user", "admin"])
    assert again.exit_code == 1 and "already exists" in again.output
    assert "Traceback" not in again.output

    assert runner.invoke(token, ["revoke", "ci"]).exit_code == 0
    assert "ci\trevoked" in runner.invoke(token, []).stdout
    assert client.get("/api/v1/jobs", headers=headers).status_code == 401

    missing = runner.invoke(token, ["revoke", "nobody"])
    assert missing.exit_code == 1 and "no token named 'nobody'" in missing.output


def test_token_name_checked(runner):
    result = runner.invoke(token, ["create", "   ", "--user", "admin"])
    assert result.exit_code == 2 and "must be 1 to 100 characters" in result.output


def test_db_upgrade_downgrade(monkeypatch, fresh_database_url):
    monkeypatch.setenv("DATABASE_URL", fresh_database_url)
    runner = CliRunner()
    result = runner.invoke(db, ["upgrade"])
    assert result.exit_code == 0, result.output
    assert current(fresh_database_url) == heads()[0]
    assert heads()[0] in runner.invoke(db, ["current"]).stdout
    result = runner.invoke(db, ["downgrade", "--revision", "base"])
    assert result.exit_code == 0 and current(fresh_database_url) is None


def test_db_upgrade_unreachable_is_one_line(monkeypatch):
    monkeypatch.setenv("DATABASE_URL", "postgresql://nobody@127.0.0.1:1/none")
    result = CliRunner().invoke(db, ["upgrade"])
    assert result.exit_code == 1 and result.output.startswith("Error: could not migrate")
    assert "Traceback" not in result.output


def test_secret_key_kept_in_instance_folder(monkeypatch, tmp_path):
    from specpipe import settings

    monkeypatch.delenv("SECRET_KEY", raising=False)
    monkeypatch.setenv("SPECPIPE_HOME", str(tmp_path))
    assert settings.secret_key() is None
    key = settings.ensure_secret_key()
    assert len(key) == 64 and settings.ensure_secret_key() == key
    assert (tmp_path / "secret_key").stat().st_mode & 0o777 == 0o600


def test_production_app_needs_secret_key(monkeypatch, tmp_path):
    from app import create_app

    monkeypatch.delenv("SECRET_KEY", raising=False)
    monkeypatch.setenv("SPECPIPE_HOME", str(tmp_path))
    with pytest.raises(RuntimeError, match="SECRET_KEY is not set"):
        create_app()
    monkeypatch.setenv("SECRET_KEY", "from-the-environment")
    assert create_app().config["SECRET_KEY"] == "from-the-environment"


def test_db_upgrade_creates_a_fresh_instance_folder(monkeypatch, tmp_path):
    monkeypatch.delenv("DATABASE_URL", raising=False)
    home = tmp_path / "not" / "there" / "yet"
    monkeypatch.setenv("SPECPIPE_HOME", str(home))
    result = CliRunner().invoke(db, ["upgrade"])
    assert result.exit_code == 0, result.output
    assert (home / "specpipe.sqlite3").is_file()


def test_a_fresh_store_is_readable_by_its_owner_only(tmp_path):
    """`specpipe db upgrade` in a fresh instance folder, then a process writing to the store:
    the folder is 0700, the database and its WAL files (while the writer holds them) 0600,
    whatever the umask allows (on main: 0644 in a 0755 folder)."""
    import json
    import os
    import subprocess
    import sys

    home = tmp_path / "instance"
    env = {**os.environ, "SPECPIPE_HOME": str(home)}
    env.pop("DATABASE_URL", None)
    upgrade = [sys.executable, "-m", "specpipe", "db", "upgrade"]
    subprocess.run(upgrade, env=env, check=True, capture_output=True, timeout=120)
    write = """
import json, os
from models.db import session_scope
from models.users import User
from specpipe.settings import database_url, instance_dir
with session_scope(database_url()) as session:
    session.add(User(name="someone"))
print(json.dumps({p.name: p.stat().st_mode & 0o777 for p in instance_dir().iterdir()}))
"""
    shown = subprocess.run(
        [sys.executable, "-c", write], env=env, check=True, capture_output=True, text=True
    )
    modes = json.loads(shown.stdout)
    assert {"specpipe.sqlite3", "specpipe.sqlite3-wal"} <= set(modes), modes
    assert set(modes.values()) == {0o600}, modes
    assert home.stat().st_mode & 0o777 == 0o700
