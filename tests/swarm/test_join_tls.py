"""`specpipe join` starts its Redis with TLS from this host's TLS folder, refuses in one line
without one (saying how to make it), and serves in clear only when told to, out loud; the
operator's own `--redis` is used as given, with a warning when it is in clear."""

from __future__ import annotations

import importlib
import logging

import pytest
import redis
from click.testing import CliRunner
from redis.backoff import NoBackoff
from redis.retry import Retry

from specpipe.cli import cli
from specpipe.ops import certificates
from specpipe.ops.redis_server import free_port
from specpipe.swarm import trust

DEAD = f"redis://127.0.0.1:{free_port()}/0"
REFUSAL = (
    "Error: no TLS files for this host's Redis in {folder} (missing {missing}): make them "
    "where the swarm's CA is with `specpipe ca issue --address ADDRESS` and copy that folder "
    "here (or pass --tls-dir), or pass --insecure-no-tls to serve in clear"
)


@pytest.fixture
def joining(tmp_path, monkeypatch):
    """A host about to join: a swarm key and a registry (not reachable), nothing else."""
    monkeypatch.setenv("SPECPIPE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SPECPIPE_SWARM_KEY", "k" * 32)
    monkeypatch.setenv("SPECPIPE_REGISTRY_URL", DEAD)
    # Host identities are not what these tests are about: the host pins no coordinator key.
    monkeypatch.setenv("SPECPIPE_INSECURE_SHARED_KEY", "1")
    for name in ("REDIS_URL", "SPECPIPE_TLS_DIR", "SPECPIPE_REDIS_PASSWORD"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_join_without_tls_files_refuses_in_one_line_and_makes_nothing(joining, tmp_path):
    result = CliRunner().invoke(cli, ["join", "--layers", "0:4"])
    assert result.exit_code == 1
    folder = tmp_path / "home" / "tls"
    assert result.output.strip() == REFUSAL.format(
        folder=folder, missing="redis.pem, redis.key, ca.pem"
    )
    assert not (tmp_path / "home").exists()  # no password, no Redis folder
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "ca.pem").write_text("a CA\n")
    result = CliRunner().invoke(cli, ["join", "--tls-dir", str(tmp_path / "half")])
    assert result.exit_code == 1
    assert result.output.strip() == REFUSAL.format(
        folder=tmp_path / "half", missing="redis.pem, redis.key"
    )


def test_the_opt_out_and_the_operators_own_redis_need_no_tls_files(joining):
    for extra in (["--insecure-no-tls"], ["--redis", "redis://198.51.100.1:6379/0"]):
        result = CliRunner().invoke(cli, ["join", "--layers", "0:4", *extra])
        assert result.exit_code == 1
        assert result.output.startswith(f"Error: cannot reach the registry at {DEAD}")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.swarmprocs import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny")


@pytest.fixture
def registered(joining, redis_url, swarm):
    joining.setenv("SPECPIPE_SWARM", swarm)
    joining.setenv("SPECPIPE_REGISTRY_URL", redis_url)
    return joining


def issue_for(tmp_path, *addresses: str):
    authority = certificates.make_ca(tmp_path / "operator" / "ca")
    return certificates.issue(authority, list(addresses), tmp_path / "home" / "tls")


def test_a_certificate_that_does_not_name_this_hosts_address_is_refused(registered, tiny, tmp_path):
    issue_for(tmp_path, "10.9.9.9")
    argv = ["join", "--model", str(tiny), "--layers", "0:4", "--address", "127.0.0.1"]
    result = CliRunner().invoke(cli, argv)
    assert result.exit_code == 1
    [line] = result.output.strip().splitlines()
    assert line.startswith(f"Error: {tmp_path / 'home' / 'tls' / 'redis.pem'} does not verify")
    assert line.endswith("issue this host's with `specpipe ca issue --address 127.0.0.1`")


def serving_records(monkeypatch) -> dict:
    """Stand in for the stage: note the URL of this host's Redis, and what it answers."""
    join_cli = importlib.import_module("specpipe.cli.join")  # the module, not the command
    seen: dict = {}

    def serving(host, layers, model_name, *, redis_url, config, **options):
        seen["url"], seen["ca"] = redis_url, config.tls_ca
        if "//specpipe:" in redis_url and "@127.0.0.1:" in redis_url:  # the one join started
            client = redis.Redis.from_url(redis_url, retry=Retry(NoBackoff(), 0))
            seen["answers"] = client.ping()
            client.close()

    monkeypatch.setattr(join_cli, "serve_stage", serving)
    return seen


