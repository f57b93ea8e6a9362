"""`specpipe bench soak`: users on the JSON API of a WAN lab for a while, under a chaos schedule.

The lab (`specpipe/ops/lab_hosts.py`) has five hosts: four serve the model's layers in four even
ranges, each with its outgoing link delayed by its share of the reference geography (one way
11, 8, 3.4 and 19 ms), and a spare, h4, serves a copy of h2's range with h2's delay, so a job
has somewhere to go when h2 fails. h1 and h3 have no copy. Host 0 also runs the registry and
broker (its Redis), the coordinator, beat, the store and the web app.

Users (each with an API token of its own, `api_load.make_users`) submit jobs through
`POST /api/v1/jobs` in waves (`api_load.submit_all`: `jobs_per_user` jobs from each user at
once, the next wave once the last has ended and the users' submission allowance lets it) for
`minutes`. Meanwhile the chaos schedule, drawn
from `seed`, injects faults, each while a job is running, with `pause_s` between them. On a
stage host (h1 to h4):

- `link-cut-5s`, `link-cut-30s`, `link-cut-90s`: its link down that long, then up (its stage
  and Redis gone at once); the 90 s one outlasts a round's wait (`ROUND_TIMEOUT_S`, 30 s);
- `redis-stall`: its Redis stopped (SIGSTOP) for `hold_s`, then SIGCONT;
- `redis-fill`: its Redis capped a little above the memory it uses and filled with junk until
  it refuses a write, held for `hold_s`, then the junk deleted and the cap lifted;
- `kill-stage`: SIGKILL of its stage's process group, restarted at once with the same argv;
- `oom-stage`: its stage moved into a memory cgroup of its own (v2, else v1) capped a little
  above what the group holds, and the group pushed over the cap by a helper that the kernel
  may not pick, so the kernel's OOM killer kills the stage (the group's `oom_kill` count must
  rise); then restarted at once;
- `clock-skew+2s`, `clock-skew-2s`, `clock-skew+20s`, `clock-skew-20s`: its stage restarted
  with its wall clock that far off (libfaketime's LD_PRELOAD, the monotonic clock left true),
  left so for `hold_s`, then restarted on time.

On host 0:

- `kill-coordinator`: SIGKILL of the coordinator's process group, restarted at once;
- `registry-kill`: SIGKILL of the registry's Redis (nothing supervises the lab's processes), and
  restarted at once with the same argv, its append-only file kept;
- `registry-stall-30s`: the registry's Redis stopped (SIGSTOP) 30 s, then SIGCONT;
- `registry-fill`: the registry's Redis filled until it refuses writes, as `redis-fill`;
- `head-clock-skew+2s`, `-2s`, `+20s`, `-20s`: the coordinator and beat restarted that far off
  (the web app stays on time, so the users' requests go on), left so for `hold_s`, then
  restarted on time.

A fill that did not make Redis refuse a write, and a skew that did not take (the process's
environment, libfaketime mapped in it, and a probe under the same settings must all show it),
are injection errors: reported, not counted as injected. Clock kinds are left out when
libfaketime is not installed (`pip install libfaketime`); `oom-stage` says why it could not be
injected where no memory cgroup can be made.

The schedule shuffles every kind once per round; a stage-host kind hits a host with a spare (h2
or h4) or one without (h1 or h3), drawn in even rounds and the other side in the odd ones, so
every two rounds hit both. With `overlap`, that share of the faults have a second one start
during them, on a host other than the first's and its copy. The soak runs at least one round,
and further faults until `minutes` are up. Nothing supervises the lab's processes: one that died
though no fault killed it (the coordinator, when its broker went away under it) is started
again after the fault, as `specpipe up`'s supervisor would, and reported.

Once the time is up and no more jobs go in, every job must end within `deadline_s`. Each job
ends in one of faults.py's columns: identical (its tokens equal the same job run in this
process over the whole model), different, failed (with its reason), lost (the store no longer
has it) or stuck (not ended by the deadline). A fault's jobs are those running when it came and
those that ended while it lasted or, no other fault in effect, within a round's wait after it
ended (the last to end). A fault's recovery time is from its end (the link up, the SIGCONT, the
restart, the junk deleted) to the next round any job stores or its end as done; its stall is
what it cost a running job: the longest any job running when it began waited from then for its
next round (or its end), reported apart for the faults whose host's stage was serving rounds as
they came (its count grew over the heartbeats before; the spare or the copy idles while the
other serves). A link cut on a serving host whose copy idled also has a takeover time: from the
cut to the first heartbeat at which the copy's round count had grown (where the copy served too,
the stall is the measure). Tokens per minute are counted per minute of the soak, and the
resident memory of every lab process (with its children) after warm-up (a first job, then
`warm_up_s` of the users' load before the first fault) and at the end.

What the soak promises (`recoverable`): a fault on a host with a spare, and any fault without
one whose outage is shorter than a round's wait (a restart, a held fault of under 30 s, a skewed
clock), fails no job; the long outages without a spare (`LONG_OUTAGES`: link cuts of 30 and
90 s on h1 or h3, the registry stopped 30 s) may fail the jobs they hit, with a reason, but
never lose one or leave it stuck. The verdict is FAIL on any lost, stuck or different job, on a
failed job that no unrecoverable fault touched, on a lab process that died of a fault that did
not kill it, on a link cut on a host with a spare that cost a running job more than
`cut_stall_s` (its stall, above; a cut that a second fault overlapped is reported but not
bounded, as the second costs what it costs alone), or on a lab process whose memory grew by
more than `MEMORY_GROWTH` after warm-up (and by more than `MEMORY_FLOOR_MIB`, so tiny processes
do not trip it).
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import psutil
import redis

from specpipe.bench import api_load
from specpipe.bench.wan import REFERENCE_DELAYS_MS
from specpipe.ops.lab_hosts import Host, Lab
from specpipe.ops.lab_network import PREFIX
from specpipe.ops.redis_server import answers
from specpipe.ops.supervisor import process_alive
from specpipe.settings import DEFAULT_HEARTBEAT_S
from specpipe.swarm import inventory, trust
from specpipe.swarm.redis_ring import ROUND_TIMEOUT_S
from specpipe.swarm.streams import stats_key

Log = Callable[[str], None]
STAGE_KINDS = (
    "link-cut-5s",
    "link-cut-30s",
    "link-cut-90s",
    "redis-stall",
    "redis-fill",
    "kill-stage",
    "oom-stage",
    "clock-skew+2s",
    "clock-skew-2s",
    "clock-skew+20s",
    "clock-skew-20s",
)
HEAD_KINDS = (
    "kill-coordinator",
    "registry-kill",
    "registry-stall-30s",
    "registry-fill",
    "head-clock-skew+2s",
    "head-clock-skew-2s",
    "head-clock-skew+20s",
    "head-clock-skew-20s",
)
KINDS = STAGE_KINDS + HEAD_KINDS
CLOCK_KINDS = tuple(k for k in KINDS if "clock-skew" in k)
LINK_CUTS = ("link-cut-5s", "link-cut-30s", "link-cut-90s")
# The kinds whose length is their own; the other held kinds draw theirs from `hold_s`, and the
# kills hold nothing.
FIXED_HOLD_S = {
    "link-cut-5s": 5.0,
    "link-cut-30s": 30.0,
    "link-cut-90s": 90.0,
    "registry-stall-30s": 30.0,
}
HELD = ("redis-stall", "redis-fill", "registry-fill", *CLOCK_KINDS)
SKEW_S = {k: float(k.rsplit("skew", 1)[1].rstrip("s")) for k in CLOCK_KINDS}  # "…-20s": -20.0
# Without a spare these outages are as long as a round's wait or longer: a job they hit may fail
# (with a reason). Every other fault, and every fault on a host with a spare, is recoverable.
LONG_OUTAGES = ("link-cut-30s", "link-cut-90s", "registry-stall-30s")
FINAL = ("done", "failed", "cancelled")
STAGES = 4
COPIED = 2  # the host whose layer range the spare serves too
SPARE = STAGES  # the spare's host index
SPARED = (f"h{COPIED}", f"h{SPARE}")  # the hosts a job can go around: each the other's copy
LONE = tuple(f"h{i}" for i in range(1, STAGES) if i != COPIED)  # stage hosts without a copy
HEAD_SKEWED = ("coordinator", "beat")  # host 0's processes a head clock skew restarts
CUT_STALL_S = 3.0  # the most a link cut on a host with a spare may cost a running job
MEMORY_GROWTH = 0.10
MEMORY_FLOOR_MIB = 20.0
FILL_MARGIN = 2 * 2**20  # the cap on a filled Redis: this much above what it uses
JUNK_BYTES = 64 * 1024
OOM_MARGIN = 8 * 2**20  # the cap on a stage's memory cgroup: this much above what it holds
SKEW_TOLERANCE_S = 1.0  # how far a probe's clock may be from the skew it was given
RECOVER_WAIT_S = 120.0
SERVING_WINDOW_S = 1.5  # how far back a stage's rounds tell it is serving


# --- the schedule ------------------------------------------------------------------------


@dataclass(frozen=True)
class Fault:
    """One planned fault: its kind, the host it hits and how long it lasts; with `overlap`, a
    second fault that starts `overlap_after_s` into this one."""

    kind: str
    host: str
    hold_s: float
    overlap: Fault | None = None
    overlap_after_s: float = 0.0


def twin(host: str) -> str | None:
    """The host serving a copy of `host`'s layers, if any."""
    return next((h for h in SPARED if h != host), None) if host in SPARED else None


