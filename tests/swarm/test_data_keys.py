"""Data keys a revoked host does not get: each epoch's key is sealed to every admitted host's
sealing key, a revocation seals the next one to the others only, and the previous epoch's key
stays accepted for a grace period only."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import redis
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from specpipe import settings as settings_module
from specpipe.ops import roster
from specpipe.settings import DEFAULT_HEARTBEAT_S as HEARTBEAT_S
from specpipe.swarm import datakeys, identity, streams, wire
from specpipe.swarm.identity import COORDINATOR, IdentityError
from tests.swarm.conftest import host_keyring
from tests.swarm.test_host_identity import round_for
from tests.swarm.test_redis_ring import PARAMS, drive, reference

KEY = b"k" * 32


def test_a_copy_opens_only_for_its_key_name_swarm_and_epoch():
    mine, other = X25519PrivateKey.generate(), X25519PrivateKey.generate()
    data_key = b"d" * 32
    copy_ = datakeys.seal_copy(data_key, mine.public_key(), "s", "a", 3)
    assert datakeys.open_copy(copy_, mine, "s", "a", 3) == data_key
    assert datakeys.seal_copy(data_key, mine.public_key(), "s", "a", 3) != copy_  # ephemeral
    flipped = bytearray(bytes.fromhex(copy_))
    flipped[40] ^= 1
    for blob, key, swarm, name, epoch in [
        (copy_, other, "s", "a", 3),  # another host's key
        (flipped.hex(), mine, "s", "a", 3),  # tampered
        (copy_, mine, "s", "a", 4),  # moved to another epoch
        (copy_, mine, "s", "b", 3),  # moved to another host
        (copy_, mine, "t", "a", 3),  # moved to another swarm
        (copy_[:-2], mine, "s", "a", 3),  # cut short
        ("zz" * 80, mine, "s", "a", 3),  # not hex
    ]:
        with pytest.raises(IdentityError) as refused:
            datakeys.open_copy(blob, key, swarm, name, epoch)
        assert data_key.hex() not in str(refused.value)


@pytest.fixture
def swarm_keys():
    """The coordinator and hosts a, b and c, each with a signing and a sealing key; a roster
    admitting all three, with the first data key epoch."""
    names = (COORDINATOR, "a", "b", "c")
    signers = {
        n: identity.Signer(n, identity.Ed25519PrivateKey.generate(), X25519PrivateKey.generate())
        for n in names
    }
    admitted = identity.Roster("s", 0, {})
    for name in names[1:]:
        me = signers[name]
        admitted = admitted.admitting(name, me.public_hex, identity.public_hex(me.sealing))
    admitted = datakeys.sealed_for_new_hosts(admitted, signers[COORDINATOR].sealing)
    assert admitted.epoch.number == 1 and set(admitted.epoch.copies) == set(names)
    return signers, admitted


def ring(signers, admitted, name: str) -> wire.Keyring:
    pin = signers[COORDINATOR].key.public_key()
    return wire.Keyring([KEY], signer=signers[name], coordinator=pin, roster=admitted)


def test_messages_are_sealed_under_the_epochs_key_not_the_swarm_key(swarm_keys):
    signers, admitted = swarm_keys
    a = ring(signers, admitted, "a")
    assert a.epoch == 1 and a.sealing_key not in (None, KEY)
    data = wire.encode(round_for("b", "a", hop=1), "s", a)
    assert wire.decode(data, "s", ring(signers, admitted, "b")).sender == "a"
    # What holds the swarm key alone (an old process, a revoked host's) cannot open it.
    with pytest.raises(wire.UnknownKeyError):
        wire.decode(data, "s", wire.Keyring([KEY]))
    # A process without a copy of the epoch's key seals nothing and opens nothing.
    outsider = ring(signers, replace(admitted, epoch=replace(admitted.epoch, copies={})), "a")
    with pytest.raises(wire.WireError, match="no copy of data key epoch 1"):
        wire.encode(round_for("b", "a", hop=1), "s", outsider)
    with pytest.raises(wire.UnknownKeyError):
        wire.decode(data, "s", outsider)
    # Only the current epoch's key seals: a copy of the previous one's alone opens, never seals.
    rotated = datakeys.rotated(admitted, signers[COORDINATOR].sealing, grace_s=60)
    behind = ring(signers, replace(rotated, epoch=replace(rotated.epoch, copies={})), "b")
    assert behind.sealing_key is None and wire.decode(data, "s", behind).sender == "a"


def test_a_revoked_host_opens_nothing_sealed_after_the_rotation(swarm_keys):
    signers, admitted = swarm_keys
    coordinator = signers[COORDINATOR].sealing
    before = wire.encode(round_for("c", "a", hop=1), "s", ring(signers, admitted, "a"))
    rotated = datakeys.rotated(admitted.revoking("c"), coordinator, grace_s=60)
    assert rotated.epoch.number == 2 and set(rotated.epoch.copies) == {COORDINATOR, "a", "b"}
    assert set(rotated.previous.copies) == {COORDINATOR, "a", "b"}
    after = wire.encode(round_for("b", "a", hop=1), "s", ring(signers, rotated, "a"))
    assert wire.decode(after, "s", ring(signers, rotated, "b")).sender == "a"

    # Everything c held: its private keys, every copy in every roster it could read, the swarm
    # key and the data key it opened before. It opens what was sealed before, nothing after.
    c = signers["c"]
    held = [wire.Keyring([KEY])]
    for seen in (admitted, rotated):
        held.append(ring(signers, seen, "c"))
        for name, copy_ in [
            *seen.epoch.copies.items(),
            *(seen.previous or seen.epoch).copies.items(),
        ]:
            for number in (1, 2):
                try:
                    key = datakeys.open_copy(copy_, c.sealing, "s", name, number)
                except IdentityError:
                    continue
                held.append(wire.Keyring([key]))
    assert any(_opens(before, keys) for keys in held)  # what it already saw
    assert not any(_opens(after, keys) for keys in held)


def _opens(data: bytes, keys: wire.Keyring) -> bool:
    try:
        wire._unseal(wire._sized(data, wire.MAX_MESSAGE_BYTES), keys)
    except wire.WireError:
        return False
    return True


def test_the_previous_epoch_is_accepted_for_its_grace_period_only(swarm_keys):
    signers, admitted = swarm_keys
    in_flight = wire.encode(round_for("b", "a", hop=1), "s", ring(signers, admitted, "a"))
    rotated = datakeys.rotated(admitted, signers[COORDINATOR].sealing, grace_s=30)
    b = ring(signers, rotated, "b")
    assert wire.decode(in_flight, "s", b).sender == "a"  # sealed before b took the rotation
    kid = in_flight[4:8]
    assert b.get(kid, now=time.time() + 29) and b.get(kid, now=time.time() + 31) is None
    assert b.get(b.sealing_id, now=time.time() + 10**6)  # the current one has no deadline
    # A roster read after the deadline opens no previous key at all; a rotation without a
    # grace keeps none, and the one before the previous is dropped at the next rotation.
    late = ring(
        signers, replace(rotated, previous=replace(rotated.previous, until=time.time())), "b"
    )
    with pytest.raises(wire.UnknownKeyError):
        wire.decode(in_flight, "s", late)
    assert datakeys.rotated(admitted, signers[COORDINATOR].sealing, grace_s=0).previous is None
    third = datakeys.rotated(rotated, signers[COORDINATOR].sealing, grace_s=30)
    assert (third.epoch.number, third.previous.number) == (3, 2)


def test_the_roster_carries_the_epochs_signed_and_no_data_key_in_clear(swarm_keys):
    signers, admitted = swarm_keys
    rotated = datakeys.rotated(admitted, signers[COORDINATOR].sealing, grace_s=30)
    stored = rotated.signed(signers[COORDINATOR])
    pin = signers[COORDINATOR].key.public_key()
    assert identity.Roster.verified(stored, "s", pin) == rotated
    for name in ("a", COORDINATOR):
        for key, _ in datakeys.open_epochs(rotated, name, signers[name].sealing):
            assert key.hex() not in stored
    # A copy swapped between hosts in a forged roster is refused by the signature first, and
    # would not open for the other host anyway.
    swapped = stored.replace(rotated.epoch.copies["a"], rotated.epoch.copies["b"])
    with pytest.raises(IdentityError, match="not signed"):
        identity.Roster.verified(swapped, "s", pin)


def test_the_swarm_key_seals_until_every_admitted_host_has_a_sealing_key(swarm_keys):
    signers, _ = swarm_keys
    coordinator = signers[COORDINATOR].sealing
    older = identity.Roster("s", 1, {"a": signers["a"].public_hex, "b": signers["b"].public_hex})
    older = older.admitting("a", signers["a"].public_hex, identity.public_hex(signers["a"].sealing))
    assert datakeys.sealed_for_new_hosts(older, coordinator).epoch is None
    assert ring(signers, older, "a").sealing_key == KEY  # as before
    with pytest.raises(IdentityError, match="no sealing key for b"):
        datakeys.rotated(older, coordinator, grace_s=0)


def test_a_coordinator_whose_sealing_key_was_made_again_starts_a_new_epoch(swarm_keys):
    signers, admitted = swarm_keys
    d = X25519PrivateKey.generate()
    joined = admitted.admitting("d", signers["a"].public_hex, identity.public_hex(d))
    made_again = X25519PrivateKey.generate()  # its old copies no longer open
    sealed = datakeys.sealed_for_new_hosts(joined, made_again)
    assert sealed.epoch.number == 2 and set(sealed.epoch.copies) == {
        COORDINATOR,
        "a",
        "b",
        "c",
        "d",
    }
    assert datakeys.open_epochs(sealed, COORDINATOR, made_again)


def host_0(tmp_path, redis_url, swarm):
    """Host 0's instance folder with hosts a, b and c admitted (their keys in it too), and the
    settings of this swarm's processes there."""
    home = tmp_path / "instance"
    client = redis.Redis.from_url(redis_url)
    roster.admit_own_hosts(client, swarm, ["a", "b", "c"], home)
    client.close()
    pin = (home / settings_module.COORDINATOR_PUB_FILE).read_text().strip()
    config = settings_module.Settings.from_env().for_swarm(
        redis_url, swarm, KEY, coordinator_public_key=pin
    )
    return home, replace(config, home=home)


