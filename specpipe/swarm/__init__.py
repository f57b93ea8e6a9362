"""The ring across hosts: the wire format, Redis streams, the signed node inventory, the
stage worker, its gathering of rounds and its KV budget, and the Redis-backed ring."""