def has_spare(host: str) -> bool:
    return twin(host) is not None


def recoverable(kind: str, spare: bool) -> bool:
    """Whether no job may fail of a `kind` fault on a host with (`spare`) or without a copy:
    with one, always; without, unless its outage is as long as a round's wait or longer."""
    return spare or kind not in LONG_OUTAGES


def schedule(
    seed: int,
    rounds: int,
    kinds: Sequence[str] = KINDS,
    hold_s: tuple[float, float] = (3.0, 8.0),
    overlap: float = 0.0,
) -> list[Fault]:
    """`rounds` rounds of faults, each round every kind once in a shuffled order. A stage-host
    kind's side (a host with a spare or without) is drawn in even rounds and flipped in odd
    ones, its host drawn within the side; a held fault's length is drawn from `hold_s`; with
    chance `overlap` a fault has a second, of any kind, on a host other than its own and its
    copy's. All drawn from `seed`."""
    rng = random.Random(seed)
    sides: dict[str, bool] = {}
    faults = []
    for r in range(rounds):
        order = list(kinds)
        rng.shuffle(order)
        for kind in order:
            if kind in STAGE_KINDS:
                if r % 2 == 0:
                    sides[kind] = rng.random() < 0.5
                spared = sides[kind] if r % 2 == 0 else not sides[kind]
                host = rng.choice(SPARED if spared else LONE)
            else:
                host = "h0"
            fault = Fault(kind, host, _hold(kind, rng, hold_s))
            if overlap > 0 and rng.random() < overlap:
                away = {host, twin(host)}
                choices = [(k, h) for k in kinds for h in _hosts(k) if h not in away]
                if choices:
                    kind2, host2 = rng.choice(choices)
                    second = Fault(kind2, host2, _hold(kind2, rng, hold_s))
                    after = round(rng.uniform(0.0, min(fault.hold_s, 10.0)), 1)
                    fault = replace(fault, overlap=second, overlap_after_s=after)
            faults.append(fault)
    return faults


