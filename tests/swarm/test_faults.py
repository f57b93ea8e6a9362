"""The fault matrix on real processes: the stack as `specpipe up` runs it, with the tiny model,
and faults injected at random rounds of running jobs. No job may be lost, stuck, or finish
with other tokens than its reference run.

The small matrix (each fault once, a shorter stop and outage) runs with the suite; the full
counts, as `specpipe bench faults` runs them, are marked `faults` (`pytest -m faults`).
"""

from __future__ import annotations

import pytest

from specpipe.bench import faults as faultbench
from tests import dbfixtures
from tests.swarmprocs import write_tiny_model

SURVIVED = (
    "kill-stage0",
    "kill-middle",
    "kill-tail",
    "kill-coordinator",
    "kill-redis",
    "stop-stage",
    "db-down",
)
SIZES = {
    "small": {
        "counts": {**dict.fromkeys(SURVIVED, 1), "resplit": 2},
        "stop_s": 5.0,
        "db_down_s": 8.0,
        "postgres": None,
    },
    "full": {
        "counts": {
            "kill-stage0": 5,
            "kill-middle": 5,
            "kill-tail": 5,
            "kill-coordinator": 5,
            "kill-redis": 3,
            "stop-stage": 3,
            "db-down": 2,
            "resplit": 3,
        },
        "stop_s": 30.0,
        "db_down_s": 10.0,
        "postgres": dbfixtures.testing_url(),
    },
}


# The small matrix runs in the suite; the full one (about 30 minutes) only under `-m faults`.
FULL = pytest.param("full", marks=[pytest.mark.faults, pytest.mark.timeout(3600)])


@pytest.fixture(scope="module", params=[pytest.param("small", marks=pytest.mark.slow), FULL])
def matrix(request, tmp_path_factory) -> dict:
    """The matrix's result, run once per size."""
    size = SIZES[request.param]
    workdir = tmp_path_factory.mktemp(f"faults-{request.param}")
    tiny = write_tiny_model(workdir / "tiny")
    return faultbench.run_matrix(
        str(tiny),
        size["counts"],
        workdir,
        print,
        tokens=64,
        postgres=size["postgres"],
        stop_s=size["stop_s"],
        db_down_s=size["db_down_s"],
        deadline_s=150,
        seed=1,
    )


def rows(result: dict) -> dict[str, dict]:
    return {row["fault"]: row for row in result["rows"]}


def test_every_fault_hit_a_running_job_and_none_was_lost_or_stuck(matrix):
    counts = matrix["setup"]["counts"]
    assert matrix["not_injected"] == []
    for fault, row in rows(matrix).items():
        assert row["injected"] == counts[fault], row
        assert (row["lost"], row["stuck"]) == (0, 0), row
    for trial in matrix["trials"]:
        for job in trial["jobs"]:
            assert job["outcome"] != "failed" or job["reason"], trial


def test_killed_stopped_and_cut_off_processes_cost_no_job_and_no_token(matrix):
    for fault in SURVIVED:
        row = rows(matrix)[fault]
        others = [
            job
            for trial in matrix["trials"]
            if trial["fault"] == fault
            for job in trial["jobs"]
            if job["outcome"] != "identical"
        ]
        assert row["identical"] == row["jobs"] >= row["injected"], (row, others)
        assert row["recover_s_median"] is not None


def test_a_stage_restarted_with_other_layers_reroutes_or_fails_with_the_reason(matrix):
    row = rows(matrix)["resplit"]
    assert row["injected"] >= 2
    assert (row["different"], row["lost"], row["stuck"]) == (0, 0, 0), row
    # Widened to the last layer: the job goes on over the new route. Moved back: no route.
    assert row["identical"] >= 1, row
    assert all(
        reason.startswith("RouteError: no online stage serves layers")
        for reason in row["failed_reasons"]
    ), row
