"""`specpipe bench drafting`: the shipped head and an EAGLE-3 head timed on the same trees."""

from __future__ import annotations

import json

from click.testing import CliRunner

from specpipe.cli import cli
from tests.swarmprocs import write_tiny_model


def test_both_heads_are_timed_on_the_same_tree_sizes(tmp_path):
    out = tmp_path / "drafting.json"
    args = ["--drafts", "2", "--drafts", "5", "--context", "24", "--repeats", "2", "--temp", "0.7"]
    result = CliRunner().invoke(cli, ["bench", "drafting", *args, "--json", str(out)])
    assert result.exit_code == 0, result.output
    [run] = json.loads(out.read_text())
    assert run["draft_vocab"] == 8192 and run["temp"] == 0.7  # the shipped head's vocabulary
    assert [row["drafts"] for row in run["sizes"]] == [2, 5]
    for row in run["sizes"]:
        assert row["shipped_ms"] > 0 and row["eagle3_ms"] > 0
        assert abs(row["ratio"] - row["eagle3_ms"] / row["shipped_ms"]) < 0.01 + 0.01 * row["ratio"]
        assert 1 <= row["depth"] <= row["drafts"]
    assert "EAGLE-3 ms" in result.output


def test_a_model_without_a_shipped_head_is_one_line(tmp_path):
    tiny = write_tiny_model(tmp_path / "tiny")
    result = CliRunner().invoke(cli, ["bench", "drafting", "--model", str(tiny), "--repeats", "1"])
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        f"Error: model {str(tiny)!r} ships no draft head to compare with"
    ]
