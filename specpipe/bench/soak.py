"""`specpipe bench soak`: users on the JSON API of a WAN lab for a while, under a chaos schedule.

The lab (`specpipe/ops/lab.py`) has five hosts: four serve the model's layers in four even
ranges, each with its outgoing link delayed by its share of the reference geography (one way
11, 8, 3.4 and 19 ms), and a spare, h4, serves a copy of h2's range with h2's delay, so a job
has somewhere to go when h2 fails. Host 0 also runs the registry, the coordinator, beat, the
store and the web app.

Users (each with an API token of its own, `api_load.make_users`) submit jobs through
`POST /api/v1/jobs` in waves (`api_load.submit_all`: one job per user, the next wave once the
last has ended) for `minutes`. Meanwhile the chaos schedule, drawn from `seed`, injects one
fault at a time, each while a job is running, with `pause_s` between them:

- `link-cut`: a stage host's link down for `hold_s`, then up (its stage and Redis gone at once);
- `redis-stall`: a stage host's Redis stopped (SIGSTOP) for `hold_s`, then SIGCONT;
- `kill-stage`: SIGKILL of a stage's process group, restarted at once with the same argv;
- `kill-coordinator`: SIGKILL of the coordinator's process group, restarted at once;
- `redis-fill`: a stage host's Redis capped a little above the memory it uses and filled with
  junk until it refuses writes, held for `hold_s`, then the junk deleted and the cap lifted;
- `clock-skew`: a stage restarted with its wall clock 60 s ahead (libfaketime's LD_PRELOAD),
  left so for `hold_s`, then restarted with the true time. Left out when libfaketime is not
  installed (`pip install libfaketime`).

The faults on a stage host hit h2 or h4 (the seed picks), the range that has a copy. The
schedule shuffles every kind once per round, so a round injects each kind once; the soak runs
at least one round, and further faults until `minutes` are up.

Once the time is up and no more jobs go in, every job must end within `deadline_s`. Each job
ends in one of faults.py's columns: identical (its tokens equal the same job run in this
process over the whole model), different, failed (with its reason), lost (the store no longer
has it) or stuck (not ended by the deadline). A fault's recovery time is from its end (the
link up, the SIGCONT, the restart, the junk deleted) to the next round any job stores or its
end as done; its stall is what it cost a running job: the longest any job running when it
began waited from then for its next round (or its end), reported apart for the faults whose
host's stage was serving rounds as they came (its count grew over the heartbeats before; the
spare or the copy idles while the other serves). Tokens per minute are counted per
minute of the soak, and the resident memory of every lab process (with its children) after
warm-up (a first job, then `warm_up_s` of the users' load before the first fault) and at the
end.

The verdict is FAIL on any lost, stuck or different job, or on a lab process whose memory grew
by more than `MEMORY_GROWTH` after warm-up (and by more than `MEMORY_FLOOR_MIB`, so tiny
processes do not trip it).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import statistics
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil
import redis

from specpipe.bench import api_load
from specpipe.bench.wan import REFERENCE_DELAYS_MS
from specpipe.ops.lab import PREFIX, Host, Lab
from specpipe.ops.supervisor import process_alive
from specpipe.settings import DEFAULT_HEARTBEAT_S
from specpipe.swarm.streams import stats_key

Log = Callable[[str], None]
KINDS = ("link-cut", "redis-stall", "kill-stage", "kill-coordinator", "redis-fill", "clock-skew")
STAGE_HOST_KINDS = tuple(k for k in KINDS if k != "kill-coordinator")
FINAL = ("done", "failed", "cancelled")
STAGES = 4
COPIED = 2  # the host whose layer range the spare serves too
SPARE = STAGES  # the spare's host index
SKEW = "+60s"
MEMORY_GROWTH = 0.10
MEMORY_FLOOR_MIB = 20.0
FILL_MARGIN = 2 * 2**20  # the cap on a filled Redis: this much above what it uses
JUNK_BYTES = 64 * 1024
RECOVER_WAIT_S = 120.0
SERVING_WINDOW_S = 3 * DEFAULT_HEARTBEAT_S  # how far back a stage's rounds tell it is serving


# --- the schedule ------------------------------------------------------------------------


@dataclass(frozen=True)
class Fault:
    """One planned fault: its kind, the host it hits and how long it lasts."""

    kind: str
    host: str
    hold_s: float


def schedule(
    seed: int,
    rounds: int,
    kinds: Sequence[str] = KINDS,
    targets: Sequence[str] = (f"h{COPIED}", f"h{SPARE}"),
    hold_s: tuple[float, float] = (3.0, 8.0),
) -> list[Fault]:
    """`rounds` rounds of faults, each round every kind once in a shuffled order; the host of a
    stage-host fault and each fault's length drawn from `seed` as well."""
    rng = random.Random(seed)
    faults = []
    for _ in range(rounds):
        order = list(kinds)
        rng.shuffle(order)
        for kind in order:
            host = "h0" if kind == "kill-coordinator" else rng.choice(list(targets))
            faults.append(Fault(kind, host, round(rng.uniform(*hold_s), 1)))
    return faults


