"""Runs: the night a nightly run answers (`night-YYYY-MM-DD`, or `manual-…`), one run each.

The nightly's verdict is read from the store by this key, never from the broker.

Revision ID: e6a2c4d8f1b3
Revises: d5f1b2c3e4a6
Create Date: 2026-12-01 23:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "e6a2c4d8f1b3"
down_revision: str | None = "d5f1b2c3e4a6"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Apply this revision."""
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("night", sa.String(length=64), nullable=True))
        batch_op.create_unique_constraint(batch_op.f("uq_runs_night"), ["night"])


def downgrade() -> None:
    """Revert this revision."""
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f("uq_runs_night"), type_="unique")
        batch_op.drop_column("night")