def _hosts(kind: str) -> tuple[str, ...]:
    return (*SPARED, *LONE) if kind in STAGE_KINDS else ("h0",)


def _hold(kind: str, rng: random.Random, hold_s: tuple[float, float]) -> float:
    if kind in FIXED_HOLD_S:
        return FIXED_HOLD_S[kind]
    return round(rng.uniform(*hold_s), 1) if kind in HELD else 0.0


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
        # How far the clock of the processes writing jobs' progress (the coordinator) is off
        # while a head clock skew lasts: their `updated_at` is read back on true time.
        self.store_skew_s = 0.0
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
            skew = self.store_skew_s
            with self.lock:
                for job_id, status, rounds, generated, updated_at in rows:
                    t = now
                    if updated_at is not None:
                        stamped = as_utc(updated_at).timestamp() - skew
                        t = min(now, stamped - self.wall_started)
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
    spare: bool = False  # whether its host's layers have a copy elsewhere (h2 and h4)
    # A link cut on a serving host whose copy idled: from the cut to the copy's rounds.
    takeover_s: float | None = None
    overlaps: str | None = None  # the other fault of an overlapping pair ("kind on host")
    # Lab processes that died though no fault killed them, started again (`Chaos.revive`).
    died: list[str] = field(default_factory=list)
    # Its jobs: those running when it came and those that ended while it lasted or soon after
    # (`attribute`).
    jobs: list[int] = field(default_factory=list)

    @property
    def label(self) -> str:
        """Its row in the summary: the kind, and for a stage host's, the side it hit."""
        if self.kind not in STAGE_KINDS:
            return self.kind
        return f"{self.kind}/{'spare' if self.spare else 'no-spare'}"


