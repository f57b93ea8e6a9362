"""The fault matrix: faults injected into the running stack while it runs jobs, and what became
of every job.

The stack runs as `specpipe up` runs it (`benchstack.Stack`: a private Redis, three or more
stages, the coordinator, beat and the web app under the supervisor, which restarts whatever
dies). Jobs go in through the one submission path (`workers.submission.Submitter`) and are
followed in the store. Each job's reference is the same job run in this process over the whole
model (what `specpipe generate --local` does, same prompt, seed and settings), so a job counts
as *identical* only when its tokens equal the reference's.

Faults, each injected while a job is running, at a random round of it:

- `kill-stage0`, `kill-middle`, `kill-tail`: SIGKILL of that stage process;
- `kill-coordinator`: SIGKILL of the Celery coordinator (its job is picked up again by beat);
- `kill-redis`: SIGKILL of the private Redis with one job running and more queued;
- `stop-stage`: SIGSTOP of the middle stage for `stop_s` seconds, then SIGCONT;
- `db-down`: the database unreachable for `db_down_s` seconds. With PostgreSQL the stack
  reaches it through a TCP relay in this process, which drops every connection and refuses new
  ones for that long (the network to the database gone); with SQLite another connection holds
  the file's write lock for that long (a backup or a stray writer), so every write times out;
- `resplit`: the middle stage restarted, under its own host name, with a different layer range
  (widened to the last layer, or with a boundary moved); the original is stopped first. A job
  must re-route or fail with a reason, never finish with different tokens.

Every job ends in one column: identical, different (it finished with other tokens than the
reference: must be 0), failed (with its reason), lost (the store no longer has it: must be 0)
or stuck (not finished `deadline_s` after the fault: must be 0). Time to recover is from the
end of the fault (the kill, the SIGCONT, the database back) to the job's next stored round or
its end.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import sqlite3
import statistics
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import ClassVar

from sqlalchemy.engine import make_url

from specpipe.bench.stack import Stack, StackError
from specpipe.settings import JOB_DEFAULTS

Log = Callable[[str], None]
FAULTS = (
    "kill-stage0",
    "kill-middle",
    "kill-tail",
    "kill-coordinator",
    "kill-redis",
    "stop-stage",
    "db-down",
    "resplit",
)
FINAL = ("done", "failed", "cancelled")
PROMPTS = (
    "Explain why the sky is blue to a ten-year-old.",
    "List five uses for a paperclip.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
)


@dataclass(frozen=True)
class JobPlan:
    """One job's request."""

    prompt: str
    seed: int
    max_new_tokens: int
    temp: float = 0.8
    top_p: float = 0.95
    top_k: int = 0
    draft_k: int = 4
    sampler: str = JOB_DEFAULTS["sampler"]
    # The plans never ask for log-probabilities; not a field, so a plan's record stays as it was.
    logprobs: ClassVar[None] = None

    def params(self) -> dict:
        """The request as `Submitter.submit` takes it."""
        return {
            "prompt": self.prompt,
            "max_new_tokens": self.max_new_tokens,
            "temp": self.temp,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "draft_k": self.draft_k,
            "stop": [],
            "sampler": self.sampler,
        }


@dataclass
class Reference:
    """A plan's tokens without faults, and the rounds the ring takes for them."""

    tokens: list[int]
    rounds: int


@dataclass
class JobOutcome:
    """What became of one job."""

    job_id: int
    outcome: str  # identical, different, failed, lost or stuck
    status: str | None
    reason: str | None = None
    attempts: int = 0


@dataclass
class Trial:
    """One injected fault and the jobs it hit."""

    fault: str
    detail: str
    injected: bool
    round_at: int | None = None  # rounds the running job had stored when the fault came
    recover_s: float | None = None
    jobs: list[JobOutcome] = field(default_factory=list)


class References:
    """Reference runs in this process over the whole model, one per plan."""

    def __init__(self, model: str) -> None:
        from specpipe.decoding.local_ring import LocalRing
        from specpipe.decoding.target import open_target

        self.target = open_target(model)
        self.ring = LocalRing(self.target.load_stages(1))
        self._done: dict[JobPlan, Reference] = {}

    def get(self, plan: JobPlan) -> Reference:
        from models.jobs import sampling_params
        from specpipe.decoding.generation import Generation

        if plan not in self._done:
            run = Generation(
                self.ring,
                f"ref-{plan.seed}",
                self.target.prompt_ids(plan.prompt),
                sampling_params(plan),
                max_new_tokens=plan.max_new_tokens,
                draft_k=plan.draft_k,
                eos_ids=self.target.eos_ids,
            )
            tokens = run.run()
            self.ring.drop(run.session)
            self._done[plan] = Reference(tokens, run.stats.rounds)
        return self._done[plan]


