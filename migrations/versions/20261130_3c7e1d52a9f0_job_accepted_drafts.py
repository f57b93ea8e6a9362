"""Jobs: `accepted_per_round` becomes `accepted_drafts` (drafts accepted in each round).

The old name also meant tokens per round elsewhere; the list keeps its values.

Revision ID: 3c7e1d52a9f0
Revises: ea3906a109e3
Create Date: 2026-11-30 16:30:00.000000
"""

from collections.abc import Sequence

from alembic import op

revision: str = "3c7e1d52a9f0"
down_revision: str | None = "ea3906a109e3"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Apply this revision."""
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.alter_column("accepted_per_round", new_column_name="accepted_drafts")


def downgrade() -> None:
    """Revert this revision."""
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.alter_column("accepted_drafts", new_column_name="accepted_per_round")
