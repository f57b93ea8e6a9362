"""The Redis Streams transport against a real Redis: groups, acks, pending re-reads, claims."""

import pytest
import redis

from specpipe.swarm import streams


def entries(consumer, **kw):
    return [data for _, data in consumer.read(block_ms=100, **kw)]


def test_keys_name_the_swarm_and_the_host():
    assert streams.stage_key("sw", "wa") == "specpipe:sw:stage:wa"
    assert streams.reply_key("sw", "job-1", "wa") == "specpipe:sw:reply:job-1@wa"


def test_unacked_entries_come_back_to_a_restarted_consumer_first(swarm, redis_url):
    client = redis.Redis.from_url(redis_url)
    key = streams.stage_key(swarm, "h")
    first = streams.StreamConsumer(client, key, "h")
    for i in range(3):
        streams.send(client, key, b"m%d" % i)
    got = first.read(block_ms=100)
    assert [d for _, d in got] == [b"m0", b"m1", b"m2"]
    first.ack([got[0][0]])  # m1 and m2 were being processed when the worker died
    first.flush()

    streams.send(client, key, b"m3")
    again = streams.StreamConsumer(client, key, "h")  # same name: the restarted worker
    assert entries(again) == [b"m1", b"m2"]
    assert entries(again) == [b"m3"]
    assert entries(again) == []
    client.close()


def test_acks_go_out_with_the_next_read_or_a_flush(swarm, redis_url):
    client = redis.Redis.from_url(redis_url)
    key = streams.stage_key(swarm, "h")
    consumer = streams.StreamConsumer(client, key, "h")
    streams.send(client, key, b"a")
    streams.send(client, key, b"b")
    (first, _), (second, _) = consumer.read(block_ms=100)
    consumer.ack([first])
    assert client.xpending(key, streams.GROUP)["pending"] == 2
    assert consumer.read(block_ms=10) == []
    assert client.xpending(key, streams.GROUP)["pending"] == 1
    consumer.ack([second])
    consumer.flush()
    assert client.xpending(key, streams.GROUP)["pending"] == 0
    client.close()


def test_entries_a_dead_consumer_left_are_claimed_by_another(swarm, redis_url):
    client = redis.Redis.from_url(redis_url)
    key = streams.stage_key(swarm, "h")
    dead = streams.StreamConsumer(client, key, "h-old")
    streams.send(client, key, b"left behind")
    assert entries(dead) == [b"left behind"]
    other = streams.StreamConsumer(client, key, "h-new", claim_idle_ms=0)
    assert entries(other) == [b"left behind"]
    pending = client.xpending_range(key, streams.GROUP, "-", "+", 10)
    assert [p["consumer"] for p in pending] == [b"h-new"]
    client.close()


def test_streams_stay_bounded(swarm, redis_url):
    client = redis.Redis.from_url(redis_url)
    key = streams.stage_key(swarm, "h")
    for _ in range(2000):
        streams.send(client, key, b"x", maxlen=100)
    assert 100 <= client.xlen(key) < 300  # approximate trimming keeps whole nodes
    client.close()


def test_a_deleted_stream_is_recreated_with_its_group(swarm, redis_url):
    client = redis.Redis.from_url(redis_url)
    key = streams.stage_key(swarm, "h")
    consumer = streams.StreamConsumer(client, key, "h")
    client.delete(key)
    assert entries(consumer) == []
    streams.send(client, key, b"after")
    assert entries(consumer) == [b"after"]
    client.close()


def test_rewind_rereads_only_what_was_not_processed(swarm, redis_url):
    client = redis.Redis.from_url(redis_url)
    key = streams.stage_key(swarm, "h")
    consumer = streams.StreamConsumer(client, key, "h")
    streams.send(client, key, b"done")
    streams.send(client, key, b"lost")
    (done, _), _ = consumer.read(block_ms=100)
    consumer.ack([done])  # processed; the connection dropped before "lost" was
    consumer.rewind()
    assert entries(consumer) == [b"lost"]
    client.close()


