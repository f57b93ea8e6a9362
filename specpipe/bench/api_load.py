"""The JSON API under load: many jobs from several users, submitted through
`POST /api/v1/jobs` against the running stack, and what became of each.

The stack runs as `specpipe up` runs it (`benchstack.Stack`). Users and their API tokens are
made in its store (`models.users.create_user`, `models.tokens.create_token`, what `specpipe
user create` and `specpipe token create --user` call). The jobs are spread evenly over a time
window, the users taking turns, each request with its user's bearer token. A submission is
either accepted (201) or refused with 429 under the per-user limits (the submission rate, the
cap on active jobs); both are counted, and every accepted job must end (done or failed): none
lost, none stuck, no 5xx anywhere. Time to done is from the job's creation to its end, as the
store records them. The resident memory of every process of the stack is taken after a warm-up
job and again once every job has ended. Every job that ended done must hold the tokens the same
job gives alone in this process (its prompt, sampling parameters and seed): many jobs at once
through the stack's batched stages change no job's output.
"""

from __future__ import annotations

import json
import re
import secrets
import statistics
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from specpipe.bench.faults import JobPlan, References
from specpipe.bench.stack import Stack

Log = Callable[[str], None]
FINAL = ("done", "failed", "cancelled")
PROMPTS = (
    "Explain why the sky is blue to a ten-year-old.",
    "List five uses for a paperclip.",
    "Summarise: The cat sat on the mat. The dog sat on the rug. They were both happy.",
    "Write a haiku about the sea.",
)


@dataclass
class Submission:
    """One POST /api/v1/jobs and its answer."""

    user: str
    status: int  # HTTP status; 0 when no answer came
    job_id: int | None = None
    error: str | None = None


def make_users(database_url: str, n_users: int, prefix: str = "load") -> dict[str, str]:
    """Create `n_users` users with an API token each in the store; returns name -> token."""
    from models.db import make_session_factory
    from models.tokens import create_token
    from models.users import create_user

    tokens = {}
    with make_session_factory(database_url)() as session:
        for i in range(n_users):
            name = f"{prefix}{i}"
            user = create_user(session, name, secrets.token_urlsafe(16))
            tokens[name] = create_token(session, f"{name}-api", user)
        session.commit()
    return tokens


def api(
    base_url: str,
    token: str,
    method: str,
    path: str,
    body: dict | None = None,
    timeout_s: float = 30.0,
) -> tuple[int, dict]:
    """One API call: (HTTP status, JSON body); status 0 when the request got no answer."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(
        base_url.rstrip("/") + path,
        data=data,
        method=method,
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, json.loads(exc.read() or b"{}")
        except ValueError:
            return exc.code, {}
    except (OSError, ValueError) as exc:
        return 0, {"error": str(exc)}


def submit_all(
    base_url: str, tokens: dict[str, str], n_jobs: int, within_s: float, tokens_per_job: int
) -> list[Submission]:
    """Submit `n_jobs` jobs spread evenly over `within_s` seconds, the users taking turns."""
    users = list(tokens)
    started = time.monotonic()

    def one(i: int) -> Submission:
        time.sleep(max(0.0, started + i * within_s / n_jobs - time.monotonic()))
        user = users[i % len(users)]
        body = {
            "prompt": PROMPTS[i % len(PROMPTS)],
            "max_new_tokens": tokens_per_job,
            "seed": i,
            "temp": 0.8,
            "draft_k": 4,
        }
        status, answer = api(base_url, tokens[user], "POST", "/api/v1/jobs", body)
        return Submission(
            user,
            status,
            answer.get("id") if status == 201 else None,
            None if status == 201 else answer.get("error"),
        )

    with ThreadPoolExecutor(max_workers=16) as pool:
        return list(pool.map(one, range(n_jobs)))


def wait_jobs(database_url: str, job_ids: list[int], deadline_s: float) -> dict[int, dict]:
    """Each job's status and times once every job has ended, or at the deadline."""
    from sqlalchemy import select

    from models.db import as_utc, make_session_factory
    from models.jobs import Job

    seen: dict[int, dict] = {}
    deadline = time.monotonic() + deadline_s
    with make_session_factory(database_url)() as session:
        while True:
            session.rollback()
            rows = session.scalars(select(Job).where(Job.id.in_(job_ids))).all()
            seen = {
                job.id: {
                    "status": job.status,
                    "error": job.error,
                    "created_at": as_utc(job.created_at),
                    "finished_at": as_utc(job.finished_at),
                }
                for job in rows
            }
            ended = sum(j["status"] in FINAL for j in seen.values())
            if ended == len(job_ids) or time.monotonic() > deadline:
                return seen
            time.sleep(0.5)


def solo_mismatches(model: str, database_url: str, job_ids: list[int]) -> list[int]:
    """The jobs among `job_ids` that ended done with other tokens than the same job run alone
    in this process (`faultbench.References`: the whole model, the job's prompt, sampling
    parameters, seed and token budget; the jobs this bench submits have no stop strings)."""
    from sqlalchemy import select

    from models.db import make_session_factory
    from models.jobs import Job

    references = References(model)
    mismatched = []
    with make_session_factory(database_url)() as session:
        jobs = session.scalars(select(Job).where(Job.id.in_(job_ids), Job.status == "done"))
        for job in jobs:
            plan = JobPlan(
                job.prompt,
                job.seed,
                job.max_new_tokens,
                job.temp,
                job.top_p,
                job.top_k,
                job.draft_k,
                job.sampler,
            )
            if references.get(plan).tokens != list(job.output_ids):
                mismatched.append(job.id)
    return sorted(mismatched)


