"""Redis locks held for as long as their process lives, whatever the work takes."""

from __future__ import annotations

import logging
import threading

import redis

log = logging.getLogger("specpipe.locks")


class LockKeeper:
    """Holds a Redis lock while this process does the work, refreshing it from a thread.

    The lock lapses only when the process stops (or cannot reach Redis for a whole lock
    lifetime): a long piece of work never lets a second worker in, and a dead worker's lock
    is gone one lifetime later."""

    def __init__(self, lock: redis.lock.Lock) -> None:
        self.lock = lock
        self._stop = threading.Event()
        self._lost = False
        self._thread = threading.Thread(target=self._refresh, daemon=True)

    def start(self) -> bool:
        """Take the lock (False when another holder has it) and start refreshing it."""
        if not self.lock.acquire(blocking=False):
            return False
        self._thread.start()
        return True

    def owned(self) -> bool:
        """Whether this process still owns the lock."""
        return not self._lost

    def stop(self) -> None:
        """Stop refreshing and release the lock."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        try:
            self.lock.release()
        except redis.RedisError:
            pass  # expired or taken: nothing of ours to release

    def _refresh(self) -> None:
        while not self._stop.wait(self.lock.timeout / 3):
            try:
                self.lock.reacquire()
            except redis.exceptions.LockNotOwnedError:
                # It lapsed (Redis was away): take it again unless someone else has.
                try:
                    self._lost = not self.lock.acquire(blocking=False)
                except redis.RedisError:
                    continue
                if self._lost:
                    return
            except redis.RedisError as exc:
                log.warning("could not refresh the lock %s: %s", self.lock.name, exc)
