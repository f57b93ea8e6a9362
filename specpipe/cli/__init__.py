"""The `specpipe` command: the composition root. Each group lives in its own module, and
commands import the store, the workers or the web app only inside their own bodies."""

import click

from specpipe import __version__
from specpipe.cli.bench import bench
from specpipe.cli.ca import ca
from specpipe.cli.checkpoints import model
from specpipe.cli.db import db
from specpipe.cli.drafter import drafter
from specpipe.cli.generate import generate
from specpipe.cli.host import host
from specpipe.cli.join import join
from specpipe.cli.key import key
from specpipe.cli.lab import lab
from specpipe.cli.nodes import nodes
from specpipe.cli.proof import proof
from specpipe.cli.regression import regression
from specpipe.cli.runs import runs
from specpipe.cli.token import token
from specpipe.cli.up import up
from specpipe.cli.user import user
from specpipe.cli.web import web
from specpipe.cli.worker import worker


@click.group()
@click.version_option(__version__, prog_name="specpipe")
def cli() -> None:
    """specpipe: serve one model across a ring of hosts with lossless speculative sampling."""
    from specpipe import settings

    try:  # a SPECPIPE_SWARM_KEY that cannot be read is one line, before any command uses it
        settings.swarm_keys()
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    except OSError:  # an unreadable key file: the commands that need a key say so
        pass


for command in (generate, model, proof, regression, bench, nodes, runs, db, user, token, key, web):
    cli.add_command(command)
for command in (worker, up, join, host, ca, lab, drafter):
    cli.add_command(command)


def main() -> None:
    """Console entry point."""
    cli()
