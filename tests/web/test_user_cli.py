"""`specpipe user` and `specpipe token create --user`, through click's CliRunner on a real
database, and the first password `specpipe web` gives the built-in admin."""

from __future__ import annotations

from datetime import timedelta

import pytest
from click.testing import CliRunner
from sqlalchemy import func, select

from models.db import as_utc, utcnow
from models.tokens import ApiToken
from models.users import authenticate, find_user
from specpipe.cli import cli
from tests.factories import gen_job
from tests.web.conftest import Api, log_in

PASSWORD = "a long enough secret"


@pytest.fixture
def runner(monkeypatch, db_url, tmp_path):
    monkeypatch.setenv("DATABASE_URL", db_url)
    monkeypatch.setenv("SPECPIPE_HOME", str(tmp_path))
    return CliRunner()


def test_create_list_passwd_delete(runner, session, anon):
    created = runner.invoke(cli, ["user", "create", "alice"], input=PASSWORD + "\n")
    assert created.exit_code == 0, created.output
    assert "created alice" in created.output and PASSWORD not in created.output
    assert authenticate(session, "alice", PASSWORD) is not None
    assert log_in(anon, "alice", PASSWORD).status_code == 302

    admin = runner.invoke(cli, ["user", "create", "root", "--admin"], input=PASSWORD + "\r\n")
    assert admin.exit_code == 0 and "created admin root" in admin.output
    session.expire_all()
    assert find_user(session, "root").is_admin and authenticate(session, "root", PASSWORD)

    listed = runner.invoke(cli, ["user"]).output.splitlines()
    assert [line.split("\t")[:2] for line in listed] == [["alice", "user"], ["root", "admin"]]

    new = "a different long secret"
    changed = runner.invoke(cli, ["user", "passwd", "alice"], input=new + "\n")
    assert changed.exit_code == 0 and "password set for alice" in changed.output
    session.expire_all()
    assert authenticate(session, "alice", new) and not authenticate(session, "alice", PASSWORD)
    assert anon.get("/history").status_code == 302  # the old session ended

    gen_job(session, owner=find_user(session, "alice"))
    deleted = runner.invoke(cli, ["user", "delete", "alice"])
    assert deleted.exit_code == 0 and "1 job now belong to admin" in deleted.output
    session.expire_all()
    assert find_user(session, "alice") is None


@pytest.mark.parametrize(
    ("args", "stdin", "message"),
    [
        (["create", "bad name"], PASSWORD, "must be 1 to 100 characters"),
        (["create", "-x"], PASSWORD, "No such option"),
        (["create"], PASSWORD, "Missing argument 'NAME'"),
        (["create", "x" * 101], PASSWORD, "must be 1 to 100 characters"),
        (["create", "carol"], "short", "the password must be 8 to 1024 characters"),
        (["create", "carol"], "", "no password on standard input"),
        (["create", "dave"], "x" * 1025, "the password must be 8 to 1024 characters"),
        (["passwd", "nobody"], PASSWORD, "no user named 'nobody'"),
        (["delete", "nobody"], "", "no user named 'nobody'"),
        (["delete", "admin"], "", "'admin' is built in"),
        (["disable"], "", "Missing argument 'NAME'"),
        (["disable", "nobody"], "", "no user named 'nobody'"),
        (["disable", "bad name"], "", "no user named 'bad name'"),
        (["enable", "nobody"], "", "no user named 'nobody'"),
        (["disable", "admin"], "", "'admin' is the last enabled admin"),
        (["enable", "admin"], "", "'admin' is not disabled"),
    ],
)
def test_bad_input_is_one_line(runner, session, admin, args, stdin, message):
    result = runner.invoke(cli, ["user", *args], input=stdin + "\n" if stdin else "")
    assert result.exit_code in (1, 2) and message in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert "Traceback" not in result.output and len(errors) == 1 and message in errors[0]
    session.expire_all()
    assert find_user(session, "carol") is None and find_user(session, "dave") is None


def test_existing_name_refused(runner, session):
    assert runner.invoke(cli, ["user", "create", "alice"], input=PASSWORD + "\n").exit_code == 0
    again = runner.invoke(cli, ["user", "create", "alice"], input=PASSWORD + "\n")
    assert again.exit_code == 1 and "a user named 'alice' already exists" in again.output


