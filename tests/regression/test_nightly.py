"""The nightly regression end to end: a real Celery worker runs it on real stage processes."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import func, select

import tests.regression.toy_target  # noqa: F401  (the `toy` target)
from app import create_app
from models.db import make_session_factory, utcnow
from models.nodes import ring_nodes
from models.records import record_of
from models.runs import Run
from models.users import builtin_admin
from specpipe.settings import Settings, nightly_sizes
from specpipe.swarm import inventory
from tests.regression.conftest import PLUMBING_SIZES, ROOT, SMALL_SIZES, STAGES
from tests.regression.toy_target import toy_target
from tests.waiting import wait_until
from tests.web.conftest import as_user
from workers.names import (
    COORDINATOR_QUEUE,
    GENERATE_TASK,
    NIGHTLY_QUEUE,
    NIGHTLY_TASK,
    manual_key,
    night_key,
)
from workers.regression import attempts_key, run_nightly, swarm_today


def nightly_runs(db_url: str) -> list[Run]:
    with make_session_factory(db_url)() as session:
        runs = session.scalars(select(Run).where(Run.kind == "nightly")).all()
        for run in runs:  # load what the tests read before the session closes
            record_of(run)
            [p.summary for p in run.proofs]
        return runs


def web_client(db_url: str, redis_url: str):
    """A client of the web app, logged in as the built-in admin."""
    app = create_app({"TESTING": True, "DATABASE_URL": db_url, "REDIS_URL": redis_url})
    with make_session_factory(db_url)() as session:
        admin = builtin_admin(session)
        session.commit()
        return as_user(app.test_client(), admin)


def enqueue(live_swarm, monkeypatch, key: str | None = None) -> None:
    """Send the nightly task by name, as beat does, to the swarm's private broker."""
    from workers.celery_app import make_celery

    monkeypatch.setenv("REDIS_URL", live_swarm.redis_url)
    app = make_celery()
    app.send_task(NIGHTLY_TASK, kwargs={"key": key} if key else {}, queue=NIGHTLY_QUEUE)
    app.close()


def test_the_beat_schedule_names_a_registered_task():
    from workers.celery_app import celery

    celery.loader.import_default_modules()
    scheduled = {entry["task"] for entry in celery.conf.beat_schedule.values()}
    assert NIGHTLY_TASK in scheduled
    assert NIGHTLY_TASK in celery.tasks
    # The nightly has a lane of its own; everything else goes to the coordinator.
    assert celery.conf.task_routes[NIGHTLY_TASK] == {"queue": NIGHTLY_QUEUE}
    for entry in celery.conf.beat_schedule.values():  # every scheduled task is routed
        lane = NIGHTLY_QUEUE if entry["task"] == NIGHTLY_TASK else COORDINATOR_QUEUE
        assert celery.conf.task_routes[entry["task"]] == {"queue": lane}


def test_beat_fires_the_nightly_at_its_time_in_the_swarms_time_zone(monkeypatch):
    from celery import Celery
    from celery.beat import ScheduleEntry

    import celery_config

    monkeypatch.setenv("SPECPIPE_TIMEZONE", "Asia/Tokyo")
    monkeypatch.setenv("SPECPIPE_NIGHTLY", "00:30")
    try:
        importlib.reload(celery_config)  # it reads the settings once, as beat does at its start
        app = Celery(set_as_current=False)
        app.config_from_object(celery_config)
        spec = app.conf.beat_schedule["nightly-lossless-regression"]
        entry = ScheduleEntry(name="nightly", task=spec["task"], schedule=spec["schedule"], app=app)
    finally:
        monkeypatch.undo()
        importlib.reload(celery_config)
    last = datetime(2026, 12, 7, 16, 0, tzinfo=UTC)  # just after 00:30 on Dec 8 in Tokyo
    fires = datetime(2026, 12, 8, 15, 30, tzinfo=UTC)  # 00:30 on Dec 9 in Tokyo
    for now, due in ((fires - timedelta(minutes=1), False), (fires, True)):
        entry.schedule.nowfun = lambda now=now: now
        assert entry.schedule.is_due(last).is_due is due
    monkeypatch.setenv("SPECPIPE_TIMEZONE", "Asia/Tokyo")
    assert night_key(swarm_today(fires)) == "night-2026-12-09"  # the key the task takes then


