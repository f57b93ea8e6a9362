"""The fault and load benches' pure parts: re-split layer ranges, the summary table and
percentiles."""

from __future__ import annotations

from specpipe.bench.api_load import percentile
from specpipe.bench.faults import JobOutcome, Trial, resplit_variants, summarise, table


def test_resplit_variants_differ_from_the_middle_stage_and_stay_in_the_model():
    layers = {"stage0": (0, 10), "stage1": (10, 20), "stage2": (20, 30)}
    assert resplit_variants(layers, 30) == [(10, 30), (9, 20), (10, 21)]
    tiny = {"stage0": (0, 2), "stage1": (2, 3), "stage2": (3, 4)}
    assert resplit_variants(tiny, 4) == [(2, 4), (1, 3)]


def test_the_summary_counts_every_job_once_in_its_column():
    trials = [
        Trial("kill-tail", "", True, 3, 1.0, [JobOutcome(1, "identical", "done")]),
        Trial("kill-tail", "", True, 5, 3.0, [JobOutcome(2, "failed", "failed", "no reply")]),
        Trial("kill-redis", "", False),
    ]
    by_fault = {row["fault"]: row for row in summarise(trials)}
    tail = by_fault["kill-tail"]
    assert (tail["injected"], tail["jobs"], tail["identical"], tail["failed"]) == (2, 2, 1, 1)
    assert (tail["recover_s_median"], tail["recover_s_max"]) == (2.0, 3.0)
    assert tail["failed_reasons"] == ["no reply"]
    assert by_fault["kill-redis"]["injected"] == 0
    text = "\n".join(table(summarise(trials)))
    assert "kill-tail failed: no reply" in text and "2.0 / 3.0" in text


def test_percentiles_interpolate_and_need_values():
    assert percentile([], 0.5) is None
    assert percentile([4.0], 0.95) == 4.0
    assert percentile([float(i) for i in range(1, 101)], 0.5) == 50.5


def test_the_benches_say_in_one_line_that_the_model_is_missing(tmp_path):
    from click.testing import CliRunner

    from specpipe.cli import cli

    for command in ("faults", "load-api", "long-prompt"):
        result = CliRunner().invoke(cli, ["bench", command, "--model", str(tmp_path / "none")])
        assert result.exit_code == 1, result.output
        error = result.output.strip().splitlines()[-1]
        assert error.startswith("Error: ") and "none" in error, result.output


def test_a_long_prompt_has_the_tokens_asked_for_and_is_the_same_for_a_seed():
    from specpipe.bench.long_prompt import long_prompt

    def words(text: str) -> list[str]:  # a tokenizer's stand-in
        return text.split()

    prompt = long_prompt(words, 300, seed=1)
    assert 300 <= len(words(prompt)) < 300 + 4 * 20  # within the last few notes added
    assert prompt == long_prompt(words, 300, seed=1) != long_prompt(words, 300, seed=2)
    assert prompt.endswith("and why?")