def test_host_revoke_rotates_and_only_the_remaining_hosts_read_on(tmp_path, redis_url, swarm):
    home, config = host_0(tmp_path, redis_url, swarm)
    for name in ("a", "b"):
        path = settings_module.host_key_path(name, home)
        assert settings_module.sealing_key_path(path).stat().st_mode & 0o777 == 0o600
    c_before = host_keyring(config, "c")
    client = redis.Redis.from_url(redis_url)
    roster.revoke(client, swarm, "c", home)
    client.close()
    a, b, c = (host_keyring(config, name) for name in ("a", "b", "c"))
    coordinator = host_keyring(config, COORDINATOR)
    assert a.epoch == b.epoch == coordinator.epoch == c_before.epoch + 1
    data = wire.encode(round_for("b", "a", hop=1), swarm, a)
    for reader in (b, coordinator):
        assert wire.decode(data, swarm, reader).sender == "a"
    for reader in (c, c_before, wire.Keyring([KEY])):
        with pytest.raises(wire.UnknownKeyError):
            wire.decode(data, swarm, reader)
    # Admitted again under new keys, a host gets the next epoch, not the current one's key.
    fresh = X25519PrivateKey.generate()
    client = redis.Redis.from_url(redis_url)
    signing = identity.public_hex(identity.load_private(settings_module.host_key_path("a", home)))
    again = roster.admit(client, swarm, "a", signing, identity.public_hex(fresh), home)
    client.close()
    assert again.epoch.number == a.epoch + 1 and "a" in again.epoch.copies