def faketime_library() -> str | None:
    """libfaketime's preload library, when the `libfaketime` package is installed."""
    try:
        import libfaketime
    except ImportError:
        return None
    path = Path(libfaketime.__file__).parent / "vendor/libfaketime/src/libfaketime.so.1"
    return str(path) if path.is_file() else None


# --- what the store shows ----------------------------------------------------------------


@dataclass(frozen=True)
class Observation:
    """A job as the store showed it, recorded on every change: `t` is when the store wrote it
    (its `updated_at`, in seconds into the soak), not when the poll saw it."""

    t: float
    job_id: int
    status: str
    rounds: int
    generated_tokens: int


class Monitor:
    """Polls the store for every job in a thread; keeps each change as an Observation."""

    def __init__(self, database_url: str, started: float, interval_s: float = 0.1) -> None:
        from models.db import make_session_factory

        self.session = make_session_factory(database_url)()
        self.started, self.interval_s = started, interval_s
        self.wall_started = time.time() - (time.monotonic() - started)
        self.observations: list[Observation] = []
        self.latest: dict[int, Observation] = {}
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)

    def start(self) -> Monitor:
        self.thread.start()
        return self

    def now(self) -> float:
        return time.monotonic() - self.started

    def _poll(self) -> None:
        from sqlalchemy import select

        from models.db import as_utc
        from models.jobs import Job

        columns = (Job.id, Job.status, Job.rounds, Job.generated_tokens, Job.updated_at)
        while not self.stopped.is_set():
            try:
                self.session.rollback()
                with self.lock:
                    done = {j for j, o in self.latest.items() if o.status in FINAL}
                rows = self.session.execute(select(*columns).where(Job.id.not_in(done))).all()
            except Exception:  # the store busy or locked for a moment: the next poll sees it
                time.sleep(self.interval_s)
                continue
            now = self.now()
            with self.lock:
                for job_id, status, rounds, generated, updated_at in rows:
                    t = now
                    if updated_at is not None:
                        t = min(now, as_utc(updated_at).timestamp() - self.wall_started)
                    seen = Observation(t, job_id, status, rounds or 0, generated or 0)
                    last = self.latest.get(job_id)
                    if last is None or (last.status, last.rounds, last.generated_tokens) != (
                        seen.status,
                        seen.rounds,
                        seen.generated_tokens,
                    ):
                        self.observations.append(seen)
                        self.latest[job_id] = seen
            time.sleep(self.interval_s)

    def status(self, job_id: int) -> str | None:
        with self.lock:
            seen = self.latest.get(job_id)
        return seen.status if seen else None

    def running(self) -> list[int]:
        with self.lock:
            return [j for j, o in self.latest.items() if o.status == "running" and o.rounds]

    def snapshot(self) -> list[Observation]:
        with self.lock:
            return list(self.observations)

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(10)
        self.session.close()


