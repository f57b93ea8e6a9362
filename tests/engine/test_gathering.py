"""Which sessions a stage waits for before a forward (`specpipe.swarm.gathering`)."""

import pytest

from specpipe.swarm.gathering import MAX_PERIOD_S, MAX_WAIT_S, WAIT_SHARE, Arrivals


def arrived(arrivals: Arrivals, session: str, *times: float) -> None:
    for t in times:
        arrivals.note(session, t)


def test_a_session_alone_never_waits():
    arrivals = Arrivals()
    arrived(arrivals, "a", 0.0, 0.1, 0.2)
    assert arrivals.due({"a"}, 0.3) == (set(), 0.3)


def test_a_round_due_within_its_window_is_waited_for_and_no_longer():
    arrivals = Arrivals()
    arrived(arrivals, "a", 0.0, 0.1, 0.2)
    arrived(arrivals, "b", 0.02, 0.12, 0.22)  # period 0.1 s, next due at 0.32
    awaited, until = arrivals.due({"a"}, 0.30)
    assert awaited == {"b"}
    assert until == pytest.approx(0.30 + min(WAIT_SHARE * 0.1, MAX_WAIT_S))


def test_rounds_due_later_or_long_overdue_are_not_waited_for():
    arrivals = Arrivals()
    arrived(arrivals, "b", 0.0, 0.2)  # period 0.2 s: due at 0.4, window 0.05 s
    assert arrivals.due({"a"}, 0.30)[0] == set()  # due in 0.1 s: later than its window
    assert arrivals.due({"a"}, 0.36)[0] == {"b"}
    assert arrivals.due({"a"}, 0.44)[0] == {"b"}  # a little late
    assert arrivals.due({"a"}, 0.50)[0] == set()  # finished, or held up elsewhere


def test_a_session_seen_once_or_forgotten_is_not_waited_for():
    arrivals = Arrivals()
    arrived(arrivals, "new", 0.0)  # no period yet
    arrived(arrivals, "gone", 0.0, 0.1)
    arrivals.forget("gone")
    assert arrivals.due({"a"}, 0.2)[0] == set()


def test_a_pause_restarts_the_period():
    arrivals = Arrivals()
    arrived(arrivals, "b", 0.0, 0.1, 0.1 + MAX_PERIOD_S + 1)  # it waited for room, say
    assert arrivals.due({"a"}, 0.2 + MAX_PERIOD_S + 1)[0] == set()
    arrivals.note("b", 0.3 + MAX_PERIOD_S + 1)  # a second round after the pause: a period again
    assert arrivals.due({"a"}, 0.5 + MAX_PERIOD_S + 1)[0] == {"b"}


def test_the_slow_trip_of_a_prefill_is_not_taken_for_the_period():
    arrivals = Arrivals()
    arrivals.note("b", 0.0, steady=False)  # its prefill: many rows, a slow trip
    arrived(arrivals, "b", 0.6, 0.8)  # then steps, 0.2 s a trip
    assert arrivals.due({"a"}, 1.0)[0] == {"b"}
    arrivals.note("b", 1.0, steady=False)  # a replay starts the period over
    assert arrivals.due({"a"}, 1.2)[0] == set()


def test_the_period_follows_the_intervals():
    arrivals = Arrivals()
    arrived(arrivals, "b", 0.0, 0.1)
    for i in range(2, 40):
        arrivals.note("b", 0.1 + (i - 1) * 0.3)  # the ring got slower: 0.3 s a trip
    last = 0.1 + 38 * 0.3
    assert arrivals.due({"a"}, last + 0.3)[0] == {"b"}
    assert arrivals.due({"a"}, last + 0.1)[0] == set()


def test_a_group_is_half_the_sessions_active_here():
    arrivals = Arrivals()
    assert arrivals.group_size(0.0) == 1
    for i, session in enumerate("abcdefg"):
        arrived(arrivals, session, 0.0 + i / 100, 0.1 + i / 100)
    assert arrivals.group_size(0.2) == 4  # seven active: groups of four and three
    assert arrivals.group_size(0.2 + 1.0) == 1  # none came round for ten periods: none active
    assert Arrivals(groups=1).group_size(0.0) == 1
