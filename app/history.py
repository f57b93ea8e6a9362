"""The job history query: filter by status, search the prompt, sort, one page at a time."""

from __future__ import annotations

import math
from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.orm import Session, selectinload

from models.jobs import JOB_STATUSES, Job

SORTS = {
    "newest": (Job.created_at.desc(), Job.id.desc()),
    "oldest": (Job.created_at.asc(), Job.id.asc()),
    "fastest": (Job.tok_s.desc().nulls_last(), Job.id.desc()),
    "longest": (Job.generated_tokens.desc(), Job.id.desc()),
}


MAX_PAGE = 10**6


@dataclass
class Page:
    """One page of jobs and where it sits in the whole result."""

    items: list[Job]
    page: int
    per_page: int
    total: int

    @property
    def pages(self) -> int:
        """How many pages the whole result fills (at least one)."""
        return max(1, math.ceil(self.total / self.per_page))


def _like_pattern(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return f"%{escaped}%"


def job_page(
    session: Session,
    owner_id: int | None = None,
    status: str | None = None,
    search: str | None = None,
    sort: str = "newest",
    page: int = 1,
    per_page: int = 25,
) -> Page:
    """The jobs matching the filters, newest first by default; unknown values raise ValueError.

    `owner_id` keeps one user's jobs; None keeps everyone's (an admin's view)."""
    if status and status not in JOB_STATUSES:
        raise ValueError(f"status must be one of {', '.join(JOB_STATUSES)}")
    if sort not in SORTS:
        raise ValueError(f"sort must be one of {', '.join(SORTS)}")
    if not (1 <= page <= MAX_PAGE and per_page >= 1):
        raise ValueError(f"page must be between 1 and {MAX_PAGE}, per_page at least 1")
    query = select(Job)
    if owner_id is not None:
        query = query.where(Job.user_id == owner_id)
    if status:
        query = query.where(Job.status == status)
    search = (search or "").replace("\x00", "").strip()  # PostgreSQL text cannot hold NUL
    if search:
        query = query.where(Job.prompt.ilike(_like_pattern(search), escape="\\"))
    total = session.scalar(select(func.count()).select_from(query.subquery())) or 0
    items = session.scalars(
        query.options(selectinload(Job.owner))
        .order_by(*SORTS[sort])
        .offset((page - 1) * per_page)
        .limit(per_page)
    ).all()
    return Page(list(items), page, per_page, total)