def test_prompts_twice_at_a_terminal(runner, session, monkeypatch):
    import sys

    answers = iter([PASSWORD, PASSWORD, PASSWORD, "not the same"])
    monkeypatch.setattr("getpass.getpass", lambda prompt="": next(answers))
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True, raising=False)
    from specpipe.cli.user import read_password

    assert read_password() == PASSWORD
    with pytest.raises(Exception, match="the two passwords differ"):
        read_password()


def test_token_for_a_user(runner, session, client):
    runner.invoke(cli, ["user", "create", "alice"], input=PASSWORD + "\n")
    created = runner.invoke(cli, ["token", "create", "alice-ci", "--user", "alice"])
    assert created.exit_code == 0, created.output
    api = Api(client, created.stdout.strip().splitlines()[0])
    assert api.post("/jobs", json={"prompt": "hi"}).get_json()["owner"] == "alice"
    assert "alice-ci\tactive\talice" in runner.invoke(cli, ["token", "list"]).stdout

    missing = runner.invoke(cli, ["token", "create", "x", "--user", "nobody"])
    assert missing.exit_code == 1 and "no user named 'nobody'" in missing.output


def test_a_token_must_name_its_user(runner, session):
    plain = runner.invoke(cli, ["token", "create", "old-script"])
    assert plain.exit_code == 2 and "Missing option '--user'" in plain.output
    assert "Traceback" not in plain.output
    assert session.scalar(select(func.count()).select_from(ApiToken)) == 0


def test_a_token_that_expires(runner, session, client):
    runner.invoke(cli, ["user", "create", "alice"], input=PASSWORD + "\n")
    made = runner.invoke(cli, ["token", "create", "ci", "--user", "alice", "--expires", "12h"])
    assert made.exit_code == 0, made.output
    api = Api(client, made.stdout.strip().splitlines()[0])
    assert api.get("/jobs").status_code == 200
    row = session.scalar(select(ApiToken).where(ApiToken.name == "ci"))
    left = as_utc(row.expires_at) - utcnow()
    assert timedelta(hours=11, minutes=59) < left <= timedelta(hours=12)
    when = f"{as_utc(row.expires_at):%Y-%m-%d %H:%M} UTC"
    assert runner.invoke(cli, ["token", "list"]).stdout.split("\t")[1] == "active"
    assert f"\texpires {when}" in runner.invoke(cli, ["token", "list"]).stdout

    row.expires_at = utcnow() - timedelta(seconds=1)  # its lifetime ran out
    session.commit()
    assert api.get("/jobs").status_code == 401
    listed = runner.invoke(cli, ["token", "list"]).stdout
    assert listed.startswith("ci\texpired\talice") and "\texpired " in listed


@pytest.mark.parametrize("age", ["30", "30x", "0d", "-1d", "1.5h", "d", "30 days", "3651d"])
def test_a_bad_expiry_is_refused(runner, session, admin, age):
    made = runner.invoke(cli, ["token", "create", "ci", "--user", "admin", "--expires", age])
    assert made.exit_code == 2 and "Invalid value for '--expires'" in made.output
    assert "Traceback" not in made.output
    assert session.scalar(select(func.count()).select_from(ApiToken)) == 0


def test_a_new_password_revokes_the_users_tokens(runner, session, client):
    for name in ("alice", "bob"):
        runner.invoke(cli, ["user", "create", name], input=PASSWORD + "\n")
    made = {
        name: runner.invoke(cli, ["token", "create", f"{name}-ci", "--user", name]).stdout
        for name in ("alice", "bob")
    }
    apis = {name: Api(client, out.strip().splitlines()[0]) for name, out in made.items()}
    assert all(api.get("/jobs").status_code == 200 for api in apis.values())

    bad = runner.invoke(cli, ["user", "passwd", "alice"], input="short\n")
    assert bad.exit_code == 1 and apis["alice"].get("/jobs").status_code == 200  # no change

    changed = runner.invoke(cli, ["user", "passwd", "alice"], input="another long secret\n")
    assert changed.exit_code == 0 and "1 API token revoked" in changed.output
    assert apis["alice"].get("/jobs").status_code == 401
    assert apis["bob"].get("/jobs").status_code == 200  # another user's are left alone
    assert "alice-ci\trevoked\talice" in runner.invoke(cli, ["token", "list"]).stdout


