"""KV memory budgets: the tokens of cache a stage holds across its sessions, and the room a job
reserves against the budgets of its route.

A stage's budget is `SPECPIPE_KV_BUDGET_TOKENS`, else a share of the memory available when it
starts divided by what one token of its own layers' keys and values takes; the stage advertises
it in its inventory record (`kv_budget_tokens`, 0: no budget known).

Before a job's first round the coordinator reserves prompt + max_new_tokens tokens, every
position its session can ever hold, on every stage of its route at once, with one Lua script:
two coordinators never both take the last room. A job that does not fit now waits for room; a
job larger than the smallest budget on its route can never run and fails at once. A reservation
is a field of the hash `specpipe:{swarm}:kv:{host}` naming its holder, a key that lives as long
as the job runs (the job's lock): the job's end deletes it, and when a coordinator dies its lock
lapses and the next reservation on that stage drops the orphan, so no room leaks. When a running
job's route changes (a failover, a rebuild), its room follows (`Room.follow`): it is taken on the
new hosts even over their budget, since the job cannot wait there, and given back on those that
left. While a job waits, the hash `specpipe:{swarm}:kv-waiting` says which stage is full
(`Reservations.waiting`; one job's reason: `waiting_for_room`, which the job page and the API
show).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import redis

from specpipe.core.ring import Hop
from specpipe.swarm.inventory import meminfo_bytes

MEMORY_SHARE = 0.5  # of the memory available at start that a stage's caches may take
# Why a job waits for room: the stage that is full, its reserved tokens and budget, and the
# tokens the job needs.
WAITING_FIELDS = ("host", "used", "budget", "need")


def waiting_key(swarm: str) -> str:
    """The hash of the jobs waiting for room: job name -> JSON of why, and who waits."""
    return f"specpipe:{swarm}:kv-waiting"


def room_name(job_id: int) -> str:
    """The name job `job_id` reserves its room and waits for it under."""
    return f"job-{job_id}"


def reservations_key(swarm: str, host: str) -> str:
    """The hash of the reservations against one stage's budget."""
    return f"specpipe:{swarm}:kv:{host}"


def available_memory_bytes() -> int:
    """Memory available to new work (MemAvailable), 0 when unknown."""
    return meminfo_bytes("MemAvailable")


