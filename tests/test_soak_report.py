"""The soak's pure parts: the chaos schedule from a seed, recovery times and tokens per minute
from what the store showed, the summaries and the memory-growth verdict."""

from __future__ import annotations

from specpipe.bench.soak import (
    KINDS,
    Injected,
    Observation,
    memory_grown,
    problems,
    recovery_s,
    report,
    schedule,
    stall_s,
    summarise_faults,
    summarise_jobs,
    tokens_per_minute,
)


def test_the_schedule_is_the_seeds_and_each_round_has_every_kind_once():
    plan = schedule(7, 3)
    assert plan == schedule(7, 3)
    assert plan != schedule(8, 3)
    assert len(plan) == 3 * len(KINDS)
    for r in range(3):
        assert sorted(f.kind for f in plan[r * len(KINDS) : (r + 1) * len(KINDS)]) == sorted(KINDS)
    for fault in plan:
        assert (
            fault.host == "h0" if fault.kind == "kill-coordinator" else fault.host in ("h2", "h4")
        )
        assert 3.0 <= fault.hold_s <= 8.0


def test_a_schedule_without_a_kind_never_injects_it():
    kinds = [k for k in KINDS if k != "clock-skew"]
    assert {f.kind for f in schedule(1, 4, kinds)} == set(kinds)


def obs(t, job, status="running", rounds=0, tokens=0):
    return Observation(t, job, status, rounds, tokens)


def test_recovery_is_the_first_round_stored_after_the_fault_ended():
    seen = [
        obs(1.0, 1, rounds=3),
        obs(2.0, 1, rounds=4),
        obs(9.0, 2, "queued"),
        obs(12.5, 1, rounds=5),
    ]
    assert recovery_s(5.0, seen) == 7.5
    assert recovery_s(0.5, seen) == 0.5
    assert recovery_s(13.0, seen) is None


def test_a_faults_stall_is_the_longest_a_running_job_waited_for_its_next_round():
    seen = [
        obs(1.0, 1, rounds=3),
        obs(1.5, 2, rounds=1),
        obs(6.0, 2, rounds=2),  # job 2 waited 4 s from the fault at 2.0
        obs(3.0, 1, rounds=4),  # job 1 only 1 s
    ]
    assert stall_s(2.0, [1, 2], seen) == 4.0
    assert stall_s(2.0, [1], seen) == 1.0
    assert stall_s(2.0, [], seen) == 0.0
    assert stall_s(7.0, [1, 2], seen) is None  # neither has moved since
    # A job that ended (however it ended) no longer waits.
    assert stall_s(2.0, [1], [obs(1.0, 1, rounds=3), obs(2.5, 1, "failed", rounds=3)]) == 0.5
    # Nor one that had ended before the fault, though the poll saw it running when it began.
    assert stall_s(2.0, [1, 2], [obs(1.0, 1, rounds=3), obs(1.9, 1, "done", rounds=4)]) is None
    assert stall_s(2.0, [1], [obs(1.0, 1, rounds=3), obs(1.9, 1, "done", rounds=4)]) == 0.0


def test_a_job_ending_done_or_a_new_job_storing_a_round_is_recovery_too():
    assert recovery_s(5.0, [obs(1.0, 1, rounds=3), obs(6.0, 1, "done", rounds=3)]) == 1.0
    assert recovery_s(5.0, [obs(1.0, 1, rounds=3), obs(8.0, 2, rounds=1)]) == 3.0
    assert recovery_s(5.0, [obs(1.0, 1, rounds=3), obs(6.0, 1, "failed", rounds=3)]) is None


def test_tokens_per_minute_count_a_job_run_again_only_past_its_best():
    seen = [
        obs(10, 1, tokens=20),
        obs(50, 1, tokens=40),
        obs(70, 1, tokens=0),  # started again from scratch
        obs(80, 1, tokens=30),
        obs(100, 1, tokens=48),
        obs(130, 2, tokens=16),
    ]
    assert tokens_per_minute(seen, 3) == [40, 8, 16]
    assert tokens_per_minute(seen, 1) == [40]


