"""`specpipe ca init` makes the operator's CA once; `specpipe ca issue` writes a host's folder,
ready to copy, and refuses bad input in one line, writing nothing."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from specpipe.cli import cli
from specpipe.ops import certificates


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPIPE_HOME", str(tmp_path / "instance"))
    return tmp_path / "instance"


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args))


def test_ca_init_makes_the_ca_once_and_refuses_a_second_time(home):
    first = invoke("ca", "init")
    assert first.exit_code == 0, first.output
    assert f"swarm CA in {home / 'ca'}" in first.output
    authority = certificates.Authority.in_dir(home / "ca")
    made = authority.cert.read_bytes()
    assert authority.key.stat().st_mode & 0o777 == 0o600
    assert home.stat().st_mode & 0o777 == 0o700  # the instance folder, made here, too
    again = invoke("ca", "init")
    assert again.exit_code == 1
    assert again.output.strip() == (
        f"Error: a CA is already in {home / 'ca'}: pass --force to replace it (every "
        "certificate it issued stops verifying)"
    )
    assert authority.cert.read_bytes() == made  # untouched
    forced = invoke("ca", "init", "--force")
    assert forced.exit_code == 0, forced.output
    assert authority.cert.read_bytes() != made


def test_ca_issue_writes_a_host_folder_to_copy_to_that_host(home, tmp_path):
    assert invoke("ca", "init", "--dir", str(tmp_path / "offline")).exit_code == 0
    out = tmp_path / "mn-tls"
    result = invoke(
        "ca",
        "issue",
        "--address",
        "203.0.113.20",
        "--address",
        "mn.example.org",
        "--name",
        "mn",
        "--out",
        str(out),
        "--dir",
        str(tmp_path / "offline"),
    )
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"mn: redis.pem, redis.key and ca.pem in {out}, valid until")
    files = certificates.host_files(out)
    assert sorted(p.name for p in out.iterdir()) == ["ca.pem", "redis.key", "redis.pem"]
    assert files.key.stat().st_mode & 0o777 == 0o600
    certificates.check_host_files(files, "203.0.113.20")
    certificates.check_host_files(files, "mn.example.org")
    assert files.ca.read_bytes() == (tmp_path / "offline" / "ca.pem").read_bytes()
    # By default the folder is the instance folder's issued/NAME, the CA its ca/.
    assert invoke("ca", "init").exit_code == 0
    assert invoke("ca", "issue", "--address", "10.0.0.3").exit_code == 0
    certificates.check_host_files(certificates.host_files(home / "issued" / "10.0.0.3"), "10.0.0.3")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--address", "300.1.2.3"],
            "--address '300.1.2.3' is neither an IP address nor a DNS name",
        ),
        (
            ["--address", "10.0.0.1", "--address", "redis://10.0.0.1:6379"],
            "--address 'redis://10.0.0.1:6379' is neither an IP address nor a DNS name",
        ),
        (
            ["--address", "10.0.0.1", "--name", "../elsewhere"],
            "--name '../elsewhere': a host's name is letters, digits and . _ : - (at most 63)",
        ),
    ],
    ids=["bad-ip", "a-url", "bad-name"],
)
def test_bad_input_to_ca_issue_is_one_line_and_writes_nothing(home, tmp_path, args, message):
    assert invoke("ca", "init").exit_code == 0
    before = sorted(home.rglob("*"))
    result = invoke("ca", "issue", *args, "--out", str(tmp_path / "out"))
    assert result.exit_code == 1
    assert result.output.strip() == f"Error: {message}"
    assert not (tmp_path / "out").exists() and sorted(home.rglob("*")) == before


def test_ca_issue_without_a_ca_or_over_a_hosts_files_is_one_line(home, tmp_path):
    result = invoke("ca", "issue", "--address", "10.0.0.1", "--out", str(tmp_path / "out"))
    assert result.exit_code == 1
    assert result.output.strip() == (
        f"Error: no certificate at {home / 'ca' / 'ca.pem'} (`specpipe ca init` makes one)"
    )
    assert not (tmp_path / "out").exists()
    assert invoke("ca", "init").exit_code == 0
    assert (
        invoke("ca", "issue", "--address", "10.0.0.1", "--out", str(tmp_path / "out")).exit_code
        == 0
    )
    kept = (tmp_path / "out" / "redis.pem").read_bytes()
    again = invoke("ca", "issue", "--address", "10.0.0.2", "--out", str(tmp_path / "out"))
    assert again.exit_code == 1
    assert again.output.strip() == (
        f"Error: {tmp_path / 'out'} already holds a host's TLS files: pass --force to replace them"
    )
    assert (tmp_path / "out" / "redis.pem").read_bytes() == kept
