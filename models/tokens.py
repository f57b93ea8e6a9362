"""API tokens: made by `specpipe token create`, shown once, stored only as a SHA-256 hash.

Each token belongs to a user, and the API acts as that user; a token made without one belongs
to the built-in admin."""

from __future__ import annotations

import hashlib
import secrets
from datetime import datetime

from sqlalchemy import DateTime, ForeignKey, Integer, String, select
from sqlalchemy.orm import Mapped, Session, mapped_column, relationship

from models.db import Base, utcnow
from models.users import User, builtin_admin

TOKEN_PREFIX = "sp_"


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
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"))
    user: Mapped[User] = relationship()

    @property
    def active(self) -> bool:
        """Whether the token still opens the API."""
        return self.revoked_at is None


def create_token(session: Session, name: str, user: User | None = None) -> str:
    """Make a token called `name` for `user` (else the built-in admin) and return its only
    plaintext copy; the caller commits."""
    if session.scalar(select(ApiToken).where(ApiToken.name == name)) is not None:
        raise ValueError(f"a token named {name!r} already exists")
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    owner = user or builtin_admin(session)
    session.add(ApiToken(name=name, token_hash=hash_token(token), user_id=owner.id))
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


def check_token(session: Session, token: str) -> ApiToken | None:
    """The active token matching `token`, with its last use updated, else None."""
    row = session.scalar(select(ApiToken).where(ApiToken.token_hash == hash_token(token)))
    if row is None or not row.active:
        return None
    row.last_used_at = utcnow()
    return row
