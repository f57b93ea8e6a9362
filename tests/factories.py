"""Row factories for tests (CTFd's gen_* shape): keyword defaults, added and committed."""

from __future__ import annotations

from datetime import timedelta

from models.db import make_session_factory, utcnow
from models.jobs import Job
from models.nodes import upsert_node
from models.runs import Proof, ProofCase, Run, start_run
from models.users import User, builtin_admin, create_user


def gen_user(session, name: str, password: str | None = None, is_admin: bool = False) -> User:
    """A user; without a password it cannot log in through the form."""
    user = create_user(session, name, password, is_admin=is_admin)
    session.commit()
    return user


def gen_job(session, owner: User | None = None, **fields) -> Job:
    """A job row owned by `owner` (else the built-in admin); defaults make a queued job."""
    values = {
        "prompt": "Once upon a time",
        "model": "tiny-test",
        "max_new_tokens": 32,
        "temp": 0.8,
        "top_p": 0.95,
        "top_k": 0,
        "seed": 1234,
        "draft_k": 4,
        "status": "queued",
    }
    values.update(fields)
    values["user_id"] = (owner or builtin_admin(session)).id
    job = Job(**values)
    session.add(job)
    session.commit()
    return job


def gen_node(session, host: str, age_s: float = 1.0, **fields):
    """A node whose last heartbeat was `age_s` seconds ago."""
    values = {"role": "stage0", "layer_start": 0, "layer_end": 9}
    values.update(fields)
    node = upsert_node(session, host, last_heartbeat=utcnow() - timedelta(seconds=age_s), **values)
    session.commit()
    return node


def gen_ring(session, count: int = 4, layers: int = 36) -> list:
    """A ring of `count` online nodes splitting `layers` evenly, the last one the tail."""
    geos = ["WA", "MN", "NC", "NJ", "TX", "CA"]
    per = layers // count
    return [
        gen_node(
            session,
            f"host{i}.example",
            role="tail" if i == count - 1 else f"stage{i}",
            layer_start=i * per,
            layer_end=(i + 1) * per,
            geo=geos[i % len(geos)],
            public_ip=f"203.0.113.{10 + i}",
            gpu_name="NVIDIA GeForce RTX 4090",
            gpu_uuid=f"GPU-{i:08x}-test",
            memory_bytes=24 * 2**30,
            software_version="0.1.0",
            redis_url=f"redis://host{i}.example:6379/0",
        )
        for i in range(count)
    ]


def gen_proof_run(session, kind: str = "proof", passed: bool = True) -> Run:
    """A proof run with a local-math proof (4 configs) and a swarm proof (3 stops)."""
    run = start_run(
        session,
        kind=kind,
        model="tiny-test",
        quant="fp32",
        shard_commit="abc1234",
        claim="speculative sampling is lossless",
        method="coupled inverse-CDF acceptance",
        verdict="pass" if passed else "fail",
    )
    local = Proof(
        kind="local_math",
        trigger="nightly" if kind == "nightly" else "manual",
        verdict="pass" if passed else "fail",
        gate=0.02,
        summary={
            "draws_per_case": 20000,
            "vocab": 50,
            "configs_tested": 4,
            "worst_tv_committed_vs_target": 0.011 if passed else 0.05,
            "gate": 0.02,
            "greedy_temp0_bit_identical_to_argmax": True,
            "verdict": "pass" if passed else "fail",
        },
    )
    for i, (temp, top_p, top_k) in enumerate(
        [(0.7, 1.0, 0), (1.0, 0.9, 0), (1.0, 1.0, 5), (1.3, 0.8, 10)]
    ):
        tv = 0.008 + 0.001 * i + (0.04 if not passed and i == 3 else 0.0)
        local.cases.append(
            ProofCase(
                position=i,
                label=f"T={temp} p={top_p} k={top_k}",
                temp=temp,
                top_p=top_p,
                top_k=top_k,
                draws=20000,
                tv=tv,
                passed=tv < 0.02,
            )
        )
    swarm = Proof(
        kind="on_swarm",
        trigger=local.trigger,
        verdict="pass",
        gate=0.05,
        noise_floor=0.03,
        summary={
            "temp": 1.0,
            "top_p": 1.0,
            "draws_per_mode_per_stop": 400,
            "stops": 3,
            "high_entropy_stops_ge_1bit": 3,
            "max_entropy_bits": 4.2,
            "mean_tv_spec_vs_plain": 0.031,
            "verdict": "pass",
        },
    )
    for i in range(3):
        spec = {str(t): 40 - 3 * t + i for t in range(12)}
        plain = {str(t): 41 - 3 * t for t in range(12)}
        swarm.cases.append(
            ProofCase(
                position=i,
                label=f"stop {i + 1}",
                temp=1.0,
                top_p=1.0,
                top_k=0,
                draws=400,
                entropy_bits=3.5 + 0.2 * i,
                tv=0.03 + 0.001 * i,
                noise_tv=0.029,
                passed=True,
                spec_counts=spec,
                plain_counts=plain,
            )
        )
    summary = {
        "greedy_temp0": {
            "text": "The cat sat on the mat.",
            "tok_s": 4.6,
            "plain_tok_s": 2.1,
            "speedup": 2.19,
            "accepted_drafts": [2, 3],
            "identical": True,
        },
        "sampled_temp0.7_seed7": {
            "text": "The dog ran home.",
            "tok_s": 3.9,
            "plain_tok_s": 2.0,
            "speedup": 1.95,
            "accepted_drafts": [1, 2],
            "identical": True,
        },
        "verdict": "PASS",
    }
    run.generation_summary = summary
    generation = Proof(kind="generation", trigger=local.trigger, verdict="pass", summary=summary)
    run.proofs.extend([local, swarm, generation])
    session.commit()
    return run


def finish_elsewhere(db_url: str, job_id: int, status: str = "done") -> None:
    """End job `job_id` from a session of its own, as a coordinator in another process does."""
    with make_session_factory(db_url)() as other:
        job = other.get(Job, job_id)
        job.status, job.finished_at = status, utcnow()
        other.commit()
