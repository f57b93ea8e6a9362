"""Deleting a user: its API tokens go with it, its jobs go to the built-in admin.

It touches users, jobs and tokens, so it lives above all three: `models.users` imports neither
of the others.
"""

from __future__ import annotations

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from models.jobs import Job
from models.tokens import ApiToken
from models.users import BUILTIN_ADMIN, builtin_admin, find_user


def delete_user(session: Session, name: str) -> int:
    """Delete the user called `name` and its API tokens; its jobs go to the built-in admin.

    Returns how many jobs changed hands. LookupError for an unknown user, ValueError for the
    built-in admin. The caller commits."""
    user = find_user(session, name)
    if user is None:
        raise LookupError(f"no user named {name!r}")
    if user.name == BUILTIN_ADMIN:
        raise ValueError(f"{BUILTIN_ADMIN!r} is built in: it owns the jobs of deleted users")
    admin = builtin_admin(session)
    moved = session.scalar(select(func.count()).where(Job.user_id == user.id)) or 0
    session.execute(update(Job).where(Job.user_id == user.id).values(user_id=admin.id))
    for token in session.scalars(select(ApiToken).where(ApiToken.user_id == user.id)):
        session.delete(token)
    session.delete(user)
    session.flush()
    return moved
