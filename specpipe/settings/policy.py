"""Policy: the limits on a job request and its defaults, the web app's rates and open
completions, and when and how big the nightly regression runs."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from specpipe.core.stopping import MAX_STOP_CHARS, MAX_STOP_STRINGS
from specpipe.settings.environment import env_int

_RATE = re.compile(r"\d+/(second|minute|hour|day)")


def _env_rate(name: str, default: str) -> str:
    value = (os.environ.get(name) or default).strip()
    if not _RATE.fullmatch(value) or int(value.partition("/")[0]) < 1:
        raise ValueError(f"{name} must be N/second, N/minute, N/hour or N/day, got {value!r}")
    return value


def submit_rate() -> str:
    """`SPECPIPE_SUBMIT_RATE` (30/minute): jobs one user may submit, form and API together."""
    return _env_rate("SPECPIPE_SUBMIT_RATE", "30/minute")


def login_rate() -> str:
    """`SPECPIPE_LOGIN_RATE` (10/minute): failed logins from one client address."""
    return _env_rate("SPECPIPE_LOGIN_RATE", "10/minute")


def login_account_rate() -> str:
    """`SPECPIPE_LOGIN_ACCOUNT_RATE` (20/hour): failed logins for one account name from one
    client address. Counted per address, so a stranger cannot lock the account's owner out."""
    return _env_rate("SPECPIPE_LOGIN_ACCOUNT_RATE", "20/hour")


def trusted_proxies() -> int:
    """`SPECPIPE_TRUSTED_PROXIES` (0): how many reverse proxies stand in front of the web app.
    With N > 0 the client's address, scheme and host are read from the last N hops of the
    `X-Forwarded-*` headers (werkzeug's ProxyFix); with 0 those headers are ignored."""
    return env_int("SPECPIPE_TRUSTED_PROXIES", 0, minimum=0)


def open_completions() -> int:
    """`SPECPIPE_OPEN_COMPLETIONS` (100): /v1 completions, streamed or waiting, one web process
    holds open at once; `specpipe web` runs one thread for each on top of its `--threads`."""
    return env_int("SPECPIPE_OPEN_COMPLETIONS", 100)


def open_completions_per_user() -> int:
    """`SPECPIPE_OPEN_COMPLETIONS_PER_USER` (8): of those, how many one user may hold."""
    return env_int("SPECPIPE_OPEN_COMPLETIONS_PER_USER", 8)


# What a job request that leaves a field out gets, from the web form, the API or the CLI.
JOB_DEFAULTS = {
    "max_new_tokens": 128,
    "temp": 0.8,
    "top_p": 0.95,
    "top_k": 0,
    "seed": None,  # drawn at random, then recorded
    "draft_k": 4,
    "stop": [],
    # Gumbel-max: its noise is the draft head's, so the head's drafts pay at a temperature too
    # (see `specpipe.core.sampling.SAMPLERS`); a job records it, and jobs from before drew by icdf.
    "sampler": "gumbel",
}


@dataclass(frozen=True)
class JobLimits:
    """Limits on a job request, the same for the web form, the API and the CLI."""

    # A sanity bound only: what limits a prompt is the model's context, counted in tokens at
    # submission (`specpipe.decoding.target.context_error`); 131k tokens of text fit in it.
    max_prompt_chars: int = 600_000
    max_new_tokens: int = 4096
    max_draft_k: int = 32
    max_active_jobs: int = 50  # one user's queued and running jobs together
    # Stop strings: fixed, not configurable.
    max_stop_strings: int = field(default=MAX_STOP_STRINGS, init=False)
    max_stop_chars: int = field(default=MAX_STOP_CHARS, init=False)


