"""Jobs: starts in a row that stored no round (`starts_since_progress`), what the coordinator
gives up after; `attempts` stays the count of every start, the attempt's fencing number.

Revision ID: f7b3d5e9a2c1
Revises: e6a2c4d8f1b3
Create Date: 2026-12-02 12:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "f7b3d5e9a2c1"
down_revision: str | None = "e6a2c4d8f1b3"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Apply this revision."""
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column(
                "starts_since_progress", sa.Integer(), server_default=sa.text("0"), nullable=False
            )
        )


def downgrade() -> None:
    """Revert this revision."""
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("starts_since_progress")
