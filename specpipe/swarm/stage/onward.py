"""Where a round goes once the stage has run it: the tail samples its logits and replies to the
coordinator, any other stage passes the hidden states to the next hop's stream, at the address
the inventory gives for that host (`stage.directory`); a round that failed is a gap (the stage
lost the session's cache) or an error reply."""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from specpipe.core.ring import GapError, Stage
from specpipe.swarm import streams, wire
from specpipe.swarm.stage.counters import StageStats
from specpipe.swarm.stage.directory import Directory
from specpipe.swarm.stage.keys import StageKeys
from specpipe.swarm.stage.samplers import TailSamplers
from specpipe.swarm.stage.sending import Outbox, Outgoing, Replies

log = logging.getLogger("specpipe.stage")


class Onward:
    """Queues in `outbox` what each round run here sends; remembers the link the rounds last
    crossed (`next_hop`), which the heartbeat measures."""

    def __init__(
        self,
        stage: Stage,
        swarm: str,
        host: str,
        keys: StageKeys,
        samplers: TailSamplers,
        replies: Replies,
        outbox: Outbox,
        stats: StageStats,
        directory: Directory,
    ) -> None:
        self.stage = stage
        self.directory = directory
        self.swarm, self.host = swarm, host
        self.keys = keys
        self.samplers = samplers
        self.replies = replies
        self.outbox = outbox
        self.stats = stats
        # Where this stage's rounds went on to last (host, Redis address): the link it measures.
        self.next_hop: tuple[str, str] | None = None

    def pass_on(self, message: wire.Message, out: torch.Tensor, batch: int = 1) -> None:
        """The tail samples and replies; any other stage sends the hidden states to the next.
        `batch`: the rounds that ran in the forward with this one (the tail says it)."""
        route, hop = message.route, message.hop
        taps = self.with_taps(message)
        if self.stage.last:
            self._features(message.session, taps)
            kind, fields = self.samplers.sample(message, out, self.host, batch)
            self.reply(message, kind, **fields)
        elif hop + 1 >= len(route):
            self.reply(message, "error", reason=f"route ends at {self.host}, not a tail")
        else:
            nxt = route[hop + 1].host
            address = self.directory.address(nxt)
            if address is None:
                self.stats.count("errors")
                reason = f"{self.host}: cannot pass the round to {nxt}: not in the inventory"
                self.reply(message, "unreachable", reason=reason)
                return
            stream = streams.stage_key(self.swarm, nxt)
            if taps is not None:
                out = torch.cat([out, taps.to(out.dtype)], dim=-1)  # [T, (1 + j) x D]
            passed_on = replace(message, tensor=out, hop=hop + 1, to=stream, sender=self.host)
            try:
                data = wire.encode(passed_on, self.swarm, self.keys.ring)
            except wire.WireError as exc:
                self.failed(message, exc)
                return
            self.next_hop = (nxt, address)
            what = f"pass the round to {nxt}"
            self.outbox.put(Outgoing(address, stream, data, message, what))

    def with_taps(self, message: wire.Message) -> torch.Tensor | None:
        """The round's taps so far, for a round that asks for them: those the earlier stages
        sent after the hidden states, then this stage's own (`StageModel.carry_taps`)."""
        if not message.taps:
            return None
        carried = None
        if not self.stage.first and message.tensor is not None:
            _, carried = self.stage.split_taps(message.tensor, message.taps)
        return self.stage.carry_taps(message.session, carried)

    def _features(self, session: str, taps: torch.Tensor | None) -> None:
        """What the tail's drafter drafts from, where it reads taps: this round's, or nothing
        (a round that carried none leaves no stale rows behind)."""
        head = self.samplers.head
        if head is None or not head.taps:
            return
        if taps is None:
            self.stage.features.pop(session, None)
        else:
            self.stage.features[session] = taps

    def failed(self, message: wire.Message, exc: BaseException) -> None:
        """The round could not run here: a gap reply for a lost cache, else an error reply."""
        if isinstance(exc, GapError):
            self.stats.count("gaps")
            self.reply(message, "gap", reason=f"{self.host}: {exc}")
            return
        self.stats.count("errors")
        log.error("%s: round %s failed: %s", self.host, message.round_id, exc)
        self.reply(message, "error", reason=f"{self.host}: {exc}")

    def reply(self, message: wire.Message, kind: str, **fields) -> None:
        """Queue the `kind` reply to `message`'s coordinator."""
        item = self.replies.to(message, kind, **fields)
        if kind == "result":
            self.next_hop = (wire.COORDINATOR, self.replies.url)
        self.outbox.put(item)
