"""`specpipe generate`: generate text from a prompt, on the swarm or with every stage here.

Both paths take the same options with the same defaults as the web form and the API, stream
their text the same way (`TextStream`) and report the same numbers (`Outcome`). On the swarm
the job goes through the submission path the web app uses, checked against the same limits,
and its text streams as the coordinator records it. A chat with gpt-oss (harmony's channels)
shows its reasoning on stderr and its answer on stdout, as they are written.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass

import click

from specpipe.cli.checkpoints import ModelInputError
from specpipe.cli.options import SEED, compute_options, model_option, sampling_options
from specpipe.core.sampling import SAMPLERS, random_seed
from specpipe.core.stopping import (
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    hold_back_stop_prefix,
)
from specpipe.settings import JOB_DEFAULTS
from specpipe.transformer.harmony import Reply, split_reply


class JobOptionError(click.ClickException):
    """Options the job limits refuse (the web app's and the API's): one line, exit status 2."""

    exit_code = 2


@dataclass
class Outcome:
    """A finished generation as `generate` reports it."""

    tokens: list[int]
    text: str  # with harmony: the answer alone
    tok_s: float
    rounds: int
    tokens_per_round: float  # tokens committed per verify round
    seed: int
    reasoning: str = ""  # with harmony: the reasoning channel

    def to_json(self) -> str:
        record = asdict(self)
        record["tok_s"] = round(self.tok_s, 3)
        record["tokens_per_round"] = round(self.tokens_per_round, 3)
        return json.dumps(record)

    def summary(self) -> str:
        return (
            f"{len(self.tokens)} tokens, {self.tok_s:.2f} tok/s, {self.rounds} rounds, "
            f"{self.tokens_per_round:.2f} tokens per round, seed {self.seed}"
        )


class TextStream:
    """Echoes a generation's text as it grows. What may still change is held back: an ending
    that could begin a stop string, and an incomplete UTF-8 sequence. With `harmony` (a chat
    with gpt-oss) the reasoning goes to stderr and the answer to stdout, without the markers."""

    def __init__(self, stops: list[str], quiet: bool, harmony: bool = False) -> None:
        self.stops, self.quiet, self.harmony = stops, quiet, harmony
        self.shown, self.shown_reply = "", Reply("", "")

    def show(self, text: str) -> None:
        if self.quiet:
            return
        text = hold_back_stop_prefix(text, self.stops)
        if not text.endswith("\ufffd") and text.startswith(self.shown):
            self._echo(text)
            self.shown = text

    def finish(self, text: str) -> None:
        if self.quiet:
            return
        if text.startswith(self.shown):
            self._echo(text)
        if self.harmony and self.shown_reply.reasoning and not self.shown_reply.content:
            click.echo("", err=True)  # the reasoning's line ends
        click.echo("")

    def _echo(self, text: str) -> None:
        """What `text` adds to what was shown."""
        if not self.harmony:
            click.echo(text[len(self.shown) :], nl=False)
            sys.stdout.flush()
            return
        reply, shown = split_reply(text), self.shown_reply
        more_reasoning = reply.reasoning[len(shown.reasoning) :]
        more_content = reply.content[len(shown.content) :]
        if more_reasoning:
            header = "" if shown.reasoning else "reasoning: "
            click.echo(header + more_reasoning, nl=False, err=True)
            sys.stderr.flush()
        if more_content:
            if reply.reasoning and not shown.content:
                click.echo("", err=True)  # the answer starts below the reasoning
            click.echo(more_content, nl=False)
            sys.stdout.flush()
        self.shown_reply = reply


def finished(text: str, harmony: bool) -> tuple[str, str]:
    """A finished generation's answer and reasoning: with `harmony`, its channels apart."""
    if not harmony:
        return text, ""
    reply = split_reply(text)
    return reply.content, reply.reasoning


