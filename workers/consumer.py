"""Celery's consumer, made to outlive a broker Redis that dies while jobs run.

On a lost connection Celery 5.7 has kombu `collect()` it, which detaches the connection's
transport from it, and then closes it. With acks-late messages in flight (a coordinator running
jobs), two things then reach for a Redis client through that detached transport and raise
`AttributeError: 'NoneType' object has no attribute 'hostname'`, which Celery counts as
unrecoverable, so the coordinator exits and every job it ran stalls until beat moves it on:

- the close, putting the in-flight messages back on the queue;
- each running job's ack as it ends, sent through the channel it was delivered on.

Here the close cannot take the consumer down, and the transport is attached again once Celery
is done with the connection, so that each ack builds a fresh client to the broker when it is
back. Nothing is lost either way: a message stays in the broker's unacked set until its ack.
"""

from __future__ import annotations

import logging

from celery.worker.consumer import Consumer as CeleryConsumer
from kombu import Connection

log = logging.getLogger("specpipe.coordinator")


class Consumer(CeleryConsumer):
    """The coordinator's consumer (`worker_consumer` in `celery_config`)."""

    def on_connection_error_after_connected(self, exc: Exception) -> None:
        connection = self.connection
        if connection is None:
            super().on_connection_error_after_connected(exc)
            return
        transport = connection.transport
        # Celery calls `connection.close` on the lost connection: this instance's is guarded.
        connection.close = lambda: close_collected(connection)
        super().on_connection_error_after_connected(exc)
        if transport.client is None:
            transport.client = connection  # for the acks still to come through it


def close_collected(connection: Connection) -> None:
    """Close a broker connection that kombu has already collected; a close that fails because
    the connection is detached from its transport is logged, not raised."""
    try:
        Connection.release(connection)
    except AttributeError as exc:
        log.warning("could not close the lost broker connection cleanly (%s); reconnecting", exc)
