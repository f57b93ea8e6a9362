"""The lossy test double: the product's stage never samples with it, a test installs it through
the stage's configuration, and a stage given it says so in its log and its inventory record."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from specpipe.cli.worker import tail_sampling
from specpipe.core.coupling import GumbelSampler
from specpipe.core.sampling import Sampler, SamplingParams, committed_tokens
from specpipe.proofs.lossy import LossySampler
from specpipe.proofs.stats import total_variation
from specpipe.swarm import inventory
from tests.regression.conftest import ROOT
from tests.regression.stage import SAMPLINGS
from tests.waiting import wait_until

ICDF, GUMBEL = SamplingParams(temp=0.7), SamplingParams(temp=0.7, sampler="gumbel")


def test_the_products_stage_samples_exactly():
    sampling = tail_sampling()
    assert type(sampling.sampler_for(ICDF)) is Sampler
    assert type(sampling.sampler_for(GUMBEL)) is GumbelSampler
    assert sampling.exact and sampling.name == inventory.EXACT_SAMPLER


def test_the_launchers_lossy_sampling_is_the_lossy_sampler_and_not_exact():
    assert type(SAMPLINGS["lossy"].sampler_for(ICDF)) is LossySampler
    assert not SAMPLINGS["lossy"].exact  # what flags the node's record and its log
    assert SAMPLINGS["exact"] == tail_sampling()


def test_the_lossy_sampler_commits_a_biased_law_and_plain_sampling_is_untouched():
    logits = np.log(np.array([[0.4, 0.3, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]]))
    honest, lossy = np.zeros(4), np.zeros(4)
    for seed in range(4000):
        for sampler, counts in ((Sampler(seed=seed), honest), (LossySampler(seed=seed), lossy)):
            first = committed_tokens([3], sampler.accept(logits, [3], 10))[0]
            counts[first] += 1
        assert LossySampler(seed=seed).sample(logits[0], 10) == Sampler(seed=seed).sample(
            logits[0], 10
        )
    target = np.array([0.4, 0.3, 0.2, 0.1]) * 4000
    assert total_variation(honest, target) < 0.03
    assert total_variation(lossy, target) > 0.2  # rejections all go to token 0
    assert lossy[1] == lossy[2] == 0


@pytest.mark.parametrize("sampler", ["lossy", "exact"])
def test_a_stage_says_in_its_log_and_its_record_how_it_samples(live_swarm, sampler):
    argv = [sys.executable, "-m", "tests.regression.stage", "--host", "nj-1", "--layers", "2:4"]
    argv += ["--redis", live_swarm.redis_url, "--swarm", live_swarm.name, "--geo", "NJ"]
    argv += ["--public-ip", "203.0.113.9", "--sampler", sampler]
    proc = subprocess.Popen(argv, cwd=ROOT, env=live_swarm.env(), stderr=subprocess.PIPE, text=True)
    live_swarm.procs.append(proc)  # stopped with the swarm whatever happens here

    def record() -> inventory.NodeInfo | None:
        if proc.poll() is not None:
            raise RuntimeError("the stage process exited")
        nodes = inventory.load(live_swarm.client, live_swarm.name, live_swarm.key)
        return nodes[0] if nodes else None

    node = wait_until(record, 120, "the stage's record", interval_s=0.1)
    proc.terminate()
    _, log = proc.communicate(timeout=15)
    assert node.sampler == sampler
    warnings = [line for line in log.splitlines() if "NOT lossless" in line]
    if sampler == "lossy":
        [line] = warnings
        assert line.startswith("WARNING:specpipe.stage:nj-1: samples with 'lossy', not the exact")
    else:
        assert warnings == []
