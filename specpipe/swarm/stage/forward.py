"""The forward: a round's input rows through the stage, or the rounds of several sessions as
one forward (`Stage.forward_many`), each output then passed on as it would be alone. A round
routed here for what this stage does not serve is refused before it (`stage.routing`)."""

from __future__ import annotations

import logging
import time

import torch

from specpipe.core.ring import BatchedStage, Request, Stage
from specpipe.swarm import wire
from specpipe.swarm.stage.counters import StageStats
from specpipe.swarm.stage.onward import Onward
from specpipe.swarm.stage.routing import Serves, misrouted

log = logging.getLogger("specpipe.stage")


class Forward:
    """Runs admitted rounds through `stage` and hands each output (or failure) to `onward`."""

    def __init__(
        self,
        stage: Stage,
        host: str,
        stats: StageStats,
        onward: Onward,
        serves: Serves | None = None,
    ) -> None:
        self.stage = stage
        self.batched = isinstance(stage, BatchedStage)  # its forward_many takes draft trees
        self.host = host
        self.stats = stats
        self.onward = onward
        self.serves = serves  # what the stage's record says it serves; None: no record

    def run(self, rounds: list[wire.Message]) -> None:
        """One round alone, or several sessions' rounds as one forward; timed either way."""
        if len(rounds) == 1:
            started = time.perf_counter()
            forward_s = self.round(rounds[0])
            if forward_s is not None:
                self.stats.time_round(time.perf_counter() - started, forward_s)
        elif rounds:
            self.rounds(rounds)

    def round(self, message: wire.Message) -> float | None:
        """Run one round and pass it on; the forward's seconds, or None if it did not run."""
        inputs = self.inputs(message)
        if inputs is None:
            return None
        try:
            forward_started = time.perf_counter()
            out = self._forward_one(self._request(message, inputs))
            forward_s = time.perf_counter() - forward_started
        except Exception as exc:  # a bad round must not take the stage down
            self.onward.failed(message, exc)
            return None
        self.stats.note_batch(1)
        self.onward.pass_on(message, out)
        return forward_s

    def rounds(self, messages: list[wire.Message]) -> None:
        """Rounds of different sessions as one forward, each then passed on as it would alone."""
        started = time.perf_counter()
        ready = [(m, x) for m in messages if (x := self.inputs(m)) is not None]
        if not ready:
            return
        requests = [self._request(m, x) for m, x in ready]
        try:
            outs = self.stage.forward_many(requests)
        except Exception:  # the batch as a whole: each round alone, with its own error
            log.exception(
                "%s: a batch of %d rounds failed; running them one by one", self.host, len(ready)
            )
            for message, _ in ready:
                self.round(message)
            return
        forward_s = time.perf_counter() - started
        self.stats.note_batch(len(ready))
        for (message, _), out in zip(ready, outs, strict=True):
            if isinstance(out, BaseException):
                self.onward.failed(message, out)
            else:
                self.onward.pass_on(message, out, len(ready))
                self.stats.time_round(time.perf_counter() - started, forward_s)

    def inputs(self, message: wire.Message) -> torch.Tensor | None:
        """A round's input rows, or None when the round is not one to run (dropped, counted)."""
        route, hop = message.route, message.hop
        if not route or route[hop].host != self.host:
            self.stats.drop(f"round {message.round_id!r} is not addressed to {self.host}")
            return None
        if (reason := misrouted(route[hop], self.serves)) is not None:
            self.stats.count("misrouted")
            log.warning("%s: refused round %s: %s", self.host, message.round_id, reason)
            self.onward.reply(message, "misrouted", reason=reason)
            return None
        if not message.tokens or message.n_draft >= len(message.tokens):
            self.stats.drop(f"round {message.round_id!r} has {len(message.tokens)} tokens")
            return None
        if self.stage.first:
            return torch.tensor(message.tokens, dtype=torch.int64)
        if message.tensor is None or message.tensor.dim() != 2:
            self.stats.drop(f"round {message.round_id!r} carries no hidden states")
            return None
        if not message.taps:
            return message.tensor
        try:  # the hidden states first, then the earlier stages' taps (`Onward.with_taps`)
            rows, _ = self.stage.split_taps(message.tensor, message.taps)
        except (AttributeError, ValueError) as exc:
            self.stats.drop(f"round {message.round_id!r}: {exc}")
            return None
        return rows

    def _request(self, message: wire.Message, inputs: torch.Tensor) -> Request:
        last_rows = message.n_draft + 1 if self.stage.last else None
        return Request(
            message.session,
            inputs,
            message.start_pos,
            last_rows,
            message.parents,
            message.keep,
            message.taps,
        )

    def _forward_one(self, request: Request) -> torch.Tensor:
        """One request through the stage: as a batch of one where the stage batches (the only
        forward that takes a draft tree), else its plain `forward`."""
        if self.batched:
            (out,) = self.stage.forward_many([request])
            if isinstance(out, BaseException):
                raise out
            return out
        if request.parents is not None or request.keep:
            raise ValueError("this stage runs no draft trees")
        return self.stage.forward(
            request.session, request.inputs, request.start_pos, request.last_rows
        )
