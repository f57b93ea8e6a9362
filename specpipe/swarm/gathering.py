"""Which sessions a stage waits for before it runs a forward.

A stage batches the rounds it finds waiting in its stream: rows of several sessions cost about
what one session's cost. But rounds that arrive one at a time never meet. With several sessions
on a ring the stages are busy and the sessions spread out around it, each a few milliseconds
behind the one before, and a stage that runs what it has at once runs one or two sessions a
forward: 8 jobs at once ran 1.2 to 1.7 rounds per forward.

So a stage learns when each session's next round is due. A session's rounds come back to a
stage once per trip around the ring, so each arrives about one period after the last one
(`Arrivals.note` keeps the last arrival and a running mean of the interval, started over after
a prefill, whose slow trip would have the mean wrong for many rounds). When a forward is
about to run, the sessions not in it whose next round is due within a short window
(`WAIT_SHARE` of their period, at most `MAX_WAIT_S`) are waited for, polling the stream, until
they arrive or the window closes. A session overdue by more than its window (finished, or held
up elsewhere) is not waited for, and a session alone on the ring never waits. Once two sessions
have run in one forward they leave together, arrive together at the next stage (a batch's
messages are sent in one write, see `streams.send_all`) and here on their next trip: they stay
gathered, and the wait is paid once, when they meet, not on every round. A forward gathers at
most half the sessions active here (`GROUPS`), so they travel in two groups.
"""

from __future__ import annotations

from collections import OrderedDict

WAIT_SHARE = 0.25  # of a session's period: how early a due round is waited for, and how late
MAX_WAIT_S = 0.05  # the longest a forward waits for the rounds due
POLL_S = 0.001  # between reads of the stream while waiting
PERIOD_WEIGHT = 0.3  # of the latest interval in a session's running mean period
MAX_PERIOD_S = 5.0  # a longer interval is a pause (the job waited for room, or a replay)
MAX_SESSIONS = 1024  # sessions whose arrivals are kept
# Sessions gather into this many groups. One group leaves all but one stage idle while it is
# at that stage; with two, a stage works on one while the other is elsewhere on the ring. On
# 4 stage processes sharing 2 cores, 8 jobs at once ran 23.9 and 26.6 tok/s in two groups of
# 4 against 23.1 and 20.9 in one of 8 at 25 ms a hop, 29.7 and 38.8 against 29.6 and 28.5 at
# 0 ms (and 18.8 to 27.0 without gathering).
GROUPS = 2


class Arrivals:
    """When each session's rounds arrive at one stage, and when its next one is due."""

    def __init__(self, groups: int = GROUPS) -> None:
        self.groups = groups
        # session -> (monotonic time of its last round, mean interval or None before a second,
        # whether that round was a steady step)
        self._seen: OrderedDict[str, tuple[float, float | None, bool]] = OrderedDict()

    def note(self, session: str, now: float, steady: bool = True) -> None:
        """A round of `session` arrived at `now`. Only an interval between two `steady` rounds
        (one committed token each) counts: a prefill or a replay carries many rows, its trip is
        slow, and the interval it begins says nothing of the next ones; it starts the session's
        period over."""
        last, period, was_steady = self._seen.pop(session, (None, None, False))
        if not steady:
            period = None
        elif last is not None and was_steady:
            interval = now - last
            if interval > MAX_PERIOD_S:
                period = None
            elif period is None:
                period = interval
            else:
                period += PERIOD_WEIGHT * (interval - period)
        self._seen[session] = (now, period, steady)
        while len(self._seen) > MAX_SESSIONS:
            self._seen.popitem(last=False)

    def forget(self, session: str) -> None:
        """`session` ended here: none of its rounds is due any more."""
        self._seen.pop(session, None)

    def group_size(self, now: float) -> int:
        """The most sessions one forward gathers: the sessions active here (a round within
        their last two periods) shared among `groups` groups."""
        active = sum(
            1
            for last, period, _ in self._seen.values()
            if now - last <= (2 * period if period else MAX_PERIOD_S)
        )
        return max(1, -(-active // self.groups))

    def due(self, present: set[str], now: float) -> tuple[set[str], float]:
        """The sessions other than `present` whose next round is due within their window of
        `now`, and until when to wait for them (`now` when there are none)."""
        awaited, wait = set(), MAX_WAIT_S
        for session, (last, period, _) in self._seen.items():
            if period is None or session in present:
                continue
            window = min(WAIT_SHARE * period, MAX_WAIT_S)
            if abs(last + period - now) <= window:
                awaited.add(session)
                wait = min(wait, window)
        return awaited, now + wait if awaited else now
