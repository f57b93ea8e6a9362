"""The JSON API under load, on the stack as `specpipe up` runs it with the tiny model: jobs from
several users through POST /api/v1/jobs with their own tokens. Every submission is accepted
or refused with 429 by the per-user rate, every accepted job ends with the tokens it gives
alone, nothing answers 5xx."""

from __future__ import annotations

import pytest

from specpipe.bench import api_load as apiloadbench
from specpipe.core.sampling import SamplingParams
from specpipe.decoding.generation import Generation
from specpipe.decoding.target import open_target
from tests.factories import gen_job
from tests.swarmprocs import write_tiny_model

USERS, JOBS, RATE = 4, 40, 8  # each user submits 10 within the minute; 8 are let through


@pytest.mark.slow
def test_jobs_from_several_users_all_end_and_the_rate_refuses_the_rest(tmp_path):
    tiny = write_tiny_model(tmp_path / "tiny")
    result = apiloadbench.run_load(
        str(tiny),
        tmp_path,
        print,
        users=USERS,
        jobs=JOBS,
        within_s=20,
        tokens=8,
        deadline_s=300,
        env={"SPECPIPE_SUBMIT_RATE": f"{RATE}/minute"},
    )
    statuses = {s["status"] for s in result["submissions"]}
    assert statuses == {201, 429}, result["http_statuses"]
    assert result["rate_limited"] == USERS * (JOBS // USERS - RATE)
    assert result["accepted"] == USERS * RATE == result["done"], result["failed_reasons"]
    assert (result["lost"], result["stuck"], result["failed"]) == (0, 0, 0)
    assert (result["http_5xx"], result["unanswered"]) == (0, 0)
    assert result["not_as_solo"] == []
    assert result["verdict"] == "PASS"
    # Each user's accepted jobs are theirs: read back with their own token.
    assert result["http_statuses"].get("200") == result["accepted"]
    roles = {"redis", "stage0", "stage1", "stage2", "coordinator", "nightly", "beat", "web"}
    assert set(result["memory"]) == roles
    assert all(m["before_mib"] > 0 and m["after_mib"] > 0 for m in result["memory"].values())


def test_a_done_job_is_held_to_its_solo_run(tmp_path, db_session, db_url):
    tiny = str(write_tiny_model(tmp_path / "tiny"))
    target = open_target(tiny)
    params = SamplingParams(temp=0.8, top_p=0.9, seed=7)
    # The job's tokens as a speculative run on two stages gives them: the same as plain, alone.
    ring = target.local_ring(2)
    ring.reset("spec", params)
    tokens = Generation(
        ring,
        "spec",
        target.prompt_ids("the cat"),
        params,
        max_new_tokens=12,
        draft_k=4,
        eos_ids=target.eos_ids,
    ).run()
    kept = gen_job(
        db_session,
        prompt="the cat",
        model=tiny,
        temp=0.8,
        top_p=0.9,
        seed=7,
        max_new_tokens=12,
        status="done",
        output_ids=tokens,
    )
    other = gen_job(
        db_session,
        prompt="the cat",
        model=tiny,
        temp=0.8,
        top_p=0.9,
        seed=7,
        max_new_tokens=12,
        status="done",
        output_ids=tokens[:-1] + [(tokens[-1] + 1) % 90],
    )
    queued = gen_job(db_session, model=tiny, status="queued", output_ids=[1, 2])
    ids = [kept.id, other.id, queued.id]
    assert apiloadbench.solo_mismatches(tiny, db_url, ids) == [other.id]
