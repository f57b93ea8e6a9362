"""Users: who may log in to the web app, and who owns each job and API token.

Passwords are stored only as werkzeug's salted scrypt hashes. A user without a hash cannot log
in until `specpipe user passwd` gives it a password. The built-in admin (`admin`) owns
everything that was stored before users existed, and everything submitted without an owner
(`specpipe generate`); the migration creates it without a password. A disabled user
(`disabled_at` set) can neither log in nor keep a session (`models.accounts` disables).
"""

from __future__ import annotations

import hashlib
import re
from datetime import datetime
from functools import lru_cache

from sqlalchemy import Boolean, DateTime, Integer, String, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Mapped, Session, mapped_column
from werkzeug.security import check_password_hash, generate_password_hash

from models.db import Base, utcnow

BUILTIN_ADMIN = "admin"
MAX_NAME = 100
MIN_PASSWORD = 8
MAX_PASSWORD = 1024
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,99}")


@lru_cache(maxsize=1)
def _dummy_hash() -> str:
    """Checked against when there is no hash, so a wrong name costs as long as a wrong
    password."""
    return generate_password_hash("not a password")


class User(Base):
    """Someone who logs in to the web app; an admin sees and acts on every job."""

    __tablename__ = "users"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(MAX_NAME), unique=True)
    password_hash: Mapped[str | None] = mapped_column(String(255))
    is_admin: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    disabled_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # Bumped to end every login session of the user (disabling and enabling it): the sessions'
    # fingerprint carries it, so a cookie from before an enable does not come back to life.
    session_epoch: Mapped[int] = mapped_column(Integer, default=0, server_default="0")

    @property
    def disabled(self) -> bool:
        """Whether the user is shut out of the pages and the API."""
        return self.disabled_at is not None

    @property
    def has_password(self) -> bool:
        """Whether the user can log in at all."""
        return self.password_hash is not None

    def set_password(self, password: str) -> None:
        """Store a new password's hash; ValueError when it is too short or too long."""
        self.password_hash = generate_password_hash(check_password(password))

    def check_password(self, password: str) -> bool:
        """Whether `password` is this user's."""
        if self.password_hash is None:
            check_password_hash(_dummy_hash(), password)
            return False
        return check_password_hash(self.password_hash, password)

    @property
    def session_check(self) -> str:
        """A short fingerprint of the password hash, the disabled state and the session epoch,
        kept in the login session: a session from before the password changed, of a disabled
        user, or from before the user was disabled (and enabled again) no longer matches and is
        logged out."""
        material = f"{self.id}:{self.password_hash or ''}"
        if self.disabled:  # only then, so the sessions of enabled users stay as they were
            material += ":disabled"
        if self.session_epoch:  # likewise: sessions from before the column stay valid
            material += f":{self.session_epoch}"
        return hashlib.sha256(material.encode()).hexdigest()[:16]

    def can_see(self, owner_id: int) -> bool:
        """Whether this user may see and act on what `owner_id` owns."""
        return self.is_admin or self.id == owner_id


def check_name(name: str) -> str:
    """A valid user name, or ValueError saying what is wrong."""
    if not _NAME.fullmatch(name):
        raise ValueError(
            f"must be 1 to {MAX_NAME} characters: letters, digits and . _ @ -, "
            "starting with a letter or digit"
        )
    return name


def check_password(password: str) -> str:
    """A password long enough to keep, or ValueError."""
    if not MIN_PASSWORD <= len(password) <= MAX_PASSWORD:
        raise ValueError(f"must be {MIN_PASSWORD} to {MAX_PASSWORD} characters")
    return password


def find_user(session: Session, name: str) -> User | None:
    """The user called `name`, else None."""
    if not _NAME.fullmatch(name):
        return None
    return session.scalar(select(User).where(User.name == name))


def builtin_admin(session: Session) -> User:
    """The built-in admin, created (without a password) when the store has none."""
    user = session.scalar(select(User).where(User.name == BUILTIN_ADMIN))
    if user is not None:
        return user
    try:
        with session.begin_nested():
            user = User(name=BUILTIN_ADMIN, is_admin=True)
            session.add(user)
    except IntegrityError:  # made meanwhile by another process
        user = session.scalar(select(User).where(User.name == BUILTIN_ADMIN))
    return user


def create_user(session: Session, name: str, password: str | None, is_admin: bool = False) -> User:
    """Make a user; ValueError for a bad or taken name or a bad password. The caller commits."""
    check_name(name)
    if session.scalar(select(User).where(User.name == name)) is not None:
        raise ValueError(f"a user named {name!r} already exists")
    user = User(name=name, is_admin=is_admin)
    if password is not None:
        user.set_password(password)
    session.add(user)
    session.flush()
    return user


def authenticate(session: Session, name: str, password: str) -> User | None:
    """The enabled user whose name and password these are, else None (in about the same time,
    so the answer does not tell whether the name exists or is disabled)."""
    user = find_user(session, name)
    if user is None:
        check_password_hash(_dummy_hash(), password)
        return None
    return user if user.check_password(password) and not user.disabled else None


def first_password(session: Session, password: str) -> bool:
    """Give the built-in admin `password` when no user can log in yet; whether it did.

    `specpipe web` calls it on start, so a fresh install has a way in."""
    usable = session.scalar(select(func.count()).where(User.password_hash.is_not(None)))
    if usable:
        return False
    builtin_admin(session).set_password(password)
    session.flush()
    return True
