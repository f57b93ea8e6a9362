"""No credential on the wire or in a record: after a generation through real stage processes on
two password-protected Redis servers, neither the data-plane password nor a host's own stands
in a stream entry, inventory record, dead letter, log line, error or append-only file."""

from __future__ import annotations

import logging
import os
import secrets
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import redis

from specpipe.core.ring import Round
from specpipe.core.sampling import SamplingParams
from specpipe.decoding.generation import Generation
from specpipe.ops.redis_server import RedisServer
from specpipe.ops.supervisor import terminate_all
from specpipe.settings import Settings
from specpipe.swarm import inventory, streams
from specpipe.swarm.redis_ring import RedisRing, RingError
from tests.swarm.test_redis_ring import PROMPT, ReferenceRing
from tests.swarmprocs import ROOT, wait_heartbeats
from tests.waiting import wait_until

BOUNDS = [(0, 2), (2, 4)]
MAX_BYTES = 64 * 1024  # h1 refuses larger entries: one goes to its dead letters


class Tap:
    """Reads every entry of the streams given, as they arrive (a stage deletes what it acks)."""

    def __init__(self, url: str, keys: list[str]) -> None:
        self.client = redis.Redis.from_url(url)
        self.cursors = {key: "0-0" for key in keys}
        self.seen: list[bytes] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            for key, entries in self.client.xread(self.cursors, block=50) or []:
                for entry_id, fields in entries:
                    self.cursors[key.decode()] = entry_id
                    self.seen.extend(fields.values())

    def close(self) -> list[bytes]:
        self._stop.set()
        self._thread.join()
        self.client.close()
        return self.seen


def files_under(directory: Path) -> dict[Path, bytes]:
    """Every file a Redis server kept (append-only files, dumps), by path."""
    return {path: path.read_bytes() for path in directory.rglob("*") if path.is_file()}


def test_no_password_in_any_message_record_dead_letter_log_or_file(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO)
    password = secrets.token_hex(16)  # the swarm's data-plane password
    owned = {host: secrets.token_hex(16) for host in ("h0", "h1")}  # each host's own user's
    swarm, key = f"t{secrets.token_hex(5)}", secrets.token_hex(16)
    monkeypatch.setenv("SPECPIPE_REDIS_PASSWORD", password)
    home, other = (  # the registry and h0's, and h1's
        RedisServer(password=owned[h], data_dir=tmp_path / f"{h}-redis", peer_password=password)
        for h in ("h0", "h1")
    )
    registry, h1_url = home.start(), other.start()
    assert owned["h0"] in registry and owned["h1"] in h1_url  # each process's own host's
    env = {
        **os.environ,
        "SPECPIPE_SWARM_KEY": key,
        # No coordinator key pinned: the shared-key mode, opted into out loud.
        "SPECPIPE_INSECURE_SHARED_KEY": "1",
        "SPECPIPE_REDIS_PASSWORD": password,
        "OMP_NUM_THREADS": "1",
    }
    logs = {host: tmp_path / f"{host}.log" for host in ("h0", "h1")}
    procs = {}
    taps = []
    try:
        for (host, own, extra), (a, b) in zip(
            [("h0", registry, []), ("h1", h1_url, ["--max-message-bytes", str(MAX_BYTES)])],
            BOUNDS,
            strict=True,
        ):
            argv = [
                *(sys.executable, "-m", "tests.swarm.toy_worker"),
                *("--host", host, "--layers", f"{a}:{b}", "--swarm", swarm),
                *("--redis", own, "--registry", registry, *extra),
            ]
            with open(logs[host], "w") as log:
                procs[host] = subprocess.Popen(
                    argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
                )
        wait_heartbeats(registry, swarm, key, procs, ["h0", "h1"], 60)
        replies = {s: [streams.reply_key(swarm, s, h) for h in ("h0", "h1")] for s in "se"}
        taps = [
            Tap(registry, [streams.stage_key(swarm, "h0"), *replies["s"]]),
            Tap(registry, replies["e"]),
            Tap(h1_url, [streams.stage_key(swarm, "h1")]),
        ]

        # No coordinator key pinned: the shared-key mode, opted into out loud.
        settings = Settings.from_env().for_swarm(registry, swarm, key, insecure_shared_key=True)
        ring = RedisRing.from_inventory(settings, "toy", 4, timeout_s=20)
        greedy = SamplingParams(temp=0.0)
        expected = Generation(
            ReferenceRing(BOUNDS), "ref", PROMPT, greedy, max_new_tokens=16, draft_k=2
        ).run()
        run = Generation(ring, "s", PROMPT, greedy, max_new_tokens=16, draft_k=2)
        assert run.run() == expected  # the same tokens as in one process
        # An error on the way back: a token outside the vocabulary.
        ring.reset("e", greedy)
        with pytest.raises(RingError) as refused:
            ring.round(Round("e", [1, 10_000], 0, 1))
        errors = [str(refused.value)]
        ring.drop("s")
        ring.drop("e")
        ring.close()
        by_tap = [tap.close() for tap in taps]
        seen = [entry for entries in by_tap for entry in entries]
        taps = []
        assert len(seen) > 10

        # A round too large for h1 ends in its dead letters, with its head kept.
        padded = by_tap[2][0] + bytes(MAX_BYTES)  # a round read off h1's stream
        client = redis.Redis.from_url(h1_url)
        streams.send(client, streams.stage_key(swarm, "h1"), padded)
        dead = streams.dead_key(swarm, "h1")
        wait_until(lambda: client.xlen(dead) >= 1, 10, "h1's dead letter")
        letters = [v for _, fields in client.xrange(dead) for v in fields.values()]
        client.close()
        client = redis.Redis.from_url(registry)
        records = client.mget(list(client.scan_iter(match=inventory.node_key(swarm, "*"))))
        client.close()
        assert len(records) == 2 and letters
    finally:
        for tap in taps:
            tap.close()
        terminate_all(procs.values())
        home.stop()
        other.stop()

    passwords = [password, *owned.values()]

    def shows(data: bytes | str) -> bool:
        return any((p if isinstance(data, str) else p.encode()) in data for p in passwords)

    found = {
        "stream entries": [m for m in seen if shows(m)],
        "inventory records": [r for r in records if shows(r)],
        "dead letters": [d for d in letters if shows(d)],
        "errors": [e for e in errors if shows(e)],
        "logs": [h for h, path in logs.items() if shows(path.read_bytes())]
        + (["this process"] if shows(caplog.text) else []),
        "Redis files": [
            str(path)
            for directory in (tmp_path / "h0-redis", tmp_path / "h1-redis")
            for path, data in files_under(directory).items()
            if shows(data)
        ],
    }
    assert any(files_under(tmp_path / "h0-redis")), "the registry keeps an append-only file"
    assert {where: hits for where, hits in found.items() if hits} == {}