def default_budget_tokens(per_token: int, available: int, share: float = MEMORY_SHARE) -> int:
    """The tokens `share` of `available` bytes holds at `per_token` bytes each; 0 (no budget)
    when either is unknown."""
    if per_token <= 0 or available <= 0:
        return 0
    return max(1, int(available * share) // per_token)


class NeverFits(ValueError):
    """A job needs more cache than some stage of its route can ever hold."""


@dataclass(frozen=True)
class Full:
    """Why a reservation did not fit now: the stage whose room is taken."""

    host: str
    used: int
    budget: int


# KEYS: each stage's reservation hash. ARGV: need, field, holder, attempt, force, then each
# budget. A reservation's value is "<tokens> <holder key> <attempt>"; one whose holder key is gone
# (its job ended without releasing it, its coordinator died) is dropped as the room is counted.
# The job's own field is replaced, not counted: a resumed job takes over its earlier attempt's
# room. Returns (index, used) of each stage the need overflows, flat: without force the first
# one only, and nothing is reserved; with force ('1') every one, and the room is taken anyway.
_RESERVE = """
local need, field, holder, attempt = tonumber(ARGV[1]), ARGV[2], ARGV[3], ARGV[4]
local force = ARGV[5] == '1'
local over = {}
for i, key in ipairs(KEYS) do
  local budget = tonumber(ARGV[5 + i])
  local used = 0
  local entries = redis.call('HGETALL', key)
  for j = 1, #entries, 2 do
    local name = entries[j]
    local tokens, owner = string.match(entries[j + 1], '^(%d+) (%S+) %S+$')
    if name ~= field then
      if tokens and redis.call('EXISTS', owner) == 1 then
        used = used + tonumber(tokens)
      else
        redis.call('HDEL', key, name)
      end
    end
  end
  if budget > 0 and used + need > budget then
    if not force then
      return {i, used}
    end
    table.insert(over, i)
    table.insert(over, used)
  end
end
for _, key in ipairs(KEYS) do
  redis.call('HSET', key, field, need .. ' ' .. holder .. ' ' .. attempt)
end
return over
"""

# KEYS: each stage's reservation hash. ARGV: field, attempt. Only this attempt's own room goes:
# a later attempt of the same job may hold the field by now.
_RELEASE = """
for _, key in ipairs(KEYS) do
  local value = redis.call('HGET', key, ARGV[1])
  if value and string.match(value, '%S+$') == ARGV[2] then
    redis.call('HDEL', key, ARGV[1])
  end
end
return 0
"""


class Reservations:
    """Reserve and release a job's room on the stages of its route, in the swarm's Redis."""

    def __init__(self, client: redis.Redis, swarm: str) -> None:
        self.client, self.swarm = client, swarm
        self._reserve = client.register_script(_RESERVE)
        self._release = client.register_script(_RELEASE)

    def reserve(
        self,
        route: Sequence[Hop],
        name: str,
        need: int,
        holder: str,
        attempt: str,
    ) -> Full | None:
        """Reserve `need` tokens on every hop of `route` for job `name`, up to each hop's
        `kv_budget_tokens`, while key `holder` exists; None when done, else the stage that is
        full now (nothing is reserved). NeverFits when a hop's budget is smaller than `need`."""
        check_fits(route, need)
        over = self._run_reserve(route, name, need, holder, attempt, force=False)
        return over[0] if over else None

    def take(
        self, route: Sequence[Hop], name: str, need: int, holder: str, attempt: str
    ) -> list[Full]:
        """Reserve `need` tokens on every hop of `route` for job `name` at once, as `reserve`
        does, but even where that goes over a budget: for a job already running there, which
        cannot wait for room. Returns the stages it overflowed, with what they held before."""
        return self._run_reserve(route, name, need, holder, attempt, force=True)

    def _run_reserve(
        self, route: Sequence[Hop], name: str, need: int, holder: str, attempt: str, force: bool
    ) -> list[Full]:
        if not route:
            return []
        keys = [reservations_key(self.swarm, hop.host) for hop in route]
        budgets = [hop.kv_budget_tokens for hop in route]
        flat = self._reserve(keys=keys, args=[need, name, holder, attempt, int(force), *budgets])
        return [
            Full(route[int(i) - 1].host, int(used), budgets[int(i) - 1])
            for i, used in zip(flat[::2], flat[1::2], strict=True)
        ]

    def release(self, route: Sequence[Hop], name: str, attempt: str) -> None:
        """Give back the room attempt `attempt` of job `name` reserved on `route`."""
        keys = [reservations_key(self.swarm, hop.host) for hop in route]
        if keys:
            self._release(keys=keys, args=[name, attempt])

    def mark_waiting(self, name: str, holder: str, full: Full, need: int) -> None:
        """Say that job `name` waits for room on `full.host` (while `holder` exists)."""
        reason = {
            "host": full.host,
            "used": full.used,
            "budget": full.budget,
            "need": need,
            "holder": holder,
        }
        self.client.hset(waiting_key(self.swarm), name, json.dumps(reason))

    def clear_waiting(self, name: str) -> None:
        """Job `name` waits no more."""
        self.client.hdel(waiting_key(self.swarm), name)

    def waiting(self) -> dict[str, dict]:
        """The jobs waiting for room now, by name: the stage that is full (`host`, `used`,
        `budget`) and the tokens the job `need`s. A waiter whose holder is gone (its
        coordinator died) is not listed."""
        out = {}
        for name, raw in self.client.hgetall(waiting_key(self.swarm)).items():
            reason = self._live_reason(raw)
            if reason is not None:
                out[name.decode()] = reason
        return out

    def waiting_for(self, name: str) -> dict | None:
        """Why job `name` waits for room now, as `waiting` lists it; None when it does not
        wait, or its holder is gone."""
        raw = self.client.hget(waiting_key(self.swarm), name)
        return None if raw is None else self._live_reason(raw)

    def _live_reason(self, raw: bytes) -> dict | None:
        """A waiting record's reason; None when unreadable or its holder is gone."""
        try:
            record = json.loads(raw)
            holder = str(record["holder"])
            reason = {field: record[field] for field in WAITING_FIELDS}
        except (ValueError, KeyError, TypeError):
            return None
        return reason if self.client.exists(holder) else None

    def used(self, host: str) -> int:
        """The tokens reserved on `host` now, live holders only."""
        total = 0
        for value in self.client.hvals(reservations_key(self.swarm, host)):
            tokens, holder, _ = value.decode().split(" ")
            if self.client.exists(holder):
                total += int(tokens)
        return total


@dataclass
class Room:
    """The room one attempt of a job holds on the hops of its route, which may change while
    the job runs (a failover, a stage serving other layers)."""

    reservations: Reservations
    route: list[Hop]
    name: str
    need: int
    holder: str
    attempt: str

    def follow(self, route: Sequence[Hop]) -> list[Full]:
        """Move the room onto `route`: taken at once on the hosts new to it, even over their
        budget (the job already runs there; the stages it overflowed are returned), and given
        back on the hosts that left it. On a redis.RedisError the room counts as held on both
        routes, so that `release` gives back all of it."""
        hosts, held = {hop.host for hop in route}, {hop.host for hop in self.route}
        joined = [hop for hop in route if hop.host not in held]
        left = [hop for hop in self.route if hop.host not in hosts]
        self.route = [*route, *left]
        over = self.reservations.take(joined, self.name, self.need, self.holder, self.attempt)
        self.reservations.release(left, self.name, self.attempt)
        self.route = list(route)
        return over

    def release(self) -> None:
        """Give back the room on the route the job holds now."""
        self.reservations.release(self.route, self.name, self.attempt)


class JobLike(Protocol):
    """What `waiting_for_room` needs of a job."""

    id: int

    @property
    def finished(self) -> bool: ...


def waiting_for_room(client: redis.Redis, swarm: str, job: JobLike) -> dict | None:
    """Why `job` waits for its stages' room, `{"host", "used", "budget", "need"}`: the stage
    that is full, the tokens reserved there and its budget, and what the job needs. None when
    it does not wait; a finished job is not looked up. A job resumed after its coordinator died
    waits running, so the reason is not only a queued job's. Raises redis.RedisError when
    Redis does not answer."""
    if job.finished:
        return None
    return Reservations(client, swarm).waiting_for(room_name(job.id))


def check_fits(route: Sequence[Hop], need: int) -> None:
    """NeverFits, naming the stage, when some hop of `route` has a budget below `need`."""
    for hop in route:
        budget = hop.kv_budget_tokens
        if 0 < budget < need:
            raise NeverFits(
                f"the job needs {need} tokens of KV cache (prompt + max_new_tokens), more than "
                f"stage {hop.host} ever holds ({budget} tokens): shorten the prompt or "
                "max_new_tokens"
            )
