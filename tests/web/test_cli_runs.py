"""`specpipe runs list|show|export` on a real database."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from specpipe.cli import cli
from tests.factories import gen_proof_run, gen_ring


@pytest.fixture
def runner(monkeypatch, db_url, tmp_path):
    monkeypatch.setenv("DATABASE_URL", db_url)
    monkeypatch.setenv("SPECPIPE_HOME", str(tmp_path))
    return CliRunner()


@pytest.fixture
def stored(db_session):
    gen_ring(db_session)
    passed = gen_proof_run(db_session, kind="nightly", passed=True)
    failed = gen_proof_run(db_session, kind="proof", passed=False)
    db_session.commit()
    return passed, failed


def test_list_shows_newest_first_and_filters(runner, stored):
    passed, failed = stored
    result = runner.invoke(cli, ["runs", "list", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert [r["run_id"] for r in rows][:2] == [failed.name, passed.name]
    nightly = json.loads(runner.invoke(cli, ["runs", "list", "--kind", "nightly", "--json"]).stdout)
    assert [r["run_id"] for r in nightly] == [passed.name]
    table = runner.invoke(cli, ["runs"]).stdout
    assert passed.name in table and "\tfail\t" in table


def test_export_matches_the_web_download(runner, stored, app, client):
    passed, _ = stored
    result = runner.invoke(cli, ["runs", "export", passed.name])
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert record["run_id"] == passed.name
    assert len(record["nodes"]) == 4
    web = client.get(f"/runs/{passed.id}/record.json")
    assert web.status_code == 200
    assert json.loads(web.data) == record
    by_id = json.loads(runner.invoke(cli, ["runs", "export", str(passed.id)]).stdout)
    assert by_id == record


def test_export_to_a_file_and_show(runner, stored, tmp_path):
    _, failed = stored
    out = tmp_path / "record.json"
    assert runner.invoke(cli, ["runs", "export", failed.name, "-o", str(out)]).exit_code == 0
    assert json.loads(out.read_text())["proof_1_local_math"]["verdict"]
    shown = runner.invoke(cli, ["runs", "show", failed.name])
    assert shown.exit_code == 0
    assert f"run {failed.name}" in shown.stdout and "proof 1" in shown.stdout
    assert "node      stage0" in shown.stdout


@pytest.mark.parametrize("command", ["show", "export"])
def test_unknown_run_is_one_line(runner, stored, command):
    result = runner.invoke(cli, ["runs", command, "no-such-run"])
    assert result.exit_code == 1
    assert "no run 'no-such-run'" in result.output and "Traceback" not in result.output
