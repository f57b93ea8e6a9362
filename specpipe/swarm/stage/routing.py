"""Whether a round was routed to this stage for what it serves.

A round's route names, for each hop, the layers of the model the coordinator routed it for,
taken from the hop's inventory record. In the moments after a re-split a coordinator may still
route by an old record: run here, the round would pass layers twice or skip them, and its
output would be silently different. So before a round's forward the stage compares its own
entry with what it serves, and refuses the round when they differ (a `misrouted` reply naming
what it serves), without running it. A worker without an inventory record (one that tests hand
messages to directly) is routed by host alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from specpipe.swarm import inventory, wire


@dataclass(frozen=True)
class Serves:
    """What a stage serves: layers `layer_start:layer_end` of `model`."""

    model: str
    layer_start: int
    layer_end: int

    @classmethod
    def of(cls, node: inventory.NodeInfo | None) -> Serves | None:
        """What the stage's record says it serves; None without a record."""
        if node is None:
            return None
        return cls(node.model, node.layer_start, node.layer_end)

    def __str__(self) -> str:
        return f"layers {self.layer_start}:{self.layer_end} of {self.model or '(no model)'}"


def misrouted(entry: wire.RouteEntry, serves: Serves | None) -> str | None:
    """Why a round whose route has this stage as `entry` must not run here; None when the
    entry names exactly what the stage serves."""
    if serves is None:
        return None
    routed = Serves(entry.model, entry.layer_start, entry.layer_end)
    if routed == serves:
        return None
    return f"{entry.host} serves {serves}, not {routed}"
