"""The whole stack as `specpipe up` runs it, for the benches that disturb or load it.

`Stack` starts `specpipe up` in an instance folder of its own (a private Redis, the stages, the
coordinator, beat and the web app, supervised), waits until every stage is online and the web
app answers, and knows its processes by the names `up` started them under (its supervisor
records each one's pid in the instance folder, `settings.PROCESSES_FILE`, and `up` each stage's
host and layers in `swarm.json`), so a bench can signal one (the supervisor restarts what dies)
and measure each one's memory. Leaving the context stops `up` and whatever it leaves behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import redis

from specpipe import settings
from specpipe.ops.redis_server import free_port
from specpipe.swarm import inventory, trust

# The variables a shell may carry that would point `up` at another swarm or store.
CLEARED = (
    "REDIS_URL",
    "DATABASE_URL",
    "SPECPIPE_SWARM_KEY",
    "SECRET_KEY",
    "SPECPIPE_SWARM",
    "SPECPIPE_MODEL",
)
SPECPIPE = [sys.executable, "-m", "specpipe"]


class StackError(RuntimeError):
    """The stack did not come up, or not back."""


class Stack:
    """`specpipe up --stages N --model M` in `home` (context manager)."""

    def __init__(
        self,
        model: str,
        stages: int,
        home: Path,
        *,
        database_url: str | None = None,
        env: dict[str, str] | None = None,
        threads: int = 1,
    ) -> None:
        self.model, self.stages, self.home = model, stages, Path(home)
        self.port = free_port()
        self.env = {k: v for k, v in os.environ.items() if k not in CLEARED}
        self.env.update(
            SPECPIPE_HOME=str(self.home),
            OMP_NUM_THREADS=str(threads),
            PYTHONUNBUFFERED="1",
            **(env or {}),
        )
        if database_url:
            self.env["DATABASE_URL"] = database_url
        self.log_path = self.home / "up.log"
        self.proc: subprocess.Popen | None = None
        self.state: dict = {}
        self.layers: dict[str, tuple[int, int]] = {}  # stage role -> its layer range

    def __enter__(self) -> Stack:
        self.home.mkdir(parents=True, exist_ok=True)
        argv = [
            *SPECPIPE,
            "up",
            "--stages",
            str(self.stages),
            "--model",
            self.model,
            "--port",
            str(self.port),
            "--status-every",
            "0",
        ]
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        try:
            state_file = self.home / "swarm.json"
            self._wait(
                lambda: state_file.is_file() and state_file.read_text().strip(),
                120,
                "the swarm's state file",
            )
            self.state = json.loads(state_file.read_text())
            self.layers = {
                role: (int(node["layers"][0]), int(node["layers"][1]))
                for role, node in self.state["stage_nodes"].items()
            }
            self.wait_ready()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    @property
    def web_url(self) -> str:
        return self.state["web_url"]

    @property
    def redis_url(self) -> str:
        return self.state["redis_url"]

    @property
    def swarm(self) -> str:
        return self.state["swarm"]

    @property
    def database_url(self) -> str:
        return self.state["database_url"]

    def roles(self) -> list[str]:
        """Every role the stack runs."""
        stages = [f"stage{i}" for i in range(self.stages)]
        return ["redis", *stages, "coordinator", "nightly", "beat", "web"]

    def stage_host(self, role: str) -> str:
        """The host name stage `role` (stage0…) serves under."""
        return self.state["stage_nodes"][role]["host"]

    def processes(self) -> dict[str, psutil.Process]:
        """The running process of each role, as `up`'s supervisor last recorded them: its
        direct children by the names it started them under."""
        try:
            pids = json.loads((self.home / settings.PROCESSES_FILE).read_text())
        except (OSError, ValueError):  # not written yet
            return {}
        found = {}
        for role, pid in pids.items():
            try:
                process = psutil.Process(pid)
                # A pid the supervisor has not reaped yet, or one since reused, is not the role's.
                if process.ppid() != self.proc.pid or process.status() == psutil.STATUS_ZOMBIE:
                    continue
            except psutil.Error:
                continue
            found[role] = process
        return found

    def pid(self, role: str) -> int:
        """The pid of `role`'s running process; StackError when it has none now."""
        process = self.processes().get(role)
        if process is None:
            raise StackError(f"no {role} process is running")
        return process.pid

    def signal(self, role: str, sig: int) -> int:
        """Send `sig` to `role`'s process; returns its pid."""
        pid = self.pid(role)
        os.kill(pid, sig)
        return pid

    def rss(self) -> dict[str, int]:
        """Resident memory in bytes of each role's process and all of its descendants."""
        sizes = {}
        for role, process in self.processes().items():
            try:
                family = [process, *process.children(recursive=True)]
                sizes[role] = sum(p.memory_info().rss for p in family)
            except psutil.Error:
                continue
        return sizes

    def online_stages(self) -> dict[str, tuple[int, int]]:
        """Online stage hosts and their layer ranges, as the inventory has them."""
        client = redis.Redis.from_url(self.redis_url, socket_connect_timeout=2, socket_timeout=2)
        try:
            found = inventory.read(client, self.swarm, trust.home_keyring(self.home))
        except redis.RedisError:
            return {}
        finally:
            client.close()
        online = [n for n in found.nodes if n.status(found.now) == "online"]
        return {n.host: (n.layer_start, n.layer_end) for n in online}

    def healthy(self) -> bool:
        """Whether the web app answers /healthz."""
        try:
            with urllib.request.urlopen(self.web_url + "healthz", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def ready(self) -> bool:
        """Every role running, every stage online with its own layers, the web app healthy."""
        if self.proc.poll() is not None:
            raise StackError(f"specpipe up exited with {self.proc.returncode}: {self.log_tail()}")
        if set(self.processes()) != set(self.roles()):
            return False
        online = self.online_stages()
        if len(online) < self.stages:
            return False
        if self.layers and sorted(online.values()) != sorted(self.layers.values()):
            return False
        return self.healthy()

    def wait_ready(self, timeout_s: float = 300.0) -> float:
        """Wait until `ready`; returns the seconds it took."""
        return self._wait(self.ready, timeout_s, "the stack to be ready")

    def log_tail(self, chars: int = 3000) -> str:
        """The end of `up`'s output."""
        try:
            return self.log_path.read_text()[-chars:]
        except OSError:
            return ""

    def _wait(self, condition, timeout_s: float, what: str) -> float:
        started = time.monotonic()
        while not condition():
            if self.proc.poll() is not None:
                raise StackError(
                    f"specpipe up exited with {self.proc.returncode}: {self.log_tail()}"
                )
            if time.monotonic() - started > timeout_s:
                raise StackError(f"timed out after {timeout_s:g} s waiting for {what}")
            time.sleep(0.2)
        return time.monotonic() - started

    def __exit__(self, *exc) -> None:
        if self.proc is None:
            return
        family = []
        try:
            family = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            pass
        for process in family:  # a stopped child would not hear the SIGTERM
            try:
                process.send_signal(signal.SIGCONT)
            except psutil.Error:
                pass
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        _, alive = psutil.wait_procs(family, timeout=10)
        for process in alive:
            try:
                process.kill()
            except psutil.Error:
                pass
