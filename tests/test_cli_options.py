"""Facts every command shares are written once: each --seed takes the seeds the sampler, the web
form, the APIs and the store take, and each --model that names a checkpoint defaults to
`default`."""

from __future__ import annotations

import click
import pytest

from app.openapi import document
from specpipe.cli import cli
from specpipe.core.sampling import MAX_SEED, check_seed, offset_seed
from specpipe.settings import JobLimits
from workers.job_request import JobRequestError, parse_job_request


def every_option(group: click.Group, path: str = "specpipe"):
    """(command path, option) for every option of every command under `group`."""
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            yield from every_option(command, f"{path} {name}")
        else:
            for param in command.params:
                if isinstance(param, click.Option):
                    yield f"{path} {name}", param


SEED_OPTIONS = [(where, o) for where, o in every_option(cli) if "--seed" in o.opts]
MODEL_OPTIONS = [(where, o) for where, o in every_option(cli) if "--model" in o.opts]


def test_the_commands_have_seed_and_model_options():
    assert len(SEED_OPTIONS) >= 10 and len(MODEL_OPTIONS) >= 15


@pytest.mark.parametrize(("where", "option"), SEED_OPTIONS, ids=[w for w, _ in SEED_OPTIONS])
def test_every_seed_option_takes_every_seed(where, option):
    assert isinstance(option.type, click.IntRange), where
    assert (option.type.min, option.type.max) == (0, MAX_SEED), where
    assert not (option.type.min_open or option.type.max_open), where


@pytest.mark.parametrize(("where", "option"), MODEL_OPTIONS, ids=[w for w, _ in MODEL_OPTIONS])
def test_every_model_option_defaults_alike(where, option):
    if isinstance(option.default, str):  # the others take the swarm's model from the settings
        assert (option.default, option.show_default) == ("default", True), where


def test_the_form_the_apis_and_the_sampler_take_the_same_seeds():
    limits = JobLimits()
    assert parse_job_request({"prompt": "hi", "seed": MAX_SEED}, limits, False)["seed"] == MAX_SEED
    with pytest.raises(JobRequestError) as refused:
        parse_job_request({"prompt": "hi", "seed": MAX_SEED + 1}, limits, False)
    assert refused.value.errors == {"seed": "must be between 0 and 2^64-1"}
    check_seed(MAX_SEED)
    with pytest.raises(ValueError, match="0 … 2\\^64-1"):
        check_seed(MAX_SEED + 1)
    seed = document(limits)["components"]["schemas"]["JobRequest"]["properties"]["seed"]
    assert (seed["minimum"], seed["maximum"]) == (0, MAX_SEED)


def test_seeds_derived_from_any_seed_are_seeds():
    assert offset_seed(7, 3) == 10
    assert offset_seed(MAX_SEED, 1) == 0 and offset_seed(MAX_SEED - 1, 5) == 3
    check_seed(offset_seed(MAX_SEED * 100_003, 2))


def test_the_command_line_starts_without_torch():
    """Every `specpipe` command pays for what the CLI imports before it runs: the commands
    import torch (a second or more) when they need it, not at start."""
    import subprocess
    import sys

    code = (
        "import sys, specpipe.cli; print(sorted(m for m in ('torch', 'scipy') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
