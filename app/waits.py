"""The bound on open completions: how many /v1 completions, streamed or waiting for their job,
one web process holds at once (`OPEN_COMPLETIONS`) and how many of them one user may hold
(`OPEN_COMPLETIONS_PER_USER`).

Each open completion holds one of the server's threads for as long as its job takes, and
`specpipe web` runs one thread per allowed completion on top of the threads for everything else,
so pages, logins and the JSON API always find a free thread. A completion beyond either bound is
refused at once (a 429) rather than queued behind the others.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable

from flask import Flask, current_app

EXTENSION = "specpipe.open_completions"
RETRY_AFTER_S = 5  # a hint: nobody knows when another completion ends


class TooManyOpen(Exception):
    """Every place for an open completion is taken, the site's or the user's."""

    retry_after_s = RETRY_AFTER_S


class OpenCompletions:
    """Counts the open completions of one process, in all and per user."""

    def __init__(self, total: int, per_user: int) -> None:
        self.total, self.per_user = total, per_user
        self._lock = threading.Lock()
        self._by_user: Counter[int] = Counter()

    def open(self, user_id: int) -> Callable[[], None]:
        """Take a place for `user_id`; returns the call that gives it back (once, however
        often it is called). Raises TooManyOpen when there is none."""
        with self._lock:
            if self._by_user[user_id] >= self.per_user:
                raise TooManyOpen(
                    f"too many open completions: at most {self.per_user} at once per user; "
                    "try again when one has ended"
                )
            if sum(self._by_user.values()) >= self.total:
                raise TooManyOpen(
                    f"the server is holding its {self.total} open completions; try again soon"
                )
            self._by_user[user_id] += 1
        released = threading.Event()

        def close() -> None:
            with self._lock:
                if released.is_set():
                    return
                released.set()
                self._by_user[user_id] -= 1
                if self._by_user[user_id] <= 0:
                    del self._by_user[user_id]

        return close

    def held(self) -> int:
        """Open completions now, all users together."""
        with self._lock:
            return sum(self._by_user.values())


def init_app(app: Flask) -> None:
    """Give `app` its bound, from `OPEN_COMPLETIONS` and `OPEN_COMPLETIONS_PER_USER`."""
    app.extensions[EXTENSION] = OpenCompletions(
        app.config["OPEN_COMPLETIONS"], app.config["OPEN_COMPLETIONS_PER_USER"]
    )


def open_completions() -> OpenCompletions:
    """The app's bound on open completions."""
    return current_app.extensions[EXTENSION]
