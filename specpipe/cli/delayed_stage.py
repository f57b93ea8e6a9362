"""`python -m specpipe.cli.delayed_stage`: a stage worker behind a simulated slow outgoing link,
as the lab and the ring benchmarks start their stages on one machine. It takes `specpipe worker
stage`'s options and `--link-delay-ms`, the one-way delay of everything the stage sends
(`specpipe.ops.link_delay.DelayedLink`)."""

from __future__ import annotations

import click

from specpipe.cli.worker import serve_stage, worker_stage


@click.command(name="delayed-stage", params=list(worker_stage.params))
@click.option(
    "--link-delay-ms",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="Wait this long before each send onward, to the next hop or the coordinator.",
)
def delayed_stage(
    link_delay_ms: float, redis_url: str | None, registry_url: str | None, **options
) -> None:
    """Serve one layer range as `specpipe worker stage` does, every send delayed."""
    from specpipe import settings
    from specpipe.ops.link_delay import DelayedLink

    delay_s = link_delay_ms / 1000
    serve_stage(
        redis_url=redis_url or settings.redis_url(),
        registry_url=registry_url or settings.registry_url(),
        wrap_sender=(lambda sender: DelayedLink(sender, delay_s)) if delay_s > 0 else None,
        **options,
    )


if __name__ == "__main__":
    delayed_stage()
