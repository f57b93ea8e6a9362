"""The node inventory: every stage host of the swarm, and a snapshot of the ring on each run.

Stage workers report heartbeats into Redis; a sync task copies them here through `upsert_node`.
A node's status is derived from the age of its last heartbeat, never stored.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import BigInteger, Boolean, DateTime, ForeignKey, Integer, String, select
from sqlalchemy.dialects.postgresql import insert as postgresql_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Mapped, Session, mapped_column, relationship

from models.db import Base, as_utc, iso_utc, utcnow
from specpipe.swarm.inventory import heartbeat_status
from specpipe.swarm.redact import redact_url


def role_order(role: str | None) -> tuple[int, int]:
    """Sort key putting stage0, stage1, … before the tail."""
    if role and role.startswith("stage") and role[5:].isdigit():
        return (0, int(role[5:]))
    return (1, 0) if role == "tail" else (2, 0)


class HostColumns:
    """What the inventory and a run's snapshot of it both record of a stage host."""

    role: Mapped[str | None] = mapped_column(String(32))  # stage0 … stageN, tail
    layer_start: Mapped[int | None] = mapped_column(Integer)
    layer_end: Mapped[int | None] = mapped_column(Integer)
    public_ip: Mapped[str | None] = mapped_column(String(64))
    geo: Mapped[str | None] = mapped_column(String(200))
    gpu_name: Mapped[str | None] = mapped_column(String(200))
    gpu_uuid: Mapped[str | None] = mapped_column(String(100))
    memory_bytes: Mapped[int | None] = mapped_column(BigInteger)
    software_version: Mapped[str | None] = mapped_column(String(100))


class Node(HostColumns, Base):
    """One stage host. `layer_end` is exclusive: a host with 0 and 9 runs layers 0 … 8."""

    __tablename__ = "nodes"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    host: Mapped[str] = mapped_column(String(255), unique=True)
    redis_url: Mapped[str | None] = mapped_column(String(500))
    last_heartbeat: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), index=True)

    def status(self, now: datetime | None = None) -> str:
        """online, stale or offline by the age of the last heartbeat, as the inventory says."""
        beat = as_utc(self.last_heartbeat)
        if beat is None:
            return "offline"
        return heartbeat_status(((now or utcnow()) - beat).total_seconds())

    def to_dict(self, now: datetime | None = None) -> dict:
        """The node as the JSON API returns it."""
        return {
            "host": self.host,
            **{f: getattr(self, f) for f in NODE_FIELDS if f != "last_heartbeat"},
            "redis_url": redact_url(self.redis_url),
            "last_heartbeat": iso_utc(self.last_heartbeat),
            "status": self.status(now),
        }


class RunNode(HostColumns, Base):
    """A node as it was when a run started: the ring that run ran on."""

    __tablename__ = "run_nodes"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    position: Mapped[int] = mapped_column(Integer)
    host: Mapped[str] = mapped_column(String(255))

    run: Mapped[Run] = relationship(back_populates="node_snapshots")  # noqa: F821


# What the store keeps of a node besides its host: the columns of `nodes`. Each is a field of
# the inventory's record (`NodeInfo`), which holds more than the store keeps; the columns stay
# written out above, since each needs its type and length (tests/test_store.py checks the two).
NODE_FIELDS = tuple(name for name in Node.__table__.columns.keys() if name not in ("id", "host"))
# What a run's snapshot copies of each node: the columns both tables have.
SNAPSHOT_FIELDS = tuple(
    name for name in RunNode.__table__.columns.keys() if name != "id" and name in Node.__table__.c
)


def upsert_node(session: Session, host: str, **fields) -> Node:
    """Insert or update the node `host` with `fields`; the caller commits."""
    unknown = set(fields) - set(NODE_FIELDS)
    if unknown:
        raise ValueError(f"unknown node fields: {', '.join(sorted(unknown))}")
    host = _fit("host", host)
    values = {name: _fit(name, value) for name, value in fields.items()}
    # One statement, insert or update: coordinators running jobs side by side snapshot the
    # same nodes at the same moment, and a read-then-insert would race them into a duplicate.
    dialect = session.get_bind().dialect.name
    insert = postgresql_insert if dialect == "postgresql" else sqlite_insert
    statement = insert(Node).values(host=host, **values)
    if values:
        statement = statement.on_conflict_do_update(index_elements=[Node.host], set_=values)
    else:
        statement = statement.on_conflict_do_nothing(index_elements=[Node.host])
    session.execute(statement)
    return session.scalar(
        select(Node).where(Node.host == host).execution_options(populate_existing=True)
    )


def _fit(name: str, value):
    """`value` as the column `name` can hold it: text without NUL, cut to the column's length;
    a number of the wrong type or out of range as unknown (None). What a stage reports about
    itself must never fail the write of the whole inventory."""
    column = Node.__table__.c[name]
    if value is None or isinstance(column.type, DateTime | Boolean):
        return value
    if isinstance(column.type, String):
        text = str(value).replace("\x00", "")
        return text[: column.type.length] if column.type.length else text
    if isinstance(column.type, Integer):
        limit = 2**63 if isinstance(column.type, BigInteger) else 2**31
        ok = isinstance(value, int) and not isinstance(value, bool)
        return value if ok and -limit <= value < limit else None
    return value


def ring_nodes(session: Session) -> list[Node]:
    """Every node in ring order: stage0, stage1, …, tail."""
    nodes = session.scalars(select(Node)).all()
    return sorted(nodes, key=lambda n: (role_order(n.role), n.layer_start or 0, n.host))


def snapshot_nodes(session: Session, run) -> list[RunNode]:
    """Copy the current inventory, in ring order, onto `run`; the caller commits."""
    copied = [
        RunNode(position=i, **{name: getattr(n, name) for name in SNAPSHOT_FIELDS})
        for i, n in enumerate(ring_nodes(session))
    ]
    run.node_snapshots = copied
    return copied
