"""Users, and an owner for every job and API token.

Adds `users` (name, password hash, admin flag) and `user_id` on `jobs` and `api_tokens`. The
built-in admin (`admin`, no password until one is set) is created here and owns every row
stored before.

Revision ID: a7c3e9f2d41b
Revises: 5d1f0c2b7e4a
Create Date: 2026-12-01 09:00:00.000000
"""

from collections.abc import Sequence
from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

revision: str = "a7c3e9f2d41b"
down_revision: str | None = "5d1f0c2b7e4a"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BUILTIN_ADMIN = "admin"


def upgrade() -> None:
    """Apply this revision."""
    users = op.create_table(
        "users",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("password_hash", sa.String(length=255), nullable=True),
        sa.Column("is_admin", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_users")),
        sa.UniqueConstraint("name", name=op.f("uq_users_name")),
    )
    op.bulk_insert(
        users, [{"name": BUILTIN_ADMIN, "is_admin": True, "created_at": datetime.now(UTC)}]
    )
    admin_id = op.get_bind().scalar(
        sa.text("SELECT id FROM users WHERE name = :name").bindparams(name=BUILTIN_ADMIN)
    )
    for table in ("jobs", "api_tokens"):
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.add_column(sa.Column("user_id", sa.Integer(), nullable=True))
        op.execute(sa.text(f"UPDATE {table} SET user_id = :id").bindparams(id=admin_id))
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.alter_column("user_id", existing_type=sa.Integer(), nullable=False)
        batch_op.create_foreign_key(
            batch_op.f("fk_jobs_user_id_users"), "users", ["user_id"], ["id"]
        )
        batch_op.create_index(batch_op.f("ix_jobs_user_id"), ["user_id"], unique=False)
    with op.batch_alter_table("api_tokens", schema=None) as batch_op:
        batch_op.alter_column("user_id", existing_type=sa.Integer(), nullable=False)
        batch_op.create_foreign_key(
            batch_op.f("fk_api_tokens_user_id_users"),
            "users",
            ["user_id"],
            ["id"],
            ondelete="CASCADE",
        )


def downgrade() -> None:
    """Revert this revision: every job and token loses its owner, and the users go."""
    with op.batch_alter_table("api_tokens", schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f("fk_api_tokens_user_id_users"), type_="foreignkey")
        batch_op.drop_column("user_id")
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_jobs_user_id"))
        batch_op.drop_constraint(batch_op.f("fk_jobs_user_id_users"), type_="foreignkey")
        batch_op.drop_column("user_id")
    op.drop_table("users")