def recovery_s(ended: float, observations: Sequence[Observation]) -> float | None:
    """Seconds from `ended` to the first round any job stored after it (or a job ending done);
    None when none did."""
    last: dict[int, Observation] = {}
    for seen in sorted(observations, key=lambda o: o.t):
        before = last.get(seen.job_id)
        last[seen.job_id] = seen
        if seen.t <= ended:
            continue
        progressed = seen.rounds > (before.rounds if before else 0)
        if progressed or (seen.status == "done" and (before is None or before.status != "done")):
            return seen.t - ended
    return None


def stall_s(
    started: float, job_ids: Sequence[int], observations: Sequence[Observation]
) -> float | None:
    """The longest any of `job_ids` (the jobs running when a fault began at `started`) waited
    from then for its next stored round or its end: what the fault cost a running job. None
    while one of them has neither."""
    waited = []
    for job_id in job_ids:
        seen = sorted((o for o in observations if o.job_id == job_id), key=lambda o: o.t)
        before = [o for o in seen if o.t <= started]
        if before and before[-1].status in FINAL:
            continue  # it had ended already; the poll saw that only after the fault began
        rounds = before[-1].rounds if before else 0
        moved = next(
            (o for o in seen if o.t > started and (o.rounds > rounds or o.status in FINAL)), None
        )
        if moved is None:
            return None
        waited.append(moved.t - started)
    return max(waited, default=0.0)


