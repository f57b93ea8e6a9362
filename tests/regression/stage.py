"""One stage as a real stage worker process, with a public IP and a geo label: the toy
transformer's layers, or with `--model` a real checkpoint's.

    python -m tests.regression.stage --host h0 --layers 0:2 --redis URL --swarm NAME --geo WA \
        --public-ip 198.51.100.7 [--model default [--draft-head PATH]] [--sampler lossy]

With `--draft-head` a tail of a real checkpoint holds that draft head, as `specpipe worker
stage --draft-head PATH` loads it. With `--sampler lossy` the stage samples with the
deliberately lossy `LossySampler`, installed through its configuration, so a test can show the
nightly regression catches it.
"""

import argparse
import logging
import os

from specpipe.proofs.lossy import LossySampler
from specpipe.swarm import inventory
from specpipe.swarm.stage.samplers import TailSampling
from specpipe.swarm.stage.worker import WorkerConfig, run
from tests.regression.toy_target import CONFIG
from tests.swarm.toy_stage import ToyStage

# How a stage's tail may sample: the product's exact samplers, or the lossy test double.
SAMPLINGS = {
    "exact": TailSampling(),
    "lossy": TailSampling(LossySampler.from_params, name="lossy"),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    for flag in ("--host", "--layers", "--redis", "--swarm", "--geo", "--public-ip"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--model")
    parser.add_argument("--draft-head")
    parser.add_argument("--sampler", choices=sorted(SAMPLINGS), default="exact")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    start, end = (int(x) for x in args.layers.split(":"))
    config = WorkerConfig(
        host=args.host,
        swarm=args.swarm,
        keys=os.environ["SPECPIPE_SWARM_KEY"].encode(),
        redis_url=args.redis,
        block_ms=200,
        heartbeat_s=0.5,
        tail_sampling=SAMPLINGS[args.sampler],
    )
    from specpipe.transformer.resolve import model_label

    node = inventory.NodeInfo(
        host=args.host,
        layer_start=start,
        layer_end=end,
        redis_url=args.redis,
        model=model_label(args.model) if args.model else "toy",
        public_ip=args.public_ip,
        geo=args.geo,
        **inventory.hardware(),
    )
    head = None
    if args.model:
        from specpipe.drafting.head import load_with_head
        from specpipe.transformer.layer_range import load_stage
        from specpipe.transformer.resolve import open_checkpoint

        checkpoint = open_checkpoint(args.model)
        label = model_label(args.model)
        (stage,), head = load_with_head(
            lambda **options: [load_stage(checkpoint, start, end, **options)],
            args.draft_head or "none",
            label,
            checkpoint,
        )
    else:
        stage = ToyStage(CONFIG, start, end)
    run(stage, config, node, head)


if __name__ == "__main__":
    main()
