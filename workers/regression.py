"""The nightly lossless regression: all three proofs on the live swarm, stored as one run.

`workers.regression.nightly` (queue `nightly`, its own lane; fired by beat at
`SPECPIPE_NIGHTLY`) runs proof 1 (the local math), proof 2 (speculative against plain on the
ring, with the exact same-seed check) and proof 3 (generation, speculative and plain side by
side) and stores ONE run
of kind `nightly`: seed, proofs, a snapshot of the ring it ran on, the project's commit, and a
verdict. A proof that cannot run (no ring, no model) is stored as an `error` proof, so a broken
swarm fails the nightly rather than skipping it.

Two schedulers firing at once run it once: a run takes a Redis lock on its key (the date in the
swarm's time zone, `SPECPIPE_TIMEZONE`, for beat's runs, a fresh key for `specpipe regression
run`) and refreshes it while it works, and
stores its run under the key (`Run.night`) before it lets go. The verdict lives only in the
store: a worker holding the lock runs the key unless the store has its run, and `specpipe
regression run` waits for that run, so nothing written into the broker fakes a pass or marks a
night done. A worker killed mid-run lets its lock lapse within `LOCK_TTL_S`, so the broker's
redelivery of the task runs the night after all. A night's key must be today's: one for another
date (queued ahead by whoever can write to the broker) is refused before it claims anything, so
it cannot store that night's run early and make the real one skip.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
from datetime import date, datetime
from pathlib import Path

import redis
from celery import shared_task
from sqlalchemy.orm import Session

from models.db import utcnow
from models.proof_store import night_outcome, run_verdict, save_proof_run
from models.runs import Proof, Run
from specpipe import __version__
from specpipe.core.ring import GapError
from specpipe.decoding.target import Target, open_target
from specpipe.prompts import DEFAULT_GENERATION_PROMPT, DEFAULT_PROMPTS
from specpipe.proofs.local import LocalProofConfig, run_local_proof
from specpipe.proofs.outputs import run_generation_proof
from specpipe.proofs.swarm import SwarmProofConfig, run_swarm_proof
from specpipe.settings import (
    PROOF_IN_FLIGHT,
    Settings,
    default_model,
    nightly_sizes,
    swarm_timezone,
)
from specpipe.swarm import inventory
from specpipe.swarm.redis_ring import RedisRing, RingError
from workers.locks import LockKeeper
from workers.names import MANUAL_KEY, NIGHT_KEY, NIGHTLY_TASK, night_key
from workers.node_sync import sync_inventory

log = logging.getLogger("specpipe.regression")

LOCK_TTL_S = 120  # refreshed every 40 s while the run lives
ATTEMPTS_TTL_S = 7 * 24 * 3600
CLAIM = (
    "Speculative sampling on the swarm is lossless: committed tokens follow the target's "
    "temperature/top-p/top-k distribution, and equal plain sampling's for the same seed."
)
RING_ERRORS = (inventory.RouteError, RingError, GapError, ValueError, redis.RedisError)
# Proofs 2 and 3 run with the tail's draft head (and the gumbel sampler its drafts share noise
# with). The coordinator cannot see whether the tail holds a head; one without a head sends no
# drafts, and the run records that the head drafted for none.
NIGHTLY_DRAFT_HEAD = True


def lock_key(swarm: str, key: str) -> str:
    return f"specpipe:{swarm}:nightly:lock:{key}"


def claim_night(
    client: redis.Redis,
    session: Session,
    swarm: str,
    key: str,
    holder: str,
    ttl_s: float = LOCK_TTL_S,
) -> LockKeeper | None:
    """The held lock when this worker is to run `key`; None when the store holds the night's
    run already or another worker holds the lock.

    The store is read under the lock: a run stores itself before it lets go, so a night done is
    never run again, and nothing in Redis marks one done. Every attempt is listed under
    `attempts_key`, marked "ran" or "skipped"."""
    keeper = LockKeeper(client.lock(lock_key(swarm, key), timeout=ttl_s, thread_local=False))
    if not keeper.start():
        keeper = None
    elif night_outcome(session, key) is not None:
        keeper.stop()
        keeper = None
    session.rollback()  # end the read: the run is stored in a transaction of its own
    client.rpush(attempts_key(swarm, key), f"{holder} {'ran' if keeper else 'skipped'}")
    client.expire(attempts_key(swarm, key), ATTEMPTS_TTL_S)
    return keeper


def attempts_key(swarm: str, key: str) -> str:
    """Every worker that tried to run the key, lock won or not (for the logs and the tests)."""
    return f"specpipe:{swarm}:nightly:attempts:{key}"


def project_commit() -> str:
    """`git describe` of the checkout this code runs from, else the package version."""
    root = Path(__file__).resolve().parents[1]
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--tags"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        )
        described = out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        described = ""
    return described or f"v{__version__}"


def swarm_today(now: datetime | None = None) -> date:
    """The date in the swarm's time zone now (or at `now`): the night beat's run answers."""
    return (now or utcnow()).astimezone(swarm_timezone()).date()


def key_refusal(key: object, today: date) -> str | None:
    """Why the nightly must not run `key` on `today`, else None: a night's key must be today's
    (`night_key`), anything else a manual run's (`manual_key`)."""
    tonight = night_key(today)
    if not isinstance(key, str):
        return f"the key is not a string (tonight's is {tonight})"
    if key == tonight or MANUAL_KEY.fullmatch(key):
        return None
    if NIGHT_KEY.fullmatch(key):
        return f"{key} is not tonight's key ({tonight} in {swarm_timezone().key})"
    return f"{key[:80]!r} is neither tonight's key ({tonight}) nor a manual run's"


