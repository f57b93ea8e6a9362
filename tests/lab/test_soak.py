"""A slice of `specpipe bench soak` on the tiny model: two users with two jobs each at once on
the lab's JSON API while one round of the kinds that are recoverable wherever they land hits it
(one fault overlapping another): no job lost, stuck, different or failed, a link cut on a host
with a spare costing a running job 3 s at most, a recovery time for every kind, and no lab
process grown over 10 %; every kind injected, none with an error.

The kinds a job must survive but that do not yet reliably let it are left out: a Redis filled
(a job starting meanwhile fails at once on the refused write instead of waiting it out), the
registry's Redis killed (the coordinator's broker connection may not come back), link cuts of
30 and 90 s (a host back from a long cut may pass its first round on over a dead connection,
failing the job). So are the head's clock skews, which restart the coordinator twice and only
take time. Seed 25 puts the link cut and the OOM kill on a host with a spare, the stage kill on
one without, the clock skews on both, and a skew on h3 during the coordinator's kill."""

from __future__ import annotations

import json
import os

import pytest

from specpipe.bench.soak import faketime_library, memory_cgroup
from tests.lab.conftest import need_lab, run

SLICE = (
    "link-cut-5s",
    "redis-stall",
    "kill-stage",
    "oom-stage",
    "clock-skew+20s",
    "clock-skew-20s",
    "kill-coordinator",
)


def no_memory_cgroup() -> str | None:
    """Why `oom-stage` cannot be injected here (no writable memory cgroup), or None."""
    try:
        memory_cgroup()
    except (RuntimeError, OSError) as exc:
        return str(exc)
    return None


@pytest.mark.slow
def test_a_slice_of_the_soak_loses_and_fails_nothing_and_recovers_from_every_fault(tiny, tmp_path):
    need_lab()
    if faketime_library() is None and os.environ.get("CI"):
        pytest.fail("cannot run under CI: libfaketime is not installed (requirements-dev.txt)")
    out = tmp_path / "soak.json"
    result = run(
        "bench",
        "soak",
        "--model",
        str(tiny),
        "--minutes",
        "0.5",
        "--users",
        "2",
        "--jobs-per-user",
        "2",
        "--tokens",
        "32",
        "--pause-s",
        "2",
        "--hold-s",
        "2",
        "3",
        "--kinds",
        ",".join(SLICE),
        "--overlap",
        "0.3",
        "--deadline-s",
        "120",
        "--warm-up-s",
        "10",
        "--seed",
        "25",
        "--home",
        str(tmp_path / "lab"),
        "--json",
        str(out),
    )
    report = json.loads(out.read_text())
    jobs = report["jobs"]
    assert jobs["lost"] == jobs["stuck"] == jobs["different"] == jobs["failed"] == 0, result.output
    assert jobs["identical"] > 0
    assert any(i["overlaps"] for i in report["injected"]), result.output
    kinds = {row["kind"] for row in report["faults"].values()}
    assert kinds == {k for k in SLICE if "clock" not in k or faketime_library()}, result.output
    why_not = no_memory_cgroup()
    for label, row in report["faults"].items():
        assert row["recoverable"], label
        if row["kind"] == "oom-stage" and why_not:
            assert row["errors"] and all(why_not in e for e in row["errors"]), (label, row)
            continue
        assert row["injected"] >= 1 and not row["errors"], (label, row)
        assert row["recover_s_max"] is not None and row["stall_s_max"] is not None, (
            label,
            result.output,
        )
    assert report["faults"]["link-cut-5s/spare"]["stall_s_max"] <= 3.0, result.output
    assert sum(report["tokens_per_minute"]) > 0
    assert set(report["memory_mib"]) >= {"h0-coordinator", "h0-web", "h4-stage-h4", "h2-redis"}
    assert report["problems"] == [] and report["verdict"] == "PASS", result.output
    assert result.exit_code == 0, result.output
    assert not (tmp_path / "lab" / "lab.json").exists()  # taken down
