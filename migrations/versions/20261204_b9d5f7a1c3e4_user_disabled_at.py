"""Users: when each was disabled (`disabled_at`), null while it may log in; and how many times
its sessions were ended (`session_epoch`), which its login sessions' fingerprint carries.

Revision ID: b9d5f7a1c3e4
Revises: a8c4e6f0b2d3
Create Date: 2026-12-04 12:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "b9d5f7a1c3e4"
down_revision: str | None = "a8c4e6f0b2d3"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Apply this revision."""
    with op.batch_alter_table("users", schema=None) as batch_op:
        batch_op.add_column(sa.Column("disabled_at", sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(
            sa.Column("session_epoch", sa.Integer(), nullable=False, server_default="0")
        )


def downgrade() -> None:
    """Revert this revision. Not in batch mode: SQLite would rebuild `users`, which jobs and
    tokens reference, and refuse to drop it; its own DROP COLUMN (3.35 on) needs no rebuild."""
    op.drop_column("users", "session_epoch")
    op.drop_column("users", "disabled_at")
