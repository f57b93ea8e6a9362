"""Jobs: the functions a chat's assistant may call, rendered into its prompt with its messages;
rows from before offered none.

Revision ID: d2f7b9c3e5a6
Revises: c1e6a8b2d4f5
Create Date: 2026-12-07 12:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "d2f7b9c3e5a6"
down_revision: str | None = "c1e6a8b2d4f5"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Apply this revision."""
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("tools", sa.JSON(), nullable=True))


def downgrade() -> None:
    """Revert this revision."""
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("tools")