def tokens_per_minute(observations: Sequence[Observation], minutes: int) -> list[int]:
    """New tokens stored in each minute of the soak (a job's tokens counted once: a job run
    again from the start counts only those past the most it had before)."""
    most: dict[int, int] = {}
    per_minute = [0] * minutes
    for seen in sorted(observations, key=lambda o: o.t):
        gained = seen.generated_tokens - most.get(seen.job_id, 0)
        if gained > 0:
            most[seen.job_id] = seen.generated_tokens
            minute = int(seen.t // 60)
            if 0 <= minute < minutes:
                per_minute[minute] += gained
    return per_minute


# --- the chaos actions -------------------------------------------------------------------


@dataclass
class Injected:
    """One fault as it was injected: when it began and ended (seconds into the soak), what it
    did, and how long the jobs took to move again."""

    kind: str
    host: str
    hold_s: float
    started: float
    ended: float
    detail: str = ""
    running: list[int] = field(default_factory=list)  # the jobs running when it came
    # Whether the stage on its host had served rounds just before (None: not a stage's host).
    serving: bool | None = None
    recover_s: float | None = None
    stall_s: float | None = None  # the longest a running job waited for its next round
    error: str | None = None  # the fault could not be injected as planned


class Chaos:
    """The lab's processes and links, to disturb and to restore."""

    def __init__(self, lab: Lab, log: Log, faketime: str | None) -> None:
        self.lab, self.log, self.faketime = lab, log, faketime

    def host(self, name: str) -> Host:
        return next(h for h in self.lab.hosts() if h.name == name)

    def pid(self, name: str) -> int:
        return self.lab.state["processes"][name]

    def restart(self, host: str, name: str, env: dict[str, str] | None = None) -> int:
        """SIGKILL the process group of `host`-`name` and start it again with the same argv
        (and `env`); the new pid."""
        pid = self.pid(f"{host}-{name}")
        argv = psutil.Process(pid).cmdline()
        kill_group(pid)
        return self.lab.spawn(self.host(host), name, argv, env)

    def processed(self, host: str) -> int:
        """The rounds the stage on `host` has counted (its counters, on its own Redis)."""
        client = self.lab.admin_redis(self.host(host))
        try:
            return int(client.hget(stats_key(self.lab.state["swarm"], host), "processed") or 0)
        finally:
            client.close()

    def serving(self, host: str) -> bool:
        """Whether the stage on `host` serves rounds now: its count grew over a few heartbeats
        (the count is written at each)."""
        before = self.processed(host)
        time.sleep(SERVING_WINDOW_S)
        return self.processed(host) > before

    def wait_whole(self, timeout_s: float = 300.0) -> None:
        """Every serving host's stage registered afresh and the web app answering."""
        serving = [h.name for h in self.lab.hosts()[: len(self.lab.state["layers"])]]
        self.lab.wait_stages(serving, timeout_s)
        self.lab._wait(lambda: _healthy(self.lab.state["web_url"]), timeout_s, "the web app")


def kill_group(pid: int, timeout_s: float = 10.0) -> None:
    """SIGKILL `pid`'s process group (the process and its children) and reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while process_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def link_cut(chaos: Chaos, fault: Fault) -> str:
    veth = f"{PREFIX}{chaos.lab.state['id']}v{fault.host[1:]}"
    subprocess.run(["ip", "link", "set", veth, "down"], check=True)
    try:
        time.sleep(fault.hold_s)
    finally:
        subprocess.run(["ip", "link", "set", veth, "up"], check=True)
    return f"{veth} down {fault.hold_s:g} s"


def redis_stall(chaos: Chaos, fault: Fault) -> str:
    pid = chaos.pid(f"{fault.host}-redis")
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(fault.hold_s)
    finally:
        os.kill(pid, signal.SIGCONT)
    return f"SIGSTOP {fault.host}'s Redis {fault.hold_s:g} s"


def kill_stage(chaos: Chaos, fault: Fault) -> str:
    chaos.restart(fault.host, f"stage-{fault.host}")
    return f"SIGKILL stage-{fault.host}, restarted"


def kill_coordinator(chaos: Chaos, fault: Fault) -> str:
    chaos.restart(fault.host, "coordinator")
    return "SIGKILL the coordinator, restarted"


def redis_fill(chaos: Chaos, fault: Fault) -> str:
    client = chaos.lab.admin_redis(chaos.host(fault.host))
    try:
        before = client.config_get("maxmemory")["maxmemory"]
        used = int(client.info("memory")["used_memory"])
        client.config_set("maxmemory", used + FILL_MARGIN)
        junk, refused = [], False
        try:
            while len(junk) < 4 * FILL_MARGIN // JUNK_BYTES:
                key = f"soak:junk:{len(junk)}"
                try:
                    client.set(key, os.urandom(JUNK_BYTES))
                except redis.exceptions.OutOfMemoryError:
                    refused = True
                    break
                junk.append(key)
            time.sleep(fault.hold_s)
        finally:
            for i in range(0, len(junk), 100):
                client.delete(*junk[i : i + 100])
            client.config_set("maxmemory", before)
    finally:
        client.close()
    full = "refusing writes" if refused else "NOT refusing writes"
    return f"{fault.host}'s Redis capped at {(used + FILL_MARGIN) / 2**20:.1f} MiB, {full}"


def clock_skew(chaos: Chaos, fault: Fault) -> str:
    if chaos.faketime is None:
        raise RuntimeError("libfaketime is not installed")
    name = f"stage-{fault.host}"
    skewed = {"LD_PRELOAD": chaos.faketime, "FAKETIME": SKEW, "FAKETIME_DONT_FAKE_MONOTONIC": "1"}
    chaos.restart(fault.host, name, skewed)
    try:
        chaos.lab.wait_stages([fault.host], 120)
        time.sleep(fault.hold_s)
    finally:
        chaos.restart(fault.host, name)
    return f"{name} {SKEW} for {fault.hold_s:g} s, then restarted on time"


ACTIONS: dict[str, Callable[[Chaos, Fault], str]] = {
    "link-cut": link_cut,
    "redis-stall": redis_stall,
    "kill-stage": kill_stage,
    "kill-coordinator": kill_coordinator,
    "redis-fill": redis_fill,
    "clock-skew": clock_skew,
}


def _healthy(url: str) -> bool:
    status, _ = api_load.api(url, "", "GET", "/healthz", timeout_s=2)
    return status == 200


# --- the verdict -------------------------------------------------------------------------


def memory_grown(
    before: dict[str, float],
    after: dict[str, float],
    growth: float = MEMORY_GROWTH,
    floor_mib: float = MEMORY_FLOOR_MIB,
) -> list[str]:
    """The processes (MiB before and after) whose memory grew by more than `growth` of what
    it was and by more than `floor_mib`."""
    return sorted(
        name
        for name, mib in before.items()
        if name in after and after[name] - mib > max(growth * mib, floor_mib)
    )


def summarise_faults(injected: Sequence[Injected]) -> dict[str, dict]:
    """Per kind: how many were injected (and failed to be), recovery time p50 and max."""
    rows = {}
    for kind in dict.fromkeys(i.kind for i in injected):
        these = [i for i in injected if i.kind == kind]
        recover = [i.recover_s for i in these if i.recover_s is not None]
        stalls = [i.stall_s for i in these if i.stall_s is not None]
        serving = [i.stall_s for i in these if i.stall_s is not None and i.serving]
        rows[kind] = {
            "injected": sum(i.error is None for i in these),
            "errors": [i.error for i in these if i.error],
            "recover_s_p50": round(statistics.median(recover), 2) if recover else None,
            "recover_s_max": round(max(recover), 2) if recover else None,
            "unrecovered": sum(i.error is None and i.recover_s is None for i in these),
            "stall_s_p50": round(statistics.median(stalls), 2) if stalls else None,
            "stall_s_max": round(max(stalls), 2) if stalls else None,
            # The same over the faults whose host was serving rounds as they came.
            "on_serving_host": len(serving),
            "serving_stall_s_p50": round(statistics.median(serving), 2) if serving else None,
            "serving_stall_s_max": round(max(serving), 2) if serving else None,
        }
    return rows


def summarise_jobs(outcomes: Sequence[dict]) -> dict:
    """Counts of the jobs' outcomes, and the failed ones' reasons counted."""
    count = Counter(o["outcome"] for o in outcomes)
    reasons = Counter(o["reason"] or o["status"] for o in outcomes if o["outcome"] == "failed")
    return {
        "jobs": len(outcomes),
        **{k: count.get(k, 0) for k in ("identical", "different", "failed", "lost", "stuck")},
        "failed_reasons": dict(reasons.most_common()),
    }


def problems(jobs: dict, grown: Sequence[str]) -> list[str]:
    """What fails the soak: lost, stuck or different jobs, and processes that grew."""
    found = [f"{jobs[k]} {k}" for k in ("lost", "stuck", "different") if jobs[k]]
    if grown:
        found.append(f"memory grew: {', '.join(grown)}")
    return found


# --- the run -----------------------------------------------------------------------------


def bring_up(home: Path, model: str, delays: Sequence[float], log: Log) -> Lab:
    """The lab of four stages and h2's spare, its store migrated, serving `model`."""
    from models import migrate as migrations
    from specpipe.model.resolve import even_split, open_checkpoint

    layers = even_split(open_checkpoint(model).config.n_layers, STAGES)
    the_lab = Lab(home)
    try:
        state = the_lab.up(
            [*layers, layers[COPIED]], model, link_delays_ms=[*delays, delays[COPIED]]
        )
        log(f"lab {state['id']}: {STAGES} stages and h{SPARE} a spare of h{COPIED}, {model}")
        migrations.upgrade(state["database_url"])
        the_lab.serve(model)
    except BaseException:
        the_lab.down()
        raise
    return the_lab


def lab_rss_mib(lab: Lab) -> dict[str, float]:
    """Resident memory (MiB) of each lab process with its children."""
    sizes = {}
    for name, pid in lab.state["processes"].items():
        try:
            process = psutil.Process(pid)
            family = [process, *process.children(recursive=True)]
            sizes[name] = round(sum(p.memory_info().rss for p in family) / 2**20, 1)
        except psutil.Error:
            continue
    return sizes


class MemoryLog:
    """Every lab process's resident memory once a minute, in a thread: whether a process that
    grew levels off or keeps growing."""

    def __init__(self, lab: Lab, monitor: Monitor, every_s: float = 60.0) -> None:
        self.lab, self.monitor, self.every_s = lab, monitor, every_s
        self.samples: list[dict] = []
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)

    def start(self) -> MemoryLog:
        self.thread.start()
        return self

    def _sample(self) -> None:
        while not self.stopped.wait(self.every_s):
            self.samples.append({"t": round(self.monitor.now(), 1), **lab_rss_mib(self.lab)})

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(10)