@pytest.mark.slow
def test_regression_run_stores_a_run_with_every_record_field(live_swarm):
    live_swarm.start_stages()
    live_swarm.start_workers(1)
    # A queue of user jobs that no coordinator is taking: the nightly runs in its own lane all
    # the same, and leaves their messages where they are.
    from workers.submission import make_client

    jobs = make_client(live_swarm.redis_url)
    for job_id in range(1, 21):
        jobs.send_task(GENERATE_TASK, args=[job_id], queue=COORDINATOR_QUEUE)
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "specpipe", "regression", "run", "--timeout", "150"],
        cwd=ROOT,
        env=live_swarm.env(),
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[-2] == "verdict: pass"
    assert live_swarm.client.llen(COORDINATOR_QUEUE) == 20

    [run] = nightly_runs(live_swarm.db_url)
    assert lines[-1] == run.name
    record = record_of(run)
    for name, value in record.items():
        assert value not in (None, "", [], {}), f"{name} is empty"
    for section in ("proof_1_local_math", "proof_2_on_swarm"):
        for name, value in record[section].items():
            assert value is not None, f"{section}.{name} is empty"
        assert record[section]["verdict"] == "PASS"
    assert record["proof_1_local_math"]["draws_per_case"] == 40000
    assert record["proof_2_on_swarm"]["stops"] == 3
    assert record["proof_2_on_swarm"]["draws_per_mode_per_stop"] == 120
    generation = record["proof_3_generation"]
    assert generation["verdict"] == "PASS"
    assert {"greedy_temp0", "sampled_temp0.7_seed7", "sampled_temp0.7_seed99"} <= set(generation)
    assert all(
        generation[m]["identical"] and generation[m]["tok_s"] > 0
        for m in ("greedy_temp0", "sampled_temp0.7_seed7")
    )
    assert [n["role"] for n in record["nodes"]] == ["stage0", "tail"]
    assert [n["layer_range"] for n in record["nodes"]] == [[0, 2], [2, 4]]
    assert [(n["geo"], n["public_ip"]) for n in record["nodes"]] == [(s[2], s[3]) for s in STAGES]
    assert all(n["gpu_name"] and n["gpu_uuid"] for n in record["nodes"])
    assert record["topology"] == "WA → NJ → back"
    assert record["model"] == "toy" and record["quant"] == "fp32"
    assert "seed 20261129" in record["method"] and record["shard_commit"]
    assert run.verdict == "pass" and {p.verdict for p in run.proofs} == {"pass"}
    assert run.proof("on_swarm").summary["exact_check"]["identical"] == 3 * 120
    print(f"nightly with small sizes: {time.monotonic() - started:.1f} s end to end")

    client = web_client(live_swarm.db_url, live_swarm.redis_url)
    assert b"nightly-banner" not in client.get("/proofs/").data
    metrics = client.get("/metrics").get_data(as_text=True).splitlines()
    assert "specpipe_nightly_last_verdict 1.0" in metrics
    assert "specpipe_nightly_failures_total 0.0" in metrics


def test_a_verdict_faked_in_the_broker_is_not_reported_and_the_night_runs(live_swarm):
    """Someone with the broker's password watches the nightly queue and writes a passing
    outcome for the night `specpipe regression run` waits on, before any worker takes it. On
    main the command printed "verdict: pass" and the worker skipped the night; here the night
    runs, on a ring whose lossy tail fails it, and the command reports the stored verdict."""
    live_swarm.sizes = PLUMBING_SIZES
    live_swarm.start_stages(lossy_tail=True)
    command = subprocess.Popen(
        [sys.executable, "-m", "specpipe", "regression", "run", "--timeout", "150"],
        cwd=ROOT,
        env=live_swarm.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )

    def queued_key() -> str | None:
        for message in live_swarm.client.lrange(NIGHTLY_QUEUE, 0, -1):
            if found := re.search(rb"manual-[0-9a-f]{12}", message):
                return found.group().decode()
        return None

    try:
        key = wait_until(queued_key, 30, "the nightly task in the broker", interval_s=0.05)
        fake = {"key": key, "run_id": 1, "name": "run-faked", "verdict": "pass"}
        live_swarm.client.set(f"specpipe:{live_swarm.name}:nightly:result:{key}", json.dumps(fake))
        live_swarm.start_workers(1)
        out, err = command.communicate(timeout=200)
    finally:
        if command.poll() is None:
            command.kill()
            command.wait()
    assert command.returncode == 1, out + err
    [run] = nightly_runs(live_swarm.db_url)
    assert out.strip().splitlines()[-2:] == ["verdict: fail", run.name]
    assert "on_swarm: error: not the exact sampler on nj-1" in err  # why, on stderr
    assert run.night == key and run.verdict == "fail"
    assert [
        a.split()[-1] for a in live_swarm.client.lrange(attempts_key(live_swarm.name, key), 0, -1)
    ] == [b"ran"]


