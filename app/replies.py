"""A job's reply as its reader sees it: gpt-oss's reasoning and answer apart.

gpt-oss writes its chat replies in harmony's channels (`specpipe.transformer.harmony`): reasoning in
`analysis`, the answer in `final`. A job keeps the reply as generated, markers and all; the job
page, the jobs API and the OpenAI API give the two apart, as OpenAI-compatible servers do.
"""

from __future__ import annotations

from models.jobs import Job
from specpipe.decoding.target import Target, open_target
from specpipe.transformer.harmony import Reply, split_reply


def job_target(job: Job) -> Target | None:
    """The job's model as the coordinator opened it (its tokenizer), or None if it cannot open."""
    try:
        return open_target(job.model)
    except ValueError:
        return None


def speaks_harmony(target: Target | None) -> bool:
    """Whether the model's replies are harmony's channels (gpt-oss), to be given apart."""
    return target is not None and target.harmony


def job_reply(job: Job) -> Reply | None:
    """The reasoning and the answer of a chat job on a model that speaks harmony; None for any
    other job (a raw prompt's too), whose text is its answer."""
    if job.raw_prompt or not speaks_harmony(job_target(job)):
        return None
    return split_reply(job.output_text or "")
