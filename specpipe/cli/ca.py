"""`specpipe ca`: the swarm's own certificate authority, and a certificate for each host's Redis."""

from __future__ import annotations

import re
from pathlib import Path

import click

ISSUED_FOLDER = "issued"  # the instance folder's: one folder per host issued for
_HOST_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,62}")

DIR_OPTION = click.option(
    "--dir",
    "ca_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="The CA's folder [default: <instance>/ca].",
)


def ca_dir_or_default(ca_dir: Path | None) -> Path:
    from specpipe import settings
    from specpipe.ops.certificates import CA_FOLDER

    return ca_dir or settings.instance_dir() / CA_FOLDER


@click.group(name="ca")
def ca() -> None:
    """The swarm's own CA: every host's Redis speaks TLS with a certificate it signed."""


@ca.command(name="init")
@DIR_OPTION
@click.option(
    "--days",
    type=click.IntRange(min=1),
    default=None,
    help="How long the CA is valid, in days [default: 3650].",
)
@click.option(
    "--force",
    is_flag=True,
    help="Replace a CA already there: every certificate it issued stops verifying.",
)
def ca_init(ca_dir: Path | None, days: int | None, force: bool) -> None:
    """Make the swarm's CA, once, on the operator's machine: its key (ca.key, mode 0600; keep
    it on this machine, off the hosts) and its certificate (ca.pem), in <instance>/ca.

    Example:

        specpipe ca init
    """
    from specpipe.ops import certificates as authority

    directory = ca_dir_or_default(ca_dir)
    try:
        made = authority.make_ca(directory, days=days or authority.CA_DAYS, overwrite=force)
        until = authority.load_certificate(made.cert).not_valid_after_utc
    except authority.CaExists:
        raise click.ClickException(
            f"a CA is already in {directory}: pass --force to replace it (every certificate "
            "it issued stops verifying)"
        ) from None
    except (authority.CaError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(
        f"swarm CA in {directory}, valid until {until:%Y-%m-%d}: {made.cert.name} goes to every "
        f"host (`specpipe ca issue` copies it), {made.key.name} stays here"
    )


@ca.command(name="issue")
@click.option(
    "--address",
    "addresses",
    multiple=True,
    required=True,
    help="Where the other hosts reach the host's Redis: an IP address or a DNS name (repeat "
    "for each).",
)
@click.option(
    "--name",
    default=None,
    help="The host's name: the certificate's and the folder's [default: the first address].",
)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where the host's files go [default: <instance>/issued/NAME].",
)
@DIR_OPTION
@click.option(
    "--days",
    type=click.IntRange(min=1),
    default=None,
    help="How long the certificate is valid, in days (never past the CA's end) [default: 825].",
)
@click.option("--force", is_flag=True, help="Replace the host's files already in --out.")
def ca_issue(
    addresses: tuple[str, ...],
    name: str | None,
    out_dir: Path | None,
    ca_dir: Path | None,
    days: int | None,
    force: bool,
) -> None:
    """Issue a certificate for a host's Redis, signed by the swarm's CA: the host's key
    (redis.key, mode 0600), its certificate (redis.pem) and a copy of the CA's (ca.pem), in
    one folder to copy to that host as its TLS folder (<its instance folder>/tls, or where
    SPECPIPE_TLS_DIR says), where `specpipe join` finds them.

    Example:

        specpipe ca issue --address 203.0.113.20 --name mn
    """
    from specpipe import settings
    from specpipe.ops import certificates as authority

    for address in addresses:
        try:
            authority.parse_address(address)
        except authority.CaError as exc:
            raise click.ClickException(f"--address {exc}") from None
    name = name or addresses[0].strip()
    if not _HOST_NAME.fullmatch(name):
        raise click.ClickException(
            f"--name {name!r}: a host's name is letters, digits and . _ : - (at most 63)"
        )
    out = out_dir or settings.instance_dir() / ISSUED_FOLDER / name
    directory = ca_dir_or_default(ca_dir)
    try:
        files = authority.issue(
            authority.Authority.in_dir(directory),
            addresses,
            out,
            name=name,
            days=days or authority.HOST_DAYS,
            overwrite=force,
        )
        until = authority.load_certificate(files.cert).not_valid_after_utc
    except authority.CaExists:
        raise click.ClickException(
            f"{out} already holds a host's TLS files: pass --force to replace them"
        ) from None
    except authority.CaError as exc:
        hint = "" if directory.exists() else " (`specpipe ca init` makes one)"
        raise click.ClickException(f"{exc}{hint}") from None
    except OSError as exc:
        raise click.ClickException(f"cannot write {out}: {exc.strerror or exc}") from None
    click.echo(
        f"{name}: {files.cert.name}, {files.key.name} and {files.ca.name} in {out}, valid until "
        f"{until:%Y-%m-%d}; copy the folder to that host's TLS folder (<instance>/tls there)"
    )