def job_limits() -> JobLimits:
    """`SPECPIPE_MAX_PROMPT_CHARS`, `SPECPIPE_MAX_NEW_TOKENS`, `SPECPIPE_MAX_DRAFT_K`,
    `SPECPIPE_MAX_ACTIVE_JOBS`."""
    defaults = JobLimits()
    return JobLimits(
        max_prompt_chars=env_int("SPECPIPE_MAX_PROMPT_CHARS", defaults.max_prompt_chars),
        max_new_tokens=env_int("SPECPIPE_MAX_NEW_TOKENS", defaults.max_new_tokens),
        max_draft_k=env_int("SPECPIPE_MAX_DRAFT_K", defaults.max_draft_k, 0),
        max_active_jobs=env_int("SPECPIPE_MAX_ACTIVE_JOBS", defaults.max_active_jobs),
    )


PREFIX_REUSE = ("user", "shared", "off")


def prefix_reuse() -> str:
    """`SPECPIPE_PREFIX_REUSE`: which earlier jobs' kept caches a job may start from, where its
    tokens start with theirs. `user` (the default): the same user's only, since a cache shared
    between users lets one time whether another sent a prompt; `shared`: every user's (a long
    system prompt is then prefilled once for all); `off`: none, and nothing is kept."""
    value = (os.environ.get("SPECPIPE_PREFIX_REUSE") or "user").strip().lower()
    if value not in PREFIX_REUSE:
        raise ValueError(f"SPECPIPE_PREFIX_REUSE must be user, shared or off, got {value!r}")
    return value


def swarm_timezone() -> ZoneInfo:
    """`SPECPIPE_TIMEZONE` (UTC): the swarm's time zone, an IANA name such as Europe/Berlin.
    Beat fires the nightly at `SPECPIPE_NIGHTLY` there, and a night's key is its date there."""
    value = (os.environ.get("SPECPIPE_TIMEZONE") or "UTC").strip()
    try:
        return ZoneInfo(value)
    except (ValueError, ZoneInfoNotFoundError):
        raise ValueError(
            f"SPECPIPE_TIMEZONE must be an IANA time zone such as UTC or Europe/Berlin, "
            f"got {value!r}"
        ) from None


def nightly_schedule() -> tuple[str, str]:
    """(minute, hour) of the nightly regression in the swarm's time zone (`swarm_timezone`):
    `SPECPIPE_NIGHTLY` as "HH:MM"."""
    value = os.environ.get("SPECPIPE_NIGHTLY") or "03:00"
    hour, _, minute = value.partition(":")
    if not (hour.isdigit() and minute.isdigit() and int(hour) < 24 and int(minute) < 60):
        raise ValueError(f"SPECPIPE_NIGHTLY must be HH:MM (in SPECPIPE_TIMEZONE), got {value!r}")
    return str(int(minute)), str(int(hour))


def nightly_sizes() -> dict[str, int]:
    """The nightly regression's proof sizes; the defaults are the reference run's."""
    return {
        "local_draws": env_int("SPECPIPE_NIGHTLY_LOCAL_DRAWS", 120_000, 1000),
        "sampler_trials": env_int("SPECPIPE_NIGHTLY_SAMPLER_TRIALS", 2_000, 4),
        "stops": env_int("SPECPIPE_NIGHTLY_STOPS", 12),
        "draws": env_int("SPECPIPE_NIGHTLY_DRAWS", 140),
        "generation_tokens": env_int("SPECPIPE_NIGHTLY_GENERATION_TOKENS", 48),
        "pilot_draws": env_int("SPECPIPE_NIGHTLY_PILOT_DRAWS", 16),
        "max_new_tokens": env_int("SPECPIPE_NIGHTLY_MAX_NEW_TOKENS", 64),
        # 0: the night's date as YYYYMMDD; set it to replay a night with its recorded seed
        "seed": env_int("SPECPIPE_NIGHTLY_SEED", 0, 0),
    }


# Sessions proof 2 keeps in flight on a swarm's ring (`proof swarm --in-flight`, the nightly).
# The head-on proof under `specpipe up` (4 stages of the default model on 2 CPUs) measured its
# stops in 186 s with 12, 165 s with 24 and 159 s with 48: larger batches pad fewer rows.
PROOF_IN_FLIGHT = 48