def test_a_link_reconnects_after_its_connection_is_killed(swarm, redis_url):
    client = redis.Redis.from_url(redis_url)
    key = streams.stage_key(swarm, "h")
    link = streams.Link(client)
    streams.send(link, key, b"before")
    # Kill only the link's own connection: the Redis is shared with tests running beside this one.
    client.client_kill_filter(_id=link.call(("CLIENT", "ID"))[0])
    # A send goes out again on a new connection at once (as after a Redis restart)…
    streams.send(link, key, b"after")
    assert [fields[streams.FIELD] for _, fields in client.xrange(key)] == [b"before", b"after"]
    # …while other commands report the lost connection once, and the next call reconnects.
    client.client_kill_filter(_id=link.call(("CLIENT", "ID"))[0])
    with pytest.raises(redis.ConnectionError):
        link.call(("XLEN", key))
    assert link.call(("XLEN", key)) == [2]
    link.close()
    client.close()


def test_a_send_whose_kept_connection_times_out_goes_out_on_a_new_one(
    swarm, redis_url, monkeypatch
):
    """A host back from a link cut longer than its socket's patience writes into a dead socket
    with a full buffer: the write times out. A send goes out again on a new connection at once,
    instead of failing the round and blaming the next hop for being unreachable."""
    client = redis.Redis.from_url(redis_url)
    key = streams.stage_key(swarm, "h")
    link = streams.Link(client)
    streams.send(link, key, b"before")
    dead = link._connection._sock

    class FullBuffer:
        """The kept socket as a long cut leaves it: every write waits out its timeout."""

        def sendall(self, data):
            raise TimeoutError("timed out")

        def __getattr__(self, name):
            return getattr(dead, name)

    monkeypatch.setattr(link._connection, "_sock", FullBuffer())
    streams.send(link, key, b"after")
    assert [fields[streams.FIELD] for _, fields in client.xrange(key)] == [b"before", b"after"]
    assert link._connection._sock is not dead
    link.close()
    client.close()


def test_an_error_reply_leaves_a_link_usable(swarm, redis_url):
    client = redis.Redis.from_url(redis_url)
    key = streams.stage_key(swarm, "h")
    link = streams.Link(client)
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        link.call(streams.xadd_command(key, b"x", 100), ("INCR", key), ("PING",))
    assert link.call(("PING",), ("XLEN", key)) == [b"PONG", 1]  # no reply left over
    link.close()
    client.close()


def test_a_consumer_reads_over_resp3_as_over_resp2(swarm, redis_url):
    client = redis.Redis.from_url(redis_url, protocol=3)
    key = streams.stage_key(swarm, "h")
    consumer = streams.StreamConsumer(client, key, "h")
    streams.send(client, key, b"three")
    assert entries(consumer) == [b"three"]
    client.close()


def dead_letters(client, swarm):
    return client.xrange(streams.dead_key(swarm, "h"))


def test_an_oversized_entry_never_leaves_redis_and_is_dead_lettered(swarm, redis_url):
    client = redis.Redis.from_url(redis_url)
    key = streams.stage_key(swarm, "h")
    consumer = streams.StreamConsumer(
        client, key, "h", max_bytes=1000, dead=streams.dead_key(swarm, "h")
    )
    streams.send(client, key, b"small")
    streams.send(client, key, b"x" * 5000)
    streams.send(client, key, b"after")
    got = consumer.read(block_ms=100)
    assert [d for _, d in got] == [b"small", b"after"]
    assert consumer.dropped == [consumer.dropped[0]] and "5000 bytes" in consumer.dropped[0]
    [(_, letter)] = dead_letters(client, swarm)
    assert letter[b"bytes"] == b"5000" and letter[b"head"] == b"x" * streams.DEAD_HEAD_BYTES
    consumer.ack(entry_id for entry_id, _ in got)
    consumer.flush()
    assert client.xlen(key) == 0 and client.xpending(key, streams.GROUP)["pending"] == 0
    client.close()