def test_on_stage_processes_jobs_run_on_after_a_revocation_the_revoked_host_cannot_read(
    identified, swarm, redis_url
):
    """b2, a spare of b, is revoked while serving: the data keys rotate, a job runs on through
    a and b with the same tokens, and every message it sends b is sealed under a key that
    nothing b2 held, before or after, opens."""
    from tests.swarm.test_attacks import Tap

    stages, settings, home = identified
    for host, layers in (("a", "0:2"), ("b", "2:4"), ("b2", "2:4")):
        stages.start(host, layers, redis_url, wait=False)
    stages.wait_ready(["a", "b", "b2"])
    b2_held = host_keyring(settings, "b2")
    client = redis.Redis.from_url(redis_url)
    roster.revoke(client, swarm, "b2", home)
    client.close()
    tap = Tap(redis_url, streams.stage_key(swarm, "b"))
    try:
        ring = trust_ring(settings)
        assert ring.keys.epoch == b2_held.epoch + 1
        ring.reset("s", PARAMS)
        assert drive(ring, "s", rounds=4, k=3)[0] == reference([(0, 2), (2, 4)], rounds=4, k=3)[0]
        ring.drop("s")
        ring.close()
        assert tap.seen
        b = host_keyring(settings, "b")
        held = [b2_held, host_keyring(settings, "b2"), wire.Keyring([settings.swarm_key])]
        for data in tap.seen:  # every round a passed to b after the revocation
            assert _opens(data, b)
            assert not any(_opens(data, keys) for keys in held)
    finally:
        tap.close()


