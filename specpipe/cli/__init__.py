"""The `specpipe` command: the composition root. Each group lives in its own module."""

import click

from specpipe import __version__
from specpipe.cli.bench import bench
from specpipe.cli.nodes import nodes
from specpipe.cli.proof import proof


@click.group()
@click.version_option(__version__, prog_name="specpipe")
def cli() -> None:
    """specpipe: serve one model across a ring of hosts with lossless speculative sampling."""


cli.add_command(bench)
cli.add_command(proof)
cli.add_command(nodes)


def main() -> None:
    """Console entry point."""
    cli()

from specpipe.cli.db import db  # noqa: E402
from specpipe.cli.token import token  # noqa: E402
from specpipe.cli.web import web  # noqa: E402

cli.add_command(db)
cli.add_command(token)
cli.add_command(web)
from specpipe.cli.runs import runs  # noqa: E402

cli.add_command(runs)
from specpipe.cli.regression import regression  # noqa: E402

cli.add_command(regression)