def nightly_seed(day: date) -> int:
    """One seed per night, readable in the record: the date as YYYYMMDD."""
    return int(day.strftime("%Y%m%d"))


def _error_proof(kind: str, reason: str) -> Proof:
    return Proof(kind=kind, trigger="nightly", verdict="error", summary={"error": reason})


def run_nightly(
    session: Session,
    target: Target | str,
    settings: Settings,
    seed: int,
    sizes: dict[str, int],
    draft_head: bool = NIGHTLY_DRAFT_HEAD,
    night: str | None = None,
) -> Run:
    """Run the three proofs and store them as one nightly run, the answer to `night` (its
    key); committed before it returns.

    `target` is the model (or why it could not be opened); the ring is routed over the online
    stages of the swarm `settings` names. With `draft_head`, proofs 2 and 3 verify the tail's
    draft head's drafts, sampling with gumbel.
    """
    local = run_local_proof(
        LocalProofConfig(
            draws=sizes["local_draws"],
            seed=seed,
            sampler_trials=sizes["sampler_trials"],
            gumbel_sampler_trials=sizes["sampler_trials"] // 4,
        )
    )
    errors: dict[str, str] = {}
    swarm_result = generation = None
    topology = None
    ring = None
    if isinstance(target, str):
        errors["on_swarm"] = errors["generation"] = target
    else:
        try:
            ring = RedisRing.from_inventory(settings, target.name, target.n_layers)
            route = list(ring.route)
            # A stage that samples inexactly fails the night; the proofs still run: they must
            # catch it.
            if warning := inventory.inexact_warning(route):
                errors["on_swarm"] = warning
                log.error("nightly: %s", errors["on_swarm"])
            sync_inventory(session, route)  # the run's node snapshot is this ring, with roles
            session.commit()
            topology = " → ".join([*(n.geo or n.host for n in route), "back"])
            prompts = [target.prompt_ids(p) for p in DEFAULT_PROMPTS]
            with ring.twins(PROOF_IN_FLIGHT - 1) as lanes:
                swarm_result = run_swarm_proof(
                    ring,
                    prompts,
                    SwarmProofConfig(
                        stops=sizes["stops"],
                        draws=sizes["draws"],
                        seed=seed,
                        generation_tokens=sizes["generation_tokens"],
                        pilot_draws=sizes["pilot_draws"],
                        draft_head=draft_head,
                    ),
                    lanes=lanes,
                )
        except RING_ERRORS as exc:
            errors["on_swarm"] = f"{type(exc).__name__}: {exc}"
        if ring is not None:
            try:
                generation = run_generation_proof(
                    ring,
                    target.prompt_ids(DEFAULT_GENERATION_PROMPT),
                    target.decode,
                    max_new_tokens=sizes["max_new_tokens"],
                    eos_ids=target.eos_ids,
                    draft_head=draft_head,
                )
            except RING_ERRORS as exc:
                errors["generation"] = f"{type(exc).__name__}: {exc}"
            ring.close()
        elif "generation" not in errors:
            errors["generation"] = errors["on_swarm"]

    model = target if isinstance(target, str) else target.name
    run = save_proof_run(
        session,
        nightly=True,
        local=local,
        swarm=swarm_result,
        generation=generation,
        shard_commit=project_commit(),
        claim=CLAIM,
        model=default_model() if isinstance(target, str) else model,
        quant=None if isinstance(target, str) else target.quant,
        method=_method(seed, sizes, draft_head, swarm_result, generation),
        topology=topology,
        night=night,
    )
    for kind, reason in errors.items():
        run.proofs.append(_error_proof(kind, reason))
    run.verdict = run_verdict([p.verdict for p in run.proofs])
    run.finished_at = utcnow()
    session.commit()
    return run