def test_an_entry_without_a_message_is_dead_lettered(swarm, redis_url):
    client = redis.Redis.from_url(redis_url)
    key = streams.stage_key(swarm, "h")
    consumer = streams.StreamConsumer(client, key, "h", dead=streams.dead_key(swarm, "h"))
    client.xadd(key, {"other": "field"})
    streams.send(client, key, b"fine")
    assert entries(consumer) == [b"fine"]
    assert "without a message" in consumer.dropped[0]
    assert len(dead_letters(client, swarm)) == 1
    client.close()


def test_an_entry_that_keeps_taking_the_reader_down_is_dead_lettered(swarm, redis_url):
    client = redis.Redis.from_url(redis_url)
    key = streams.stage_key(swarm, "h")
    streams.send(client, key, b"poison")
    streams.send(client, key, b"next")
    # Each "restart" reads its pending entries again and dies before acking the first.
    for _ in range(streams.MAX_DELIVERIES):
        consumer = streams.StreamConsumer(client, key, "h", dead=streams.dead_key(swarm, "h"))
        assert [d for _, d in consumer.read(count=1, block_ms=0)] == [b"poison"]
    consumer = streams.StreamConsumer(client, key, "h", dead=streams.dead_key(swarm, "h"))
    assert entries(consumer) == [b"next"]
    assert f"delivered {streams.MAX_DELIVERIES + 1} times" in consumer.dropped[0]
    client.close()


def test_a_send_wakes_a_reader_waiting_on_the_bell(swarm, redis_url):
    import threading
    import time

    client = redis.Redis.from_url(redis_url)
    key = streams.stage_key(swarm, "h")
    consumer = streams.StreamConsumer(client, key, "h")
    assert consumer.read(block_ms=10) == []  # empty: the reader now waits on the bell
    sender = threading.Timer(0.3, streams.send, (client, key, b"ring"))
    sender.start()
    started = time.monotonic()
    got = consumer.read(block_ms=8000)
    while not got and time.monotonic() - started < 8:
        got = consumer.read(block_ms=8000)
    waited = time.monotonic() - started
    sender.join()  # its send may still be reading Redis's answer on the shared client
    assert [d for _, d in got] == [b"ring"]
    assert waited < 4, f"the reader slept {waited:.1f} s through the bell"
    assert client.llen(streams.bell_key(key)) <= 1
    client.close()


def test_send_all_writes_every_entry_before_ringing_each_bell_once(redis_url, swarm):
    client = redis.Redis.from_url(redis_url)
    key, other = streams.stage_key(swarm, "a"), streams.stage_key(swarm, "b")
    reply = streams.reply_key(swarm, "job", "a")
    writes = []
    link = streams.Link(client)
    call = link.call
    link.call = lambda *commands, **kw: writes.append(commands) or call(*commands, **kw)
    streams.send_all(
        link, [(key, b"a", False), (key, b"b", False), (other, b"c", False), (reply, b"d", True)]
    )
    assert len(writes) == 1
    names = [(c[0], c[1]) for c in writes[0]]
    assert names == [
        ("XADD", key),
        ("XADD", key),
        ("XADD", other),
        ("XADD", reply),
        ("EXPIRE", reply),
        ("LPUSH", streams.bell_key(key)),
        ("LTRIM", streams.bell_key(key)),
        ("LPUSH", streams.bell_key(other)),
        ("LTRIM", streams.bell_key(other)),
    ]
    assert client.xlen(key) == 2 and client.llen(streams.bell_key(key)) == 1
    assert 0 < client.ttl(reply) <= streams.REPLY_TTL_S
    assert client.llen(streams.bell_key(reply)) == 0  # nobody waits on a reply stream's bell
    link.close()
    client.close()
