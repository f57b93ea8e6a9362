"""A nightly that cannot reach its ring or open its model is stored as a run that did not pass."""

from __future__ import annotations

from models.records import record_of
from specpipe.settings import Settings, nightly_sizes
from tests.regression.toy_target import toy_target
from workers.regression import run_nightly

SIZES = {**nightly_sizes(), "local_draws": 40_000, "sampler_trials": 400}


def nobody(redis_url: str) -> Settings:
    """A swarm with no stage at all."""
    # No coordinator key pinned: the shared-key mode, opted into out loud.
    return Settings.from_env().for_swarm(redis_url, "nobody", "k", insecure_shared_key=True)


def test_no_online_stage_is_an_error_run_naming_the_layers(db_session, private_redis):
    run = run_nightly(db_session, toy_target(), nobody(private_redis), 7, SIZES)
    assert run.verdict == "error"
    assert run.proof("local_math").verdict == "pass"
    for kind in ("on_swarm", "generation"):
        proof = run.proof(kind)
        assert proof.verdict == "error"
        assert proof.summary["error"] == "RouteError: no online stage serves layers 0:4"
    record = record_of(run)
    assert record["proof_1_local_math"]["verdict"] == "PASS"
    assert record["proof_2_on_swarm"]["verdict"] == "error"
    assert record["shard_commit"] and "seed 7" in record["method"]


def test_a_model_that_cannot_open_is_an_error_run(db_session, private_redis):
    reason = "cannot open model 'gone': no such file"
    run = run_nightly(db_session, reason, nobody(private_redis), 7, SIZES)
    assert run.verdict == "error"
    assert {p.kind: p.summary.get("error") for p in run.proofs if p.verdict == "error"} == {
        "on_swarm": reason,
        "generation": reason,
    }
