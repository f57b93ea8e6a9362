"""Settings read from the environment, in one place.

Every entry point (CLI, stage worker, Celery workers, web app) reads its configuration here, so
each default is written once. Nothing secret has a default: secrets come from the environment or
from files that `specpipe up` writes into the instance folder.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


def instance_dir() -> Path:
    """The instance folder: `$SPECPIPE_HOME`, else `./instance`."""
    return Path(os.environ.get("SPECPIPE_HOME") or "instance").resolve()


def database_url() -> str:
    """`DATABASE_URL` when set, else a SQLite file in the instance folder."""
    url = os.environ.get("DATABASE_URL")
    if url:
        return url
    return f"sqlite:///{instance_dir() / 'specpipe.sqlite3'}"


@dataclass(frozen=True)
class Settings:
    """A snapshot of the environment-driven settings."""

    home: Path
    database_url: str
    redis_url: str | None  # None: `specpipe up` starts its own Redis
    swarm: str  # the swarm's name, part of every stream key
    swarm_key: str | None  # HMAC key signing the data plane

    @classmethod
    def from_env(cls) -> Settings:
        return cls(
            home=instance_dir(),
            database_url=database_url(),
            redis_url=os.environ.get("REDIS_URL") or None,
            swarm=os.environ.get("SPECPIPE_SWARM", "default"),
            swarm_key=os.environ.get("SPECPIPE_SWARM_KEY") or None,
        )
