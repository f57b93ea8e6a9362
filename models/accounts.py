"""Changes to a user's standing that reach its API tokens: a new password or disabling the
user revokes them all, and enabling it again does not bring them back.

It touches users and tokens, so it lives above both (`models.users` imports neither).
`models.user_deletion` deletes a user with its tokens.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from models.db import utcnow
from models.tokens import revoke_user_tokens
from models.users import User


def change_password(session: Session, user: User, password: str) -> int:
    """Give `user` a new password, ending its sessions and revoking its API tokens: whoever
    held the old password may have made them. Returns how many tokens were revoked; ValueError
    for a bad password (nothing changes). The caller commits."""
    user.set_password(password)
    session.flush()
    return revoke_user_tokens(session, user)


def disable_user(session: Session, user: User) -> int:
    """Disable `user`: it can no longer log in, its sessions end at their next request and its
    API tokens are revoked. Returns how many tokens were revoked. ValueError when it is already
    disabled or is the last enabled admin (nothing changes). The caller commits."""
    if user.disabled:
        raise ValueError(f"{user.name!r} is already disabled")
    if user.is_admin and _enabled_admin_ids(session) == [user.id]:
        raise ValueError(f"{user.name!r} is the last enabled admin: enable or create another")
    user.disabled_at = utcnow()
    user.session_epoch = (user.session_epoch or 0) + 1
    session.flush()
    return revoke_user_tokens(session, user)


def enable_user(session: Session, user: User) -> None:
    """Let `user` log in again; its revoked API tokens stay revoked. ValueError when it is not
    disabled (nothing changes). The caller commits."""
    if not user.disabled:
        raise ValueError(f"{user.name!r} is not disabled")
    user.disabled_at = None
    user.session_epoch = (user.session_epoch or 0) + 1  # a cookie from before stays dead
    session.flush()


def _enabled_admin_ids(session: Session) -> list[int]:
    # Locked (on PostgreSQL), so two admins disabled at once cannot both see the other enabled.
    query = select(User.id).where(User.is_admin, User.disabled_at.is_(None)).with_for_update()
    return list(session.scalars(query))
