"""`specpipe bench wan` on a small lab with the tiny model: spec and plain through hosts of
their own with delayed links, every row identical, tok/s set against the measured ceiling."""

from __future__ import annotations

import json

import pytest

from tests.lab.conftest import need_lab, run


@pytest.mark.slow
def test_bench_wan_reports_tok_s_against_the_ceiling_and_identical_tokens(tiny, tmp_path):
    need_lab()
    out = tmp_path / "wan.json"
    result = run(
        "bench",
        "wan",
        "--model",
        str(tiny),
        "--link-delay-ms",
        "6,4",
        "--tokens",
        "16",
        "--draft-k",
        "4",
        "--temp",
        "0.7",
        "--home",
        str(tmp_path / "lab"),
        "--json",
        str(out),
    )
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["route"] == ["h0", "h1"] and report["link_delays_ms"] == [6.0, 4.0]
    assert [(r["prompt"], r["temp"]) for r in report["rows"]] == [("grounded", 0.7), ("novel", 0.7)]
    for row in report["rows"]:
        assert row["identical"]
        for mode in ("plain", "spec"):
            r = row[mode]
            # The links alone are 10 ms a round: no round trip beats that.
            assert r["link_ms"] >= 10.0 and r["ring_ms"] > r["link_ms"]
            assert 0 < r["tok_s"] <= r["link_ceiling_tok_s"]
            assert r["link_ceiling_tok_s"] == pytest.approx(
                r["tokens_per_round"] * 1000 / r["link_ms"], rel=0.02
            )
            assert r["ceiling_tok_s"] == pytest.approx(
                r["tokens_per_round"] * 1000 / r["ring_ms"], rel=0.02
            )
    assert "| grounded | 0.7 | spec |" in result.output
    assert not (tmp_path / "lab" / "lab.json").exists()  # taken down