def percentile(values: list[float], q: float) -> float | None:
    """The q-quantile (0..1) of `values`, by linear interpolation; None when empty."""
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def run_load(
    model: str,
    workdir: Path,
    log: Log,
    *,
    stages: int = 3,
    users: int = 8,
    jobs: int = 200,
    within_s: float = 60.0,
    tokens: int = 16,
    deadline_s: float = 1800.0,
    env: dict[str, str] | None = None,
) -> dict:
    """Start the stack, load its API, wait for every job; the numbers as a dict."""
    with Stack(model, stages, workdir / "stack", env=env) as stack:
        log(f"stack up: {stages} stages of {model}, {stack.web_url}")
        tokens_by_user = make_users(stack.database_url, users)
        warm = make_users(stack.database_url, 1, prefix="warmup")
        status, answer = api(
            stack.web_url,
            next(iter(warm.values())),
            "POST",
            "/api/v1/jobs",
            {"prompt": PROMPTS[0], "max_new_tokens": tokens},
        )
        if status != 201:
            raise RuntimeError(f"the warm-up job was refused: {status} {answer}")
        wait_jobs(stack.database_url, [answer["id"]], deadline_s)
        rss_before = stack.rss()

        started = time.monotonic()
        subs = submit_all(stack.web_url, tokens_by_user, jobs, within_s, tokens)
        submit_s = time.monotonic() - started
        accepted = [s.job_id for s in subs if s.status == 201]
        log(
            f"{len(subs)} submissions in {submit_s:.1f} s: {len(accepted)} accepted, "
            f"{sum(s.status == 429 for s in subs)} refused with 429"
        )
        final = wait_jobs(stack.database_url, accepted, deadline_s)
        statuses = _read_back(stack.web_url, tokens_by_user, subs)
        time.sleep(2.0)  # let the last job's buffers go before measuring
        rss_after = stack.rss()
        log("each done job against its solo run in this process")
        mismatched = solo_mismatches(model, stack.database_url, accepted)

    http = Counter(s.status for s in subs) + Counter(statuses)
    durations = [
        (j["finished_at"] - j["created_at"]).total_seconds()
        for j in final.values()
        if j["status"] == "done" and j["finished_at"]
    ]
    outcome = Counter(j["status"] for j in final.values())
    memory = {
        role: {"before_mib": rss_before[role] / 2**20, "after_mib": rss_after.get(role, 0) / 2**20}
        for role in rss_before
    }
    # "try again in 42 s": one reason whatever the wait it names
    refused = Counter(
        re.sub(r"in \d+ s\b", "in N s", s.error or "") for s in subs if s.status == 429
    )
    result = {
        "setup": {
            "model": model,
            "stages": stages,
            "users": users,
            "jobs": jobs,
            "within_s": within_s,
            "tokens": tokens,
        },
        "submitted": len(subs),
        "submit_s": submit_s,
        "accepted": len(accepted),
        "rate_limited": sum(refused.values()),
        "rate_limited_reasons": dict(refused),
        "unanswered": http.get(0, 0),
        "http_5xx": sum(n for code, n in http.items() if code >= 500),
        "http_statuses": {str(code): n for code, n in sorted(http.items())},
        "done": outcome.get("done", 0),
        "failed": outcome.get("failed", 0) + outcome.get("cancelled", 0),
        "failed_reasons": sorted(
            {
                j["error"] or j["status"]
                for j in final.values()
                if j["status"] in ("failed", "cancelled")
            }
        ),
        "lost": len(set(accepted) - set(final)),
        "stuck": sum(j["status"] not in FINAL for j in final.values()),
        "not_as_solo": mismatched,
        "time_to_done_s_p50": percentile(durations, 0.50),
        "time_to_done_s_p95": percentile(durations, 0.95),
        "memory": memory,
        "submissions": [asdict(s) for s in subs],
    }
    bad = (
        result["lost"]
        + result["stuck"]
        + result["http_5xx"]
        + result["unanswered"]
        + len(mismatched)
    )
    result["verdict"] = "PASS" if not bad else "FAIL"
    return result


def _read_back(base_url: str, tokens: dict[str, str], subs: list[Submission]) -> Counter:
    """GET every accepted job with its owner's token; the HTTP statuses seen."""
    lock, seen = threading.Lock(), Counter()

    def one(sub: Submission) -> None:
        status, _ = api(base_url, tokens[sub.user], "GET", f"/api/v1/jobs/{sub.job_id}")
        with lock:
            seen[status] += 1

    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(one, [s for s in subs if s.job_id is not None]))
    return seen


def report(result: dict) -> list[str]:
    """The result as a few lines of text."""
    p50, p95 = result["time_to_done_s_p50"], result["time_to_done_s_p95"]
    times = f"p50 {p50:.1f} s, p95 {p95:.1f} s" if p50 is not None else "none done"
    lines = [
        f"submitted {result['submitted']} in {result['submit_s']:.1f} s: "
        f"{result['accepted']} accepted, {result['rate_limited']} refused with 429, "
        f"{result['unanswered']} unanswered; HTTP 5xx: {result['http_5xx']}",
        f"jobs: {result['done']} done, {result['failed']} failed, {result['lost']} lost, "
        f"{result['stuck']} stuck; time to done {times}",
        f"done jobs whose tokens differ from their solo run: {len(result['not_as_solo'])}",
        "memory (RSS, MiB)  before  after",
    ]
    for role, m in result["memory"].items():
        lines.append(f"  {role:<16} {m['before_mib']:7.1f} {m['after_mib']:7.1f}")
    lines += [f"  429: {reason} ({n})" for reason, n in result["rate_limited_reasons"].items()]
    lines += [f"  failed: {reason}" for reason in result["failed_reasons"]]
    return lines