@pytest.mark.slow
def test_a_lossy_tail_is_a_failed_run_flagged_on_the_web_and_in_metrics(live_swarm, monkeypatch):
    live_swarm.start_stages(lossy_tail=True)
    live_swarm.start_workers(1)
    key = manual_key()  # as `specpipe regression run` asks: no key but tonight's or one of these
    enqueue(live_swarm, monkeypatch, key=key)
    outcome = live_swarm.wait_result(key)
    assert outcome["verdict"] == "fail"

    [run] = nightly_runs(live_swarm.db_url)
    assert run.verdict == "fail"
    assert run.proof("local_math").verdict == "pass"  # the math is fine; the swarm is not
    on_swarm = run.proof("on_swarm")
    assert on_swarm.verdict == "fail"
    exact = on_swarm.summary["exact_check"]
    assert exact["identical"] < exact["pairs"]
    assert run.proof("generation").verdict == "fail"
    [flagged] = [p for p in run.proofs if p.verdict == "error"]  # the inventory said so too
    assert flagged.kind == "on_swarm"
    assert flagged.summary["error"].startswith("not the exact sampler on nj-1 ('lossy'):")

    client = web_client(live_swarm.db_url, live_swarm.redis_url)
    for page in ("/", "/proofs/", "/nodes/"):
        html = client.get(page).get_data(as_text=True)
        assert 'id="nightly-banner"' in html, page
        assert run.name in html
    detail = client.get(f"/proofs/{run.id}").get_data(as_text=True)
    assert "badge-fail" in detail and "same-seed draws differ" in detail
    assert "not the exact sampler on nj-1" in detail and "NOT lossless" in detail
    metrics = client.get("/metrics").get_data(as_text=True).splitlines()
    assert "specpipe_nightly_last_verdict 0.0" in metrics
    assert "specpipe_nightly_failures_total 1.0" in metrics


@pytest.mark.slow
def test_a_stage_flagged_lossy_fails_the_night_even_when_the_proofs_pass(live_swarm, monkeypatch):
    # The lossy sampler on the head biases nothing (only a tail samples), so the proofs pass:
    # the inventory's record of it alone must keep the night from passing.
    live_swarm.start_stages(lossy_head=True)
    for name, value in SMALL_SIZES.items():
        monkeypatch.setenv(name, value)
    sizes = nightly_sizes()
    # No coordinator key pinned: the shared-key mode, opted into out loud.
    swarm = Settings.from_env().for_swarm(
        live_swarm.redis_url, live_swarm.name, live_swarm.key, insecure_shared_key=True
    )
    with make_session_factory(live_swarm.db_url)() as session:
        run = run_nightly(session, toy_target(), swarm, sizes["seed"], sizes)
        assert run.verdict == "error", [(p.kind, p.summary.get("reasons")) for p in run.proofs]
        verdicts = [(p.kind, p.verdict) for p in run.proofs]
        assert verdicts == [
            ("local_math", "pass"),
            ("on_swarm", "pass"),
            ("generation", "pass"),
            ("on_swarm", "error"),
        ]
        reason = run.proofs[-1].summary["error"]
        assert reason.startswith("not the exact sampler on wa-1 ('lossy'):")
        assert "nj-1" not in reason and "NOT lossless" in reason
        assert [n.host for n in ring_nodes(session)] == ["wa-1", "nj-1"]  # the ring it ran on
    records = inventory.load(live_swarm.client, live_swarm.name, live_swarm.key)
    assert sorted((n.host, n.sampler) for n in records) == [("nj-1", "exact"), ("wa-1", "lossy")]


@pytest.mark.slow
def test_two_schedulers_firing_at_once_store_one_run(live_swarm, monkeypatch):
    live_swarm.sizes = PLUMBING_SIZES
    live_swarm.start_stages()
    live_swarm.start_workers(2)
    enqueue(live_swarm, monkeypatch)  # beat's own call: the key is tonight's date
    enqueue(live_swarm, monkeypatch)

    def both_attempts() -> tuple[bytes, list[bytes]] | None:
        # The night's key is its date in the swarm's time zone, UTC here (the day before, if
        # midnight passed since enqueuing).
        today = utcnow().date()
        for day in (today - timedelta(days=1), today):
            key = attempts_key(live_swarm.name, f"night-{day.isoformat()}")
            attempts = live_swarm.client.lrange(key, 0, -1)
            if len(attempts) == 2:
                return key.encode(), attempts
        return None

    key, attempts = wait_until(both_attempts, 150, "both workers' attempts", interval_s=0.2)
    outcome = live_swarm.wait_result(key.decode().rsplit(":", 1)[1])
    assert sorted(a.split()[-1] for a in attempts) == [b"ran", b"skipped"]
    assert len({a.split()[0] for a in attempts}) == 2  # two different worker processes
    runs = nightly_runs(live_swarm.db_url)
    assert [r.name for r in runs] == [outcome["name"]]
    with make_session_factory(live_swarm.db_url)() as session:
        assert session.scalar(select(func.count()).select_from(Run)) == 1