class Chaos:
    """The lab's processes and links, to disturb and to restore."""

    def __init__(
        self, lab: Lab, log: Log, faketime: str | None, monitor: Monitor | None = None
    ) -> None:
        self.lab, self.log, self.faketime, self.monitor = lab, log, faketime, monitor
        self.hosts = {h.name: h for h in lab.hosts()}
        self.lock = threading.Lock()  # two overlapping faults may restart processes at once

    def host(self, name: str) -> Host:
        return self.hosts[name]

    def pid(self, name: str) -> int:
        with self.lock:
            return self.lab.state["processes"][name]

    def restart(self, host: str, name: str, env: dict[str, str] | None = None) -> int:
        """SIGKILL the process group of `host`-`name` and start it again with the same argv
        (and `env`); the new pid."""
        key = f"{host}-{name}"
        with self.lock:
            argv = self.lab.state["argv"][key]
        kill_group(self.pid(key))
        with self.lock:
            return self.lab.spawn(self.host(host), name, argv, env)

    def revive(self) -> list[str]:
        """Start again, as `specpipe up`'s supervisor would, every lab process that died
        though no fault killed it (nothing supervises the lab's); their names."""
        with self.lock:
            processes = dict(self.lab.state["processes"])
        dead = [name for name, pid in processes.items() if not process_alive(pid)]
        for name in dead:
            host, _, process = name.partition("-")
            self.restart(host, process)
        return dead

    def processed(self, host: str) -> int:
        """The rounds the stage on `host` has counted (its counters, on its own Redis)."""
        client = self.lab.admin_redis(self.host(host))
        try:
            return int(client.hget(stats_key(self.lab.state["swarm"], host), "processed") or 0)
        finally:
            client.close()

    def serving(self, hosts: Iterable[str]) -> dict[str, bool | None]:
        """Whether the stage on each of `hosts` serves rounds now: its count grew over a few
        heartbeats (the count is written at each); None where its Redis did not answer."""
        hosts = list(dict.fromkeys(hosts))
        if not hosts:
            return {}
        before = {h: self._processed_or_none(h) for h in hosts}
        time.sleep(SERVING_WINDOW_S)
        after = {h: self._processed_or_none(h) for h in hosts}
        return {h: None if None in (before[h], after[h]) else after[h] > before[h] for h in hosts}

    def _processed_or_none(self, host: str) -> int | None:
        try:
            return self.processed(host)
        except (redis.RedisError, OSError):  # its Redis is still on its way back
            return None

    def heartbeats(self) -> dict[str, float]:
        """Each stage's last heartbeat as its inventory record has it."""
        client = redis.Redis.from_url(
            self.lab.state["registry_url"], socket_connect_timeout=5, socket_timeout=5
        )
        try:
            nodes = inventory.load(
                client, self.lab.state["swarm"], trust.home_keyring(self.lab.home)
            )
        finally:
            client.close()
        return {n.host: n.last_heartbeat for n in nodes}

    def wait_heartbeat(self, host: str, since: float | None, timeout_s: float = 120.0) -> None:
        """Until `host`'s record carries a heartbeat other than `since` (the one its killed
        stage left): whatever the clock that dates it, its restarted stage is up."""

        def beaten() -> bool:
            with contextlib.suppress(redis.RedisError, OSError):
                beat = self.heartbeats().get(host)
                return beat is not None and beat != since
            return False

        until(beaten, timeout_s, f"{host}'s restarted stage to heartbeat")

    def skewed_env(self, skew_s: float) -> dict[str, str]:
        if self.faketime is None:
            raise RuntimeError("libfaketime is not installed")
        return {
            "LD_PRELOAD": self.faketime,
            "FAKETIME": f"{skew_s:+g}s",
            "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        }

    def wait_whole(self, timeout_s: float = 300.0) -> None:
        """Every serving host's stage registered afresh and the web app answering."""
        # The lab's wait takes a heartbeat of the last second for fresh: a killed stage's last
        # one would do, so it waits past that first.
        time.sleep(1.0 + DEFAULT_HEARTBEAT_S)
        serving = [h.name for h in self.lab.hosts()[: len(self.lab.state["layers"])]]
        self.lab.wait_stages(serving, timeout_s)
        self.lab._wait(lambda: _healthy(self.lab.state["web_url"]), timeout_s, "the web app")


def until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Wait for `condition`; RuntimeError naming `what` after `timeout_s`. (Unlike the lab's
    own wait, a process that another fault has just killed is no reason to stop.)"""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"waited {timeout_s:g} s for {what}")
        time.sleep(0.2)


def kill_group(pid: int, timeout_s: float = 10.0) -> None:
    """SIGKILL `pid`'s process group (the process and its children) and reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while process_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def check_skewed(chaos: Chaos, name: str, skew_s: float) -> float:
    """That the process `name` runs `skew_s` off: its environment asks for it, libfaketime is
    mapped in it, and a probe under the same settings reads a clock that far off (returned).
    RuntimeError otherwise."""
    pid = chaos.pid(name)
    env = chaos.skewed_env(skew_s)
    deadline = time.monotonic() + 10
    while os.path.basename(os.readlink(f"/proc/{pid}/exe")) == "ip":  # not exec'd yet
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} did not start")
        time.sleep(0.05)
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    if f"FAKETIME={env['FAKETIME']}".encode() not in environ:
        raise RuntimeError(f"{name}'s environment has no FAKETIME={env['FAKETIME']}")
    if "libfaketime" not in Path(f"/proc/{pid}/maps").read_text():
        raise RuntimeError(f"libfaketime is not loaded in {name}")
    before = time.time()
    probe = subprocess.run(
        [sys.executable, "-c", "import time; print(time.time())"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    off = float(probe.stdout) - (before + time.time()) / 2
    if abs(off - skew_s) > SKEW_TOLERANCE_S:
        raise RuntimeError(f"a probe under FAKETIME={env['FAKETIME']} ran {off:+.1f} s off")
    return off


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
            if refused:
                time.sleep(fault.hold_s)
        finally:
            for i in range(0, len(junk), 100):
                client.delete(*junk[i : i + 100])
            client.config_set("maxmemory", before)
    finally:
        client.close()
    cap = (used + FILL_MARGIN) / 2**20
    if not refused:
        raise RuntimeError(f"{fault.host}'s Redis capped at {cap:.1f} MiB never refused a write")
    return f"{fault.host}'s Redis capped at {cap:.1f} MiB, refusing writes {fault.hold_s:g} s"


def kill_stage(chaos: Chaos, fault: Fault) -> str:
    chaos.restart(fault.host, f"stage-{fault.host}")
    return f"SIGKILL stage-{fault.host}, restarted"


def kill_coordinator(chaos: Chaos, fault: Fault) -> str:
    chaos.restart(fault.host, "coordinator")
    return "SIGKILL the coordinator, restarted"


def registry_kill(chaos: Chaos, fault: Fault) -> str:
    chaos.restart(fault.host, "redis")
    url = chaos.lab.state["registry_url"]
    until(lambda: answers(url), 60, "the registry's Redis to answer")
    return "SIGKILL the registry's Redis, restarted"


def oom_stage(chaos: Chaos, fault: Fault) -> str:
    name = f"stage-{fault.host}"
    pid = chaos.pid(f"{fault.host}-{name}")
    parent, version = memory_cgroup()
    limit_file, usage_file, events_file = CGROUP_FILES[version]
    group = parent / f"{PREFIX}-soak-{chaos.lab.state['id']}-{fault.host}"
    group.mkdir(exist_ok=True)
    moved, balloon, kills = False, None, 0
    try:
        (group / "cgroup.procs").write_text(str(pid))
        moved = True
        cap = int((group / usage_file).read_text()) + OOM_MARGIN
        (group / limit_file).write_text(str(cap))
        before = oom_kills(group / events_file)
        # The helper joins the group and fills it past its cap; the kernel may not pick it
        # while the stage, far larger, is there.
        balloon = subprocess.Popen(
            [sys.executable, "-c", BALLOON, str(group / "cgroup.procs"), str(4 * OOM_MARGIN)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while process_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        kills = oom_kills(group / events_file) - before
        if process_alive(pid):
            raise RuntimeError(f"{name} outlived its cgroup's cap of {cap / 2**20:.0f} MiB")
        if kills < 1:
            raise RuntimeError(f"{name} died, but its cgroup counts no OOM kill")
    finally:
        if balloon is not None:
            balloon.kill()
            balloon.wait()
        if moved:
            chaos.restart(fault.host, name)  # out of the group: a restarted stage is this one's
        # The group cannot go while its killed tasks are still on their way out.
        with contextlib.suppress(RuntimeError):
            until(lambda: _rmdir(group), 10, f"{group} to empty")
    return (
        f"{name} OOM-killed by the kernel (cgroup v{version}, cap {cap / 2**20:.0f} MiB, "
        f"oom_kill +{kills}), restarted"
    )


# What fills a cgroup: joins the group (argv 1), makes itself the kernel's last choice, then
# touches argv 2 bytes a MiB at a time.
BALLOON = """
import sys, time
open("/proc/self/oom_score_adj", "w").write("-999")
open(sys.argv[1], "w").write("0")
held = []
for _ in range(int(sys.argv[2]) >> 20):
    held.append(bytearray(b"x") * 2**20)
    time.sleep(0.01)
time.sleep(60)
"""
# Per cgroup version: the files of the cap, the usage and the OOM-kill count.
CGROUP_FILES = {
    2: ("memory.max", "memory.current", "memory.events"),
    1: ("memory.limit_in_bytes", "memory.usage_in_bytes", "memory.oom_control"),
}


def memory_cgroup() -> tuple[Path, int]:
    """Where a memory cgroup can be made, and its version: the root of a cgroup v2 hierarchy
    with the memory controller, else this process's own cgroup in a v1 memory hierarchy.
    RuntimeError saying why when neither is writable."""
    mounts = [line.split() for line in Path("/proc/self/mounts").read_text().splitlines()]
    for _, where, fstype, *_ in mounts:
        root = Path(where)
        if fstype == "cgroup2" and "memory" in _read(root / "cgroup.controllers").split():
            if "memory" not in _read(root / "cgroup.subtree_control").split():
                (root / "cgroup.subtree_control").write_text("+memory")
            if os.access(root, os.W_OK):
                return root, 2
    for _, where, fstype, options, *_ in mounts:
        if fstype == "cgroup" and "memory" in options.split(","):
            own = next(
                line.split(":", 2)[2]
                for line in Path("/proc/self/cgroup").read_text().splitlines()
                if "memory" in line.split(":", 2)[1].split(",")
            )
            parent = Path(where) / own.lstrip("/")
            if os.access(parent, os.W_OK):
                return parent, 1
    raise RuntimeError("no writable cgroup has the memory controller (v2 or v1)")


def _rmdir(path: Path) -> bool:
    """Whether `path` is gone, removed now or before."""
    try:
        path.rmdir()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def oom_kills(events: Path) -> int:
    """The OOM kills a cgroup's events file counts (`oom_kill N`)."""
    for line in events.read_text().splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill":
            return int(value)
    raise RuntimeError(f"{events} has no oom_kill count")


def clock_skew(chaos: Chaos, fault: Fault) -> str:
    skew = SKEW_S[fault.kind]
    name = f"stage-{fault.host}"
    chaos.restart(fault.host, name, chaos.skewed_env(skew))
    try:
        since = chaos.heartbeats().get(fault.host)  # the killed stage's last, read before the
        off = check_skewed(chaos, f"{fault.host}-{name}", skew)  # new one is up
        chaos.wait_heartbeat(fault.host, since)
        time.sleep(fault.hold_s)
    finally:
        chaos.restart(fault.host, name)
    return f"{name} {skew:+g} s (a probe read {off:+.1f} s) for {fault.hold_s:g} s, then on time"


def head_clock_skew(chaos: Chaos, fault: Fault) -> str:
    skew = SKEW_S[fault.kind]
    try:
        for name in HEAD_SKEWED:
            chaos.restart(fault.host, name, chaos.skewed_env(skew))
        if chaos.monitor is not None:
            chaos.monitor.store_skew_s = skew
        offs = [check_skewed(chaos, f"{fault.host}-{name}", skew) for name in HEAD_SKEWED]
        time.sleep(fault.hold_s)
    finally:
        for name in HEAD_SKEWED:
            chaos.restart(fault.host, name)
        if chaos.monitor is not None:
            chaos.monitor.store_skew_s = 0.0
    return (
        f"{' and '.join(HEAD_SKEWED)} {skew:+g} s (a probe read {offs[0]:+.1f} s) for "
        f"{fault.hold_s:g} s, then on time"
    )


ACTIONS: dict[str, Callable[[Chaos, Fault], str]] = {
    **dict.fromkeys(LINK_CUTS, link_cut),
    "redis-stall": redis_stall,
    "redis-fill": redis_fill,
    "kill-stage": kill_stage,
    "oom-stage": oom_stage,
    **{k: clock_skew for k in CLOCK_KINDS if k in STAGE_KINDS},
    "kill-coordinator": kill_coordinator,
    "registry-kill": registry_kill,
    "registry-stall-30s": redis_stall,
    "registry-fill": redis_fill,
    **{k: head_clock_skew for k in CLOCK_KINDS if k in HEAD_KINDS},
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


def attribute(
    injected: Sequence[Injected],
    observations: Sequence[Observation],
    grace_s: float = ROUND_TIMEOUT_S,
) -> None:
    """Set each fault's `jobs`: those running when it came, and those that ended while it
    lasted or, when none was in effect then, after it within `grace_s` (a job gives up on a
    round a round's wait after it) and before any other fault ended."""
    ends: dict[int, float] = {}
    for seen in sorted(observations, key=lambda o: o.t):
        if seen.status in FINAL:
            ends.setdefault(seen.job_id, seen.t)
    owned: dict[int, set[int]] = {id(fault): set(fault.running) for fault in injected}
    for job, t in ends.items():
        during = [f for f in injected if f.started <= t <= f.ended]
        before = [f for f in injected if f.ended < t <= f.ended + grace_s]
        if not during and before:
            during = [max(before, key=lambda f: f.ended)]
        for fault in during:
            owned[id(fault)].add(job)
    for fault in injected:
        fault.jobs = sorted(owned[id(fault)])


def unexcused_failures(outcomes: Sequence[dict], injected: Sequence[Injected]) -> list[dict]:
    """The failed jobs that no injected unrecoverable fault touched: each a broken promise."""
    excused = {
        job
        for fault in injected
        if fault.error is None and not recoverable(fault.kind, fault.spare)
        for job in fault.jobs
    }
    return [o for o in outcomes if o["outcome"] == "failed" and o["job_id"] not in excused]


def summarise_faults(
    injected: Sequence[Injected], outcomes: Sequence[dict] = ()
) -> dict[str, dict]:
    """Per kind and side (`Injected.label`): how many were injected (and failed to be), how
    their jobs ended, and their recovery, stall and takeover times, p50 and max."""
    by_job = {o["job_id"]: o for o in outcomes}
    rows = {}
    for label in dict.fromkeys(i.label for i in injected):
        these = [i for i in injected if i.label == label]
        done = [i for i in these if i.error is None]
        jobs = sorted({j for i in done for j in i.jobs if j in by_job})
        count = Counter(by_job[j]["outcome"] for j in jobs)
        reasons = Counter(
            by_job[j]["reason"] or by_job[j]["status"]
            for j in jobs
            if by_job[j]["outcome"] == "failed"
        )
        recover = [i.recover_s for i in done if i.recover_s is not None]
        stalls = [i.stall_s for i in done if i.stall_s is not None]
        serving = [i.stall_s for i in done if i.stall_s is not None and i.serving]
        alone = [i.stall_s for i in done if i.stall_s is not None and not i.overlaps]
        takeover = [i.takeover_s for i in done if i.takeover_s is not None]
        rows[label] = {
            "kind": these[0].kind,
            "spare": these[0].spare,
            "recoverable": recoverable(these[0].kind, these[0].spare),
            "injected": len(done),
            "errors": [i.error for i in these if i.error],
            "jobs": len(jobs),
            **{k: count.get(k, 0) for k in ("identical", "different", "failed", "lost", "stuck")},
            "failed_reasons": dict(reasons.most_common()),
            "died": sorted({name for i in these for name in i.died}),
            "overlapped": sorted({i.overlaps for i in these if i.overlaps}),
            **_p50_max_of("recover_s", recover),
            "unrecovered": sum(i.recover_s is None for i in done),
            **_p50_max_of("stall_s", stalls),
            # The same over the faults whose host was serving rounds as they came.
            "on_serving_host": len(serving),
            **_p50_max_of("serving_stall_s", serving),
            # The same over the faults no second one overlapped: what the fault alone cost.
            "alone_stall_s_max": round(max(alone), 2) if alone else None,
            **_p50_max_of("takeover_s", takeover),
        }
    return rows


def _p50_max_of(name: str, values: Sequence[float]) -> dict[str, float | None]:
    return {
        f"{name}_p50": round(statistics.median(values), 2) if values else None,
        f"{name}_max": round(max(values), 2) if values else None,
    }


def summarise_jobs(outcomes: Sequence[dict]) -> dict:
    """Counts of the jobs' outcomes, and the failed ones' reasons counted."""
    count = Counter(o["outcome"] for o in outcomes)
    reasons = Counter(o["reason"] or o["status"] for o in outcomes if o["outcome"] == "failed")
    return {
        "jobs": len(outcomes),
        **{k: count.get(k, 0) for k in ("identical", "different", "failed", "lost", "stuck")},
        "failed_reasons": dict(reasons.most_common()),
    }


def problems(
    jobs: dict,
    grown: Sequence[str],
    faults: dict[str, dict] | None = None,
    unexcused: Sequence[dict] = (),
    cut_stall_s: float = CUT_STALL_S,
) -> list[str]:
    """What fails the soak: lost, stuck or different jobs; failed jobs no unrecoverable fault
    touched (`unexcused`); a lab process that died of a fault that did not kill it; a link
    cut on a host with a spare that cost a running job more than `cut_stall_s` (no second
    fault overlapping it: a coordinator's restart during a cut costs what it costs alone);
    processes that grew."""
    found = [f"{jobs[k]} {k}" for k in ("lost", "stuck", "different") if jobs[k]]
    if unexcused:
        reasons = Counter(o["reason"] or o["status"] for o in unexcused)
        listed = "; ".join(f"{why} ({n})" for why, n in reasons.most_common())
        found.append(f"{len(unexcused)} failed where recovery was possible: {listed}")
    for label, row in (faults or {}).items():
        if row["died"]:
            found.append(f"{label}: {', '.join(row['died'])} died (started again)")
        most = row["alone_stall_s_max"]
        if row["kind"] in LINK_CUTS and row["spare"] and most is not None and most > cut_stall_s:
            found.append(f"{label} cost a running job {most:.2f} s (over {cut_stall_s:g} s)")
    if grown:
        found.append(f"memory grew: {', '.join(grown)}")
    return found


# --- the run -----------------------------------------------------------------------------


def bring_up(home: Path, model: str, delays: Sequence[float], log: Log) -> Lab:
    """The lab of four stages and h2's spare, its store migrated, serving `model`."""
    from models import migrate as migrations
    from specpipe.transformer.resolve import even_split, open_checkpoint

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
    for name, pid in list(lab.state["processes"].items()):
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
    """Waves of jobs through the API, `per_user` from every user at once, in a thread, until
    stopped; the next wave once the last has ended, and no sooner than each user's allowance
    (`SPECPIPE_SUBMIT_RATE`, what the web app refuses past) lets it submit again: a refused
    wave would leave the ring idle and read as a slow recovery."""

    def __init__(
        self,
        web_url: str,
        tokens: dict[str, str],
        monitor: Monitor,
        max_new_tokens: int,
        per_user: int = 1,
    ) -> None:
        self.web_url, self.tokens, self.monitor = web_url, tokens, monitor
        self.max_new_tokens, self.per_user = max_new_tokens, per_user
        self.submissions: list[api_load.Submission] = []
        self.every_s = wave_every_s(per_user)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._waves, daemon=True)

    def _waves(self) -> None:
        while not self.stopped.is_set():
            due = time.monotonic() + self.every_s
            n_jobs = len(self.tokens) * self.per_user  # the users take turns: per_user each
            wave = api_load.submit_all(self.web_url, self.tokens, n_jobs, 1.0, self.max_new_tokens)
            self.submissions += wave
            ids = [s.job_id for s in wave if s.job_id is not None]
            time.sleep(0.5 if ids else 2.0)
            while ids and not all(self.monitor.status(j) in FINAL for j in ids):
                time.sleep(0.2)
                if self.stopped.is_set() and self.monitor.now() > self.give_up:
                    return
            self.stopped.wait(max(0.0, due - time.monotonic()))

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


def wave_every_s(per_user: int) -> float:
    """The least time from one wave to the next that keeps `per_user` jobs a wave within each
    user's submission allowance, with a tenth to spare."""
    from limits import parse

    from specpipe import settings

    allowance = parse(settings.submit_rate())
    return 1.1 * per_user * allowance.get_expiry() / allowance.amount


def inject(chaos: Chaos, monitor: Monitor, fault: Fault, log: Log) -> list[Injected]:
    """Note whether the hosts the fault (and its overlapping second) hit are serving, wait for
    a running job (a minute at most), inject them, wait for the jobs to move."""
    faults = [fault, *([fault.overlap] if fault.overlap else [])]
    stage_hosts = [f.host for f in faults if f.kind in STAGE_KINDS]
    serving = chaos.serving([*stage_hosts, *filter(None, map(twin, stage_hosts))])
    deadline = time.monotonic() + 60
    while not monitor.running() and time.monotonic() < deadline:
        time.sleep(0.05)
    done = [
        Injected(
            f.kind,
            f.host,
            f.hold_s,
            0.0,
            0.0,
            serving=serving.get(f.host) if f.kind in STAGE_KINDS else None,
            spare=has_spare(f.host),
        )
        for f in faults
    ]
    second = None
    if fault.overlap:
        done[0].overlaps = f"{fault.overlap.kind} on {fault.overlap.host}"
        done[1].overlaps = f"{fault.kind} on {fault.host}"

        def later() -> None:
            time.sleep(fault.overlap_after_s)
            _act(chaos, monitor, fault.overlap, done[1], serving)

        second = threading.Thread(target=later, daemon=True)
        second.start()
    _act(chaos, monitor, fault, done[0], serving)
    if second is not None:
        second.join()
    died = chaos.revive()
    limit = time.monotonic() + RECOVER_WAIT_S
    waiting = [d for d in done if d.error is None]
    while waiting and time.monotonic() < limit:
        time.sleep(0.1)
        seen = monitor.snapshot()
        for d in waiting:
            if d.recover_s is None:
                d.recover_s = recovery_s(d.ended, seen)
            if d.stall_s is None:
                d.stall_s = stall_s(d.started, d.running, seen)
        waiting = [d for d in waiting if None in (d.recover_s, d.stall_s)]
    died += chaos.revive()
    for d in done:
        d.died = sorted(set(died))
        recover = f"{d.recover_s:.2f} s" if d.recover_s is not None else "-"
        stalled = f"{d.stall_s:.2f} s" if d.stall_s is not None else "-"
        where = {True: " (serving)", False: " (idle)", None: ""}[d.serving]
        took = f"; the copy took over in {d.takeover_s:.2f} s" if d.takeover_s is not None else ""
        along = f" (with {d.overlaps})" if d.overlaps else ""
        gone = f"; {', '.join(d.died)} died, started again" if d.died else ""
        log(
            f"[{d.started:6.1f} s] {d.kind} on {d.host}{where}{along}: {d.detail or d.error}; "
            f"running {d.running}; recovered in {recover}; a running job waited {stalled}"
            f"{took}{gone}"
        )
    return done


def _act(
    chaos: Chaos,
    monitor: Monitor,
    fault: Fault,
    done: Injected,
    serving: dict[str, bool | None],
) -> None:
    """Inject `fault`, noting in `done` when it began and ended, the jobs running then, what it
    did (or why it could not) and, for a link cut, how soon the copy took over."""
    watcher = _watch_takeover(chaos, monitor, fault, done, serving)
    done.started = monitor.now()
    done.running = monitor.running()
    try:
        done.detail = ACTIONS[fault.kind](chaos, fault)
    except Exception as exc:  # reported, the soak goes on
        done.error = f"{type(exc).__name__}: {exc}"
    done.ended = monitor.now()
    if watcher is not None:
        watcher.join(15)


def _watch_takeover(
    chaos: Chaos,
    monitor: Monitor,
    fault: Fault,
    done: Injected,
    serving: dict[str, bool | None],
) -> threading.Thread | None:
    """For a link cut on a serving host whose copy idled: a thread, started just before the
    cut, that sets `done.takeover_s` once the copy's round count grows (to within a heartbeat,
    when the count is written)."""
    copy = twin(fault.host)
    if fault.kind not in LINK_CUTS or copy is None:
        return None
    if not serving.get(fault.host) or serving.get(copy) is not False:
        return None
    counted = chaos._processed_or_none(copy)
    if counted is None:
        return None

    def watch() -> None:
        deadline = time.monotonic() + fault.hold_s + 10
        while time.monotonic() < deadline:
            now = chaos._processed_or_none(copy)
            if now is not None and now > counted:
                done.takeover_s = round(monitor.now() - done.started, 2)
                return
            time.sleep(0.1)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


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
                ("different", "tokens differ") if job_id in different else ("identical", None)
            )
        elif status in FINAL:
            outcome, reason = "failed", error
        else:
            outcome, reason = "stuck", f"{status} at the deadline"
        found.append({"job_id": job_id, "outcome": outcome, "status": status, "reason": reason})
    return found


def warm_up(database_url: str, web_url: str, tokens: int, deadline_s: float) -> None:
    """One job through the lab's API by a user of its own, which must end done: the stages'
    caches, the coordinator and the web app are warm before the users come."""
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


def inject_plan(
    chaos: Chaos,
    monitor: Monitor,
    plan: Sequence[Fault],
    at_least: int,
    soak_s: float,
    pause_s: float,
    log: Log,
) -> list[Injected]:
    """The faults of `plan` one after another, each held and healed, a pause between them,
    until `soak_s` is up (but `at_least` of them whatever the time); then the rest of the
    soak's time passes without faults."""
    injected: list[Injected] = []
    for i, fault in enumerate(plan):
        if i >= at_least and monitor.now() > soak_s:
            break
        injected += inject(chaos, monitor, fault, log)
        chaos.wait_whole()
        time.sleep(max(0.0, min(pause_s, soak_s - monitor.now())))
    while monitor.now() < soak_s:
        time.sleep(1.0)
    return injected


def run_soak(
    model: str,
    home: Path,
    log: Log,
    *,
    minutes: float = 20.0,
    users: int = 3,
    jobs_per_user: int = 2,
    seed: int = 0,
    tokens: int = 48,
    pause_s: float = 20.0,
    hold_s: tuple[float, float] = (3.0, 8.0),
    deadline_s: float = 600.0,
    warm_up_s: float = 60.0,
    delays: Sequence[float] = REFERENCE_DELAYS_MS,
    kinds: Sequence[str] = KINDS,
    overlap: float = 0.25,
    cut_stall_s: float = CUT_STALL_S,
) -> dict:
    """The soak on a lab in `home` (taken down after); the result, with its verdict."""
    faketime = faketime_library()
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise ValueError(f"no such fault kinds: {', '.join(unknown)}")
    left_out = []
    if not faketime and set(kinds) & set(CLOCK_KINDS):
        left_out.append("the clock skews (libfaketime is not installed)")
    kinds = [k for k in kinds if k not in CLOCK_KINDS or faketime]
    lab = bring_up(home, model, delays, log)
    injected: list[Injected] = []
    monitor = memory_log = None
    try:
        database_url, web_url = lab.state["database_url"], lab.state["web_url"]
        by_user = api_load.make_users(database_url, users, prefix="soak")
        warm_up(database_url, web_url, tokens, deadline_s)
        monitor = Monitor(database_url, time.monotonic()).start()
        chaos = Chaos(lab, log, faketime, monitor)
        crowd = Users(web_url, by_user, monitor, tokens, jobs_per_user).start()
        # A process's size after warm-up is its size once it has served the users' load (every
        # session's cache, the batches, the allocator's arenas), before the first fault.
        time.sleep(warm_up_s)
        rss_start = lab_rss_mib(lab)
        memory_log = MemoryLog(lab, monitor).start()
        log(
            f"{users} users, {jobs_per_user} jobs each at once, on {web_url} for {minutes:g} "
            f"min, faults {', '.join(kinds)}"
        )
        rounds = 1 + int(minutes * 60 / max(pause_s, 1.0))
        plan = schedule(seed, rounds, kinds, hold_s=hold_s, overlap=overlap)
        injected += inject_plan(chaos, monitor, plan, len(kinds), minutes * 60, pause_s, log)
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
    attribute(injected, observations)
    job_summary = summarise_jobs(jobs)
    faults = summarise_faults(injected, jobs)
    grown = memory_grown(rss_start, rss_end)
    found = problems(job_summary, grown, faults, unexcused_failures(jobs, injected), cut_stall_s)
    subs = crowd.submissions
    return {
        "setup": {
            "model": model,
            "minutes": minutes,
            "users": users,
            "jobs_per_user": jobs_per_user,
            "seed": seed,
            "tokens": tokens,
            "pause_s": pause_s,
            "hold_s": list(hold_s),
            "deadline_s": deadline_s,
            "warm_up_s": warm_up_s,
            "kinds": list(kinds),
            "overlap": overlap,
            "cut_stall_s": cut_stall_s,
            "link_delays_ms": [*delays, delays[COPIED]],
            "spare": f"h{SPARE} serves h{COPIED}'s layers",
            "left_out": left_out,
        },
        "soak_s": round(soak_s, 1),
        "submitted": len(subs),
        "refused": dict(Counter(_refusal(s) for s in subs if s.job_id is None)),
        "jobs": job_summary,
        "faults": faults,
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
    width = max([24, *(len(label) for label in result["faults"])])
    lines.append(
        f"{'FAULT':<{width}}  INJECTED  RECOVERABLE  JOBS  IDENTICAL  DIFFERENT  FAILED  LOST"
        "  STUCK"
    )
    for label, row in result["faults"].items():
        promise = "yes" if row["recoverable"] else "no"
        lines.append(
            f"{label:<{width}}  {row['injected']:>8}  {promise:>11}  {row['jobs']:>4}  "
            f"{row['identical']:>9}  {row['different']:>9}  {row['failed']:>6}  "
            f"{row['lost']:>4}  {row['stuck']:>5}"
        )
        lines += [f"  failed ({n}): {why}" for why, n in row["failed_reasons"].items()]
        lines += [f"  died, started again: {', '.join(row['died'])}"] if row["died"] else []
        if row["overlapped"]:
            alone = row["alone_stall_s_max"]
            without = "-" if alone is None else f"{alone:.2f} s"
            others = ", ".join(row["overlapped"])
            lines.append(f"  overlapped: {others}; stall max without: {without}")
        lines += [f"  not injected: {e}" for e in row["errors"]]
    lines.append(
        f"{'FAULT':<{width}}  RECOVER s p50 / max  UNRECOVERED  STALL s p50 / max  SERVING"
        "  ITS STALL s max  TAKEOVER s p50 / max"
    )
    for label, row in result["faults"].items():
        recover = _p50_max(row["recover_s_p50"], row["recover_s_max"])
        stall = _p50_max(row["stall_s_p50"], row["stall_s_max"])
        its = "-" if row["serving_stall_s_max"] is None else f"{row['serving_stall_s_max']:.2f}"
        takeover = _p50_max(row["takeover_s_p50"], row["takeover_s_max"])
        lines.append(
            f"{label:<{width}}  {recover:>19}  {row['unrecovered']:>11}  {stall:>17}  "
            f"{row['on_serving_host']:>7}  {its:>15}  {takeover:>20}"
        )
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


def _refusal(submission: api_load.Submission) -> str:
    """Why a submission was refused, one reason whatever wait it names ("try again in 9 s")."""
    return re.sub(r"\b\d+ s\b", "N s", f"{submission.status} {submission.error}")


def _p50_max(p50: float | None, most: float | None) -> str:
    return "-" if p50 is None else f"{p50:.2f} / {most:.2f}"
