"""`specpipe bench wan` on a small lab with the tiny model: spec and plain through hosts of
their own with delayed links, every row identical, tok/s set against the measured ceiling."""

from __future__ import annotations

import json

import pytest

from tests.lab.conftest import lab_unavailable, run


@pytest.mark.slow
def test_bench_wan_reports_tok_s_against_the_ceiling_and_identical_tokens(tiny, tmp_path):
    reason = lab_unavailable()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "wan.json"
    result = run("bench", "wan", "--model", str(tiny), "--link-delay-ms", "6,4", "--tokens", "16",
                 "--draft-k", "4", "--temp", "0.7", "--home", str(tmp_path / "lab"),
                 "--json", str(out))  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["route"] == ["h0", "h1"] and report["link_delays_ms"] == [6.0, 4.0]
    assert [(r["prompt"], r["temp"]) for r in report["rows"]] == [("grounded", 0.7),
                                                                  ("novel", 0.7)]  # fmt: skip
    for row in report["rows"]:
        assert row["identical"]
        # The links alone are 10 ms a round, so no mode can beat 100 tokens per round a second.
        assert row["link_ms"] >= 10.0 and row["ring_ms"] > row["link_ms"]
        for mode in ("plain", "spec"):
            r = row[mode]
            assert 0 < r["tok_s"] <= r["ceiling_tok_s"] * 1.05
            assert r["ceiling_tok_s"] == pytest.approx(
                r["tokens_per_round"] * 1000 / row["ring_ms"], rel=0.02)  # fmt: skip
    assert "| grounded | 0.7 |" in result.output
    assert not (tmp_path / "lab" / "lab.json").exists()  # taken down
