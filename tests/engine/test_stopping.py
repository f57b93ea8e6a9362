"""Stop strings: the text cut, what streaming holds back, the checks, and the generation loop
ending at the round whose text first holds a stop string."""

import pytest

from specpipe.core.sampling import SamplingParams
from specpipe.core.stopping import (
    GenerationText,
    check_stop_strings,
    cut_at_stop,
    hold_back_stop_prefix,
)
from specpipe.decoding.generation import Generation
from specpipe.decoding.local_ring import LocalRing
from tests.engine.toy_stages import VOCAB, toy_stages

PROMPT = [3, 7, 1, 9, 3, 7, 1, 9]
LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMN"  # one character per toy token id
assert len(LETTERS) == VOCAB


def decode(ids: list[int]) -> str:
    return "".join(LETTERS[i] for i in ids)


@pytest.mark.parametrize(
    ("text", "stops", "cut", "stopped"),
    [
        ("Hello world", [], "Hello world", False),
        ("Hello world", ["xyz"], "Hello world", False),
        ("Hello world", ["o w"], "Hell", True),
        ("Hello world", ["world", "lo"], "Hel", True),  # the earliest occurrence wins,
        ("Hello world", ["lo", "world"], "Hel", True),  # whatever the order of the list
        ("Hello world", ["H"], "", True),  # a stop at the very first character
        ("Hello world", ["d"], "Hello worl", True),
        ("a\n\nUser: b\n\nUser:", ["\n\nUser:"], "a", True),
        ("", ["a"], "", False),
    ],
)
def test_cut_at_stop(text, stops, cut, stopped):
    assert cut_at_stop(text, stops) == (cut, stopped)


@pytest.mark.parametrize(
    ("text", "stops", "shown"),
    [
        ("Hello wor", ["world"], "Hello "),
        ("Hello w", ["world", "w!"], "Hello "),
        ("Hello", ["world"], "Hello"),
        ("Hello\n", ["\n\nUser:"], "Hello"),
        ("Hello", [], "Hello"),
        ("wor", ["world"], ""),
        ("ab", ["abc", "b"], ""),  # "ab" could still become "abc"
    ],
)
def test_hold_back_stop_prefix(text, stops, shown):
    assert hold_back_stop_prefix(text, stops) == shown


@pytest.mark.parametrize(
    ("stops", "reason"),
    [
        (["a", "b", "c", "d", "e"], "must be at most 4 strings, not 5"),
        ([""], "must not contain an empty string"),
        (["x" * 65], "must each be at most 64 characters"),
        ([3], "must be text or a list of text"),
        (["a\x00"], "must not contain NUL characters"),
        (["\ud800"], "must be valid UTF-8"),
    ],
)
def test_check_stop_strings_refuses(stops, reason):
    with pytest.raises(ValueError, match=f"^{reason}$"):
        check_stop_strings(stops)


def test_check_stop_strings_keeps_good_ones():
    assert check_stop_strings(("a", "x" * 64, " ", "\n")) == ["a", "x" * 64, " ", "\n"]
    assert check_stop_strings([]) == []


def run(draft_k: int, stops=(), resume=(), max_new=40) -> Generation:
    gen = Generation(
        LocalRing(toy_stages()),
        "s",
        PROMPT,
        SamplingParams(temp=0.9, seed=3),
        max_new_tokens=max_new,
        draft_k=draft_k,
        resume=resume,
        should_stop=(lambda ids: cut_at_stop(decode(ids), stops)[1]) if stops else None,
    )
    gen.run()
    return gen


@pytest.mark.parametrize("draft_k", [0, 4])
def test_a_stop_string_split_across_rounds_ends_the_generation(draft_k):
    full = decode(run(draft_k).generated)
    stop = full[20:23]  # plain: three tokens from three rounds
    start = full.index(stop)
    stopped = run(draft_k, [stop])
    text, found = cut_at_stop(decode(stopped.generated), [stop])
    assert found and text == full[:start]
    # Every token up to the round that completed the stop is kept, and nothing after it.
    n = len(stopped.generated)
    assert decode(stopped.generated) == full[:n] and n >= start + len(stop)
    assert stop not in full[: n - 1]
    assert stopped.stats.generated == n < len(full)
    if draft_k == 0:
        assert n == start + len(stop) and stopped.stats.rounds == n


def test_several_stop_strings_the_earliest_in_the_text_wins():
    full = decode(run(0).generated)
    late, early = full[30:32], full[10:12]
    stopped = run(0, [late, early])
    text, _ = cut_at_stop(decode(stopped.generated), [late, early])
    assert text == full[: min(full.index(early), full.index(late))]


def test_a_stop_at_the_first_token():
    full = decode(run(0).generated)
    stopped = run(0, [full[0]])
    assert stopped.generated and stopped.stats.rounds == 1
    assert cut_at_stop(decode(stopped.generated), [full[0]]) == ("", True)


def test_no_stop_string_in_the_text_runs_to_the_budget():
    full = run(0).generated
    absent = next(c for c in LETTERS if c not in decode(full))
    assert run(0, [absent]).generated == full and len(full) == 40


def test_a_resume_past_a_stop_string_generates_nothing_more():
    full = run(0).generated
    stop = decode(full)[5:7]
    assert run(0, [stop], resume=full[:12]).stats.rounds == 0


def test_generation_text_leaves_out_end_markers_cuts_at_a_stop_and_decodes_each_length_once():
    decoded = []

    def decode(ids: list[int]) -> str:
        decoded.append(list(ids))
        return "".join(chr(ord("a") + i) for i in ids)

    output = GenerationText(decode, eos_ids=[25], stops=["cd"])
    assert output.should_stop([0, 1]) is False
    assert output.cut([0, 1]) == ("ab", False)
    assert output.cut([0, 1, 2, 3, 4, 25]) == ("ab", True)
    assert output.should_stop([0, 1, 2, 3, 4, 25]) is True
    assert decoded == [[0, 1], [0, 1, 2, 3, 4]]  # once per length, end marker left out
    assert GenerationText(decode, [], []).should_stop is None
