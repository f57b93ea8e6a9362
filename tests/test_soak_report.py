"""The soak's pure parts: the chaos schedule from a seed, recovery times and tokens per minute
from what the store showed, which faults a job's failure is excused by, the summaries and the
verdict."""

from __future__ import annotations

import pytest

from specpipe.bench.soak import (
    FIXED_HOLD_S,
    HEAD_KINDS,
    KINDS,
    LINK_CUTS,
    LONE,
    SPARED,
    STAGE_KINDS,
    Injected,
    Observation,
    attribute,
    memory_grown,
    oom_kills,
    problems,
    recoverable,
    recovery_s,
    report,
    schedule,
    stall_s,
    summarise_faults,
    summarise_jobs,
    tokens_per_minute,
    twin,
    unexcused_failures,
    wave_every_s,
)


def test_the_schedule_is_the_seeds_and_each_round_has_every_kind_once():
    plan = schedule(7, 3)
    assert plan == schedule(7, 3)
    assert plan != schedule(8, 3)
    assert len(plan) == 3 * len(KINDS)
    for r in range(3):
        assert sorted(f.kind for f in plan[r * len(KINDS) : (r + 1) * len(KINDS)]) == sorted(KINDS)
    for fault in plan:
        if fault.kind in HEAD_KINDS:
            assert fault.host == "h0"
        else:
            assert fault.host in (*SPARED, *LONE)
        if fault.kind in FIXED_HOLD_S:
            assert fault.hold_s == FIXED_HOLD_S[fault.kind]
        elif fault.kind in ("kill-stage", "oom-stage", "kill-coordinator", "registry-kill"):
            assert fault.hold_s == 0.0
        else:
            assert 3.0 <= fault.hold_s <= 8.0
        assert fault.overlap is None  # none asked for


def test_every_two_rounds_hit_each_stage_kind_with_a_spare_and_without():
    plan = schedule(3, 4)
    for pair in (plan[: 2 * len(KINDS)], plan[2 * len(KINDS) :]):
        for kind in STAGE_KINDS:
            hosts = [f.host for f in pair if f.kind == kind]
            assert len(hosts) == 2
            assert sorted(h in SPARED for h in hosts) == [False, True], (kind, hosts)
    assert {f.host for f in plan if f.kind in STAGE_KINDS} == {*SPARED, *LONE}


def test_a_schedule_without_a_kind_never_injects_it():
    kinds = [k for k in KINDS if "clock" not in k]
    assert {f.kind for f in schedule(1, 4, kinds)} == set(kinds)
    assert {f.kind for f in schedule(1, 4, kinds, overlap=1.0) if f.overlap} <= set(kinds)


def test_an_overlapping_fault_hits_another_host_than_the_first_and_its_copy():
    plan = schedule(5, 4, overlap=1.0)
    assert all(f.overlap is not None for f in plan)
    for fault in plan:
        second = fault.overlap
        assert second.host not in (fault.host, twin(fault.host))
        assert second.overlap is None
        assert 0.0 <= fault.overlap_after_s <= min(fault.hold_s, 10.0)
    some = schedule(5, 4, overlap=0.3)
    assert 0 < sum(f.overlap is not None for f in some) < len(some)


def test_recoverable_kinds_are_every_kind_with_a_spare_and_the_short_outages_without():
    for kind in STAGE_KINDS:
        assert recoverable(kind, spare=True)
    unrecoverable = {k for k in KINDS if not recoverable(k, spare=False)}
    assert unrecoverable == {"link-cut-30s", "link-cut-90s", "registry-stall-30s"}
    assert twin("h2") == "h4" and twin("h4") == "h2" and twin("h1") is None


def test_waves_keep_each_user_within_its_submission_allowance(monkeypatch):
    monkeypatch.setenv("SPECPIPE_SUBMIT_RATE", "30/minute")
    assert wave_every_s(2) == pytest.approx(4.4)  # 2 jobs of 30 a minute, a tenth to spare
    monkeypatch.setenv("SPECPIPE_SUBMIT_RATE", "10/second")
    assert wave_every_s(1) == pytest.approx(0.11)


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