def trust_ring(settings):
    from specpipe.swarm.redis_ring import RedisRing

    return RedisRing.from_inventory(settings, "toy", 4, timeout_s=20)


def test_a_rotation_mid_job_loses_no_round(identified, swarm, redis_url):
    """Two rotations while a job runs: after the first the coordinator seals a round under the
    previous epoch (still accepted) and meets the new one in its reply, after the second it is
    ahead of the stages (each takes the new epoch when it meets it). The job ends with the
    tokens of an undisturbed run, and no round waits for a resend."""
    from specpipe.decoding.generation import Generation
    from tests.swarm.test_redis_ring import PROMPT, ReferenceRing

    stages, settings, home = identified
    for host, layers in (("a", "0:2"), ("b", "2:4")):
        stages.start(host, layers, redis_url, wait=False)
    stages.wait_ready(["a", "b"])
    options = dict(max_new_tokens=40, draft_k=3)
    expected = Generation(ReferenceRing([(0, 2), (2, 4)]), "l", PROMPT * 2, PARAMS, **options).run()
    ring = trust_ring(settings)
    first = ring.keys.epoch
    client = redis.Redis.from_url(redis_url)
    run = Generation(ring, "s", PROMPT * 2, PARAMS, **options)
    slowest, last, epochs = 0.0, time.monotonic(), []
    for i, _ in enumerate(run.rounds()):
        slowest = max(slowest, time.monotonic() - last)
        epochs.append(ring.keys.epoch)
        if i == 2:  # the stages take the new epoch, the ring seals on under the previous one
            roster.rotate(client, swarm, home)
            ring._roster_due = time.monotonic() + 60
            time.sleep(4 * HEARTBEAT_S)
        if i == 6:  # the ring takes the next one at once, before the stages beat
            roster.rotate(client, swarm, home)
            ring._roster_due = 0.0
        last = time.monotonic()
    client.close()
    ring.close()
    assert run.generated == expected
    # Round 3 went out under the previous epoch; the tail's result, under the new one, had the
    # ring read the roster at once.
    assert epochs[2:4] == [first, first + 1] and epochs[-1] == first + 2
    assert slowest < 1.0, slowest  # a round that waited for a resend takes seconds


def test_a_stage_meeting_an_unknown_key_reloads_whatever_its_housekeeping_did():
    """On main the housekeeping's reload (every 0.5 s) held off the one an unknown key asks for
    (1 s), so a stage running with `reload_keys` dropped every round sealed under a data key
    newer than its roster until its next heartbeat."""
    from specpipe.swarm.stage.keys import StageKeys

    keys = StageKeys(KEY, "a", reload_keys=lambda: wire.Keyring([KEY]))
    keys.reload()  # the housekeeping's
    assert keys.reload_due()  # the first unknown key reloads at once
    assert not keys.reload_due()  # the next within KEY_RELOAD_S does not


