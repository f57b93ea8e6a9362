"""Released EAGLE-3 heads at gpt-oss's real shapes drafting on a ring of the released layout.

gpt-oss-20b's layout cut to its first 2 layers (`synth.synthesize(n_layers=2)`: the real
embedding, norm and head, 201,088 × 2880, 64 query and 8 KV heads, 32 MXFP4 experts a layer,
random weights) as two stages in one process, the tail holding a head of each published format
at the released heads' shapes (H 2880, 64 heads of 64, 8 KV heads, a 32,000-token draft
vocabulary through d2t, YaRN) tapping the states entering layers 0 and 1 and the last layer's
output, loaded as a stage worker loads it (`load_with_head`): the tap of layer 0 crosses from
stage 0 to the tail. Spec == plain: greedy chains with one format, sampled trees with the
other. Each routed expert is unpacked from MXFP4 on the CPU (about 0.7 s a layer a row), so
the jobs are short. About 6 GB; `make test` runs the `realshape` tests alone, after the others.
"""

from __future__ import annotations

from functools import partial

import pytest

from specpipe.core.sampling import SamplingParams
from specpipe.core.tree import TreeShape
from specpipe.decoding.local_ring import LocalRing
from specpipe.drafting.eagle3_drafter import Eagle3Drafter
from specpipe.drafting.eagle3_format import FORMATS
from specpipe.drafting.eagle3_synth import synthesize_head
from specpipe.drafting.head import load_with_head
from specpipe.transformer import synth
from specpipe.transformer.resolve import load_stages
from tests.drafting import head_generation

pytestmark = pytest.mark.realshape

LIKE = "gpt-oss-20b"
TAPS = (0, 1, 2)
PROMPT = [200006, 17, 4200, 91, 30000, 8, 1234, 56789, 200007]
TREE = TreeShape((0, 0, 1), (0, 1, 0))  # two candidates under the root, one under the best
GREEDY = SamplingParams(temp=0.0)
SAMPLED = SamplingParams(temp=0.8, top_p=0.95, seed=3, sampler="gumbel")


@pytest.fixture
def one_thread():
    """Every core (overriding the tiny models' one thread): this test runs alone."""
    yield


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    return synth.synthesize(LIKE, tmp_path_factory.mktemp("oss") / "model", n_layers=2).path


@pytest.mark.parametrize(
    ("fmt", "params", "trees"),
    [("eagle", GREEDY, False), ("speculators", SAMPLED, True)],
    ids=["eagle-greedy-chains", "speculators-sampled-trees"],
)
def test_a_released_head_drafts_on_a_ring_of_the_released_layout(
    released, tmp_path, fmt, params, trees
):
    assert fmt in FORMATS
    folder = synthesize_head(LIKE, tmp_path / fmt, fmt, taps=TAPS)
    ring = LocalRing(*load_with_head(partial(load_stages, released, 2), str(folder), LIKE))
    assert isinstance(ring.head, Eagle3Drafter) and ring.head.taps == TAPS
    assert [(s.start, s.end) for s in ring.stages] == [(0, 1), (1, 2)]
    head = ring.head.head.cfg
    assert (head.hidden, head.heads, head.kv_heads, head.head_dim) == (2880, 64, 8, 64)
    assert (head.draft_vocab, head.target_vocab) == (32000, 201088)
    plain = head_generation(ring, "plain", PROMPT, params, 3, draft_k=0)
    expected = plain.run()
    ring.drop("plain")
    tree = TREE if trees else None  # every round asks for it, whatever its rows cost here
    spec = head_generation(ring, "spec", PROMPT, params, 3, draft_k=2, tree=tree)
    assert spec.run() == expected
    assert spec.stats.head_rounds > 0 and (not trees or spec.stats.tree_rounds > 0)