def test_a_faults_jobs_are_those_running_and_those_ending_while_it_lasted_or_a_round_after():
    cut = Injected("link-cut-90s", "h1", 90.0, 10.0, 100.0, running=[1])
    kill = Injected("kill-stage", "h3", 0.0, 200.0, 201.0, running=[])
    seen = [
        obs(5.0, 1, rounds=2),
        obs(50.0, 1, "failed", rounds=2),  # running when the cut came
        obs(20.0, 2, "queued"),
        obs(125.0, 2, "failed"),  # ended within a round's wait (30 s) of the cut's end
        obs(150.0, 3, "done", rounds=9),  # too late for the cut, too early for the kill
        obs(215.0, 4, "done", rounds=9),
        obs(220.0, 4, "done", rounds=9),  # only its first end counts
    ]
    attribute([cut, kill], seen)
    assert cut.jobs == [1, 2]
    assert kill.jobs == [4]


def test_a_job_ending_after_faults_is_the_last_ones_and_one_ending_during_a_fault_only_its():
    skew = Injected("clock-skew+20s", "h4", 2.0, 10.0, 14.0, running=[1])
    fill = Injected("registry-fill", "h0", 3.0, 20.0, 23.0, running=[2])
    stall = Injected("redis-stall", "h2", 3.0, 21.0, 24.0, running=[2])
    seen = [
        obs(12.0, 3, "done", rounds=9),  # during the skew only
        obs(16.0, 4, "done", rounds=9),  # after the skew, before the fill
        obs(21.5, 5, "failed"),  # during the fill and the stall
        obs(23.5, 6, "failed"),  # during the stall, after the fill
        obs(30.0, 7, "failed"),  # after all three: the last to end has it
    ]
    attribute([skew, fill, stall], seen)
    assert skew.jobs == [1, 3, 4]
    assert fill.jobs == [2, 5]
    assert stall.jobs == [2, 5, 6, 7]


def outcome(job, what="identical", reason=None):
    status = {"identical": "done", "different": "done", "failed": "failed"}.get(what, "running")
    return {"job_id": job, "outcome": what, "status": status, "reason": reason}


def test_only_an_unrecoverable_fault_excuses_a_failed_job():
    long_cut = Injected("link-cut-90s", "h1", 90.0, 10.0, 100.0, jobs=[1, 2])
    spared_cut = Injected("link-cut-90s", "h2", 90.0, 200.0, 290.0, spare=True, jobs=[3])
    short = Injected("link-cut-5s", "h3", 5.0, 300.0, 305.0, jobs=[4])
    missed = Injected("link-cut-30s", "h1", 30.0, 400.0, 430.0, error="boom", jobs=[5])
    faults = [long_cut, spared_cut, short, missed]
    jobs = [
        outcome(1, "failed", "RingError: no reply"),
        outcome(2),
        outcome(3, "failed", "RouteError: x"),
        outcome(4, "failed", "HopUnreachableError: y"),
        outcome(5, "failed", "RingError: no reply"),  # its fault was never injected
        outcome(6, "failed", None),  # no fault touched it at all
    ]
    assert [o["job_id"] for o in unexcused_failures(jobs, faults)] == [3, 4, 5, 6]
    assert unexcused_failures(jobs[:2], faults) == []
    found = problems(summarise_jobs(jobs), [], unexcused=unexcused_failures(jobs, faults))
    assert found == [
        "4 failed where recovery was possible: RouteError: x (1); HopUnreachableError: y (1); "
        "RingError: no reply (1); failed (1)"
    ]