def test_join_starts_its_redis_with_tls_from_the_hosts_tls_folder(registered, tiny, tmp_path):
    files = issue_for(tmp_path, "127.0.0.1")
    seen = serving_records(registered)
    port = free_port()
    argv = ["join", "--model", str(tiny), "--layers", "0:4", "--address", "127.0.0.1"]
    result = CliRunner().invoke(cli, [*argv, "--port", str(port)])
    assert result.exit_code == 0, result.output
    assert seen["url"].startswith("rediss://specpipe:")
    assert seen["url"].endswith(f"@127.0.0.1:{port}/0?ssl_ca_certs={files.ca}")
    assert seen["answers"] and seen["ca"] == str(files.ca)  # it verifies the others with it too
    plain = redis.Redis(port=port, retry=Retry(NoBackoff(), 0), socket_connect_timeout=2)
    with pytest.raises(redis.ConnectionError):  # TLS only: plain text is not spoken
        plain.ping()
    plain.close()


def link_warnings(caplog) -> list[str]:
    """What `join` warned of about its links (not the opt-out's warning, which is another
    logger's: this test's host pins no coordinator key)."""
    return [r.getMessage() for r in caplog.records if r.name == "specpipe.join"]


def test_the_opt_out_and_a_plain_redis_elsewhere_warn_at_start(registered, tiny, caplog):
    seen = serving_records(registered)
    argv = ["join", "--model", str(tiny), "--layers", "0:4", "--address", "127.0.0.1"]
    caplog.set_level(logging.WARNING, logger="specpipe.join")
    port = free_port()
    result = CliRunner().invoke(cli, [*argv, "--port", str(port), "--insecure-no-tls"])
    assert result.exit_code == 0, result.output
    assert seen["url"].startswith("redis://specpipe:") and seen["answers"]
    [warning] = link_warnings(caplog)
    assert warning.startswith(f"--insecure-no-tls: this host's Redis on 127.0.0.1:{port} speaks")
    assert "links to this host are in clear" in warning
    caplog.clear()
    theirs = "redis://specpipe:their-secret@198.51.100.1:6379/0"
    result = CliRunner().invoke(cli, [*argv, "--redis", theirs])
    assert result.exit_code == 0, result.output
    assert seen["url"] == theirs  # used as given
    [warning] = link_warnings(caplog)
    assert warning == (
        "this host's Redis redis://specpipe:***@198.51.100.1:6379/0 is not TLS (rediss://): "
        "links to this host are in clear"
    )
    caplog.clear()
    for quiet in ("redis://127.0.0.1:6379/0", "rediss://198.51.100.1:6379/0"):
        result = CliRunner().invoke(cli, [*argv, "--redis", quiet])
        assert result.exit_code == 0, result.output
    assert not link_warnings(caplog)


def test_a_host_that_pins_no_coordinator_key_is_refused_unless_it_opts_out(
    joining, tmp_path, caplog, monkeypatch
):
    joining.delenv("SPECPIPE_INSECURE_SHARED_KEY")
    result = CliRunner().invoke(cli, ["join", "--layers", "0:4", "--insecure-no-tls"])
    assert result.exit_code == 1
    folder, home = tmp_path / "home" / "tls", tmp_path / "home"
    assert result.output.strip().splitlines() == [
        f"Error: this host pins no coordinator key: copy host 0's coordinator.pub into {folder} "
        f"or {home} (`specpipe host init` on host 0 makes it), or set "
        "SPECPIPE_INSECURE_SHARED_KEY=1 to trust every holder of the swarm key alike"
    ]
    assert not home.exists()  # no host key, no password
    # The flag is the same opt-out as the variable: past the check (to the dead registry),
    # with the warning of what it means.
    monkeypatch.setattr(trust, "_warned", False)  # a warning once per process: this test's
    argv = ["join", "--layers", "0:4", "--insecure-no-tls", "--insecure-shared-key"]
    with caplog.at_level(logging.WARNING):
        result = CliRunner().invoke(cli, argv)
    assert result.exit_code == 1 and "cannot reach the registry" in result.output
    [warning] = [r.getMessage() for r in caplog.records if r.name == "specpipe.trust"]
    assert warning.startswith("this host pins no coordinator key (SPECPIPE_INSECURE_SHARED_KEY=1)")
    assert "can speak here as the coordinator or as any host" in warning