class Jobs:
    """Submits jobs to a running stack and reads them back from its store."""

    def __init__(
        self,
        stack: Stack,
        references: References,
        store_url: str,
        max_new_tokens: int,
        rng: random.Random,
    ) -> None:
        from models.db import make_session_factory
        from specpipe.settings import JobLimits
        from workers.submission import Submitter

        self.stack, self.references, self.rng = stack, references, rng
        self.max_new_tokens = max_new_tokens
        self.session = make_session_factory(store_url)()
        limits = JobLimits(max_active_jobs=1000, max_new_tokens=max(4096, max_new_tokens))
        self.submitter = Submitter.connect(stack.redis_url, stack.model, limits)
        self.plans: dict[int, JobPlan] = {}

    def plan(self, min_rounds: int = 4) -> JobPlan:
        """A plan whose clean run takes at least `min_rounds` rounds (a fault can land)."""
        for _ in range(50):
            plan = JobPlan(self.rng.choice(PROMPTS), self.rng.randrange(2**32), self.max_new_tokens)
            if self.references.get(plan).rounds >= min_rounds:
                return plan
        raise RuntimeError(f"no seed gives a job of {min_rounds} rounds: raise --tokens")

    def submit(self, plan: JobPlan) -> int:
        job = self.submitter.submit(self.session, plan.params())
        self.plans[job.id] = plan
        return job.id

    def read(self, job_id: int):
        """The job as stored now (None when the store does not have it)."""
        from models.jobs import Job

        self.session.rollback()  # end the last read's transaction: see what is stored now
        self.session.expire_all()
        return self.session.get(Job, job_id)

    def wait_round(self, job_id: int, rounds: int, timeout_s: float) -> int | None:
        """Wait until the job has stored `rounds` rounds; returns the rounds stored then, or
        None when it ended (or never got there) first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            job = self.read(job_id)
            if job is None or job.status in FINAL:
                return None
            if job.status == "running" and job.rounds >= rounds:
                return job.rounds
            time.sleep(0.01)
        return None

    def follow(
        self, job_ids: list[int], since: float, deadline_s: float, progress: int
    ) -> tuple[list[JobOutcome], float | None]:
        """Wait for every job to end (at most `deadline_s` after `since`); returns their
        outcomes and the seconds from `since` until the first job stored more than `progress`
        rounds or ended."""
        recover_s = None
        pending = list(job_ids)
        ended: dict[int, JobOutcome] = {}
        while pending and time.monotonic() - since < deadline_s:
            for job_id in list(pending):
                job = self.read(job_id)
                if job is None:
                    ended[job_id] = JobOutcome(job_id, "lost", None, "the store has no such job")
                elif job.status in FINAL:
                    ended[job_id] = self.judge(job)
                if (
                    job_id == job_ids[0]
                    and recover_s is None
                    and (job is None or job.status in FINAL or job.rounds > progress)
                ):
                    recover_s = time.monotonic() - since
                if job_id in ended:
                    pending.remove(job_id)
            time.sleep(0.05)
        for job_id in pending:
            job = self.read(job_id)
            ended[job_id] = JobOutcome(
                job_id,
                "stuck",
                job.status if job else None,
                f"not finished {deadline_s:g} s after the fault",
                job.attempts if job else 0,
            )
        return [ended[j] for j in job_ids], recover_s

    def judge(self, job) -> JobOutcome:
        """identical, different or failed, for a finished job."""
        if job.status != "done":
            return JobOutcome(job.id, "failed", job.status, job.error, job.attempts)
        want = self.references.get(self.plans[job.id]).tokens
        if list(job.output_ids) == want:
            return JobOutcome(job.id, "identical", "done", None, job.attempts)
        return JobOutcome(
            job.id,
            "different",
            "done",
            f"{len(job.output_ids)} tokens, {len(want)} in the reference, first "
            f"difference at {_first_difference(job.output_ids, want)}",
            job.attempts,
        )

    def close(self) -> None:
        self.session.close()


def _first_difference(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


class DbRelay:
    """A TCP relay to a PostgreSQL server that can drop every connection and refuse new ones
    for a while: the database unreachable, as a network fault makes it."""

    def __init__(self, host: str, port: int) -> None:
        self.upstream = (host, port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.down = threading.Event()
        self.closed = threading.Event()
        self.sockets: set[socket.socket] = set()
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.down.is_set():
                client.close()
                continue
            try:
                server = socket.create_connection(self.upstream, timeout=5)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            with self.lock:
                self.sockets |= {client, server}
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        for s in (source, sink):
            self._close(s)

    def _close(self, s: socket.socket) -> None:
        with self.lock:
            self.sockets.discard(s)
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        s.close()

    def outage(self, seconds: float) -> None:
        """Drop every connection and refuse new ones for `seconds`."""
        self.down.set()
        with self.lock:
            live = list(self.sockets)
        for s in live:
            self._close(s)
        time.sleep(seconds)
        self.down.clear()

    def close(self) -> None:
        self.closed.set()
        self.listener.close()
        with self.lock:
            live = list(self.sockets)
        for s in live:
            self._close(s)


def lock_sqlite(path: str, seconds: float) -> None:
    """Hold the SQLite database's write lock for `seconds`: every other writer times out."""
    conn = sqlite3.connect(path, timeout=30, isolation_level=None)
    try:
        conn.execute("BEGIN EXCLUSIVE")
        time.sleep(seconds)
        conn.execute("ROLLBACK")
    finally:
        conn.close()


