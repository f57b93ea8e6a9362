"""Handing a stage worker its messages directly, without its stream."""

from __future__ import annotations

from specpipe.swarm.stage.worker import StageWorker


def handle(worker: StageWorker, *entries: bytes | None) -> None:
    """Act on `entries` as if one read of the worker's stream had returned them (admitted,
    batched and answered as `serve_once` does them), without the stream: no wait for other
    sessions' rounds, no ack."""
    worker.process(worker.admit(list(entries)), worker.batcher.size())
