"""The attempt that holds a job, and the fence on every write it makes to the job's row.

A job's `attempts` column is its fencing number: a start sets it one higher in one conditional
UPDATE, and each later write of that attempt (a round's progress, the job's end) is one UPDATE
that matches only while the row still holds this attempt's number and the job is unfinished.
The job's Redis lock keeps two coordinators off one job, but not through a registry outage
longer than the stall time: beat then resumes the job elsewhere while the first coordinator runs
on. That first attempt's next write matches no row; it raises `Superseded` and stops, and the
newer attempt's rows stand.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from models import Job
from models.db import utcnow
from models.jobs import ACTIVE_STATUSES, progress_values
from models.runs import Run
from specpipe.swarm.redact import one_line_reason


class Superseded(Exception):
    """The job's row no longer belongs to this attempt: a newer one started, or it ended."""


@dataclass(frozen=True)
class Attempt:
    """Job `job_id` as attempt `number` (its `attempts` value) holds it."""

    job_id: int
    number: int

    @classmethod
    def seen(cls, job: Job) -> Attempt:
        """The attempt a coordinator that read `job` would take over: its writes before it
        starts one of its own (ending the job) hold only while nobody started it since."""
        return cls(job.id, job.attempts)

    def start(self, session: Session, prompt_tokens: int) -> Attempt:
        """Start the next attempt (queued or running -> running) and commit; the new attempt."""
        now = utcnow()
        self._update(
            session,
            status="running",
            error=None,
            attempts=self.number + 1,
            starts_since_progress=Job.starts_since_progress + 1,
            started_at=func.coalesce(Job.started_at, now),
            prompt_tokens=prompt_tokens,
        )
        session.commit()
        return Attempt(self.job_id, self.number + 1)

    def run_started(self, session: Session, run: Run) -> None:
        """Record `run` (new, flushed) as the job's run, and commit."""
        self._update(session, run_id=run.id)
        session.commit()

    def progress(
        self,
        session: Session,
        ids: list[int],
        text: str,
        accepted_drafts: list[int],
        elapsed_s: float,
        logprobs: list | None = None,
    ) -> None:
        """Store a round's progress (`models.jobs.progress_values`) and commit: the job's
        starts since progress are none again."""
        values = progress_values(ids, text, accepted_drafts, elapsed_s, logprobs)
        self._update(session, **values, starts_since_progress=0)
        session.commit()

    def finish(
        self, session: Session, status: str, error: str | BaseException | None = None
    ) -> None:
        """End the job with `status` (an error stored as one redacted line), its generation run
        with it, and commit."""
        now = utcnow()
        reason = None if error is None else one_line_reason(error)
        self._update(session, status=status, finished_at=now, error=reason)
        run_id = select(Job.run_id).where(Job.id == self.job_id).scalar_subquery()
        session.execute(
            update(Run)
            .where(Run.id == run_id, Run.kind == "generation")
            .values(finished_at=now)
            .execution_options(synchronize_session=False)
        )
        session.commit()

    def _update(self, session: Session, **values) -> None:
        """One UPDATE of the job's row, matching while this attempt holds the unfinished job;
        Superseded (the transaction rolled back) when it matches none. The session's Job, if it
        holds one, is left as it was read: whoever needs the row reads it back."""
        result = session.execute(
            update(Job)
            .where(
                Job.id == self.job_id,
                Job.attempts == self.number,
                Job.status.in_(ACTIVE_STATUSES),
            )
            .values(**values)
            .execution_options(synchronize_session=False)
        )
        if result.rowcount == 0:
            session.rollback()
            raise Superseded(f"job {self.job_id}: attempt {self.number} no longer holds it")