def test_disable_then_enable(runner, session, app, anon, client):
    runner.invoke(cli, ["user", "create", "alice"], input=PASSWORD + "\n")
    made = runner.invoke(cli, ["token", "create", "alice-ci", "--user", "alice"])
    api = Api(client, made.stdout.strip().splitlines()[0])
    assert api.get("/jobs").status_code == 200
    assert log_in(anon, "alice", PASSWORD).status_code == 302
    assert anon.get("/history").status_code == 200
    idle = app.test_client()  # logged in before the disable, and quiet until after the enable
    assert log_in(idle, "alice", PASSWORD).status_code == 302

    disabled = runner.invoke(cli, ["user", "disable", "alice"])
    assert disabled.exit_code == 0, disabled.output
    assert "disabled alice; 1 API token revoked (enabling does not restore them)" in disabled.output
    assert anon.get("/history").status_code == 302  # the open session ended
    assert api.get("/jobs").status_code == 401
    refused = log_in(app.test_client(), "alice", PASSWORD)
    assert refused.status_code == 400  # as for a wrong password: nothing says it exists
    assert "Wrong user name or password." in refused.get_data(as_text=True)
    session.expire_all()
    since = f"{as_utc(find_user(session, 'alice').disabled_at):%Y-%m-%d}"
    listed = runner.invoke(cli, ["user", "list"]).stdout
    assert f"alice\tuser\tdisabled {since}\tcreated " in listed

    enabled = runner.invoke(cli, ["user", "enable", "alice"])
    assert enabled.exit_code == 0 and "enabled alice" in enabled.output
    assert "revoked API tokens stay revoked" in enabled.output
    assert api.get("/jobs").status_code == 401  # tokens stay revoked
    assert "alice-ci\trevoked\talice" in runner.invoke(cli, ["token", "list"]).stdout
    assert idle.get("/history").status_code == 302  # its session ended with the disable
    assert log_in(anon, "alice", PASSWORD).status_code == 302
    assert anon.get("/history").status_code == 200
    assert "alice\tuser\tenabled\tcreated " in runner.invoke(cli, ["user", "list"]).stdout


def test_disabling_twice_or_the_last_admin_changes_nothing(runner, session, admin):
    runner.invoke(cli, ["user", "create", "alice"], input=PASSWORD + "\n")
    assert runner.invoke(cli, ["user", "disable", "alice"]).exit_code == 0
    session.expire_all()
    first = find_user(session, "alice").disabled_at
    again = runner.invoke(cli, ["user", "disable", "alice"])
    assert again.exit_code == 1 and "Error: 'alice' is already disabled" in again.output
    last = runner.invoke(cli, ["user", "disable", "admin"])
    assert last.exit_code == 1 and "'admin' is the last enabled admin" in last.output
    session.expire_all()
    assert find_user(session, "alice").disabled_at == first and first is not None
    assert not find_user(session, "admin").disabled

    runner.invoke(cli, ["user", "create", "root", "--admin"], input=PASSWORD + "\n")
    other = runner.invoke(cli, ["user", "disable", "admin"])  # root is an enabled admin
    assert other.exit_code == 0 and "disabled admin; 0 API tokens revoked" in other.output
    session.expire_all()
    assert find_user(session, "admin").disabled and not find_user(session, "root").disabled


def test_first_password_for_a_fresh_install(runner, session, tmp_path):
    from specpipe.cli.web import first_login

    first_login()
    path = tmp_path / "admin_password"
    assert path.stat().st_mode & 0o777 == 0o600
    password = path.read_text().strip()
    assert len(password) >= 20 and authenticate(session, "admin", password) is not None
    first_login()  # someone can log in now: nothing changes
    assert path.read_text().strip() == password
    result = runner.invoke(cli, ["user", "passwd", "admin"], input=PASSWORD + "\n")
    assert result.exit_code == 0 and not path.exists()  # the generated one is gone