def test_memory_growth_needs_both_the_share_and_the_floor():
    before = {"stage": 400.0, "redis": 10.0, "web": 100.0, "gone": 50.0}
    after = {"stage": 450.0, "redis": 29.0, "web": 121.0}
    # stage: +50 MiB, 12.5 %; web: +21 MiB, 21 %; redis: nearly tripled, but under the floor.
    assert memory_grown(before, after) == ["stage", "web"]
    assert memory_grown(before, after, floor_mib=25.0) == ["stage"]
    assert memory_grown(before, {"stage": 430.0}) == []


def test_the_job_summary_counts_outcomes_and_reasons():
    outcomes = [
        {"outcome": "identical", "status": "done", "reason": None},
        {"outcome": "failed", "status": "failed", "reason": "RouteError: x"},
        {"outcome": "failed", "status": "failed", "reason": "RouteError: x"},
        {"outcome": "failed", "status": "cancelled", "reason": None},
        {"outcome": "stuck", "status": "running", "reason": "running at the deadline"},
    ]
    jobs = summarise_jobs(outcomes)
    assert jobs["jobs"] == 5 and jobs["identical"] == 1 and jobs["failed"] == 3
    assert jobs["stuck"] == 1 and jobs["lost"] == jobs["different"] == 0
    assert jobs["failed_reasons"] == {"RouteError: x": 2, "cancelled": 1}
    assert problems(jobs, []) == ["1 stuck"]
    assert problems(jobs, ["h0-web"]) == ["1 stuck", "memory grew: h0-web"]
    clean = summarise_jobs(outcomes[:2])
    assert problems(clean, []) == []


def test_the_fault_summary_has_p50_and_max_recovery_per_kind():
    injected = [
        Injected("link-cut", "h2", 3.0, 10.0, 13.0, recover_s=1.0, stall_s=2.0, serving=True),
        Injected("link-cut", "h4", 3.0, 30.0, 33.0, recover_s=3.0, stall_s=5.0, serving=True),
        Injected("link-cut", "h2", 3.0, 50.0, 53.0, recover_s=2.5, stall_s=1.0, serving=False),
        Injected("redis-fill", "h2", 3.0, 70.0, 73.0, recover_s=None),
        Injected("clock-skew", "h2", 3.0, 80.0, 80.0, error="RuntimeError: no"),
    ]
    rows = summarise_faults(injected)
    assert rows["link-cut"] == {
        "injected": 3,
        "errors": [],
        "recover_s_p50": 2.5,
        "recover_s_max": 3.0,
        "unrecovered": 0,
        "stall_s_p50": 2.0,
        "stall_s_max": 5.0,
        "on_serving_host": 2,
        "serving_stall_s_p50": 3.5,
        "serving_stall_s_max": 5.0,
    }
    assert rows["redis-fill"]["unrecovered"] == 1 and rows["redis-fill"]["recover_s_p50"] is None
    assert rows["clock-skew"]["injected"] == 0 and rows["clock-skew"]["errors"] == [
        "RuntimeError: no"
    ]


def test_the_report_shows_a_grown_process_minute_by_minute():
    result = {
        "soak_s": 180.0,
        "submitted": 2,
        "refused": {},
        "jobs": summarise_jobs([{"outcome": "identical", "status": "done", "reason": None}]),
        "faults": summarise_faults([Injected("link-cut", "h2", 3.0, 1.0, 4.0, 0.1, 0.2)]),
        "setup": {"left_out": []},
        "tokens_per_minute": [10, 20, 30],
        "memory_mib": {
            "h0-web": {"start": 100.0, "end": 101.0},
            "h1-stage": {"start": 500.0, "end": 600.0},
        },
        "memory_grown": ["h1-stage"],
        "memory_per_minute_mib": [
            {"t": 60.0, "h0-web": 100.0, "h1-stage": 540.0},
            {"t": 120.0, "h0-web": 101.0, "h1-stage": 580.0},
        ],
        "problems": ["memory grew: h1-stage"],
        "verdict": "FAIL",
    }
    lines = report(result)
    assert "  h1-stage by minute: 540, 580" in lines
    assert not any(line.startswith("  h0-web by minute") for line in lines)
    assert lines[-1] == "verdict FAIL"
