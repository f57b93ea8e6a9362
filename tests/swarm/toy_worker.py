"""Run one toy stage as a real stage worker process (the swarm tests start several).

    python -m tests.swarm.toy_worker --host h0 --layers 0:2 --redis URL --swarm NAME

The swarm key comes from SPECPIPE_SWARM_KEY, as for a real worker, and so do the host
identities (the pinned coordinator key, this host's own key) where the environment gives them.
"""

import argparse
import logging

from specpipe import settings
from specpipe.swarm import inventory, trust
from specpipe.swarm.stage.worker import WorkerConfig, run
from tests.swarm.toy_stage import ToyConfig, ToyStage


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", required=True)
    parser.add_argument("--layers", required=True)
    parser.add_argument("--redis", required=True)
    parser.add_argument("--registry")
    parser.add_argument("--swarm", required=True)
    parser.add_argument("--n-layers", type=int, default=ToyConfig.n_layers)
    parser.add_argument("--dim", type=int, default=ToyConfig.dim)
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--heartbeat-s", type=float, default=0.5)
    parser.add_argument("--max-message-bytes", type=int, default=WorkerConfig.max_message_bytes)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    start, end = (int(x) for x in args.layers.split(":"))
    stage = ToyStage(ToyConfig(n_layers=args.n_layers, dim=args.dim), start, end)
    if args.delay_ms:
        stage = DelayedStage(stage, args.delay_ms / 1000)
    config = WorkerConfig(
        host=args.host,
        swarm=args.swarm,
        keys=trust.keyring(settings.Settings.from_env(), args.host),
        redis_url=args.redis,
        registry_url=args.registry,
        block_ms=200,
        heartbeat_s=args.heartbeat_s,
        max_message_bytes=args.max_message_bytes,
        redis_password=settings.redis_password(),
        tls_ca=settings.swarm_ca(),
    )
    node = inventory.NodeInfo(
        host=args.host,
        layer_start=start,
        layer_end=end,
        redis_url=args.redis,
        model="toy",
        **inventory.hardware(),
    )
    run(stage, config, node)


class DelayedStage:
    """A stage behind a slow link: sleeps before each forward (for the latency benchmark)."""

    def __init__(self, stage, delay_s: float) -> None:
        self.stage, self.delay_s = stage, delay_s
        self.first, self.last = stage.first, stage.last

    def forward(self, session, inputs, start_pos, last_rows=None):
        import time

        time.sleep(self.delay_s)
        return self.stage.forward(session, inputs, start_pos, last_rows)

    def drop(self, session):
        self.stage.drop(session)

    def held_tokens(self):
        return self.stage.held_tokens()


if __name__ == "__main__":
    main()
