"""An EAGLE-3 head at the tail of a ring of stage processes: the tail's record names the layers it
reads, every round asks the stages for them, each stage sends its own on with the hidden states,
and the committed tokens are plain sampling's, through a tail killed mid-job and a spare taking
over a tapped range."""

from __future__ import annotations

import json
import secrets
import uuid

import pytest
import redis
from safetensors.torch import save_file

from specpipe.core.sampling import SamplingParams
from specpipe.core.tree import TreeShape
from specpipe.decoding.generation import Generation
from specpipe.decoding.target import open_target
from specpipe.drafting.eagle3_synth import head_config, head_tensors
from specpipe.settings import Settings
from specpipe.swarm import inventory, streams
from specpipe.swarm.failover import CheckedRing, lost_with_spare, served_layers
from specpipe.swarm.redis_ring import RedisRing
from specpipe.transformer.resolve import model_label
from tests.drafting import head_generation
from tests.swarmprocs import Swarm, write_tiny_model

PROMPT = [5, 17, 42, 8, 23, 61, 9, 5, 17, 30]
TAPS = [1, 2, 4]  # s1 holds 1 and 2, the tail 4 (the last layer's output)
SAMPLED = SamplingParams(temp=0.8, top_p=0.95, seed=21, sampler="gumbel")
WIDE = TreeShape((0, 0, 0, 1, 1, 4, 2), (0, 1, 2, 0, 1, 0, 0))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("eagle3-swarm") / "tiny")
    config = head_config(json.loads((path / "config.json").read_text()), "speculators", 48, 50)
    config["eagle_aux_hidden_state_layer_ids"] = TAPS
    head = path / "eagle3"
    head.mkdir()
    (head / "config.json").write_text(json.dumps(config))
    save_file(head_tensors(config, "speculators", seed=4), head / "model.safetensors")
    return path


@pytest.fixture
def swarm(tiny, redis_url):
    group = Swarm(redis_url, f"t{uuid.uuid4().hex[:8]}", secrets.token_hex(16), tiny)
    try:
        group.start_stage("s0", "0:1")
        group.start_stage("s1", "1:3")
        group.start_stage("s2", "3:4", "--draft-head", str(tiny / "eagle3"))
        group.wait_stages(["s0", "s1", "s2"])
        yield group
    finally:
        group.stop()


def settings_of(swarm) -> Settings:
    # No coordinator key pinned: the shared-key mode, opted into out loud.
    return Settings.from_env().for_swarm(
        swarm.redis_url, swarm.swarm, swarm.key.encode(), insecure_shared_key=True
    )


def local_plain(tiny, params, n):
    ring = open_target(str(tiny)).local_ring(1, "none")
    return Generation(ring, "plain", PROMPT, params, max_new_tokens=n, draft_k=0).run()


def spec_run(ring, session, params, n, trees=False):
    return head_generation(ring, session, PROMPT, params, n, tree=WIDE if trees else None)


@pytest.mark.parametrize("trees", [False, True], ids=["chains", "trees"])
@pytest.mark.parametrize("params", [SamplingParams(temp=0.0), SAMPLED], ids=["greedy", "sampled"])
def test_the_stages_send_their_taps_on_and_the_tail_drafts_from_them(swarm, tiny, params, trees):
    model = model_label(str(tiny))
    client = redis.Redis.from_url(swarm.redis_url)
    tail = next(n for n in inventory.load(client, swarm.swarm, swarm.key) if n.host == "s2")
    assert tail.tap_layers() == tuple(TAPS)
    ring = RedisRing.from_inventory(settings_of(swarm), model, 4, timeout_s=30)
    assert ring.taps == tuple(TAPS)  # every round asks for them
    try:
        run = spec_run(ring, f"e3-{params.temp}-{trees}", params, 30, trees)
        assert run.run() == local_plain(tiny, params, 30)
        assert run.stats.head_rounds > 5 and run.stats.replays == 0
        if trees:
            assert run.stats.tree_rounds > 5
    finally:
        ring.close()
    stats = streams.read_stats(client, swarm.swarm, "s2")
    assert int(stats.get("dropped", 0)) == 0  # no round came with the wrong width
    client.close()


def test_a_tail_killed_mid_job_drafts_again_once_back_and_the_output_is_unchanged(swarm, tiny):
    ring = RedisRing.from_inventory(settings_of(swarm), model_label(str(tiny)), 4, timeout_s=30)
    try:
        run = spec_run(ring, "killed", SAMPLED, 30)
        for i, _ in enumerate(run.rounds()):
            if i == 3:
                swarm.kill9("s2")
                swarm.restart("s2")
        assert run.generated == local_plain(tiny, SAMPLED, 30)
        assert run.stats.replays >= 1 and run.stats.head_rounds > 5
    finally:
        ring.close()


def test_a_spare_takes_over_a_tapped_range_and_the_output_is_unchanged(swarm, tiny):
    settings = settings_of(swarm)
    model = model_label(str(tiny))
    swarm.start_stage("s1b", "1:3")  # a spare of the range that holds two of the taps
    swarm.wait_stages(["s1b"])

    def build(avoid=frozenset()):
        return RedisRing.from_inventory(settings, model, 4, avoid=avoid, timeout_s=30)

    ring = CheckedRing(build, lambda: served_layers(settings), lost_with_spare(settings, model, 4))
    first = ring.route[1].host
    try:
        run = spec_run(ring, "spare", SAMPLED, 30)
        for i, _ in enumerate(run.rounds()):
            if i == 3:
                swarm.kill9(first)  # never restarted
        assert run.generated == local_plain(tiny, SAMPLED, 30)
        assert ring.failovers == 1 and ring.route[1].host != first
        assert ring.ring.taps == tuple(TAPS) and run.stats.head_rounds > 5
    finally:
        ring.close()


def test_the_taps_bytes_on_the_wire_are_one_block_a_tap_a_row():
    import torch

    from specpipe.bench import taps

    oss = next(s for s in taps.shapes() if s.name == "gpt-oss-120b")
    assert oss.taps == (2, 18, 33) and taps.hop_blocks(oss) == [1, 1, 2]  # 4 x 9 layers
    result = taps.measure(oss, rows=5, mbit_s=100)
    assert result["tap_bytes_per_row"] == 2880 * 2  # bf16
    for hop in result["hops"]:
        added = hop["tapped_bytes"] - hop["plain_bytes"]
        blocks = hop["tap_blocks"] * 5 * 2880 * 2
        assert blocks <= added <= blocks + 32  # the blocks, and the header's list of taps
    # 4 blocks a row over the round: 23 KB, about 9 ms at 100 Mbit/s for 5 rows.
    assert 4 * 5760 <= result["extra_bytes_per_row"] <= 4 * 5760 + 32
    assert result["extra_ms_per_round"] == pytest.approx(5 * 4 * 5760 * 8 / 1e5, rel=0.01)
    assert taps.sealed_bytes(8, 2, 0, torch.float32, ()) < taps.sealed_bytes(
        8, 2, 1, torch.float32, (1,)
    )
