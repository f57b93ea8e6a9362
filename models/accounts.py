"""Changes to a user's standing that reach its API tokens: a new password revokes them all.

It touches users and tokens, so it lives above both (`models.users` imports neither).
`models.user_deletion` deletes a user with its tokens.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from models.tokens import revoke_user_tokens
from models.users import User


def change_password(session: Session, user: User, password: str) -> int:
    """Give `user` a new password, ending its sessions and revoking its API tokens: whoever
    held the old password may have made them. Returns how many tokens were revoked; ValueError
    for a bad password (nothing changes). The caller commits."""
    user.set_password(password)
    session.flush()
    return revoke_user_tokens(session, user)
