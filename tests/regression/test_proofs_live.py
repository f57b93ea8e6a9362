"""The proofs on real stage processes: the nightly with the tail's draft head, and the proof
commands on a live ring (the nightly's own runs are in `test_nightly.py`)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from sqlalchemy import select

import tests.regression.toy_target  # noqa: F401  (the `toy` target)
from models.db import make_session_factory
from models.runs import Run
from specpipe.cli import cli
from specpipe.settings import Settings, nightly_sizes
from tests.regression.conftest import SMALL_SIZES
from workers.regression import run_nightly


@pytest.mark.slow
def test_the_nightly_verifies_the_tails_draft_head_on_real_stage_processes(
    live_swarm, monkeypatch, tmp_path
):
    import torch

    from specpipe.decoding.target import open_target
    from specpipe.drafting.head import DraftHead
    from specpipe.transformer.resolve import model_label, open_checkpoint
    from tests.swarmprocs import write_tiny_model

    tiny = str(write_tiny_model(tmp_path / "tiny"))
    cfg = open_checkpoint(tiny).config
    torch.manual_seed(0)  # an untrained head: its drafts are verified all the same
    head_file = tmp_path / "head.safetensors"
    meta = {"model": model_label(tiny), "dim": cfg.dim, "vocab": cfg.vocab_size}
    DraftHead(cfg.dim, 32).save(head_file, meta)
    live_swarm.start_stages(model=tiny, draft_head=str(head_file))
    for name, value in SMALL_SIZES.items():
        monkeypatch.setenv(name, value)
    sizes = {**nightly_sizes(), "stops": 2, "draws": 80}
    # No coordinator key pinned: the shared-key mode, opted into out loud.
    swarm = Settings.from_env().for_swarm(
        live_swarm.redis_url, live_swarm.name, live_swarm.key, insecure_shared_key=True
    )
    with make_session_factory(live_swarm.db_url)() as session:
        run = run_nightly(session, open_target(tiny), swarm, sizes["seed"], sizes)
        on_swarm = run.proof("on_swarm")
        assert run.verdict == "pass", [(p.kind, p.verdict, p.summary) for p in run.proofs]
        assert (on_swarm.summary["sampler"], on_swarm.summary["drafter"]) == ("gumbel", "head")
        head = on_swarm.summary["head"]
        assert head["rounds"] == head["draws"] == 2 * 80 and head["tree_rounds"] > 0
        assert 4 * 2 * 80 <= head["drafted"] <= 7 * 2 * 80  # a chain of 4 and up to 3 siblings
        assert on_swarm.summary["draft_trees"] is True
        assert on_swarm.summary["exact_check"] == {"pairs": 160, "identical": 160}
        assert "sampler gumbel" in run.method and "head drafted for 160/160 draws" in run.method
        generation = run.generation_summary
        sampled = generation["sampled_temp0.7_seed7"]
        assert sampled["draft_head"] and sampled["sampler"] == "gumbel"
        assert sampled["drafts_from"] == "both"
        assert generation["greedy_temp0"]["head_rounds"] > 0


def test_the_swarm_proof_command_on_the_live_ring(live_swarm, tmp_path):
    live_swarm.start_stages()
    env = {k: v for k, v in live_swarm.env().items() if k.startswith(("SPECPIPE_", "REDIS_"))}
    env["DATABASE_URL"] = live_swarm.db_url
    argv = ["proof", "swarm", "--stops", "3", "--draws", "100"]
    argv += ["--prompt", "the cat sat on the mat", "--prompt", "tell me a story"]
    # One stop at a time: the numbers the stops measured at once (the default) must repeat.
    alone = CliRunner().invoke(
        cli,
        [*argv, "--in-flight", "1", "--no-store", "--json", str(tmp_path / "alone.json")],
        env=env,
    )
    assert alone.exit_code == 0, alone.output
    result = CliRunner().invoke(cli, [*argv, "--json", str(tmp_path / "at-once.json")], env=env)
    assert result.exit_code == 0, result.output
    at_once = json.loads((tmp_path / "at-once.json").read_text())
    assert at_once == json.loads((tmp_path / "alone.json").read_text())
    assert len(at_once["per_stop"]) == 3
    assert "TV spec/plain" in result.output and "wa-1 → nj-1" in result.output
    assert "same-seed draws          300/300 identical" in result.output
    *_, verdict, wrote, stored = result.output.strip().splitlines()
    assert verdict.startswith("verdict: PASS") and wrote.startswith("wrote ")
    # Kept in the store as the nightly's are: the ring it ran on, and why it passed.
    name = stored.split()[3]
    with make_session_factory(live_swarm.db_url)() as session:
        run = session.scalar(select(Run).where(Run.name == name))
        assert (run.kind, run.verdict, run.topology) == ("proof", "pass", "wa-1 → nj-1")
        assert [n.host for n in run.node_snapshots] == ["wa-1", "nj-1"]
        assert run.proof("on_swarm").summary["reasons"] == []


def test_the_generation_proof_on_a_live_ring_of_the_default_model(live_swarm):
    live_swarm.start_stages(model="default")
    env = {k: v for k, v in live_swarm.env().items() if k.startswith(("SPECPIPE_", "REDIS_"))}
    result = CliRunner().invoke(
        cli,
        [
            "proof",
            "generation",
            "--model",
            "default",
            "--max-new-tokens",
            "5",
            "--seed",
            "7",
            "--no-store",
        ],
        env=env,
    )
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("proof 3: generation, speculative vs plain (wa-1 → nj-1)")
    assert result.stdout.count("texts identical") == 2
    assert result.stdout.strip().endswith("verdict: PASS")