def _method(
    seed: int,
    sizes: dict[str, int],
    draft_head: bool,
    swarm: dict | None,
    generation: dict | None,
) -> str:
    """How the night ran, for the run record: sizes, sampler and where the drafts came from
    (with the head: for how many speculative draws and rounds it drafted)."""
    if draft_head:
        drafts = "the tail's draft head's drafts K=4 (the n-gram's where it sent none)"
        if (swarm or {}).get("draft_trees"):
            drafts = (
                "the tail's draft head's draft trees: its chain of K=4 and its next candidates "
                "at the first two positions (the n-gram's chain where it sent none)"
            )
        head = (swarm or {}).get("head")
        if head is not None:
            drafts += f", head drafted for {head['rounds']}/{head['draws']} draws"
        sampler, law = "gumbel", "joint law of the stop's token and the next"
    else:
        drafts, sampler, law = "n-gram drafts K=4", "icdf", "law of the stop's token"
    generation_drafts = "n-gram"
    if draft_head:
        head_rounds = sum(
            m["head_rounds"] for m in (generation or {}).values() if isinstance(m, dict)
        )
        generation_drafts = f"n-gram and draft head, {head_rounds} head rounds"
    return (
        f"nightly regression, seed {seed}: proof 1 local math ({sizes['local_draws']:,} "
        f"draws per case); proof 2 on the swarm ({sizes['stops']} stops × "
        f"{sizes['draws']} draws per mode, {drafts}, sampler {sampler}, {law}, coupled verify "
        f"keyed by (seed, position), exact same-seed check); proof 3 generation greedy and "
        f"seeds 7, 99 (sampler {sampler}, drafts {generation_drafts}), speculative vs plain"
    )


@shared_task(name=NIGHTLY_TASK, bind=True)
def nightly(self, key: str | None = None) -> dict:
    """Celery task: the nightly regression once per key (default: tonight's, dated in the
    swarm's time zone); a key for another night is refused and claims nothing."""
    today = swarm_today()
    key = key or night_key(today)
    refusal = key_refusal(key, today)
    if refusal is not None:
        log.warning("nightly refused: %s", refusal)
        return {"key": str(key)[:80], "refused": refusal}
    settings = Settings.from_env()
    client = redis.Redis.from_url(settings.redis_url, socket_connect_timeout=5)
    holder = f"{socket.gethostname()}:{os.getpid()}"
    keeper = None
    try:
        keeper = claim_night(client, self.session, settings.swarm, key, holder)
        if keeper is None:
            log.info("nightly %s is already running or done elsewhere", key)
            return {"key": key, "skipped": True}
        try:
            target: Target | str = open_target(default_model())
        except ValueError as exc:
            target = str(exc)
        sizes = nightly_sizes()
        seed = sizes["seed"] or nightly_seed(today)
        run = run_nightly(
            self.session, target, settings, seed, sizes, night=key
        )  # on an exception the lock is released below, so a retry runs the night
        outcome = {"key": key, "run_id": run.id, "name": run.name, "verdict": run.verdict}
        log.info("nightly %s: run %s %s", key, run.name, run.verdict)
        return outcome
    finally:
        if keeper is not None:
            keeper.stop()  # after the run is stored: a later claim sees the night done
        client.close()
