"""Jobs: how often each was started (`attempts`), and output text stored NUL-safe.

`output_text` is now stored escaped (a backslash as two, NUL as a backslash and `0`), so text
holding NUL fits PostgreSQL's text; rows from before have their backslashes doubled.

Revision ID: 5d1f0c2b7e4a
Revises: 3c7e1d52a9f0
Create Date: 2026-11-30 17:00:00.000000
"""

import re
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "5d1f0c2b7e4a"
down_revision: str | None = "3c7e1d52a9f0"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_ESCAPED = re.compile(r"\\(\\|0)")


def upgrade() -> None:
    """Apply this revision."""
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("attempts", sa.Integer(), server_default=sa.text("0"), nullable=False)
        )
    op.execute(
        sa.text("UPDATE jobs SET output_text = replace(output_text, :one, :two)").bindparams(
            one="\\", two="\\\\"
        )
    )


def downgrade() -> None:
    """Revert this revision. A NUL cannot go back into plain text: it comes back as U+FFFD."""
    conn = op.get_bind()
    rows = conn.execute(sa.text("SELECT id, output_text FROM jobs")).all()
    for job_id, text in rows:
        plain = _ESCAPED.sub(lambda m: "\ufffd" if m.group(1) == "0" else "\\", text or "")
        if plain != text:
            conn.execute(
                sa.text("UPDATE jobs SET output_text = :text WHERE id = :id"),
                {"text": plain, "id": job_id},
            )
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("attempts")