def resplit_variants(layers: dict[str, tuple[int, int]], n_layers: int) -> list[tuple[int, int]]:
    """Other layer ranges for the middle stage: widened to the last layer, its start moved
    back, its end moved on (each where the model's layers allow it)."""
    roles = sorted(layers, key=lambda r: layers[r][0])
    first_end = layers[roles[0]][1]
    start, end = layers[roles[len(roles) // 2]]
    variants = [(start, n_layers)]
    if start - 1 >= 1 and start - 1 < first_end:
        variants.append((start - 1, end))
    if end + 1 < n_layers:
        variants.append((start, end + 1))
    return list(dict.fromkeys(v for v in variants if v != (start, end)))


class Matrix:
    """Runs the faults on one stack and collects the trials."""

    def __init__(
        self,
        stack: Stack,
        jobs: Jobs,
        rng: random.Random,
        log: Log,
        *,
        deadline_s: float,
        stop_s: float,
        db_down_s: float,
        db_fault: Callable[[float], None] | None = None,
        queued: int = 2,
    ) -> None:
        self.stack, self.jobs, self.rng, self.log = stack, jobs, rng, log
        self.deadline_s, self.stop_s, self.db_down_s = deadline_s, stop_s, db_down_s
        self.db_fault, self.queued = db_fault, queued
        self.middle = f"stage{stack.stages // 2}"
        self.tail = f"stage{stack.stages - 1}"
        self.trials: list[Trial] = []

    def run(self, fault: str, count: int) -> None:
        """Inject `fault` `count` times, one job (or a few) each time."""
        for i in range(count):
            trial = self.trial(fault, i)
            self.trials.append(trial)
            seen = ", ".join(
                f"{o.job_id}: {o.outcome}" + (f" ({o.reason})" if o.reason else "")
                for o in trial.jobs
            )
            recover = f"{trial.recover_s:.1f} s" if trial.recover_s is not None else "-"
            self.log(
                f"{fault} {i + 1}/{count} {trial.detail} at round {trial.round_at}: {seen}; "
                f"recovered in {recover}"
            )
            self.stack.wait_ready()

    def trial(self, fault: str, index: int) -> Trial:
        inject, detail, cleanup = self.injector(fault, index)
        extra = self.queued if fault == "kill-redis" else 0
        for _ in range(5):
            plans = [self.jobs.plan(min_rounds=6) for _ in range(1 + extra)]
            ids = [self.jobs.submit(plan) for plan in plans]
            last = self.jobs.references.get(plans[0]).rounds - 2
            at = self.jobs.wait_round(ids[0], self.rng.randint(1, max(1, last)), self.deadline_s)
            if at is not None:
                break
            self.jobs.follow(ids, time.monotonic(), self.deadline_s, 0)  # let it end, try again
        else:
            return Trial(fault, detail, False)
        try:
            inject()
            ended = time.monotonic()
            # What the job had stored when the fault ended; a round stored later is recovery.
            job = self.jobs.read(ids[0])
            stored = job.rounds if job is not None else at
            outcomes, recover_s = self.jobs.follow(ids, ended, self.deadline_s, stored)
        finally:
            cleanup()
        return Trial(fault, detail, True, at, recover_s, outcomes)

    def injector(self, fault: str, index: int) -> tuple[Callable, str, Callable]:
        """(inject, what it does, clean-up) for `fault`."""
        stack, nothing = self.stack, lambda: None
        kills = {
            "kill-stage0": "stage0",
            "kill-middle": self.middle,
            "kill-tail": self.tail,
            "kill-coordinator": "coordinator",
            "kill-redis": "redis",
        }
        if fault in kills:
            role = kills[fault]
            return lambda: stack.signal(role, signal.SIGKILL), f"SIGKILL {role}", nothing
        if fault == "stop-stage":

            def stop() -> None:
                pid = stack.signal(self.middle, signal.SIGSTOP)
                time.sleep(self.stop_s)
                os.kill(pid, signal.SIGCONT)

            return stop, f"SIGSTOP {self.middle} {self.stop_s:g} s", nothing
        if fault == "db-down":
            if self.db_fault is None:
                raise ValueError("no way to take this stack's database away")
            return lambda: self.db_fault(self.db_down_s), f"{self.db_down_s:g} s", nothing
        if fault == "resplit":
            return self.resplitter(index)
        raise ValueError(f"unknown fault {fault!r}")

    def resplitter(self, index: int) -> tuple[Callable, str, Callable]:
        """Stop the middle stage and start it again, under its host name, with other layers."""
        n_layers = max(end for _, end in self.stack.layers.values())
        variants = resplit_variants(self.stack.layers, n_layers)
        layers = variants[index % len(variants)]
        started: list[subprocess.Popen] = []
        old: list[int] = []

        def inject() -> None:
            process = self.stack.processes()[self.middle]
            argv, env = process.cmdline(), process.environ()
            host = self.stack.stage_host(self.middle)
            argv[argv.index("--layers") + 1] = f"{layers[0]}:{layers[1]}"
            old.append(self.stack.signal(self.middle, signal.SIGSTOP))
            started.append(
                subprocess.Popen(
                    argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
                )
            )
            deadline = time.monotonic() + 300
            while self.stack.online_stages().get(host) != layers:
                if started[0].poll() is not None or time.monotonic() > deadline:
                    raise StackError(f"the re-split stage {host} {layers} did not come online")
                time.sleep(0.1)

        def cleanup() -> None:
            for process in started:
                process.terminate()
                try:
                    process.wait(30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            for pid in old:  # the supervisor starts it again with its own layers
                try:
                    os.kill(pid, signal.SIGKILL)
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
            self.stack.wait_ready()

        a, b = self.stack.layers[self.middle]
        return inject, f"{self.middle} {a}:{b} -> {layers[0]}:{layers[1]}", cleanup


def summarise(trials: list[Trial]) -> list[dict]:
    """One row per fault: injected, identical, different, failed, lost, stuck, recovery."""
    rows = []
    for fault in dict.fromkeys(t.fault for t in trials):
        these = [t for t in trials if t.fault == fault]
        outcomes = [o for t in these for o in t.jobs]
        count = {
            kind: sum(o.outcome == kind for o in outcomes)
            for kind in ("identical", "different", "failed", "lost", "stuck")
        }
        recover = [t.recover_s for t in these if t.recover_s is not None]
        rows.append(
            {
                "fault": fault,
                "injected": sum(t.injected for t in these),
                "jobs": len(outcomes),
                **count,
                "failed_reasons": sorted(
                    {o.reason or o.status for o in outcomes if o.outcome == "failed"}
                ),
                "recover_s_median": statistics.median(recover) if recover else None,
                "recover_s_max": max(recover) if recover else None,
            }
        )
    return rows


def table(rows: list[dict]) -> list[str]:
    """The summary as aligned text lines."""
    head = (
        "FAULT",
        "INJECTED",
        "JOBS",
        "IDENTICAL",
        "DIFFERENT",
        "FAILED",
        "LOST",
        "STUCK",
        "RECOVER s (median/max)",
    )
    lines = [head]
    for r in rows:
        recover = "-"
        if r["recover_s_median"] is not None:
            recover = f"{r['recover_s_median']:.1f} / {r['recover_s_max']:.1f}"
        lines.append(
            (
                r["fault"],
                str(r["injected"]),
                str(r["jobs"]),
                str(r["identical"]),
                str(r["different"]),
                str(r["failed"]),
                str(r["lost"]),
                str(r["stuck"]),
                recover,
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    text = [
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines
    ]
    for r in rows:
        for reason in r["failed_reasons"]:
            text.append(f"  {r['fault']} failed: {reason}")
    return text


def run_matrix(
    model: str,
    counts: dict[str, int],
    workdir: Path,
    log: Log,
    *,
    stages: int = 3,
    tokens: int = 48,
    postgres: str | None = None,
    stop_s: float = 30.0,
    db_down_s: float = 10.0,
    deadline_s: float = 300.0,
    seed: int = 0,
    env: dict[str, str] | None = None,
) -> dict:
    """Every fault in `counts` (fault -> times), on a stack of `stages` stages of `model`.

    `db-down` runs on a stack of its own on PostgreSQL (`postgres`, a server URL: a database is
    created there and dropped after) when given, else on the SQLite stack. Returns the summary
    rows, every trial, and a verdict: PASS when no job was lost, stuck or different."""
    if stages < 3:
        raise ValueError("the matrix needs at least 3 stages: stage 0, a middle one and the tail")
    unknown = set(counts) - set(FAULTS)
    if unknown:
        raise ValueError(f"unknown faults: {', '.join(sorted(unknown))}")
    rng = random.Random(seed)
    references = References(model)
    on_sqlite = [f for f in FAULTS if counts.get(f) and not (f == "db-down" and postgres)]
    trials: list[Trial] = []
    setup = {
        "model": model,
        "stages": stages,
        "tokens": tokens,
        "stop_s": stop_s,
        "db_down_s": db_down_s,
        "deadline_s": deadline_s,
        "counts": counts,
    }
    if on_sqlite:
        with Stack(model, stages, workdir / "sqlite", env=env) as stack:
            log(f"stack up: {stages} stages of {model}, SQLite store, {stack.web_url}")
            db_path = make_url(stack.database_url).database
            jobs = Jobs(stack, references, stack.database_url, tokens, rng)
            matrix = Matrix(
                stack,
                jobs,
                rng,
                log,
                deadline_s=deadline_s,
                stop_s=stop_s,
                db_down_s=db_down_s,
                db_fault=lambda s: lock_sqlite(db_path, s),
            )
            try:
                for fault in on_sqlite:
                    matrix.run(fault, counts[fault])
            finally:
                jobs.close()
            trials += matrix.trials
            if "db-down" in on_sqlite:
                setup["db_fault"] = "SQLite: the write lock held by another connection"
    if postgres and counts.get("db-down"):
        trials += _postgres_db_down(
            model,
            stages,
            tokens,
            postgres,
            counts["db-down"],
            workdir,
            references,
            rng,
            log,
            deadline_s,
            db_down_s,
            env,
        )
        setup["db_fault"] = "PostgreSQL: a relay drops every connection and refuses new ones"
    rows = summarise(trials)
    bad = sum(r["different"] + r["lost"] + r["stuck"] for r in rows)
    missed = [r["fault"] for r in rows if r["injected"] < counts.get(r["fault"], 0)]
    return {
        "setup": setup,
        "rows": rows,
        "trials": [asdict(t) for t in trials],
        "not_injected": missed,
        "verdict": "PASS" if not bad else "FAIL",
    }


def _postgres_db_down(
    model,
    stages,
    tokens,
    postgres,
    count,
    workdir,
    references,
    rng,
    log,
    deadline_s,
    db_down_s,
    env,
) -> list[Trial]:
    from sqlalchemy import create_engine, text

    from models.db import get_engine, normalize_url

    base = make_url(normalize_url(postgres))
    name = f"{base.database}_faults_{os.getpid()}_{rng.randrange(10**6)}"
    admin = create_engine(base, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    direct = base.set(database=name)
    relay = DbRelay(direct.host or "127.0.0.1", direct.port or 5432)
    relayed = direct.set(host="127.0.0.1", port=relay.port)
    direct_url = direct.render_as_string(hide_password=False)
    try:
        home = workdir / "postgres"
        with Stack(
            model, stages, home, database_url=relayed.render_as_string(hide_password=False), env=env
        ) as stack:
            log(f"stack up: {stages} stages of {model}, PostgreSQL through a relay")
            jobs = Jobs(stack, references, direct_url, tokens, rng)
            matrix = Matrix(
                stack,
                jobs,
                rng,
                log,
                deadline_s=deadline_s,
                stop_s=0,
                db_down_s=db_down_s,
                db_fault=relay.outage,
            )
            try:
                matrix.run("db-down", count)
            finally:
                jobs.close()
            return matrix.trials
    finally:
        relay.close()
        get_engine(direct_url).dispose()
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