def test_the_fault_summary_has_its_jobs_and_p50_and_max_times_per_kind_and_side():
    injected = [
        Injected(
            "link-cut-5s",
            "h2",
            5.0,
            10.0,
            15.0,
            recover_s=1.0,
            stall_s=2.0,
            serving=True,
            spare=True,
            takeover_s=1.6,
            jobs=[1, 2],
        ),
        Injected(
            "link-cut-5s",
            "h4",
            5.0,
            30.0,
            35.0,
            recover_s=3.0,
            stall_s=5.0,
            serving=True,
            spare=True,
            takeover_s=2.0,
            jobs=[3],
        ),
        Injected(
            "link-cut-5s",
            "h2",
            5.0,
            50.0,
            55.0,
            recover_s=2.5,
            stall_s=1.0,
            serving=False,
            spare=True,
            jobs=[3, 4],
        ),
        Injected("link-cut-5s", "h1", 5.0, 60.0, 65.0, recover_s=0.5, stall_s=6.0, jobs=[5]),
        Injected("redis-fill", "h3", 3.0, 70.0, 73.0, recover_s=None, jobs=[6]),
        Injected("clock-skew+20s", "h2", 3.0, 80.0, 80.0, spare=True, error="RuntimeError: no"),
        Injected("registry-stall-30s", "h0", 30.0, 90.0, 120.0, recover_s=4.0, stall_s=31.0),
    ]
    outcomes = [
        outcome(1),
        outcome(2),
        outcome(3, "different", "tokens differ"),
        outcome(4),
        outcome(5, "failed", "HopUnreachableError: h1"),
        outcome(6, "stuck", "running at the deadline"),
    ]
    rows = summarise_faults(injected, outcomes)
    assert list(rows) == [
        "link-cut-5s/spare",
        "link-cut-5s/no-spare",
        "redis-fill/no-spare",
        "clock-skew+20s/spare",
        "registry-stall-30s",
    ]
    assert rows["link-cut-5s/spare"] == {
        "kind": "link-cut-5s",
        "spare": True,
        "recoverable": True,
        "injected": 3,
        "errors": [],
        "jobs": 4,
        "identical": 3,
        "different": 1,
        "failed": 0,
        "lost": 0,
        "stuck": 0,
        "failed_reasons": {},
        "died": [],
        "overlapped": [],
        "recover_s_p50": 2.5,
        "recover_s_max": 3.0,
        "unrecovered": 0,
        "stall_s_p50": 2.0,
        "stall_s_max": 5.0,
        "on_serving_host": 2,
        "serving_stall_s_p50": 3.5,
        "serving_stall_s_max": 5.0,
        "alone_stall_s_max": 5.0,
        "takeover_s_p50": 1.8,
        "takeover_s_max": 2.0,
    }
    lone = rows["link-cut-5s/no-spare"]
    assert lone["failed"] == 1 and lone["failed_reasons"] == {"HopUnreachableError: h1": 1}
    assert lone["recoverable"] and lone["takeover_s_p50"] is None
    fill = rows["redis-fill/no-spare"]
    assert fill["unrecovered"] == 1 and fill["recover_s_p50"] is None and fill["stuck"] == 1
    skew = rows["clock-skew+20s/spare"]
    assert skew["injected"] == 0 and skew["errors"] == ["RuntimeError: no"]
    assert skew["jobs"] == 0 and skew["unrecovered"] == 0
    assert rows["registry-stall-30s"]["recoverable"] is False
    assert rows["registry-stall-30s"]["spare"] is False


@pytest.mark.parametrize("kind", LINK_CUTS)
def test_a_link_cut_with_a_spare_fails_the_soak_when_it_cost_a_running_job_too_much(kind):
    def rows(stall, spare=True):
        fault = Injected(kind, "h2" if spare else "h1", 5.0, 1.0, 6.0, stall_s=stall, spare=spare)
        return summarise_faults([fault])

    jobs = summarise_jobs([outcome(1)])
    assert problems(jobs, [], rows(2.9)) == []
    label = f"{kind}/spare"
    assert problems(jobs, [], rows(3.4)) == [f"{label} cost a running job 3.40 s (over 3 s)"]
    assert problems(jobs, [], rows(3.4), cut_stall_s=4.0) == []
    assert problems(jobs, [], rows(40.0, spare=False)) == []  # nothing to go to: no bound
    assert problems(jobs, [], rows(None)) == []
    overlapped = Injected(kind, "h2", 5.0, 1.0, 6.0, stall_s=12.0, spare=True, overlaps="x on h0")
    alone = Injected(kind, "h2", 5.0, 30.0, 35.0, stall_s=1.5, spare=True)
    both = summarise_faults([overlapped, alone])
    assert both[label]["stall_s_max"] == 12.0 and both[label]["alone_stall_s_max"] == 1.5
    assert problems(jobs, [], both) == []  # the overlapping fault's cost is its own


def test_a_process_that_died_of_a_fault_that_did_not_kill_it_fails_the_soak():
    injected = [
        Injected("registry-kill", "h0", 0.0, 1.0, 2.0, died=["h0-coordinator"]),
        Injected("registry-kill", "h0", 0.0, 9.0, 10.0),
        Injected("kill-stage", "h1", 0.0, 20.0, 21.0, died=["h0-beat", "h0-coordinator"]),
    ]
    rows = summarise_faults(injected)
    assert rows["registry-kill"]["died"] == ["h0-coordinator"]
    assert problems(summarise_jobs([outcome(1)]), [], rows) == [
        "registry-kill: h0-coordinator died (started again)",
        "kill-stage/no-spare: h0-beat, h0-coordinator died (started again)",
    ]
    lines = report(a_result(injected, [outcome(1)]))
    assert "  died, started again: h0-coordinator" in lines


def test_other_kinds_have_no_stall_bound():
    fault = Injected("kill-stage", "h2", 0.0, 1.0, 2.0, stall_s=9.0, spare=True)
    assert problems(summarise_jobs([outcome(1)]), [], summarise_faults([fault])) == []


