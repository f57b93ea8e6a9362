"""Spares and failover on real stage processes: two stages serve the same layers, the one a job
runs through is killed (SIGKILL, never restarted), and the job goes on through the other at
once, replaying its tokens there, to the output an undisturbed run gives."""

from __future__ import annotations

import json
import secrets
import time
import uuid

import pytest
from click.testing import CliRunner

from models.db import make_session_factory
from models.runs import Run
from specpipe.cli import cli
from specpipe.core.sampling import SamplingParams
from specpipe.decoding.generation import Generation
from specpipe.ops.redis_server import RedisServer
from specpipe.swarm.failover import CheckedRing, lost_with_spare, served_layers
from specpipe.swarm.redis_ring import RedisRing
from tests.swarm.test_redis_ring import PARAMS, PROMPT, ReferenceRing
from tests.swarm.test_swarm_jobs import in_background, latest_job, options, watch
from tests.swarmprocs import Swarm, write_tiny_model

# A dead stage lapses after three missed beats (1.5 s at the tests' 0.5 s); the round that
# found it late re-routes then, and the replay is one round. Far below the 3 x 30 s a round
# would wait out before failing the job.
FAILOVER_BOUND_S = 6.0


def checked_ring(settings, model: str, n_layers: int) -> CheckedRing:
    """The ring the coordinator builds for a job, over the test's swarm."""

    def build(avoid=frozenset()):
        return RedisRing.from_inventory(settings, model, n_layers, avoid=avoid, timeout_s=30)

    return CheckedRing(
        build,
        lambda: served_layers(settings),
        lost_with_spare(settings, model, n_layers),
    )


@pytest.mark.parametrize("params", [SamplingParams(temp=0.0), PARAMS], ids=["greedy", "sampled"])
def test_a_killed_stage_with_a_spare_is_routed_around_at_once(
    stages, ring_settings, redis_url, params
):
    bounds = [(0, 2), (2, 4)]
    stages.start("h0", "0:2", redis_url, wait=False)
    stages.start("t1", "2:4", redis_url, wait=False)
    stages.start("t2", "2:4", redis_url, wait=False)
    stages.wait_ready(["h0", "t1", "t2"])
    options_ = dict(max_new_tokens=40, draft_k=3)
    expected = Generation(ReferenceRing(bounds), "l", PROMPT * 2, params, **options_).run()

    ring = checked_ring(ring_settings, "toy", 4)
    first_tail = ring.route[-1].host
    spare = {"t1": "t2", "t2": "t1"}[first_tail]
    run = Generation(ring, "s", PROMPT * 2, params, **options_)
    stall_s, killed_at = 0.0, None
    for i, _ in enumerate(run.rounds()):
        if killed_at is not None and not stall_s:
            stall_s = time.monotonic() - killed_at
        if i == 2:
            stages.kill9(first_tail)  # never restarted
            killed_at = time.monotonic()
    ring.close()
    assert run.generated == expected
    assert (ring.failovers, run.stats.replays) == (1, 1)
    assert [hop.host for hop in ring.route] == ["h0", spare]
    assert 0 < stall_s < FAILOVER_BOUND_S, stall_s


def test_without_a_spare_a_killed_stage_is_still_waited_for(stages, ring_settings, redis_url):
    stages.start("h0", "0:2", redis_url, wait=False)
    stages.start("t1", "2:4", redis_url, wait=False)
    stages.wait_ready(["h0", "t1"])
    expected = Generation(
        ReferenceRing([(0, 2), (2, 4)]), "l", PROMPT * 2, PARAMS, max_new_tokens=30, draft_k=3
    ).run()
    ring = checked_ring(ring_settings, "toy", 4)
    run = Generation(ring, "s", PROMPT * 2, PARAMS, max_new_tokens=30, draft_k=3)
    for i, _ in enumerate(run.rounds()):
        if i == 2:
            stages.kill9("t1")
            time.sleep(2.0)  # long enough for its heartbeat to lapse: still no one to take over
            stages.restart("t1")
    ring.close()
    assert run.generated == expected
    assert (ring.failovers, run.stats.replays) == (0, 1)