class Users:
    """Waves of jobs from every user through the API, in a thread, until stopped."""

    def __init__(
        self, web_url: str, tokens: dict[str, str], monitor: Monitor, max_new_tokens: int
    ) -> None:
        self.web_url, self.tokens, self.monitor = web_url, tokens, monitor
        self.max_new_tokens = max_new_tokens
        self.submissions: list[api_load.Submission] = []
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._waves, daemon=True)

    def _waves(self) -> None:
        while not self.stopped.is_set():
            wave = api_load.submit_all(
                self.web_url, self.tokens, len(self.tokens), 1.0, self.max_new_tokens
            )
            self.submissions += wave
            ids = [s.job_id for s in wave if s.job_id is not None]
            time.sleep(0.5 if ids else 2.0)
            while ids and not all(self.monitor.status(j) in FINAL for j in ids):
                time.sleep(0.2)
                if self.stopped.is_set() and self.monitor.now() > self.give_up:
                    return

    def start(self) -> Users:
        self.give_up = float("inf")
        self.thread.start()
        return self

    def stop(self, deadline_s: float) -> None:
        self.give_up = self.monitor.now() + deadline_s
        self.stopped.set()
        self.thread.join(deadline_s + 30)

    def accepted(self) -> list[int]:
        return [s.job_id for s in self.submissions if s.job_id is not None]


