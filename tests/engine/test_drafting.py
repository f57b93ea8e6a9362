"""The n-gram drafter against a brute-force search over the whole context."""

import numpy as np
import pytest

from specpipe.drafting.ngram import NgramDrafter


def brute_force_proposal(tokens, k, max_ngram, min_ngram):
    """Scan the context for the longest suffix seen before; continue periodically from there."""
    end = len(tokens)
    for n in range(min(max_ngram, end), min_ngram - 1, -1):
        suffix = tokens[end - n :]
        for start in range(end - 1, n - 1, -1):  # most recent earlier occurrence first
            if tokens[start - n : start] == suffix:
                period = end - start
                return [tokens[start + i % period] for i in range(k)]
    return []


@pytest.mark.parametrize("max_ngram,min_ngram", [(3, 1), (4, 2), (1, 1)])
def test_proposals_match_brute_force(max_ngram, min_ngram):
    rng = np.random.default_rng(max_ngram * 10 + min_ngram)
    tokens = rng.integers(0, 6, size=400).tolist()
    drafter = NgramDrafter(max_ngram, min_ngram)
    for i, token in enumerate(tokens):
        drafter.extend([token])
        for k in (1, 4, 8):
            expected = brute_force_proposal(tokens[: i + 1], k, max_ngram, min_ngram)
            assert drafter.propose(k) == expected, (i, k)


def test_copies_a_repeated_passage():
    passage = list(range(100, 140))
    drafter = NgramDrafter()
    drafter.extend(passage + [7, 8] + passage[:5])
    assert drafter.propose(6) == passage[5:11]


def test_no_match_no_proposal():
    drafter = NgramDrafter(max_ngram=3, min_ngram=2)
    drafter.extend([1, 2, 3, 4])
    assert drafter.propose(5) == []
    assert NgramDrafter().propose(3) == []
    drafter.extend([1, 2])
    assert drafter.propose(0) == []


def test_a_short_loop_is_continued_periodically():
    drafter = NgramDrafter()
    drafter.extend([9, 1, 2, 1, 2])
    assert drafter.propose(5) == [1, 2, 1, 2, 1]


def test_bad_ngram_bounds_are_refused():
    with pytest.raises(ValueError):
        NgramDrafter(max_ngram=2, min_ngram=3)
    with pytest.raises(ValueError):
        NgramDrafter(max_ngram=2, min_ngram=0)


def test_bench_draft_reports_the_cost():
    from click.testing import CliRunner

    from specpipe.cli import cli

    result = CliRunner().invoke(cli, ["bench", "draft", "--repeats", "50"])
    assert result.exit_code == 0, result.output
    assert "context 4,096 tokens, K=8: propose" in result.output
    assert "100% of proposals non-empty" in result.output
