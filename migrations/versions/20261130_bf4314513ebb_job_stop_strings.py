"""Jobs: stop strings, a JSON list; rows from before read as no stop strings.

Revision ID: bf4314513ebb
Revises: dc866fa56549
Create Date: 2026-11-30 00:09:16.146320
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "bf4314513ebb"
down_revision: str | None = "dc866fa56549"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Apply this revision."""
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("stop", sa.JSON(), server_default=sa.text("'[]'"), nullable=False)
        )


def downgrade() -> None:
    """Revert this revision."""
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("stop")
