"""`specpipe bench ring` and `bench exact` on a tiny checkpoint: real stage processes, a private
Redis, and the numbers they report."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from specpipe.bench import ring_hops as ringbench
from specpipe.bench import wan as wanbench
from specpipe.cli import cli
from specpipe.swarm import inventory
from tests.swarmprocs import write_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny")


def test_bench_exact_passes_on_real_stage_processes(tiny, tmp_path):
    out = tmp_path / "exact.json"
    result = CliRunner().invoke(
        cli,
        [
            "bench",
            "exact",
            "--model",
            str(tiny),
            "--stages",
            "2",
            "--pairs",
            "3",
            "--tokens",
            "12",
            "--json",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert doc["verdict"] == "PASS" and doc["pairs"] == 3
    assert doc["spec_vs_plain_mismatches"] == [] and doc["greedy_ring_vs_local_mismatches"] == []


def test_the_wan_bench_adds_the_delay_each_lab_host_adds_to_its_measured_link():
    hop = inventory.HopLatency("h0", "h1", forward_ms=2.0, handling_ms=0.5, link_ms=0.25)
    tail = inventory.HopLatency("h1", "coordinator", forward_ms=2.0, handling_ms=0.5, link_ms=0.5)
    latency = wanbench.with_link_delays(inventory.RingLatency([hop, tail]), {"h0": 11.0})
    assert [h.link_ms for h in latency.hops] == [11.25, 0.5]
    assert latency.ring_ms == pytest.approx(2.5 + 11.25 + 2.5 + 0.5)


@pytest.mark.slow
def test_bench_ring_reports_overhead_and_delays(tiny, tmp_path):
    out = tmp_path / "ring.json"
    args = [
        "bench",
        "ring",
        "--model",
        str(tiny),
        "--stages",
        "2",
        "--tokens",
        "10",
        "--hop-delay-ms",
        "0",
        "--hop-delay-ms",
        "20",
        "--repeats",
        "3",
        "--json",
        str(out),
    ]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert doc["overhead"]["same_tokens"] is True
    assert doc["overhead"]["hops_per_round"] == 3
    o = doc["overhead"]
    parts = o["split_per_hop_ms"] + o["slower_forwards_per_hop_ms"] + o["transport_per_hop_ms"]
    assert parts == pytest.approx(o["overhead_per_hop_ms"])
    assert o["rounds_paired"] == 3 * 9  # 10 tokens: a prefill round, then 9 decode rounds
    low, high = o["overhead_per_hop_ms_interval"]
    assert low <= o["overhead_per_hop_ms"] <= high
    assert len(o["ring_stage_forwards_ms_runs"]) == 3
    assert all(ms > 0 for ms in o["ring_stage_forwards_ms_runs"])  # the stages' own timings
    # The wire's cost per hop, with and without the sender's own signature, side by side.
    for rows in ("1_rows_us", "512_rows_us"):
        us = doc["wire"][rows]
        assert 0 < us["swarm key"] and us["signature"] == us["host identities"] - us["swarm key"]
    assert "with the sender's signature and its check" in result.output
    delayed = [row for row in doc["latency"] if row["hop_delay_ms"] == 20]
    assert {row["prompt"] for row in delayed} == {"grounded", "novel"}
    assert all(row["identical"] for row in doc["latency"])
    # Three delayed links per round: a plain round cannot beat 60 ms.
    assert all(row["plain_tok_s"] < 1000 / 60 for row in delayed)


def test_bench_with_a_missing_model_is_one_line():
    result = CliRunner().invoke(cli, ["bench", "exact", "--model", "/nonexistent/model"])
    assert result.exit_code == 1
    assert "Traceback" not in result.output and "nonexistent" in result.output


def test_the_median_interval_brackets_the_median_and_narrows_with_more_rounds():
    few, many = [5.0, 1.0, 3.0], [float(x) for x in range(400)]
    assert ringbench.median_interval(few) == (1.0, 5.0)
    low, high = ringbench.median_interval(many)
    assert low < 199.5 < high and high - low < 50  # about 2 x 1.96 x sqrt(400) / 2 ranks


def test_bench_load_runs_jobs_at_once_each_as_alone(tiny, tmp_path):
    out = tmp_path / "load.json"
    args = [
        "bench",
        "load",
        "--model",
        str(tiny),
        "--stages",
        "2",
        "--jobs",
        "1",
        "--jobs",
        "3",
        "--hop-delay-ms",
        "0",
        "--tokens",
        "12",
        "--json",
        str(out),
    ]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert [
        (r["jobs"], r["one_at_a_time"], r["failed"], r["identical_to_solo"]) for r in doc["runs"]
    ] == [(1, 3, [], True), (3, 0, [], True)]  # one at a time: the three jobs, one after another
    three = doc["runs"][1]
    assert three["aggregate_tok_s"] > 0 and three["done_s"]["p95"] >= three["done_s"]["p50"] > 0
    assert doc["runs"][0]["aggregate_vs_one"] == 1.0
    # One job alone: every forward is one round. Three at once: never more forwards than rounds.
    assert doc["runs"][0]["stage_batch_size"] == [1.0, 1.0]
    assert all(size >= 1.0 for size in three["stage_batch_size"])


def test_load_runs_are_checked_against_solo_runs(tiny, monkeypatch):
    from specpipe.bench import load as loadbench

    real = loadbench.solo_tokens

    def off_by_one(*args, **kwargs):  # a wrong reference: the check must notice
        return [tokens[:-1] + [tokens[-1] + 1] for tokens in real(*args, **kwargs)]

    monkeypatch.setattr(loadbench, "solo_tokens", off_by_one)
    args = [
        "bench",
        "load",
        "--model",
        str(tiny),
        "--stages",
        "2",
        "--jobs",
        "2",
        "--hop-delay-ms",
        "0",
        "--tokens",
        "8",
    ]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code != 0 and "differ from its solo run" in result.output


def test_bench_adaptive_k_compares_the_methods_side_by_side(tiny, tmp_path):
    out = tmp_path / "adaptive.json"
    args = [
        "bench",
        "adaptive-k",
        "--model",
        str(tiny),
        "--stages",
        "2",
        "--hop-delay-ms",
        "0",
        "--k",
        "2",
        "--max-k",
        "4",
        "--tokens",
        "12",
        "--repeats",
        "1",
        "--json",
        str(out),
    ]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert doc["identical_to_plain"] is True
    assert [(r["hop_delay_ms"], r["kind"]) for r in doc["runs"]] == [(0, "grounded"), (0, "novel")]
    for row in doc["runs"]:
        assert set(row["tok_s"]) == {"plain", "K=2", "adaptive<=4"}
        assert row["vs_plain"]["plain"] == 1.0 and row["tok_s"]["adaptive<=4"] > 0
        assert row["adaptive_vs_best_fixed"] == row["tok_s"]["adaptive<=4"] / row["tok_s"]["K=2"]


def test_bench_adaptive_k_fails_when_a_method_commits_other_tokens(tiny, monkeypatch):
    from specpipe.bench import load as loadbench

    real = loadbench.run_job

    def wrong_when_adaptive(*args, **kwargs):  # a broken method: the check must notice
        timing = real(*args, **kwargs)
        if args[5] is True:  # adaptive
            timing.tokens = [*timing.tokens[:-1], timing.tokens[-1] + 1]
        return timing

    monkeypatch.setattr(loadbench, "run_job", wrong_when_adaptive)
    args = [
        "bench",
        "adaptive-k",
        "--model",
        str(tiny),
        "--stages",
        "2",
        "--hop-delay-ms",
        "0",
        "--k",
        "2",
        "--max-k",
        "4",
        "--tokens",
        "8",
        "--repeats",
        "1",
    ]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code != 0 and "differ from plain decoding's" in result.output


def test_bench_trees_compares_chains_and_trees_on_real_stages(tiny, tmp_path, monkeypatch):
    import torch

    from specpipe.drafting.head import DraftHead
    from specpipe.transformer.resolve import model_label, open_checkpoint

    cfg = open_checkpoint(tiny).config
    torch.manual_seed(0)  # an untrained head: its trees are verified all the same
    head = tmp_path / "head.safetensors"
    meta = {"model": model_label(str(tiny)), "dim": cfg.dim, "vocab": cfg.vocab_size}
    DraftHead(cfg.dim, 32).save(head, meta)
    out = tmp_path / "trees.json"
    args = ["bench", "trees", "--model", str(tiny), "--head", str(head), "--stages", "2"]
    args += ["--hop-delay-ms", "0", "--tokens", "16", "--seeds", "1", "--at-once", "2"]
    result = CliRunner().invoke(cli, [*args, "--fixed-tree", "12", "--json", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert doc["identical_to_plain"] is True
    assert [(r["mode"], r["kind"]) for r in doc["runs"]] == [
        (mode, kind) for mode in ("greedy", "temp 0.7 top_p 0.95") for kind in ("grounded", "novel")
    ]
    # Trees of 12 drafts whatever they cost: the head's rounds carry 13 rows.
    assert max(r["methods"]["tree-12"]["rows_per_round"] for r in doc["runs"]) > 6
    for row in doc["runs"]:
        assert set(row["methods"]) == {"plain", "chain", "tree", "tree-12"}
        tree = row["methods"]["tree"]
        assert tree["rows_per_round"] >= 1 and 0 <= tree["tree_round_share"] <= 1
        assert row["tree_vs_chain"] == tree["tok_s"] / row["methods"]["chain"]["tok_s"]
        assert row["methods"]["chain"]["tree_round_share"] == 0
    (together,) = doc["at_once"]
    assert together["jobs"] == 2 and together["identical_to_plain"] is True

    from specpipe.bench import load as loadbench

    real = loadbench.run_job

    def wrong_with_trees(*args, **kwargs):  # a broken method: the check must notice
        timing = real(*args, **kwargs)
        if args[7] if len(args) > 7 else kwargs.get("trees"):
            timing.tokens = [*timing.tokens[:-1], timing.tokens[-1] + 1]
        return timing

    monkeypatch.setattr(loadbench, "run_job", wrong_with_trees)
    monkeypatch.setattr("specpipe.bench.draft_trees.run_job", wrong_with_trees)
    result = CliRunner().invoke(cli, [*args, "--at-once", "0"])
    assert result.exit_code != 0 and "differ from plain decoding's" in result.output


def test_bench_conversation_reuses_each_turns_cache_with_the_same_tokens(tiny, tmp_path):
    out = tmp_path / "conversation.json"
    args = ["bench", "conversation", "--model", str(tiny), "--stages", "2", "--hop-delay-ms", "0"]
    args += ["--turns", "3", "--context-tokens", "48", "--tokens", "8", "--json", str(out)]
    # A tiny model prefills in no time, so reuse saves it nothing: its time is not checked here.
    result = CliRunner().invoke(cli, [*args, "--target-ratio", "1000"])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    (run,) = doc["runs"]
    turns = run["turns"]
    assert [row["turn"] for row in turns] == [1, 2, 3]
    assert turns[0]["context_tokens"] >= 48 and turns[0]["reused"] == 0
    assert all(row["identical"] for row in turns) and doc["identical"]
    # Each later turn starts from the last one's cache: its whole context, to a 16-token block.
    for before, row in zip(turns, turns[1:], strict=False):
        assert before["context_tokens"] - 16 < row["reused"] < row["context_tokens"]
        assert row["warm_replays"] == 0
    assert doc["reused_every_later_turn"] and doc["verdict"] == "PASS"
    rows = [line for line in result.output.splitlines() if line.lstrip()[:2] in ("1 ", "2 ", "3 ")]
    assert len(rows) == 3 and all(line.endswith("yes") for line in rows)
    assert "(target <= 1000): met" in result.output and "verdict PASS" in result.output
