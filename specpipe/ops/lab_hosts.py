"""A multi-host lab on one machine: each host a network namespace of its own on a bridge.

`Lab` puts the lab together from its network (`specpipe.ops.lab_network`: the bridge, and per
host a namespace with its own address) and its trust (`specpipe.ops.lab_trust`: the lab's own
swarm CA, every host's TLS folder, the secrets and passwords in the lab's folder), and runs
its processes itself: per host its own Redis (host 1's speaks TLS only: every process verifies
it against its host's copy of the CA, and a `join` on a bare host starts a TLS Redis with its
host's files) and, on the hosts that serve, its own stage worker. Each Redis has its host's own
user, whose password only that host's processes are given, its keeper, and a user for each
other host that writes to it, which its stage makes from the roster with the password that
pair derives (`specpipe.swarm.peering`). Host 0 also runs the swarm's registry and broker
(its Redis, which the other hosts reach each as a user of its own,
`specpipe.swarm.credentials`), the coordinator, beat and the web app, with a SQLite store in
the lab's folder. The kernel here has no netem: a link's
latency is the sending stage's own (`specpipe.ops.link_delay`: the lab starts its stages with
`python -m specpipe.cli.delayed_stage --link-delay-ms`). Hosts beyond the serving ones
(`idle`) get a namespace and nothing else: a place to run `specpipe join`, which starts the
host's Redis itself (its stage's link undelayed).

The lab's folder is an instance folder (`SPECPIPE_HOME`): the swarm key, `swarm.json` and the
store live there, so `SPECPIPE_HOME=<lab> specpipe generate …` submits to the lab from this
machine. `lab.json` there records every namespace, link and process *before* it is made, so
`Lab.down` removes them all even after a crash halfway; it also kills whatever else runs in
the lab's namespaces. Root only: namespaces need it.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import redis

from specpipe.ops import certificates, lab_network, roster
from specpipe.ops.lab_network import LabError, LabNetwork, check_can_run
from specpipe.ops.lab_trust import ADMIN_USER, LabTrust, make_certificates
from specpipe.ops.redis_server import RedisServer, answers
from specpipe.ops.supervisor import process_alive
from specpipe.settings import TLS_DIR, write_private
from specpipe.swarm import inventory, trust
from specpipe.swarm.redact import without_credentials

LAB_FILE = "lab.json"
LAB_STORE = "lab.sqlite3"  # the lab's own store, made afresh by each `up`
SWARM = "lab"
REDIS_PORT = 6379  # every host has a network stack of its own: the same port on each
WEB_PORT = 8000
TLS_HOST = 1  # the host whose Redis speaks only TLS (when the lab has one)


@dataclass(frozen=True)
class Host:
    """One host of the lab: its namespace, address and Redis."""

    index: int
    namespace: str
    address: str
    redis_url: str
    tls: bool

    @property
    def name(self) -> str:
        return f"h{self.index}"


class Lab:
    """The lab whose folder is `home`."""

    def __init__(self, home: Path) -> None:
        self.home = Path(home).resolve()
        self.state_path = self.home / LAB_FILE
        self.state: dict = {}
        self.trust = LabTrust(self.home)

    # --- state ---------------------------------------------------------------------------

    def load(self) -> dict:
        """The recorded state ({} when there is none)."""
        try:
            self.state = json.loads(self.state_path.read_text())
        except (OSError, ValueError):
            self.state = {}
        return self.state

    def _save(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        write_private(self.state_path, json.dumps(self.state, indent=2) + "\n")

    def _record(self, kind: str, value) -> None:
        """Note a resource in the state file before it is made."""
        self.state.setdefault(kind, []).append(value)
        self._save()

    def running(self) -> bool:
        """Whether a lab recorded here still has a namespace."""
        if not self.load():
            return False
        existing = lab_network.namespace_names()
        return any(ns in existing for ns in self.state.get("namespaces", []))

    def hosts(self) -> list[Host]:
        """The hosts as recorded (addresses, Redis URLs with their own users' passwords)."""
        return [Host(**h) for h in self.load().get("hosts", [])]

    def env(self, host: Host | None = None) -> dict[str, str]:
        """The environment of a swarm process on `host` (host 0's registry and store): host 0's
        (and, without a host, this machine's) with host 0's own registry URL, any other host's
        with the registry URL for other hosts."""
        state = self.state or self.load()
        env = {
            **os.environ,
            "SPECPIPE_HOME": str(self.home),
            "SPECPIPE_SWARM": state["swarm"],
            "REDIS_URL": state["registry_url"],
            "SPECPIPE_REGISTRY_URL": state["registry_url"],
            "DATABASE_URL": state["database_url"],
            # What the web app and the coordinator take jobs for: the lab's model, also before
            # swarm.json (written once everything is up) names it.
            "SPECPIPE_MODEL": state["model"],
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
            # A Redis `join` starts in a namespace serves this machine's namespaces only, which
            # nothing outside reaches: whatever build this machine has may serve them.
            "SPECPIPE_ACCEPT_BACKPORTED_REDIS": "1",
            # The host's TLS folder (this machine's: the lab's own), with its copy of the CA.
            "SPECPIPE_TLS_DIR": str(self.tls_dir(host)),
            # All but one of the lab's Redis servers speak plain text, on veth links inside
            # this machine: its hosts send them their passwords in clear, out loud.
            "SPECPIPE_INSECURE_CLEAR_PASSWORDS": "1",
        }
        env.pop("SPECPIPE_SWARM_KEY", None)  # the lab's own key, from its folder
        # And the lab's own pin, which `start` writes there: every process refuses to start
        # without one, and one from this machine's environment would be another swarm's.
        env.pop("SPECPIPE_COORDINATOR_PUB", None)
        if host is not None:
            env["REDIS_URL"] = host.redis_url
            if not host.redis_url:  # an idle host: no Redis until one is started there
                env.pop("REDIS_URL")
            if host.index != 0:
                env["SPECPIPE_REGISTRY_URL"] = state["remote_registry_url"]
        return env

    def tls_dir(self, host: Host | None = None) -> Path:
        """`host`'s TLS folder (this machine's without one): its certificate and key, and its
        copy of the lab's CA."""
        return self.trust.tls_dir(host.name if host else None)

    def ca_cert(self) -> Path:
        """The lab's CA's certificate, which every host's TLS folder holds a copy of."""
        return self.trust.ca_cert()

    def network(self) -> LabNetwork:
        """The network of the lab recorded in `state`."""
        return LabNetwork(self.state["id"], self.state["subnet"], self._record)

    # --- up ------------------------------------------------------------------------------

    def up(
        self,
        layers: Sequence[tuple[int, int]],
        model: str,
        *,
        idle: int = 0,
        link_delays_ms: Sequence[float] = (),
        database_url: str | None = None,
    ) -> dict:
        """Make the network and every host's Redis: one serving host per layer range in
        `layers` (host i will serve `layers[i]`, see `serve`) and `idle` bare hosts; return
        the state. LabError on any failure, after taking down what was made."""
        check_can_run()
        if self.running():
            raise LabError(f"a lab already runs from {self.home}: `specpipe lab down` first")
        self.home.mkdir(parents=True, exist_ok=True)
        self.home.chmod(0o700)
        (self.home / "logs").mkdir(exist_ok=True)
        # A new lab starts empty: no inventory, queues, streams or jobs kept by an earlier one.
        for data in [*self.home.glob("h*/redis"), self.home / "redis"]:
            shutil.rmtree(data, ignore_errors=True)
        (self.home / LAB_STORE).unlink(missing_ok=True)
        lab_id = secrets.token_hex(2)
        network = LabNetwork(lab_id, lab_network.free_subnet(), self._record)
        n_hosts = len(layers) + idle
        delays = _per_host(link_delays_ms, len(layers))
        self.state = {
            "id": lab_id,
            "swarm": SWARM,
            "model": model,
            "bridge": network.bridge,
            "subnet": network.subnet,
            "layers": [list(r) for r in layers],
            "link_delays_ms": delays,
            "database_url": database_url or f"sqlite:///{self.home / LAB_STORE}",
            "namespaces": [],
            "links": [],
            "processes": {},
            "hosts": [],
        }
        self._save()
        try:
            network.make(n_hosts)
            self.trust.make_secrets()
            authority = self.trust.make_ca()
            for index in range(n_hosts):
                if index < len(layers):
                    self._start_redis(index, authority)
                else:
                    self._add_idle(index, authority)
            return self.state
        except BaseException:
            self.down()
            raise

    def serve(
        self,
        model: str,
        *,
        web_port: int = WEB_PORT,
        stage_args: Sequence[str] = (),
        timeout_s: float = 180.0,
    ) -> dict:
        """Start the stage workers and host 0's coordinator, beat and web app; wait for them.
        (The store must be migrated first.)"""
        hosts = self.hosts()
        registry = self.state["registry_url"]
        python = [sys.executable, "-m", "specpipe"]
        delayed_stage = [sys.executable, "-m", "specpipe.cli.delayed_stage"]
        # The lab is host 0's operator: the serving hosts' keys (in its folder) are admitted.
        serving = [h.name for h in hosts[: len(self.state["layers"])]]
        client = redis.Redis.from_url(registry, socket_connect_timeout=5, socket_timeout=5)
        try:
            roster.admit_own_hosts(client, self.state["swarm"], serving, self.home)
        finally:
            client.close()
        plan = zip(hosts, self.state["layers"], self.state["link_delays_ms"], strict=False)
        for host, (start, end), delay in plan:
            argv = [
                *delayed_stage,
                "--host",
                host.name,
                "--layers",
                f"{start}:{end}",
                "--model",
                model,
                "--threads",
                "1",
                "--public-ip",
                host.address,
                "--link-delay-ms",
                f"{delay:g}",
                *stage_args,
            ]
            self.spawn(host, f"stage-{host.name}", argv)
        head = hosts[0]
        quiet = ["--loglevel", "WARNING"]
        self.spawn(head, "coordinator", [*python, "worker", "coordinator", *quiet])
        self.spawn(head, "beat", [*python, "worker", "beat", *quiet])
        self.spawn(
            head,
            "web",
            [*python, "web", "--host", head.address, "--port", str(web_port), "--no-migrate"],
        )
        web_url = f"http://{head.address}:{web_port}/"
        self.state["web_url"] = web_url
        self._save()
        self.wait_stages(serving, timeout_s)
        self._wait(lambda: _http_ok(web_url + "healthz"), timeout_s, "the web app")
        swarm_file = {
            "redis_url": registry,
            "web_url": web_url,
            "swarm": self.state["swarm"],
            "model": model,
            "stages": len(serving),
            "database_url": self.state["database_url"],
        }
        write_private(self.home / "swarm.json", json.dumps(swarm_file, indent=2) + "\n")
        return self.state

    def add_namespace(self, index: int) -> str:
        """Host `index`'s namespace on the bridge, with its address; return its name."""
        return self.network().add_namespace(index)

    def link_delays_ms(self) -> dict[str, float]:
        """The one-way delay each serving host's stage adds to its outgoing link, by host."""
        state = self.state or self.load()
        return dict(zip((h.name for h in self.hosts()), state["link_delays_ms"], strict=False))

    def admin_redis(self, host: Host) -> redis.Redis:
        """A client of `host`'s Redis as the lab's admin user (every command), over its unix
        socket: the same for a TLS-only server."""
        return redis.Redis(
            unix_socket_path=str(self.home / host.name / "redis" / "redis.sock"),
            username=ADMIN_USER,
            password=self.trust.admin_password(),
            socket_timeout=10,
        )

    def _start_redis(self, index: int, authority: certificates.Authority) -> Host:
        network = self.network()
        namespace, address = network.namespace(index), network.address(index)
        directory = self.home / f"h{index}"
        files = make_certificates(directory / TLS_DIR, address, authority)
        tls = files if index == TLS_HOST else None
        server = RedisServer(
            port=REDIS_PORT,
            data_dir=directory / "redis",
            password=self.trust.own_password(directory),
            host=address,
            tls=tls,
            keeper_password=self.trust.keeper_password(),
        )
        with open(server.config_path, "a") as acl:
            acl.write(self.trust.admin_acl())
        host = Host(index, namespace, address, server.url, tls is not None)
        self.state["hosts"].append(host.__dict__)
        if index == 0:
            self.state["registry_url"] = server.url
            # Other hosts dial it as their own registry users (`swarm.credentials`).
            self.state["remote_registry_url"] = without_credentials(server.url)
        self._save()
        self.spawn(host, "redis", server.argv())
        self._wait(lambda: answers(server.url), 20, f"{host.name}'s Redis")
        return host

    def _add_idle(self, index: int, authority: certificates.Authority) -> Host:
        network = self.network()
        address = network.address(index)
        # Nothing runs there yet; a `join` there starts its Redis with these.
        make_certificates(self.home / f"h{index}" / TLS_DIR, address, authority)
        host = Host(index, network.namespace(index), address, "", False)
        self.state["hosts"].append(host.__dict__)
        self._save()
        return host

    def spawn(
        self, host: Host, name: str, argv: Sequence[str], env: dict[str, str] | None = None
    ) -> int:
        """Run `argv` in `host`'s namespace with the lab's environment (and `env`); its output
        goes to logs/<host>-<name>.log. Returns its pid. The argv is recorded too (`argv`):
        a process may rewrite its own command line (Redis does), and a restart needs it."""
        log_path = self.home / "logs" / f"{host.name}-{name}.log"
        with open(log_path, "a") as log:
            process = subprocess.Popen(
                ["ip", "netns", "exec", host.namespace, *argv],
                env={**self.env(host), **(env or {})},
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.state["processes"][f"{host.name}-{name}"] = process.pid
        self.state.setdefault("argv", {})[f"{host.name}-{name}"] = list(argv)
        self._save()
        return process.pid

    def wait_stages(self, hosts: Sequence[str], timeout_s: float) -> None:
        """Wait until each of `hosts` has a fresh record in the registry."""
        client = redis.Redis.from_url(
            self.state["registry_url"], socket_connect_timeout=5, socket_timeout=5
        )
        keys = trust.home_keyring(self.home)
        since = time.time() - 1

        def fresh() -> bool:
            nodes = inventory.load(client, self.state["swarm"], keys)
            seen = {n.host for n in nodes if n.last_heartbeat >= since}
            return set(hosts) <= seen

        try:
            self._wait(fresh, timeout_s, f"stages {', '.join(hosts)} to register")
        finally:
            client.close()

    def _wait(self, condition: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            if time.monotonic() > deadline:
                raise LabError(
                    f"{what} did not come up in {timeout_s:g} s (logs in {self.home / 'logs'})"
                )
            dead = [
                name
                for name, pid in self.state.get("processes", {}).items()
                if not process_alive(pid)
            ]
            if dead:
                raise LabError(f"{', '.join(sorted(dead))} exited (logs in {self.home / 'logs'})")
            time.sleep(0.2)

    # --- down ----------------------------------------------------------------------------

    def down(self, timeout_s: float = 10.0) -> list[str]:
        """Stop every process in the lab's namespaces and remove the namespaces and links;
        return what was removed. Safe to run again, and after a crash."""
        state = self.load()
        lab_id = state.get("id")
        namespaces = set(state.get("namespaces", []))
        links = set(state.get("links", []))
        if lab_id:  # anything made under the lab's names that the state did not get to record
            made_namespaces, made_links = lab_network.leftovers(lab_id)
            namespaces |= made_namespaces
            links |= made_links
        pids = {pid for pid in state.get("processes", {}).values() if process_alive(pid)}
        for namespace in namespaces & lab_network.namespace_names():
            pids |= lab_network.namespace_pids(namespace)
        _stop(pids, timeout_s)
        removed = lab_network.remove(namespaces, links)
        if pids:
            removed.append(f"{len(pids)} processes")
        self.state_path.unlink(missing_ok=True)
        (self.home / "swarm.json").unlink(missing_ok=True)
        self.state = {}
        return removed


def _per_host(delays: Sequence[float], n: int) -> list[float]:
    """One delay per serving host: as given, one for all, or none."""
    if not delays:
        return [0.0] * n
    if len(delays) == 1:
        return [float(delays[0])] * n
    if len(delays) != n:
        raise LabError(f"{len(delays)} link delays for {n} serving hosts: give one or {n}")
    return [float(d) for d in delays]


def _stop(pids: set[int], timeout_s: float) -> None:
    """SIGTERM each, then SIGKILL what is left after `timeout_s`."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(process_alive(pid) for pid in pids):
        _reap(pids)
        time.sleep(0.1)
    for pid in pids:
        if process_alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    time.sleep(0.1)
    _reap(pids)


def _reap(pids: set[int]) -> None:
    """Collect those of `pids` that are this process's exited children (no zombies left)."""
    for pid in pids:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # not our child: its own parent collects it
            pass


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False