def inject(chaos: Chaos, monitor: Monitor, fault: Fault, log: Log) -> Injected:
    """Note whether the fault's host is serving, wait for a running job (a minute at most),
    inject `fault`, wait for the jobs to move."""
    serving = None
    if fault.kind in STAGE_HOST_KINDS:
        try:
            serving = chaos.serving(fault.host)
        except (redis.RedisError, OSError):  # its Redis is still on its way back: say nothing
            serving = None
    deadline = time.monotonic() + 60
    while not monitor.running() and time.monotonic() < deadline:
        time.sleep(0.05)
    done = Injected(fault.kind, fault.host, fault.hold_s, monitor.now(), 0.0, serving=serving)
    done.running = monitor.running()
    try:
        done.detail = ACTIONS[fault.kind](chaos, fault)
    except Exception as exc:  # reported, the soak goes on
        done.error = f"{type(exc).__name__}: {exc}"
    done.ended = monitor.now()
    if done.error is None:
        limit = time.monotonic() + RECOVER_WAIT_S
        while None in (done.recover_s, done.stall_s) and time.monotonic() < limit:
            time.sleep(0.1)
            seen = monitor.snapshot()
            if done.recover_s is None:
                done.recover_s = recovery_s(done.ended, seen)
            if done.stall_s is None:
                done.stall_s = stall_s(done.started, done.running, seen)
    recover = f"{done.recover_s:.2f} s" if done.recover_s is not None else "-"
    stalled = f"{done.stall_s:.2f} s" if done.stall_s is not None else "-"
    where = {True: " (serving)", False: " (idle)", None: ""}[done.serving]
    log(
        f"[{done.started:6.1f} s] {fault.kind} on {fault.host}{where}: "
        f"{done.detail or done.error}; running {done.running}; recovered in {recover}; "
        f"a running job waited {stalled}"
    )
    return done


