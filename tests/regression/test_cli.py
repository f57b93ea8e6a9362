"""`specpipe proof swarm|generation` and `specpipe regression run`: bad input, in-process runs."""

from __future__ import annotations

import json
import uuid

import pytest
import redis
from click.testing import CliRunner

import tests.regression.toy_target  # noqa: F401  (the `toy` target)
from specpipe.cli import cli
from specpipe.cli.proof import open_ring
from specpipe.swarm import inventory
from specpipe.swarm.redact import without_credentials

# No coordinator key pinned: the shared-key mode, opted into out loud.
NO_SWARM = {
    "SPECPIPE_SWARM_KEY": "k" * 32,
    "SPECPIPE_INSECURE_SHARED_KEY": "1",
    "SPECPIPE_MODEL": "toy",
    "REDIS_URL": None,
}


def invoke(*args: str, env: dict | None = None):
    return CliRunner().invoke(cli, list(args), env=env)


@pytest.mark.parametrize(
    "args",
    [
        ("proof", "swarm", "--stops", "0"),
        ("proof", "swarm", "--draws", "many"),
        ("proof", "swarm", "--temp", "0"),
        ("proof", "swarm", "--top-p", "1.5"),
        ("proof", "swarm", "--top-k", "-1"),
        ("proof", "swarm", "--draft-k", "0"),
        ("proof", "swarm", "--prompt", " "),
        ("proof", "swarm", "--local", "toy", "--redis", "redis://127.0.0.1:6379/0"),
        ("proof", "generation", "--prompt", ""),
        ("proof", "generation", "--seed", "-3"),
        ("proof", "generation", "--max-new-tokens", "0"),
        ("regression", "run", "--timeout", "0"),
    ],
)
def test_bad_options_are_usage_errors(args):
    result = invoke(*args, env=NO_SWARM)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert "Error:" in result.output.strip().splitlines()[-1]


@pytest.mark.parametrize("command", ["swarm", "generation"])
def test_no_swarm_reachable_is_one_clear_line(command):
    result = invoke("proof", command, "--redis", "redis://127.0.0.1:1/0", env=NO_SWARM)
    assert result.exit_code == 1
    assert result.output.startswith("Error: cannot read the inventory at redis://127.0.0.1:1/0")
    assert len(result.output.strip().splitlines()) == 1


def test_an_empty_inventory_names_the_missing_layers(redis_url_for_cli):
    result = invoke(
        "proof",
        "swarm",
        env={**NO_SWARM, "SPECPIPE_SWARM": "nobody-here", "REDIS_URL": redis_url_for_cli},
    )
    assert result.exit_code == 1
    assert (
        result.output == "Error: no complete ring in swarm 'nobody-here': "
        "no online stage serves layers 0:4\n"
    )


@pytest.mark.parametrize("lossy", [True, False])
def test_a_ring_with_a_stage_that_does_not_sample_exactly_is_a_warning_line(
    redis_url_for_cli, monkeypatch, capsys, lossy
):
    swarm = f"p{uuid.uuid4().hex[:10]}"
    monkeypatch.setenv("SPECPIPE_SWARM", swarm)
    monkeypatch.setenv("SPECPIPE_SWARM_KEY", "k" * 32)
    # No coordinator key pinned: the shared-key mode, opted into out loud.
    monkeypatch.setenv("SPECPIPE_INSECURE_SHARED_KEY", "1")
    monkeypatch.setenv("SPECPIPE_MODEL", "toy")
    monkeypatch.setenv("REDIS_URL", redis_url_for_cli)
    client = redis.Redis.from_url(redis_url_for_cli)
    for host, start, end in (("wa", 0, 2), ("nj", 2, 4)):
        node = inventory.NodeInfo(
            host,
            start,
            end,
            without_credentials(redis_url_for_cli),
            sampler="lossy" if lossy and host == "nj" else inventory.EXACT_SAMPLER,
        )
        inventory.publish(client, swarm, node, "k" * 32)
    try:
        ring, _target, where = open_ring(None, None, None)
        ring.close()
    finally:
        client.delete(*(inventory.node_key(swarm, host) for host in ("wa", "nj")))
        client.close()
    assert where == "wa → nj"
    err = capsys.readouterr().err
    if lossy:
        assert err.startswith("warning: not the exact sampler on nj ('lossy'): ")
        assert "NOT lossless" in err and len(err.splitlines()) == 1
    else:
        assert err == ""


def test_an_unknown_model_and_a_missing_key_are_one_line_each():
    result = invoke("proof", "swarm", "--model", "/no/such/model", env=NO_SWARM)
    assert result.exit_code == 1 and "cannot open model '/no/such/model'" in result.output
    result = invoke("proof", "generation", env={**NO_SWARM, "SPECPIPE_SWARM_KEY": None})
    assert result.exit_code == 1
    assert result.output == ("Error: the swarm is not configured: SPECPIPE_SWARM_KEY is not set\n")


def test_proof_swarm_runs_in_process_on_a_local_ring(tmp_path):
    out = tmp_path / "proof2.json"
    result = invoke(
        "proof",
        "swarm",
        "--local",
        "toy",
        "--stops",
        "2",
        "--draws",
        "100",
        "--json",
        str(out),
        "--no-store",
    )
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()  # the progress bar went to stderr
    assert lines[0] == "proof 2: speculative vs plain on the ring (local (toy))"
    assert "TV spec/plain" in lines[1] and "p-value" in lines[1]
    assert "same-seed draws          200/200 identical" in result.output
    assert lines[-2].startswith("verdict: PASS") and lines[-1] == f"wrote {out}"
    assert json.loads(out.read_text())["proof_2_on_swarm"]["stops"] == 2


def test_proof_generation_shows_identical_texts_side_by_side():
    result = invoke(
        "proof",
        "generation",
        "--local",
        "toy",
        "--max-new-tokens",
        "12",
        "--seed",
        "5",
        "--no-store",
    )
    assert result.exit_code == 0, result.output
    assert "[greedy_temp0]" in result.output and "[sampled_temp0.7_seed5]" in result.output
    assert result.output.count("texts identical") == 2
    assert result.output.strip().endswith("verdict: PASS")


def test_regression_run_without_redis_is_one_line():
    result = invoke(
        "regression", "run", "--timeout", "1", env={"REDIS_URL": "redis://127.0.0.1:1/0"}
    )
    assert result.exit_code == 1
    assert result.output.startswith("Error: cannot reach Redis at redis://127.0.0.1:1/0")


def test_proof_generation_on_the_default_model_uses_its_tokenizer():
    result = invoke(
        "proof",
        "generation",
        "--local",
        "default",
        "--max-new-tokens",
        "6",
        "--seed",
        "7",
        "--no-store",
    )
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(
        "proof 3: generation, speculative vs plain (local (SmolLM2-135M-Instruct))"
    )
    assert result.stdout.count("texts identical") == 2
    texts = [line for line in result.stdout.splitlines() if "speculative: " in line]
    assert all(any(c.isalpha() for c in t) for t in texts)  # real words from the tokenizer
