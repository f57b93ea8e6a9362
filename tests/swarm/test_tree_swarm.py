"""Tree rounds on a real swarm: `specpipe worker stage` processes of a tiny checkpoint, the tail
holding a draft head, rounds over Redis Streams. Every output is plain sampling's, also after the
tail is killed mid-job."""

from __future__ import annotations

import secrets
import uuid

import pytest
import redis
import torch

from specpipe.core.sampling import SamplingParams
from specpipe.core.tree import TreeShape
from specpipe.decoding.generation import Generation
from specpipe.decoding.target import open_target
from specpipe.drafting.head import DraftHead
from specpipe.settings import Settings
from specpipe.swarm import streams
from specpipe.swarm.redis_ring import RedisRing
from specpipe.transformer.resolve import model_label, open_checkpoint
from tests.drafting import head_generation
from tests.swarmprocs import Swarm, write_tiny_model
from tests.waiting import wait_until

PROMPT = [5, 17, 42, 8, 23, 61, 9]
WIDE = TreeShape((0, 0, 0, 1, 1, 4, 2), (0, 1, 2, 0, 1, 0, 0))
SAMPLED = SamplingParams(temp=0.8, top_p=0.95, seed=21, sampler="gumbel")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("tree-swarm") / "tiny")
    cfg = open_checkpoint(path).config
    torch.manual_seed(0)  # an untrained head: its trees are verified all the same
    meta = {"model": model_label(str(path)), "dim": cfg.dim, "vocab": cfg.vocab_size}
    head = DraftHead(cfg.dim, 32, heads=2)  # with attention: the tail keeps each session's past
    torch.nn.init.normal_(head.attention.out.weight, std=0.3)
    head.save(path / "head.safetensors", meta)
    return path


@pytest.fixture(scope="module")
def swarm(tiny, redis_url):
    group = Swarm(redis_url, f"t{uuid.uuid4().hex[:8]}", secrets.token_hex(16), tiny)
    try:
        group.start_stage("s0", "0:2")
        group.start_stage("s1", "2:4", "--draft-head", str(tiny / "head.safetensors"))
        group.wait_stages(["s0", "s1"])
        yield group
    finally:
        group.stop()


def local_plain(tiny, params, n):
    ring = open_target(str(tiny)).local_ring(1, "none")
    return Generation(ring, "plain", PROMPT, params, max_new_tokens=n, draft_k=0).run()


def tree_run(ring, session, params, n):
    return head_generation(ring, session, PROMPT, params, n, tree=WIDE)  # a wide tree a round


def ring_of(swarm, tiny) -> RedisRing:
    # No coordinator key pinned: the shared-key mode, opted into out loud.
    settings = Settings.from_env().for_swarm(
        swarm.redis_url, swarm.swarm, swarm.key.encode(), insecure_shared_key=True
    )
    return RedisRing.from_inventory(settings, model_label(str(tiny)), 4, timeout_s=30)


@pytest.mark.parametrize("params", [SamplingParams(temp=0.0), SAMPLED], ids=["greedy", "sampled"])
def test_tree_rounds_over_the_swarm_commit_plain_samplings_tokens(swarm, tiny, params):
    ring = ring_of(swarm, tiny)
    try:
        run = tree_run(ring, f"tree-{params.temp}", params, 40)
        assert run.run() == local_plain(tiny, params, 40)
        assert run.stats.tree_rounds > 10 and run.stats.replays == 0
    finally:
        ring.close()
    client = redis.Redis.from_url(swarm.redis_url)
    wait_until(
        lambda: int(streams.read_stats(client, swarm.swarm, "s1").get("trees", 0)) > 10,
        10,
        "the tail's count of tree rounds",
    )


def test_a_tail_killed_mid_job_loses_its_tree_and_the_output_is_unchanged(swarm, tiny):
    ring = ring_of(swarm, tiny)
    try:
        run = tree_run(ring, "killed", SAMPLED, 40)
        for i, _ in enumerate(run.rounds()):
            if i == 4:  # a tree waits on both stages for its walked rows
                swarm.kill9("s1")
                swarm.restart("s1")
        assert run.generated == local_plain(tiny, SAMPLED, 40)
        assert run.stats.replays >= 1 and run.stats.tree_rounds > 10
    finally:
        ring.close()