def outcomes(database_url: str, model: str, job_ids: Sequence[int]) -> list[dict]:
    """Each job's outcome as faults.py counts them; the done ones against their solo runs."""
    from sqlalchemy import select

    from models.db import make_session_factory
    from models.jobs import Job

    with make_session_factory(database_url)() as session:
        jobs = {j.id: j for j in session.scalars(select(Job).where(Job.id.in_(job_ids)))}
        rows = {j: (job.status, job.error) for j, job in jobs.items()}
    done = [j for j, (status, _) in rows.items() if status == "done"]
    different = set(api_load.solo_mismatches(model, database_url, done))
    found = []
    for job_id in job_ids:
        status, error = rows.get(job_id, (None, None))
        if status is None:
            outcome, reason = "lost", "the store has no such job"
        elif status == "done":
            outcome, reason = (
                ("different", "tokens differ")
                if job_id in different
                else (
                    "identical",
                    None,
                )
            )
        elif status in FINAL:
            outcome, reason = "failed", error
        else:
            outcome, reason = "stuck", f"{status} at the deadline"
        found.append({"job_id": job_id, "outcome": outcome, "status": status, "reason": reason})
    return found


def run_soak(
    model: str,
    home: Path,
    log: Log,
    *,
    minutes: float = 20.0,
    users: int = 3,
    seed: int = 0,
    tokens: int = 48,
    pause_s: float = 20.0,
    hold_s: tuple[float, float] = (3.0, 8.0),
    deadline_s: float = 600.0,
    warm_up_s: float = 60.0,
    delays: Sequence[float] = REFERENCE_DELAYS_MS,
) -> dict:
    """The soak on a lab in `home` (taken down after); the result, with its verdict."""
    faketime = faketime_library()
    kinds = [k for k in KINDS if k != "clock-skew" or faketime]
    left_out = [] if faketime else ["clock-skew (libfaketime is not installed)"]
    lab = bring_up(home, model, delays, log)
    chaos = Chaos(lab, log, faketime)
    injected: list[Injected] = []
    monitor = memory_log = None
    try:
        database_url, web_url = lab.state["database_url"], lab.state["web_url"]
        by_user = api_load.make_users(database_url, users, prefix="soak")
        warm = api_load.make_users(database_url, 1, prefix="warmup")
        status, answer = api_load.api(
            web_url,
            next(iter(warm.values())),
            "POST",
            "/api/v1/jobs",
            {"prompt": api_load.PROMPTS[0], "max_new_tokens": tokens},
        )
        if status != 201:
            raise RuntimeError(f"the warm-up job was refused: {status} {answer}")
        warmed = api_load.wait_jobs(database_url, [answer["id"]], deadline_s)[answer["id"]]
        if warmed["status"] != "done":
            raise RuntimeError(f"the warm-up job ended {warmed['status']}: {warmed['error']}")
        monitor = Monitor(database_url, time.monotonic()).start()
        crowd = Users(web_url, by_user, monitor, tokens).start()
        # A process's size after warm-up is its size once it has served the users' load (every
        # session's cache, the batches, the allocator's arenas), before the first fault.
        time.sleep(warm_up_s)
        rss_start = lab_rss_mib(lab)
        memory_log = MemoryLog(lab, monitor).start()
        log(f"{users} users on {web_url} for {minutes:g} min, faults {', '.join(kinds)}")
        plan = schedule(seed, 1 + int(minutes * 60 / max(pause_s, 1.0)), kinds, hold_s=hold_s)
        for i, fault in enumerate(plan):
            if i >= len(kinds) and monitor.now() > minutes * 60:
                break
            injected.append(inject(chaos, monitor, fault, log))
            chaos.wait_whole()
            time.sleep(max(0.0, min(pause_s, minutes * 60 - monitor.now())))
        while monitor.now() < minutes * 60:
            time.sleep(1.0)
        soak_s = monitor.now()
        log(f"time up at {soak_s:.0f} s: no more jobs; waiting for every job to end")
        crowd.stop(deadline_s)
        accepted = crowd.accepted()
        api_load.wait_jobs(database_url, accepted, deadline_s)
        time.sleep(2.0)
        rss_end = lab_rss_mib(lab)
        observations = monitor.snapshot()
    finally:
        if memory_log is not None:
            memory_log.stop()
        if monitor is not None:
            monitor.stop()
        lab.down()
    log(f"every done job against its solo run in this process ({len(accepted)} jobs)")
    jobs = outcomes(database_url, model, accepted)
    job_summary = summarise_jobs(jobs)
    grown = memory_grown(rss_start, rss_end)
    found = problems(job_summary, grown)
    subs = crowd.submissions
    return {
        "setup": {
            "model": model,
            "minutes": minutes,
            "users": users,
            "seed": seed,
            "tokens": tokens,
            "pause_s": pause_s,
            "hold_s": list(hold_s),
            "deadline_s": deadline_s,
            "warm_up_s": warm_up_s,
            "link_delays_ms": [*delays, delays[COPIED]],
            "spare": f"h{SPARE} serves h{COPIED}'s layers",
            "left_out": left_out,
        },
        "soak_s": round(soak_s, 1),
        "submitted": len(subs),
        "refused": dict(Counter(f"{s.status} {s.error}" for s in subs if s.job_id is None)),
        "jobs": job_summary,
        "faults": summarise_faults(injected),
        "injected": [asdict(i) for i in injected],
        "tokens_per_minute": tokens_per_minute(observations, max(1, int(-(-soak_s // 60)))),
        "memory_mib": {
            name: {"start": mib, "end": rss_end.get(name)} for name, mib in rss_start.items()
        },
        "memory_grown": grown,
        "memory_per_minute_mib": memory_log.samples,
        "problems": found,
        "outcomes": jobs,
        "verdict": "FAIL" if found else "PASS",
    }


def report(result: dict) -> list[str]:
    """The result as lines of text."""
    j = result["jobs"]
    lines = [
        f"soak {result['soak_s']:.0f} s, {result['submitted']} submitted "
        f"({sum(result['refused'].values())} refused): {j['jobs']} jobs, "
        f"{j['identical']} done identical to solo, {j['different']} different, "
        f"{j['failed']} failed, {j['lost']} lost, {j['stuck']} stuck",
    ]
    lines += [f"  failed ({n}): {reason}" for reason, n in j["failed_reasons"].items()]
    lines += [f"  refused ({n}): {why}" for why, n in result["refused"].items()]
    lines.append(
        "FAULT             INJECTED  RECOVER s p50 / max  UNRECOVERED  STALL s p50 / max"
        "  SERVING  ITS STALL s p50 / max"
    )
    for kind, row in result["faults"].items():
        recover = _p50_max(row["recover_s_p50"], row["recover_s_max"])
        stall = _p50_max(row["stall_s_p50"], row["stall_s_max"])
        serving = _p50_max(row["serving_stall_s_p50"], row["serving_stall_s_max"])
        lines.append(
            f"{kind:<17} {row['injected']:>8}  {recover:>19}  {row['unrecovered']:>11}  {stall:>17}"
            f"  {row['on_serving_host']:>7}  {serving:>21}"
        )
        lines += [f"  {kind} not injected: {e}" for e in row["errors"]]
    lines += [f"left out: {why}" for why in result["setup"]["left_out"]]
    per_minute = ", ".join(str(n) for n in result["tokens_per_minute"])
    lines.append(f"tokens per minute: {per_minute}")
    lines.append("memory (RSS MiB)       start     end")
    for name, m in result["memory_mib"].items():
        end = f"{m['end']:7.1f}" if m["end"] is not None else "      -"
        lines.append(f"  {name:<18} {m['start']:7.1f} {end}")
    for name in result["memory_grown"]:
        series = ", ".join(f"{m[name]:.0f}" for m in result["memory_per_minute_mib"] if name in m)
        lines.append(f"  {name} by minute: {series}")
    lines += [f"problem: {p}" for p in result["problems"]]
    lines.append(f"verdict {result['verdict']}")
    return lines


def _p50_max(p50: float | None, most: float | None) -> str:
    return "-" if p50 is None else f"{p50:.2f} / {most:.2f}"
