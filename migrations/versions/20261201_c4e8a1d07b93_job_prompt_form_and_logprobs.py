"""Jobs: how the prompt is fed (raw, or a chat's messages) and the committed tokens'
log-probabilities when asked for; rows from before read as chat prompts without them.

Revision ID: c4e8a1d07b93
Revises: a7c3e9f2d41b
Create Date: 2026-12-01 12:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "c4e8a1d07b93"
down_revision: str | None = "a7c3e9f2d41b"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Apply this revision."""
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("raw_prompt", sa.Boolean(), server_default=sa.false(), nullable=False)
        )
        batch_op.add_column(sa.Column("messages", sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column("logprobs", sa.Integer(), nullable=True))
        batch_op.add_column(
            sa.Column("output_logprobs", sa.JSON(), server_default=sa.text("'[]'"), nullable=False)
        )


def downgrade() -> None:
    """Revert this revision."""
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("output_logprobs")
        batch_op.drop_column("logprobs")
        batch_op.drop_column("messages")
        batch_op.drop_column("raw_prompt")
