"""A slice of `specpipe bench soak` on the tiny model: two users with two jobs each at once on
the lab's JSON API while one round of the kinds that are recoverable wherever they land hits it
(one fault overlapping another): no job lost, stuck, different or failed, a link cut on a host
with a spare costing a running job 3 s at most, a recovery time for every kind, and no lab
process grown over 10 %; every kind injected, none with an error.

Left out for the time they take: link cuts of 30 and 90 s and a registry stopped for 30 s (the
20-minute soak runs them), and the head's clock skews, which restart the coordinator twice.
Every fault here hits a running job; it must wait it out, whichever host it lands on: a Redis
filled until it refuses writes, the registry's Redis killed while the coordinator runs jobs.
Seed 38 puts the link cut on a host with a spare, alone; the stage kill, the OOM kill and the
fill on hosts without one (the job waits for the stage's restart, for the full Redis); a skew
on h3 during the coordinator's kill."""

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
    "redis-fill",
    "registry-kill",
    "registry-fill",
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
        "38",
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