def test_a_re_split_after_the_route_was_built_is_refused_and_re_routed_to_the_plain_output(
    stages, ring_settings, redis_url
):
    # a 0:2 and b 2:4 route the job; c serves 3:4 and waits as a spare.
    for host, layers in (("a", "0:2"), ("b", "2:4"), ("c", "3:4")):
        stages.start(host, layers, redis_url, wait=False)
    stages.wait_ready(["a", "b", "c"])
    expected = Generation(
        ReferenceRing([(0, 2), (2, 4)]), "l", PROMPT, PARAMS, max_new_tokens=20, draft_k=3
    ).run()
    ring = checked_ring(ring_settings, "toy", 4)
    assert [hop.host for hop in ring.route] == ["a", "b"]
    # The model is split again before the first round: a now serves 0:3. The route a -> b
    # would run layer 2 twice; a refuses it instead, and the ring goes a -> c.
    stages.kill9("a")
    stages.start("a", "0:3", redis_url)
    run = Generation(ring, "s", PROMPT, PARAMS, max_new_tokens=20, draft_k=3)
    assert run.run() == expected
    ring.close()
    assert [(hop.host, hop.layer_start, hop.layer_end) for hop in ring.route] == [
        ("a", 0, 3),
        ("c", 3, 4),
    ]
    assert ring.rebuilt == 1


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny")


@pytest.fixture(scope="module")
def spared(tiny, database_url, tmp_path_factory):
    """Stage s0 (layers 0:2), two stages for 2:4 (a1, a2) and a coordinator, on a private Redis
    with a password."""
    with RedisServer(password=secrets.token_hex(16)) as server:
        group = Swarm(
            server.url,
            f"t{uuid.uuid4().hex[:8]}",
            secrets.token_hex(16),
            tiny,
            DATABASE_URL=database_url,
        )
        try:
            for host, layers in (("s0", "0:2"), ("a1", "2:4"), ("a2", "2:4")):
                group.start_stage(host, layers)
            group.start_coordinator(log=tmp_path_factory.mktemp("logs") / "coordinator.log")
            group.wait_stages(["s0", "a1", "a2"])
            yield group
        finally:
            group.stop()


def test_a_job_whose_stage_is_killed_goes_on_through_the_spare_identically(
    tiny, spared, db_url, monkeypatch
):
    for name, value in (
        ("REDIS_URL", spared.redis_url),
        ("SPECPIPE_SWARM", spared.swarm),
        ("SPECPIPE_SWARM_KEY", spared.key),
        ("SPECPIPE_INSECURE_SHARED_KEY", "1"),  # the test swarm's shared-key mode
        ("DATABASE_URL", db_url),
    ):
        monkeypatch.setenv(name, value)
    kw = dict(temp=0.8, seed=7, max_new_tokens=120)
    result = CliRunner().invoke(
        cli, ["generate", "hello world", "--local", "--stages", "2", *options(tiny, **kw)]
    )
    assert result.exit_code == 0, result.output
    want = json.loads(result.stdout)["tokens"]

    thread, out = in_background(*options(tiny, **kw))
    job = watch(db_url, lambda j: j.generated_tokens >= 10 and j.run_id is not None, "10 tokens")
    with make_session_factory(db_url)() as session:
        victim = session.get(Run, job.run_id).topology.split(" -> ")[-1]
    assert victim in ("a1", "a2")
    before = job.generated_tokens
    spared.kill9(victim)  # never restarted
    killed_at = time.monotonic()
    watch(db_url, lambda j: j.generated_tokens > before + 1 or j.finished, "the next round")
    stall_s = time.monotonic() - killed_at
    thread.join(120)
    result = out["result"]
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["tokens"] == want
    assert latest_job(db_url).status == "done"
    assert stall_s < FAILOVER_BOUND_S, stall_s
    print(f"failover: {stall_s:.2f} s from the kill to the next stored round")
