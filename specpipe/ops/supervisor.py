"""A small process supervisor for `specpipe up`.

It starts named child processes, each in its own process group, restarts one that dies (after a
backoff that doubles while it keeps dying young), prints a one-line status per process, and on
Ctrl-C or SIGTERM stops every group (SIGTERM, then SIGKILL) so that nothing is left behind.
Whoever needs to know which process is which (a bench that signals one) is told each child's
pid by name whenever one starts or stops (`on_change`).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

PR_SET_PDEATHSIG = 1
HEALTHY_AFTER_S = 30.0  # a child that ran this long starts over at the initial backoff


@dataclass(frozen=True)
class ProcessSpec:
    """A child to keep running: its name, argv and extra environment.

    `ready`, when given, says whether the child serves yet: at start the next child is started
    only once it does (a service the others need, such as Redis, comes first). A `stop_last`
    child is stopped after all the others, which may still need it while they stop."""

    name: str
    argv: Sequence[str]
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    ready: Callable[[], bool] | None = None
    stop_last: bool = False


@dataclass
class Child:
    """The supervisor's view of one child."""

    spec: ProcessSpec
    process: subprocess.Popen | None = None
    started_at: float = 0.0
    restarts: int = 0
    backoff_s: float = 0.0
    restart_at: float | None = None
    last_exit: int | None = None

    def status(self) -> str:
        """One line: name, state, pid, restarts."""
        if self.process is not None and self.process.poll() is None:
            state = f"running  pid {self.process.pid}"
        elif self.restart_at is not None:
            wait_s = max(0.0, self.restart_at - time.monotonic())
            state = f"exited {self.last_exit}, restarting in {wait_s:.1f} s"
        else:
            state = f"stopped (exit {self.last_exit})"
        return f"{self.spec.name:<14} {state}  restarts {self.restarts}"


def _die_with_parent() -> None:
    # Linux: the child gets SIGTERM if the supervisor itself is killed without cleaning up.
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


class Supervisor:
    """Keeps a set of named processes running until stopped."""

    def __init__(
        self,
        specs: Sequence[ProcessSpec],
        backoff_initial_s: float = 0.5,
        backoff_max_s: float = 30.0,
        out: Callable[[str], None] = print,
        on_change: Callable[[dict[str, int]], None] | None = None,
    ) -> None:
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError("process names must be unique")
        self.children = {s.name: Child(s) for s in specs}
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.out = out
        self.on_change = on_change  # called with `pids()` after a child starts or stops
        self.stopping = threading.Event()

    def start(self, ready_timeout_s: float = 30.0) -> None:
        """Start every child in order, waiting for each one that says when it is ready."""
        for child in self.children.values():
            self._spawn(child)
            if child.spec.ready is not None:
                self._wait_ready(child, ready_timeout_s)

    def _wait_ready(self, child: Child, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self.stopping.is_set():
            if child.process.poll() is not None:
                self.out(f"{child.spec.name}: exited with {child.process.returncode} at start")
                return  # poll() restarts it; the children after it retry on their own
            if child.spec.ready():
                return
            time.sleep(0.05)
        self.out(f"{child.spec.name}: not ready after {timeout_s:g} s")

    def poll(self) -> None:
        """Notice children that died and restart those whose backoff is over."""
        now = time.monotonic()
        for child in self.children.values():
            if child.process is not None and child.process.poll() is not None:
                child.last_exit = child.process.returncode
                ran = now - child.started_at
                child.process = None
                self._changed()
                if self.stopping.is_set():
                    continue
                if ran >= HEALTHY_AFTER_S or child.backoff_s == 0:
                    child.backoff_s = self.backoff_initial_s
                else:
                    child.backoff_s = min(child.backoff_s * 2, self.backoff_max_s)
                child.restart_at = now + child.backoff_s
                self.out(
                    f"{child.spec.name}: exited with {child.last_exit}; restarting in "
                    f"{child.backoff_s:.1f} s"
                )
            due = child.restart_at is not None and now >= child.restart_at
            if due and not self.stopping.is_set():
                child.restarts += 1
                self._spawn(child)

    def pids(self) -> dict[str, int]:
        """The pid of each child running now, by name."""
        return {
            name: child.process.pid
            for name, child in self.children.items()
            if child.process is not None
        }

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change(self.pids())

    def status_lines(self) -> list[str]:
        """One line per child."""
        return [child.status() for child in self.children.values()]

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop every child's process group: SIGTERM, then SIGKILL after `timeout_s`; the
        `stop_last` children once all the others are gone."""
        self.stopping.set()
        for last in (False, True):
            self._stop_group(
                [c for c in self.children.values() if c.spec.stop_last == last], timeout_s
            )
        for child in self.children.values():
            child.restart_at = None

    def _stop_group(self, children: list[Child], timeout_s: float) -> None:
        running = [c for c in children if c.process is not None]
        for child in running:
            child.restart_at = None
            self._signal_group(child.process, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for child in running:
            try:
                child.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for child in running:
            # The leader may be gone while its own children linger: kill the whole group.
            self._signal_group(child.process, signal.SIGKILL)
            child.process.wait()
            child.last_exit = child.process.returncode
            child.process = None
        if running:
            self._changed()

    def run(self, status_every_s: float = 0.0, tick_s: float = 0.2) -> None:
        """Supervise until SIGINT or SIGTERM (or `stopping` is set), then stop everything."""
        previous = {
            sig: signal.signal(sig, lambda *_: self.stopping.set())
            for sig in (signal.SIGINT, signal.SIGTERM)
        }
        try:
            self.start()
            for line in self.status_lines():
                self.out(line)
            next_status = time.monotonic() + status_every_s
            while not self.stopping.wait(tick_s):
                self.poll()
                if status_every_s and time.monotonic() >= next_status:
                    for line in self.status_lines():
                        self.out(line)
                    next_status = time.monotonic() + status_every_s
        finally:
            self.stop()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _spawn(self, child: Child) -> None:
        spec = child.spec
        env = {**os.environ, **spec.env}
        child.process = subprocess.Popen(
            list(spec.argv),
            env=env,
            cwd=spec.cwd,
            start_new_session=True,  # own group: stopped as a whole, spared the terminal's ^C
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )
        child.started_at = time.monotonic()
        child.restart_at = None
        self._changed()

    @staticmethod
    def _signal_group(process: subprocess.Popen, sig: int) -> None:
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            pass


def terminate_all(processes: Iterable[subprocess.Popen], timeout_s: float = 20.0) -> None:
    """SIGTERM every process still running, then SIGKILL the ones not gone by `timeout_s`."""
    processes = list(processes)
    for process in processes:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + timeout_s
    for process in processes:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def process_alive(pid: object) -> bool:
    """Whether `pid` names a running process (a zombie, exited but not yet reaped, is not)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's: it exists
        return True
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:  # no /proc: kill(0) is all there is to go on
        return True
