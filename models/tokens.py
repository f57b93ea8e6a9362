"""API tokens: made by `specpipe token create`, shown once, stored only as a SHA-256 hash.

Each token belongs to the user it was made for, and the API acts as that user. A token may
expire (`expires_at`); it stops opening the API then, as when it is revoked. A user's tokens
are revoked when its password changes or it is disabled (`models.accounts`), and no token of
a disabled user opens the API even if it was not.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from datetime import datetime, timedelta

from sqlalchemy import DateTime, ForeignKey, Integer, String, select, update
from sqlalchemy.orm import Mapped, Session, mapped_column, relationship

from models.db import Base, as_utc, utcnow
from models.users import User

TOKEN_PREFIX = "sp_"
MAX_LIFETIME = timedelta(days=3650)
_LIFETIME = re.compile(r"([0-9]{1,7})([mhd])")
_UNITS = {"m": "minutes", "h": "hours", "d": "days"}


def hash_token(token: str) -> str:
    """The stored form of a token. Tokens are 256 random bits, so a plain hash suffices."""
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


class ApiToken(Base):
    """A named bearer token for the JSON API."""

    __tablename__ = "api_tokens"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(100), unique=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    last_used_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"))
    user: Mapped[User] = relationship()

    @property
    def expired(self) -> bool:
        """Whether the token's lifetime has run out."""
        return self.expires_at is not None and as_utc(self.expires_at) <= utcnow()

    @property
    def active(self) -> bool:
        """Whether the token still opens the API: neither revoked nor expired."""
        return self.revoked_at is None and not self.expired


def parse_lifetime(text: str) -> timedelta:
    """A token's lifetime from `90m`, `12h` or `30d` (up to ten years); ValueError otherwise."""
    match = _LIFETIME.fullmatch(text.strip())
    if match is None or int(match[1]) == 0:
        raise ValueError(f"must be minutes, hours or days, as 90m, 12h or 30d; got {text!r}")
    lifetime = timedelta(**{_UNITS[match[2]]: int(match[1])})
    if lifetime > MAX_LIFETIME:
        raise ValueError(f"must be at most {MAX_LIFETIME.days}d; got {text!r}")
    return lifetime


def create_token(session: Session, name: str, user: User, lifetime: timedelta | None = None) -> str:
    """Make a token called `name` for `user`, expiring after `lifetime` (never when None), and
    return its only plaintext copy; the caller commits."""
    if session.scalar(select(ApiToken).where(ApiToken.name == name)) is not None:
        raise ValueError(f"a token named {name!r} already exists")
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    expires_at = utcnow() + lifetime if lifetime is not None else None
    session.add(
        ApiToken(name=name, token_hash=hash_token(token), user_id=user.id, expires_at=expires_at)
    )
    session.flush()
    return token


def revoke_token(session: Session, name: str) -> ApiToken:
    """Revoke the token called `name`; the caller commits."""
    row = session.scalar(select(ApiToken).where(ApiToken.name == name))
    if row is None:
        raise LookupError(f"no token named {name!r}")
    if row.revoked_at is None:
        row.revoked_at = utcnow()
    return row


def revoke_user_tokens(session: Session, user: User) -> int:
    """Revoke every active token of `user` in one UPDATE; how many. The caller commits."""
    result = session.execute(
        update(ApiToken)
        .where(ApiToken.user_id == user.id, ApiToken.revoked_at.is_(None))
        .values(revoked_at=utcnow())
        .execution_options(synchronize_session="fetch")
    )
    return result.rowcount


def check_token(session: Session, token: str) -> ApiToken | None:
    """The active token of an enabled user matching `token`, with its last use updated, else
    None."""
    row = session.scalar(select(ApiToken).where(ApiToken.token_hash == hash_token(token)))
    if row is None or not row.active or row.user.disabled:
        return None
    row.last_used_at = utcnow()
    return row
