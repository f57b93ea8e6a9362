"""Jobs: the sampler that draws their tokens; rows from before drew by inverse CDF.

Revision ID: d5f1b2c3e4a6
Revises: c4e8a1d07b93
Create Date: 2026-12-01 18:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "d5f1b2c3e4a6"
down_revision: str | None = "c4e8a1d07b93"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Apply this revision."""
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("sampler", sa.String(length=16), server_default="icdf", nullable=False)
        )


def downgrade() -> None:
    """Revert this revision."""
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("sampler")
