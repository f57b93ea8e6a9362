"""Jobs: one generation request from the web form or the API, its parameters and its result.

The prompt goes through the model's chat template as one user message, unless the job says
otherwise: `raw_prompt` feeds it as it is (OpenAI's completions), `messages` holds a whole chat
(OpenAI's chat completions), and `prompt` is then that chat as readable text; `tools`, the
functions a chat's assistant may call, go through the template with its messages. `logprobs` asks
for the committed tokens' log-probabilities (with that many alternatives, 0 … 5), stored in
`output_logprobs` one entry per output id: `[logprob, [[id, logprob], ...]]`.
"""

from __future__ import annotations

from datetime import datetime
from typing import Protocol

from sqlalchemy import (
    Boolean,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    case,
    false,
    text,
    update,
)
from sqlalchemy.orm import Mapped, mapped_column, object_session, relationship

from models.db import Base, NulSafeText, Uint64, iso_utc, utcnow
from models.users import User
from specpipe.core.sampling import SamplingParams

JOB_STATUSES = ("queued", "running", "done", "failed", "cancelled")
FINISHED_STATUSES = ("done", "failed", "cancelled")
ACTIVE_STATUSES = ("queued", "running")


class SamplingRequest(Protocol):
    """What a job's sampling parameters are read from: a stored `Job`, or a plan of one."""

    temp: float
    top_p: float
    top_k: int
    seed: int
    logprobs: int | None
    sampler: str


def sampling_params(job: SamplingRequest) -> SamplingParams:
    """The parameters the tail samples a job's tokens with."""
    return SamplingParams(
        temp=job.temp,
        top_p=job.top_p,
        top_k=job.top_k,
        seed=job.seed,
        logprobs=job.logprobs,
        sampler=job.sampler,
    )


