"""Nodes: whether the worker runs the test-only lossy tail; rows from before read as not.

Revision ID: ea3906a109e3
Revises: bf4314513ebb
Create Date: 2026-11-30 15:30:41.208517
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "ea3906a109e3"
down_revision: str | None = "bf4314513ebb"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Apply this revision."""
    with op.batch_alter_table("nodes", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("test_lossy_tail", sa.Boolean(), server_default=sa.false(), nullable=False)
        )


def downgrade() -> None:
    """Revert this revision."""
    with op.batch_alter_table("nodes", schema=None) as batch_op:
        batch_op.drop_column("test_lossy_tail")