@click.command(name="generate")
@click.argument("prompt")
@click.option("--local", is_flag=True, help="Run every stage in this process (no swarm).")
@model_option("Model (on the swarm, `default` is the model the swarm serves).", dest="model_name")
@click.option(
    "--stages",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Split the model into this many stages (still one process).",
)
@click.option("--no-spec", is_flag=True, help="Plain decoding: one token per round, no drafts.")
@click.option(
    "--draft-k",
    type=int,
    default=JOB_DEFAULTS["draft_k"],
    show_default=True,
    help="The most drafted tokens a round verifies; each round's number is chosen "
    "(0: plain, as --no-spec).",
)
@sampling_options(JOB_DEFAULTS["temp"], JOB_DEFAULTS["top_p"], greedy=True)
@click.option(
    "--seed",
    type=SEED,
    default=None,
    help="Seed [default: drawn at random and reported, so the run can be repeated].",
)
@click.option(
    "--sampler",
    type=click.Choice(SAMPLERS),
    default=JOB_DEFAULTS["sampler"],
    show_default=True,
    help="How tokens are drawn: inverse CDF, or Gumbel-max (whose noise the draft head shares).",
)
@click.option(
    "--max-new-tokens",
    type=int,
    default=JOB_DEFAULTS["max_new_tokens"],
    show_default=True,
    help="Stop after this many new tokens.",
)
@click.option(
    "--stop",
    "stops",
    multiple=True,
    metavar="TEXT",
    help=f"End the text just before the first appearance of TEXT (repeatable, up to "
    f"{MAX_STOP_STRINGS}, each 1-{MAX_STOP_CHARS} characters).",
)
@click.option("--raw", is_flag=True, help="Do not apply the model's chat template.")
@compute_options
@click.option(
    "--row-stable/--no-row-stable",
    default=True,
    show_default=True,
    help="Make each position's logits independent of how many positions share a forward "
    "(speculative == plain exactly); off is faster per plain step on CPU.",
)
@click.option(
    "--draft-head",
    default=None,
    metavar="PATH|none",
    help="With --local, the tail's draft head: a head file of ours, or a folder holding a "
    "released EAGLE-3 head [default: the one shipped for the model, if any].",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
def generate(
    prompt: str,
    local: bool,
    model_name: str,
    stages: int,
    no_spec: bool,
    draft_k: int,
    temp: float,
    top_p: float,
    top_k: int,
    seed: int | None,
    sampler: str,
    max_new_tokens: int,
    stops: tuple[str, ...],
    raw: bool,
    dtype: str,
    device: str,
    threads: int | None,
    row_stable: bool,
    draft_head: str | None,
    as_json: bool,
) -> None:
    """Generate a reply to PROMPT, streaming it, then report tok/s and tokens per round.

    Without --local the job goes to the running swarm (the one `specpipe up` started, or
    REDIS_URL's) exactly as a job from the web app does, and its text streams as the
    coordinator records it. With --local it runs as the swarm runs a job: the tail drafts with
    the model's draft head and each round's draft length is chosen. The defaults are the web
    form's and the API's.

    Examples:

        specpipe generate "Why is the sky blue?" --temp 0.8 --seed 1

        specpipe generate --local "Summarise: the cat sat on the mat." --temp 0

        specpipe generate --local "List three colours:" --stop "4."
    """
    request = dict(
        prompt=prompt,
        max_new_tokens=max_new_tokens,
        temp=temp,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        draft_k=0 if no_spec else draft_k,
        stop=list(stops),
        sampler=sampler,
    )
    request = checked_request(request)
    stream = TextStream(request["stop"], quiet=as_json)
    if local:
        options = dict(
            stages=stages,
            raw=raw,
            dtype=dtype,
            device=device,
            threads=threads,
            row_stable=row_stable,
            draft_head=draft_head,
        )
        outcome, where = generate_locally(request, model_name, options, stream), ""
    else:
        if draft_head is not None:
            raise click.UsageError("--draft-head needs --local: the swarm's tails hold their own")
        model = None if model_name == "default" else model_name
        job_id, outcome = generate_on_swarm({**request, "raw_prompt": raw}, model, stream)
        where = f"job {job_id}: "
    if as_json:
        click.echo(outcome.to_json())
        return
    click.echo(f"\n{where}{outcome.summary()}", err=True)


def generate_locally(request: dict, model_name: str, options: dict, stream: TextStream) -> Outcome:
    """Run the generation with every stage in this process, as the coordinator runs a job."""
    import torch

    from specpipe.core.sampling import SamplingParams
    from specpipe.core.stopping import GenerationText
    from specpipe.decoding.generation import Generation
    from specpipe.decoding.target import open_target

    if options["threads"]:
        torch.set_num_threads(options["threads"])
    try:
        target = open_target(model_name)
        ring = target.local_ring(
            options["stages"],
            options["draft_head"],
            dtype=options["dtype"],
            device=options["device"],
            row_stable=options["row_stable"],
        )
        prompt_ids = target.prompt_ids(request["prompt"], raw=options["raw"])
    except ValueError as e:
        raise ModelInputError(str(e)) from None
    seed = random_seed() if request["seed"] is None else request["seed"]
    output = GenerationText(target.decode, target.eos_ids, request["stop"])
    run = Generation(
        ring,
        "local",
        prompt_ids,
        SamplingParams(
            temp=request["temp"],
            top_p=request["top_p"],
            top_k=request["top_k"],
            seed=seed,
            sampler=request["sampler"],
        ),
        max_new_tokens=request["max_new_tokens"],
        draft_k=request["draft_k"],  # the most a round sends: each round's K is chosen
        adaptive=True,
        trees=True,  # the head's proposals are trees, sized as they pay
        eos_ids=target.eos_ids,
        should_stop=output.should_stop,
    )
    stream.harmony = target.harmony and not options["raw"]
    for _ in run.rounds():
        stream.show(output.cut(run.generated)[0])
    text = output.cut(run.generated)[0]
    stream.finish(text)
    stats = run.stats
    answer, reasoning = finished(text, stream.harmony)
    return Outcome(
        run.generated,
        answer,
        stats.tok_s,
        stats.rounds,
        stats.tokens_per_round,
        seed,
        reasoning,
    )


def _online(client, config, keys):
    """The swarm's inventory, for the check that a swarm runs: mended first where a host
    retyped the registry, and read again while its stages beat back in
    (`mending.read_mended`); None when no stage is online."""
    from specpipe.swarm import mending
    from specpipe.swarm.inventory import RouteError

    def some_online(found):
        if not any(n.status(found.now) == "online" for n in found.nodes):
            raise RouteError("no stage is online")
        return found

    try:
        return mending.read_mended(client, config.swarm, keys, some_online, config.home)[1]
    except RouteError:
        return None


def generate_on_swarm(request: dict, model: str | None, stream: TextStream) -> tuple[int, Outcome]:
    """Submit a job to the running swarm and stream its text as it is recorded; `request` may
    say how the prompt is fed (`raw_prompt`)."""
    from models.db import make_session_factory
    from specpipe import settings
    from workers.submission import Submitter

    config = settings.Settings.from_env()
    keys = _keyring(config)
    submitter = Submitter.connect(
        config.redis_url, model or settings.default_model(), settings.job_limits()
    )
    request = checked_request(request, submitter.check_context)
    _check_swarm_runs(config, keys)
    sessions = make_session_factory(config.database_url)
    job_id, job_model, job_raw = _submitted(sessions, submitter, request, config.database_url)
    stream.harmony = not job_raw and _speaks_harmony(job_model)
    job = _followed(sessions, job_id, stream)
    if job.status != "done":
        raise click.ClickException(f"job {job_id} {job.status}: {job.error or 'no reason given'}")
    stream.finish(job.output_text)
    answer, reasoning = finished(job.output_text, stream.harmony)
    outcome = Outcome(
        list(job.output_ids or []),
        answer,
        job.tok_s or 0.0,
        job.rounds,
        job.tokens_per_round or 0.0,
        job.seed,
        reasoning,
    )
    return job_id, outcome


NO_SWARM_HINT = "start one with `specpipe up`, or set REDIS_URL"


def _keyring(config):
    """The swarm key, and the coordinator key pinned (or the opt-out), before anything else;
    None without a swarm key."""
    from specpipe.swarm import trust

    try:
        return trust.keyring(config) if config.accepted_swarm_keys else None
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None


def _check_swarm_runs(config, keys) -> None:
    """One line unless the swarm's Redis answers and a stage of it is online."""
    import redis

    from specpipe.swarm.redact import redact_url

    url = redact_url(config.redis_url)
    client = redis.Redis.from_url(config.redis_url, socket_connect_timeout=3)
    try:
        client.ping()
        found = _online(client, config, keys) if keys else None
    except redis.RedisError as exc:
        raise click.ClickException(
            f"no swarm running: cannot reach Redis at {url} ({exc}); {NO_SWARM_HINT}"
        ) from None
    finally:
        client.close()
    if not config.swarm_key:
        raise click.ClickException(
            "no swarm running here: no swarm key; set SPECPIPE_SWARM_KEY, "
            "or start one with `specpipe up`"
        )
    if found is None:
        raise click.ClickException(
            f"no swarm running: no stage is online in swarm {config.swarm!r} at {url}; "
            f"{NO_SWARM_HINT}"
        )


def _submitted(sessions, submitter, request: dict, database_url: str) -> tuple[int, str, bool]:
    """The job stored and queued: its id, model and whether its prompt is fed raw."""
    from specpipe.swarm.redact import redact_url
    from workers.submission import QueueUnavailable

    with sessions() as session:
        try:
            job = submitter.submit(session, request)
            return job.id, job.model, job.raw_prompt
        except QueueUnavailable as exc:
            raise click.ClickException(f"job {exc.job.id}: {exc}") from None
        except Exception as exc:  # e.g. a store that was never migrated
            where = redact_url(database_url)
            raise click.ClickException(f"cannot store the job in {where}: {exc}") from None


def _followed(sessions, job_id: int, stream: TextStream):
    """The job once it finished, its text shown as it is recorded; Ctrl-C cancels it."""
    from models.jobs import Job

    warned, queued_since = False, time.monotonic()
    try:
        while True:
            with sessions() as session:
                job = session.get(Job, job_id)
            stream.show(job.output_text or "")
            if job.finished:
                return job
            if job.status == "queued" and not warned and time.monotonic() - queued_since > 10:
                click.echo(f"job {job_id} is still queued: is a coordinator running?", err=True)
                warned = True
            time.sleep(0.1)
    except KeyboardInterrupt:
        with sessions() as session:
            session.get(Job, job_id).request_cancel()
            session.commit()
        raise click.ClickException(f"job {job_id}: cancelled") from None


def _speaks_harmony(model: str) -> bool:
    """Whether the model writes harmony's channels (gpt-oss); False for one that cannot open
    here, whose text is shown as it is."""
    from specpipe.decoding.target import open_target

    try:
        return open_target(model).harmony
    except ValueError:
        return False


def checked_request(request: dict, check=None) -> dict:
    """The request checked against the job limits the web app and the API apply (or by
    `check`, a submitter's further check of checked values)."""
    from specpipe.settings import job_limits
    from workers.job_request import JobRequestError, parse_job_request

    try:
        if check is not None:
            return check(request)
        return parse_job_request(request, job_limits(), from_text=False)
    except JobRequestError as exc:
        problems = [f"{_option(name)} {reason}" for name, reason in exc.errors.items()]
        raise JobOptionError("; ".join(problems)) from None


def _option(field: str) -> str:
    """The command-line spelling of a job field."""
    return "PROMPT" if field == "prompt" else "--" + field.replace("_", "-")