def test_host_0s_beat_rotates_once_the_epoch_is_old_enough(tmp_path, redis_url, swarm, monkeypatch):
    from workers.node_sync import rotate_when_due

    home, config = host_0(tmp_path, redis_url, swarm)
    client = redis.Redis.from_url(redis_url)
    pin = identity.pinned((home / settings_module.COORDINATOR_PUB_FILE).read_text())[0]
    made = identity.read_roster(client, swarm, pin)[0].epoch
    assert not datakeys.due(identity.read_roster(client, swarm, pin)[0], 60, now=made.made + 59)
    rotate_when_due(client, config)  # a day by default: not yet
    assert identity.read_roster(client, swarm, pin)[0].epoch == made
    monkeypatch.setenv("SPECPIPE_DATA_KEY_EPOCH_S", "0.001")
    time.sleep(0.01)
    rotate_when_due(client, config)
    rotated = identity.read_roster(client, swarm, pin)[0]
    assert rotated.epoch.number == made.number + 1 and rotated.previous.number == made.number
    assert set(rotated.epoch.copies) == {COORDINATOR, "a", "b", "c"}
    monkeypatch.setenv("SPECPIPE_DATA_KEY_EPOCH_S", "0")  # never
    rotate_when_due(client, config)
    assert identity.read_roster(client, swarm, pin)[0] == rotated
    client.close()


def test_changes_of_the_roster_on_host_0_wait_for_each_other(tmp_path, redis_url, swarm):
    """The beat's rotation and an operator's `host revoke` at once: each reads the roster and
    stores the next version, so without the lock one would undo the other (a revoked host
    admitted again, with the next epoch's key)."""
    import threading

    home, config = host_0(tmp_path, redis_url, swarm)
    done = threading.Event()

    def revoke_c():
        client = redis.Redis.from_url(redis_url)
        roster.revoke(client, swarm, "c", home)
        client.close()
        done.set()

    with roster.changing(swarm, home):
        revoking = threading.Thread(target=revoke_c)
        revoking.start()
        assert not done.wait(0.3)  # it waits for the change under way
    revoking.join(10)
    assert done.is_set() and "c" not in host_keyring(config, COORDINATOR).roster.hosts


def test_of_what_each_host_holds_only_the_epochs_data_key_is_held_by_another(
    tmp_path, redis_url, swarm
):
    """Every key each host holds for the data plane (its key files, the data keys it opens from
    the roster, all it could take from the registry): the admitted hosts share the current
    epoch's data key (and the previous one's while it is accepted), which a ring needs, and
    nothing else; the revoked host shares nothing it can get now. (The passwords a host logs in
    to the others' Redis with are derived per pair: tests/swarm/test_peering.py; a host that
    joins by invitation holds no swarm key: tests/lab/test_invite.py.)"""
    home, config = host_0(tmp_path, redis_url, swarm)
    client = redis.Redis.from_url(redis_url)
    roster.revoke(client, swarm, "c", home)
    client.close()

    def held(name: str) -> set[bytes]:
        path = settings_module.host_key_path(name, home)
        files = {path.read_bytes(), settings_module.sealing_key_path(path).read_bytes()}
        keys = host_keyring(config, name)
        opened = datakeys.open_epochs(keys.roster, name, keys.signer.sealing)
        return files | {key for key, _ in opened}

    a, b, c = held("a"), held("b"), held("c")
    coordinator = host_keyring(config, COORDINATOR)
    signer = coordinator.signer
    epochs = {k for k, _ in datakeys.open_epochs(coordinator.roster, COORDINATOR, signer.sealing)}
    assert len(epochs) == 2 and len(a) == len(b) == 4  # two key files, two epochs' data keys
    assert a & b == epochs
    assert not (c & a) and not (c & b) and len(c) == 2  # its own key files, nothing else
