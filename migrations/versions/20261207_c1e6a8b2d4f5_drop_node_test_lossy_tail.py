"""Nodes: drop `test_lossy_tail`; the store keeps nothing of how a stage samples. A downgrade
brings the column back, every row reading as not flagged.

Revision ID: c1e6a8b2d4f5
Revises: b9d5f7a1c3e4
Create Date: 2026-12-07 10:30:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "c1e6a8b2d4f5"
down_revision: str | None = "b9d5f7a1c3e4"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Apply this revision."""
    with op.batch_alter_table("nodes", schema=None) as batch_op:
        batch_op.drop_column("test_lossy_tail")


def downgrade() -> None:
    """Revert this revision."""
    with op.batch_alter_table("nodes", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("test_lossy_tail", sa.Boolean(), server_default=sa.false(), nullable=False)
        )