def test_the_oom_kill_count_is_read_from_either_cgroup_versions_file(tmp_path):
    v2 = tmp_path / "memory.events"
    v2.write_text("low 0\nhigh 0\nmax 12\noom 2\noom_kill 2\noom_group_kill 0\n")
    v1 = tmp_path / "memory.oom_control"
    v1.write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 1\n")
    assert oom_kills(v2) == 2 and oom_kills(v1) == 1
    (tmp_path / "empty").write_text("")
    with pytest.raises(RuntimeError):
        oom_kills(tmp_path / "empty")


def a_result(injected, outcomes, **more):
    return {
        "soak_s": 180.0,
        "submitted": len(outcomes),
        "refused": {},
        "jobs": summarise_jobs(outcomes),
        "faults": summarise_faults(injected, outcomes),
        "setup": {"left_out": []},
        "tokens_per_minute": [10, 20, 30],
        "memory_mib": {
            "h0-web": {"start": 100.0, "end": 101.0},
            "h1-stage": {"start": 500.0, "end": 600.0},
        },
        "memory_grown": [],
        "memory_per_minute_mib": [],
        "problems": [],
        "verdict": "PASS",
        **more,
    }


def test_the_report_shows_a_grown_process_minute_by_minute():
    result = a_result(
        [Injected("link-cut-5s", "h2", 5.0, 1.0, 6.0, 0.1, 0.2, spare=True)],
        [outcome(1)],
        memory_grown=["h1-stage"],
        memory_per_minute_mib=[
            {"t": 60.0, "h0-web": 100.0, "h1-stage": 540.0},
            {"t": 120.0, "h0-web": 101.0, "h1-stage": 580.0},
        ],
        problems=["memory grew: h1-stage"],
        verdict="FAIL",
    )
    lines = report(result)
    assert "  h1-stage by minute: 540, 580" in lines
    assert not any(line.startswith("  h0-web by minute") for line in lines)
    assert lines[-1] == "verdict FAIL"


def test_the_report_has_a_row_per_kind_and_side_in_both_tables_with_reasons_under_it():
    injected = [
        Injected(
            "link-cut-90s",
            "h1",
            90.0,
            1.0,
            91.0,
            recover_s=0.4,
            stall_s=12.0,
            serving=True,
            jobs=[1, 2],
        ),
        Injected(
            "link-cut-90s",
            "h2",
            90.0,
            100.0,
            190.0,
            recover_s=0.3,
            stall_s=1.9,
            serving=True,
            spare=True,
            takeover_s=1.5,
            jobs=[3],
        ),
        Injected("oom-stage", "h4", 0.0, 200.0, 203.0, spare=True, error="RuntimeError: no cgroup"),
    ]
    injected[0].overlaps = "redis-stall on h3"
    jobs = [outcome(1, "failed", "HopUnreachableError: h1"), outcome(2), outcome(3)]
    lines = report(a_result(injected, jobs))
    assert lines[0].startswith("soak 180 s, 3 submitted (0 refused): 3 jobs, 2 done identical")
    first = next(i for i, line in enumerate(lines) if line.startswith("FAULT") and "JOBS" in line)
    second = next(i for i, line in enumerate(lines) if line.startswith("FAULT") and "STALL" in line)
    rows = [line.split() for line in lines[first + 1 : first + 7]]
    assert rows == [
        ["link-cut-90s/no-spare", "1", "no", "2", "1", "0", "1", "0", "0"],
        ["failed", "(1):", "HopUnreachableError:", "h1"],
        ["overlapped:", "redis-stall", "on", "h3;", "stall", "max", "without:", "-"],
        ["link-cut-90s/spare", "1", "yes", "1", "1", "0", "0", "0", "0"],
        ["oom-stage/spare", "0", "yes", "0", "0", "0", "0", "0", "0"],
        ["not", "injected:", "RuntimeError:", "no", "cgroup"],
    ]
    times = [" ".join(line.split()) for line in lines[second + 1 : second + 4]]
    assert times == [
        "link-cut-90s/no-spare 0.40 / 0.40 0 12.00 / 12.00 1 12.00 -",
        "link-cut-90s/spare 0.30 / 0.30 0 1.90 / 1.90 1 1.90 1.50 / 1.50",
        "oom-stage/spare - 0 - 0 - -",
    ]
    widths = {len(lines[i]) for i in (first, first + 1, first + 4, second, second + 2)}
    assert len(widths) == 2  # each table's columns line up