class Job(Base):
    """A generation job. The coordinator writes committed tokens and stats every round."""

    __tablename__ = "jobs"
    __table_args__ = (
        CheckConstraint(
            "status IN ('queued', 'running', 'done', 'failed', 'cancelled')", name="status"
        ),
        Index("ix_jobs_status_created_at", "status", "created_at"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    created_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), default=utcnow, index=True
    )
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    updated_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), default=utcnow, onupdate=utcnow
    )

    prompt: Mapped[str] = mapped_column(Text)
    model: Mapped[str] = mapped_column(String(200))
    max_new_tokens: Mapped[int] = mapped_column(Integer)
    temp: Mapped[float] = mapped_column(Float)
    top_p: Mapped[float] = mapped_column(Float)
    top_k: Mapped[int] = mapped_column(Integer)
    seed: Mapped[int] = mapped_column(Uint64)
    seed_was_random: Mapped[bool] = mapped_column(Boolean, default=False)
    draft_k: Mapped[int] = mapped_column(Integer)  # 0: plain sampling, no speculation
    # Up to 4 strings; the output text ends before the first of them that appears.
    stop: Mapped[list] = mapped_column(default=list, server_default=text("'[]'"))
    raw_prompt: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    # [{"role", "content"}, ...] of a chat, as the chat template takes them (an assistant's
    # `tool_calls`, a tool's result with the `name` of the function that gave it)
    messages: Mapped[list | None] = mapped_column()
    # [{"type": "function", "function": {name, description, parameters}}, ...]: the functions
    # rendered into a chat's prompt; None: none
    tools: Mapped[list | None] = mapped_column()
    logprobs: Mapped[int | None] = mapped_column(Integer)  # None: not asked for
    # How tokens are drawn (`specpipe.core.sampling.SAMPLERS`): a re-run keeps it, since the two
    # draw different tokens for one seed. Jobs from before it was recorded drew by inverse CDF.
    sampler: Mapped[str] = mapped_column(String(16), default="icdf", server_default="icdf")

    status: Mapped[str] = mapped_column(String(16), default="queued")
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    error: Mapped[str | None] = mapped_column(Text)
    task_id: Mapped[str | None] = mapped_column(String(64))
    # Every start sets it one higher: the fencing number of the attempt holding the job
    # (`workers/attempt.py`), never lowered.
    attempts: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    # Starts in a row that stored no round: what the coordinator gives up after, so outages
    # that resume a job which goes on making progress never use up its starts.
    starts_since_progress: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))

    output_text: Mapped[str] = mapped_column(NulSafeText, default="")
    output_ids: Mapped[list] = mapped_column(default=list)
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    generated_tokens: Mapped[int] = mapped_column(Integer, default=0)
    tok_s: Mapped[float | None] = mapped_column(Float)
    rounds: Mapped[int] = mapped_column(Integer, default=0)
    accepted_drafts: Mapped[list] = mapped_column(default=list)
    output_logprobs: Mapped[list] = mapped_column(default=list, server_default=text("'[]'"))

    run_id: Mapped[int | None] = mapped_column(ForeignKey("runs.id", ondelete="SET NULL"))
    run: Mapped[Run | None] = relationship(back_populates="jobs")  # noqa: F821
    # Who submitted it: only they (and admins) see it.
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id"), index=True)
    owner: Mapped[User] = relationship()

    @property
    def speculative(self) -> bool:
        """Whether drafts are proposed and verified for this job."""
        return self.draft_k > 0

    @property
    def finished(self) -> bool:
        """Whether the job has reached a final status."""
        return self.status in FINISHED_STATUSES

    @property
    def accepted_drafts_mean(self) -> float | None:
        """Mean number of drafts accepted per round, None before the first round."""
        counts = self.accepted_drafts or []
        return sum(counts) / len(counts) if counts else None

    @property
    def tokens_per_round(self) -> float | None:
        """Tokens committed per round (accepted drafts plus the target's own), None before any."""
        return self.generated_tokens / self.rounds if self.rounds else None

    def params(self) -> dict:
        """The sampling parameters as the API and run records show them."""
        return {
            "max_new_tokens": self.max_new_tokens,
            "temp": self.temp,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "draft_k": self.draft_k,
            "stop": list(self.stop or []),
            "sampler": self.sampler,
        }

    def prompt_form(self) -> dict:
        """How the prompt is fed and what else the output carries: what a re-run must keep."""
        return {
            "raw_prompt": self.raw_prompt,
            "messages": self.messages,
            "tools": self.tools,
            "logprobs": self.logprobs,
        }

    def request_cancel(self) -> bool:
        """Ask for a cooperative stop: a queued job ends now, a running one at its next round.

        One conditional UPDATE, fenced like every other write to a job: it matches only while
        the row is still unfinished, so a job that finished since it was read keeps its end.
        The row is re-read either way; whether the cancel took. The caller commits."""
        session = object_session(self)
        queued = Job.status == "queued"
        matched = session.execute(
            update(Job)
            .where(Job.id == self.id, Job.status.in_(ACTIVE_STATUSES))
            .values(
                cancel_requested=True,
                status=case((queued, "cancelled"), else_=Job.status),
                finished_at=case((queued, utcnow()), else_=Job.finished_at),
            )
            .execution_options(synchronize_session=False)
        ).rowcount
        session.refresh(self)
        return matched == 1

    def record_progress(
        self,
        ids: list[int],
        text: str,
        accepted_drafts: list[int],
        elapsed_s: float,
        logprobs: list | None = None,
    ) -> None:
        """Store what has been committed so far (`progress_values`)."""
        for name, value in progress_values(ids, text, accepted_drafts, elapsed_s, logprobs).items():
            setattr(self, name, value)

    def to_dict(self) -> dict:
        """The job as the JSON API returns it."""
        return {
            "id": self.id,
            "status": self.status,
            "created_at": iso_utc(self.created_at),
            "started_at": iso_utc(self.started_at),
            "finished_at": iso_utc(self.finished_at),
            "prompt": self.prompt,
            "model": self.model,
            **self.params(),
            **self.prompt_form(),
            "seed_was_random": self.seed_was_random,
            "cancel_requested": self.cancel_requested,
            "output_text": self.output_text,
            "output_ids": self.output_ids or [],
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "tok_s": self.tok_s,
            "rounds": self.rounds,
            "accepted_drafts": self.accepted_drafts or [],
            "accepted_drafts_mean": self.accepted_drafts_mean,
            "output_logprobs": self.output_logprobs or [],
            "tokens_per_round": self.tokens_per_round,
            "error": self.error,
            "attempts": self.attempts,
            "run_id": self.run_id,
            "owner": self.owner.name,
        }


def progress_values(
    ids: list[int],
    text: str,
    accepted_drafts: list[int],
    elapsed_s: float,
    logprobs: list | None = None,
) -> dict:
    """The columns a job's progress sets, written by the coordinator every round: what has been
    committed so far. `logprobs`, when the job asked for them: one `[logprob, [[id, logprob],
    ...]]` per id."""
    values = {
        "output_ids": list(ids),
        "output_text": text,
        "generated_tokens": len(ids),
        "accepted_drafts": list(accepted_drafts),
        "rounds": len(accepted_drafts),
        "tok_s": len(ids) / elapsed_s if elapsed_s > 0 else None,
    }
    if logprobs is not None:
        values["output_logprobs"] = list(logprobs)
    return values
