"""Settings read from the environment, in one place.

Every entry point (CLI, stage worker, Celery workers, web app) reads its configuration here, as
`settings.NAME`, so each default is written once. The reading is split by what it reads:
`environment` (where a process finds its swarm, and the operator's switches), `keys` (secrets
and key files) and `policy` (job limits, rates, the nightly); `Settings` is a snapshot of what
a process needs of them. Nothing secret has a default: secrets come from the environment or
from files that `specpipe up` writes into the instance folder.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from specpipe.settings.environment import (
    CA_CERT_FILE,
    DEFAULT_HEARTBEAT_S,
    DEFAULT_MODEL,
    DEFAULT_REDIS_MAXMEMORY,
    DEFAULT_REDIS_URL,
    DEFAULT_SWARM,
    JOINED_FILE,
    PROCESSES_FILE,
    SWARM_FILE,
    TLS_CERT_FILE,
    TLS_DIR,
    TLS_KEY_FILE,
    accept_backported_redis,
    configured_redis_url,
    data_key_epoch_s,
    database_url,
    default_model,
    host_quota_bytes,
    https,
    insecure_clear_passwords,
    insecure_shared_key,
    instance_dir,
    kept_prefixes,
    kv_budget_tokens,
    max_sessions,
    redis_maxmemory,
    redis_url,
    registry_url,
    stalled_after_s,
    swarm_ca,
    swarm_file,
    swarm_name,
    tls_dir,
)
from specpipe.settings.keys import (
    ADMIN_PASSWORD_FILE,
    COORDINATOR_KEY_FILE,
    COORDINATOR_PUB_FILE,
    HOST_KEYS_DIR,
    KEEPER_PASSWORD_FILE,
    LOCAL_REDIS_PASSWORD_FILE,
    REDIS_PASSWORD_FILE,
    ROSTERS_DIR,
    SECRET_KEY_FILE,
    SWARM_KEY_FILE,
    admin_password_file,
    coordinator_key_path,
    coordinator_public_key,
    ensure_keeper_password,
    ensure_local_redis_password,
    ensure_redis_password,
    ensure_secret_key,
    ensure_swarm_key,
    host_key_path,
    keeper_password,
    key_file_keys,
    local_redis_password,
    parse_deadline,
    redis_password,
    roster_path,
    rotate_swarm_key,
    sealing_key_path,
    secret_key,
    swarm_key,
    swarm_key_path,
    swarm_keys,
    write_admin_password,
    write_private,
)
from specpipe.settings.policy import (
    JOB_DEFAULTS,
    PROOF_IN_FLIGHT,
    JobLimits,
    job_limits,
    login_account_rate,
    login_rate,
    nightly_schedule,
    nightly_sizes,
    open_completions,
    open_completions_per_user,
    prefix_reuse,
    submit_rate,
    swarm_timezone,
    trusted_proxies,
)


@dataclass(frozen=True)
class Settings:
    """A snapshot of the environment-driven settings."""

    home: Path
    database_url: str
    redis_url: str  # the registry and broker Redis
    swarm: str  # the swarm's name, part of every stream key
    swarm_key: str | None  # HMAC key signing the data plane
    old_swarm_keys: tuple[str, ...] = ()  # still accepted while a new key spreads
    # The swarm's data-plane Redis password, for the hosts' addresses (`redis_password`).
    redis_password: str | None = field(default=None, repr=False)
    # This host's copy of the swarm CA, which other hosts' TLS Redis must verify against.
    tls_ca: str | None = None
    # The coordinator's public key this host pins (hex): every host's own key is then checked
    # against the roster the coordinator signs. None: no process starts, unless the operator
    # opted out (`insecure_shared_key`).
    coordinator_public_key: str | None = None
    # `SPECPIPE_INSECURE_SHARED_KEY=1`: without a pinned coordinator key, trust every holder of
    # the swarm key alike (the shared-key mode) rather than refuse to start.
    insecure_shared_key: bool = False
    # This host's TLS folder (`tls_dir`), where it keeps its copy of `coordinator.pub`.
    tls_dir: Path | None = None

    @classmethod
    def from_env(cls) -> Settings:
        keys = swarm_keys()
        return cls(
            home=instance_dir(),
            database_url=database_url(),
            redis_url=redis_url(),
            swarm=swarm_name(),
            swarm_key=keys[0] if keys else None,
            old_swarm_keys=keys[1:],
            redis_password=redis_password(),
            tls_ca=swarm_ca(),
            coordinator_public_key=coordinator_public_key(),
            insecure_shared_key=insecure_shared_key(),
            tls_dir=tls_dir(),
        )

    @property
    def accepted_swarm_keys(self) -> tuple[str, ...]:
        """The key that signs, then the old ones still accepted."""
        return (self.swarm_key, *self.old_swarm_keys) if self.swarm_key else ()

    def for_swarm(
        self,
        redis_url: str,
        swarm: str,
        swarm_key: str | bytes,
        coordinator_public_key: str | None = None,
        insecure_shared_key: bool = False,
    ) -> Settings:
        """These settings pointed at another swarm (a benchmark's or a test's own), which pins
        `coordinator_public_key`, or else trusts its swarm key holders alike when
        `insecure_shared_key` says so (`specpipe.swarm.trust.keyring` refuses otherwise)."""
        key = swarm_key.decode() if isinstance(swarm_key, bytes) else swarm_key
        return replace(
            self,
            redis_url=redis_url,
            swarm=swarm,
            swarm_key=key,
            old_swarm_keys=(),
            coordinator_public_key=coordinator_public_key,
            insecure_shared_key=insecure_shared_key,
        )


__all__ = [
    "Settings",
    "instance_dir",
    "database_url",
    "DEFAULT_REDIS_URL",
    "DEFAULT_SWARM",
    "DEFAULT_MODEL",
    "DEFAULT_REDIS_MAXMEMORY",
    "SWARM_FILE",
    "JOINED_FILE",
    "PROCESSES_FILE",
    "TLS_DIR",
    "TLS_CERT_FILE",
    "TLS_KEY_FILE",
    "CA_CERT_FILE",
    "DEFAULT_HEARTBEAT_S",
    "swarm_file",
    "redis_url",
    "configured_redis_url",
    "registry_url",
    "swarm_name",
    "max_sessions",
    "kept_prefixes",
    "kv_budget_tokens",
    "stalled_after_s",
    "data_key_epoch_s",
    "host_quota_bytes",
    "redis_maxmemory",
    "tls_dir",
    "swarm_ca",
    "insecure_shared_key",
    "insecure_clear_passwords",
    "accept_backported_redis",
    "https",
    "default_model",
    "SECRET_KEY_FILE",
    "SWARM_KEY_FILE",
    "REDIS_PASSWORD_FILE",
    "LOCAL_REDIS_PASSWORD_FILE",
    "KEEPER_PASSWORD_FILE",
    "ADMIN_PASSWORD_FILE",
    "HOST_KEYS_DIR",
    "COORDINATOR_KEY_FILE",
    "COORDINATOR_PUB_FILE",
    "ROSTERS_DIR",
    "swarm_key",
    "swarm_keys",
    "swarm_key_path",
    "parse_deadline",
    "key_file_keys",
    "ensure_swarm_key",
    "rotate_swarm_key",
    "secret_key",
    "ensure_secret_key",
    "redis_password",
    "ensure_redis_password",
    "local_redis_password",
    "ensure_local_redis_password",
    "keeper_password",
    "ensure_keeper_password",
    "host_key_path",
    "coordinator_key_path",
    "coordinator_public_key",
    "roster_path",
    "sealing_key_path",
    "write_private",
    "admin_password_file",
    "write_admin_password",
    "submit_rate",
    "login_rate",
    "login_account_rate",
    "trusted_proxies",
    "open_completions",
    "open_completions_per_user",
    "prefix_reuse",
    "JOB_DEFAULTS",
    "JobLimits",
    "job_limits",
    "swarm_timezone",
    "nightly_schedule",
    "nightly_sizes",
    "PROOF_IN_FLIGHT",
]
