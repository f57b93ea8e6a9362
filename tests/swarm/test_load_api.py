"""The JSON API under load, on the stack as `specpipe up` runs it with the tiny model: jobs from
several users through POST /api/v1/jobs with their own tokens. Every submission is accepted
or refused with 429 by the per-user rate, every accepted job ends, nothing answers 5xx."""

from __future__ import annotations

from specpipe import apiloadbench
from tests.swarmprocs import write_tiny_model

USERS, JOBS, RATE = 4, 40, 8  # each user submits 10 within the minute; 8 are let through


def test_jobs_from_several_users_all_end_and_the_rate_refuses_the_rest(tmp_path):
    tiny = write_tiny_model(tmp_path / "tiny")
    result = apiloadbench.run_load(str(tiny), tmp_path, print, users=USERS, jobs=JOBS,
                                within_s=20, tokens=8, deadline_s=300,
                                env={"SPECPIPE_SUBMIT_RATE": f"{RATE}/minute"})  # fmt: skip
    statuses = {s["status"] for s in result["submissions"]}
    assert statuses == {201, 429}, result["http_statuses"]
    assert result["rate_limited"] == USERS * (JOBS // USERS - RATE)
    assert result["accepted"] == USERS * RATE == result["done"], result["failed_reasons"]
    assert (result["lost"], result["stuck"], result["failed"]) == (0, 0, 0)
    assert (result["http_5xx"], result["unanswered"]) == (0, 0)
    assert result["verdict"] == "PASS"
    # Each user's accepted jobs are theirs: read back with their own token.
    assert result["http_statuses"].get("200") == result["accepted"]
    roles = {"redis", "stage0", "stage1", "stage2", "coordinator", "nightly", "beat", "web"}
    assert set(result["memory"]) == roles
    assert all(m["before_mib"] > 0 and m["after_mib"] > 0 for m in result["memory"].values())
