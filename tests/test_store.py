"""The store: migrations on both backends, the schema matching the models, and model helpers."""

from __future__ import annotations

from dataclasses import fields
from datetime import timedelta

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import MetaData, Table, inspect, select

from models import Base, Job
from models.accounts import change_password, disable_user, enable_user
from models.db import UINT64_MAX, get_engine, make_session_factory, utcnow
from models.migrate import current, downgrade, heads, upgrade
from models.nodes import NODE_FIELDS, SNAPSHOT_FIELDS, Node, RunNode, upsert_node
from models.records import PROOF_1_FIELDS, PROOF_2_FIELDS, run_record
from models.runs import start_run
from models.tokens import ApiToken, check_token, create_token, parse_lifetime, revoke_token
from models.user_deletion import delete_user
from models.users import BUILTIN_ADMIN, User, authenticate, builtin_admin, first_password
from specpipe.swarm.inventory import NodeInfo
from tests.factories import finish_elsewhere, gen_job, gen_node, gen_proof_run, gen_ring, gen_user

BEFORE_STOP_STRINGS = "dc866fa56549"  # the revision before jobs had stop strings
LOSSY_FLAG = "ea3906a109e3"  # the revision that gave nodes the test lossy tail's column
BEFORE_NO_LOSSY_FLAG = "b9d5f7a1c3e4"  # the last revision with that column
BEFORE_ACCEPTED_DRAFTS = "ea3906a109e3"  # the revision before jobs.accepted_drafts was named so
BEFORE_NUL_SAFE_TEXT = "3c7e1d52a9f0"  # the revision before output text was stored escaped
BEFORE_USERS = "5d1f0c2b7e4a"  # the revision before users, and owners of jobs and tokens
BEFORE_STARTS_SINCE_PROGRESS = "e6a2c4d8f1b3"  # the revision before jobs counted those starts
BEFORE_DISABLED_AT = "a8c4e6f0b2d3"  # the revision before users could be disabled
BEFORE_TOOLS = "c1e6a8b2d4f5"  # the revision before jobs kept the functions a chat offered
TABLES = {"jobs", "runs", "proofs", "proof_cases", "nodes", "run_nodes", "api_tokens", "users"}


def old_job_row(**fields) -> dict:
    """A finished job's columns as every revision so far has them."""
    now = utcnow()
    return dict(
        created_at=now,
        updated_at=now,
        prompt="old",
        model="tiny-test",
        max_new_tokens=8,
        temp=0.0,
        top_p=1.0,
        top_k=0,
        seed="00000000000000000001",
        seed_was_random=False,
        draft_k=0,
        status="done",
        cancel_requested=False,
        output_text="abc",
        output_ids=[1, 2, 3],
        generated_tokens=3,
        rounds=3,
        **fields,
    )


def test_one_head():
    assert len(heads()) == 1


def test_upgrade_from_empty_and_downgrade_to_base(fresh_database_url):
    url = fresh_database_url
    assert current(url) is None
    upgrade(url)
    assert current(url) == heads()[0]
    assert TABLES <= set(inspect(get_engine(url)).get_table_names())
    downgrade(url, "base")
    assert current(url) is None
    assert not TABLES & set(inspect(get_engine(url)).get_table_names())
    upgrade(url)  # and back up again: the downgrade left nothing behind
    assert current(url) == heads()[0]


def test_models_match_migrated_schema(database_url):
    with get_engine(database_url).connect() as conn:
        context = MigrationContext.configure(conn, opts={"compare_type": True})
        diff = compare_metadata(context, Base.metadata)
    assert diff == []


def test_stop_strings_round_trip_and_default_to_none(db_session):
    stops = ["\n\nUser:", "ende ü", " ", "x" * 64]
    with_stops = gen_job(db_session, stop=stops)
    without = gen_job(db_session)
    db_session.expire_all()
    assert db_session.get(Job, with_stops.id).stop == stops
    assert db_session.get(Job, without.id).stop == []
    assert db_session.get(Job, with_stops.id).params()["stop"] == stops
    assert db_session.get(Job, without.id).to_dict()["stop"] == []


def test_jobs_from_before_stop_strings_read_as_none(fresh_database_url):
    url = fresh_database_url
    upgrade(url, BEFORE_STOP_STRINGS)
    engine = get_engine(url)
    jobs = Table("jobs", MetaData(), autoload_with=engine)
    assert "stop" not in jobs.c
    with engine.begin() as conn:
        conn.execute(jobs.insert().values(**old_job_row(), accepted_per_round=[0, 0, 0]))
    upgrade(url)
    with make_session_factory(url)() as session:
        job = session.scalars(select(Job)).one()
        assert (job.prompt, job.stop, job.output_ids) == ("old", [], [1, 2, 3])
        assert job.accepted_drafts == [0, 0, 0]  # the list keeps its values under its new name
    downgrade(url, BEFORE_STOP_STRINGS)
    assert "stop" not in {c["name"] for c in inspect(engine).get_columns("jobs")}


def test_the_lossy_flag_column_is_dropped_and_a_downgrade_brings_it_back(fresh_database_url):
    url = fresh_database_url
    upgrade(url, LOSSY_FLAG)
    engine = get_engine(url)
    nodes = Table("nodes", MetaData(), autoload_with=engine)
    with engine.begin() as conn:
        conn.execute(nodes.insert().values(host="old.example", role="tail", test_lossy_tail=True))
    upgrade(url, BEFORE_NO_LOSSY_FLAG)
    assert "test_lossy_tail" in {c["name"] for c in inspect(engine).get_columns("nodes")}
    upgrade(url)
    assert "test_lossy_tail" not in {c["name"] for c in inspect(engine).get_columns("nodes")}
    with make_session_factory(url)() as session:
        node = session.scalars(select(Node)).one()
        assert (node.host, node.role) == ("old.example", "tail")  # the row outlives the column
        assert "test_lossy_tail" not in node.to_dict()
    downgrade(url, BEFORE_NO_LOSSY_FLAG)
    nodes = Table("nodes", MetaData(), autoload_with=engine)
    with engine.connect() as conn:
        assert conn.execute(select(nodes.c.host, nodes.c.test_lossy_tail)).all() == [
            ("old.example", False)
        ]


def test_seed_keeps_every_uint64(db_session):
    for seed in (0, 1, 2**63 - 1, 2**63, UINT64_MAX):
        job = gen_job(db_session, seed=seed)
        db_session.expire_all()
        assert db_session.get(Job, job.id).seed == seed
    with pytest.raises(Exception, match="outside"):
        gen_job(db_session, seed=UINT64_MAX + 1)


def test_seed_sorts_numerically(db_session):
    for seed in (10, 9, 2**64 - 1, 100):
        gen_job(db_session, seed=seed)
    seeds = db_session.scalars(select(Job.seed).order_by(Job.seed)).all()
    assert seeds == [9, 10, 100, 2**64 - 1]


def test_cancel_queued_ends_now_running_waits(db_session):
    queued = gen_job(db_session)
    running = gen_job(db_session, status="running")
    done = gen_job(db_session, status="done")
    assert [job.request_cancel() for job in (queued, running, done)] == [True, True, False]
    assert queued.finished_at is not None and running.finished_at is None
    assert (queued.status, queued.cancel_requested) == ("cancelled", True)
    assert (running.status, running.cancel_requested) == ("running", True)
    assert (done.status, done.cancel_requested) == ("done", False)


@pytest.mark.parametrize("status", ["queued", "running"])
def test_a_cancel_never_undoes_an_end_stored_since_the_read(db_session, db_url, status):
    job = gen_job(db_session, status=status)
    assert db_session.get(Job, job.id).status == status  # read here, then ended elsewhere
    finish_elsewhere(db_url, job.id)
    assert job.request_cancel() is False
    db_session.commit()
    db_session.expire_all()
    stored = db_session.get(Job, job.id)
    assert (stored.status, stored.cancel_requested, stored.finished_at is not None) == (
        "done",
        False,
        True,
    )


def test_record_progress(db_session):
    job = gen_job(db_session, status="running")
    job.record_progress([5, 6, 7, 8], "abcd", [2, 0], elapsed_s=2.0)
    db_session.commit()
    assert job.generated_tokens == 4 and job.rounds == 2
    assert job.tok_s == pytest.approx(2.0)
    assert job.accepted_drafts_mean == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("age_s", "status"),
    [(0, "online"), (29, "online"), (31, "stale"), (119, "stale"), (121, "offline")],
)
def test_node_status_from_heartbeat_age(db_session, age_s, status):
    node = gen_node(db_session, "h1", age_s=age_s)
    assert node.status() == status


def test_node_without_heartbeat_is_offline(db_session):
    assert upsert_node(db_session, "h1", role="tail").status() == "offline"


def test_coordinators_snapshotting_the_same_new_node_at_once_do_not_collide(db_url):
    """Jobs side by side write the same nodes at the same moment: one row, no IntegrityError."""
    import threading

    start, errors = threading.Barrier(4), []

    def snapshot(i: int) -> None:
        with make_session_factory(db_url)() as session:
            start.wait()
            try:
                upsert_node(session, "same-host", geo=f"writer {i}", layer_start=i)
                session.commit()
            except Exception as exc:  # what the test is about
                errors.append(exc)

    writers = [threading.Thread(target=snapshot, args=(i,)) for i in range(4)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join()
    assert errors == []
    with make_session_factory(db_url)() as session:
        [node] = session.scalars(select(Node).where(Node.host == "same-host")).all()
        assert node.geo == f"writer {node.layer_start}"


def test_upsert_node_updates_in_place(db_session):
    upsert_node(db_session, "h1", role="stage0", layer_start=0, layer_end=9)
    upsert_node(db_session, "h1", gpu_name="RTX 4090", last_heartbeat=utcnow())
    db_session.commit()
    nodes = db_session.scalars(select(Node)).all()
    assert len(nodes) == 1
    assert (nodes[0].role, nodes[0].layer_end, nodes[0].gpu_name) == ("stage0", 9, "RTX 4090")
    with pytest.raises(ValueError, match="unknown node fields: colour"):
        upsert_node(db_session, "h1", colour="red")


def test_run_snapshot_is_frozen(db_session):
    gen_ring(db_session, 4)
    run = start_run(db_session, model="tiny-test")
    db_session.commit()
    upsert_node(db_session, "host0.example", geo="Elsewhere")
    db_session.commit()
    assert [n.role for n in run.node_snapshots] == ["stage0", "stage1", "stage2", "tail"]
    assert run.node_snapshots[0].geo == "WA"


def test_the_store_keeps_fields_of_the_inventory_record():
    record = {f.name for f in fields(NodeInfo)}
    assert set(NODE_FIELDS) <= record
    assert set(SNAPSHOT_FIELDS) <= record
    assert set(SNAPSHOT_FIELDS) - {"host"} <= set(NODE_FIELDS)


def test_a_run_snapshot_copies_every_column_it_shares_with_the_node(db_session):
    gen_node(db_session, "h1", public_ip="10.0.0.1", geo="WA", gpu_name="RTX 4090", gpu_uuid="u")
    upsert_node(db_session, "h1", memory_bytes=2**40, software_version="1.2.3")
    node = db_session.scalars(select(Node)).one()
    run = start_run(db_session, model="tiny-test")
    db_session.commit()
    [copy] = run.node_snapshots
    shared = set(RunNode.__table__.columns.keys()) & set(Node.__table__.columns.keys()) - {"id"}
    assert {name: getattr(copy, name) for name in shared} == {
        name: getattr(node, name) for name in shared
    }
    assert None not in {getattr(copy, name) for name in shared}


def test_run_record_schema(db_session):
    gen_ring(db_session, 4)
    run = gen_proof_run(db_session)
    run.generation_summary = {"greedy_temp0": {"text": "hi", "tok_s": 4.6}}
    db_session.commit()
    record = run_record(db_session, run.id)
    assert list(record) == [
        "run_id",
        "utc",
        "shard_commit",
        "claim",
        "model",
        "quant",
        "method",
        "proof_1_local_math",
        "proof_2_on_swarm",
        "proof_3_generation",
        "nodes",
        "topology",
    ]
    assert list(record["proof_1_local_math"]) == list(PROOF_1_FIELDS)
    assert list(record["proof_2_on_swarm"]) == list(PROOF_2_FIELDS)
    assert record["proof_1_local_math"]["worst_tv_committed_vs_target"] == 0.011
    assert record["proof_2_on_swarm"]["mean_tv_noise_floor_plain_vs_plain"] == 0.03
    assert record["nodes"][0] == {
        "role": "stage0",
        "layer_range": [0, 9],
        "public_ip": "203.0.113.10",
        "geo": "WA",
        "gpu_uuid": "GPU-00000000-test",
        "gpu_name": "NVIDIA GeForce RTX 4090",
    }
    assert record["topology"] == "WA → MN → NC → NJ → back"
    assert record["utc"].endswith("Z")
    with pytest.raises(LookupError):
        run_record(db_session, run.id + 1000)


def test_tokens_hashed_checked_revoked(db_session):
    plaintext = create_token(db_session, "ci", builtin_admin(db_session))
    db_session.commit()
    from models.tokens import ApiToken

    row = db_session.scalar(select(ApiToken))
    assert plaintext not in row.token_hash and len(row.token_hash) == 64
    assert check_token(db_session, plaintext).name == "ci"
    assert check_token(db_session, plaintext + "x") is None
    with pytest.raises(ValueError, match="already exists"):
        create_token(db_session, "ci", builtin_admin(db_session))
    revoke_token(db_session, "ci")
    db_session.commit()
    assert check_token(db_session, plaintext) is None
    with pytest.raises(LookupError):
        revoke_token(db_session, "nope")


def test_an_expired_token_is_refused(db_session):
    admin = builtin_admin(db_session)
    lasting = create_token(db_session, "lasting", admin)
    brief = create_token(db_session, "brief", admin, timedelta(minutes=90))
    db_session.commit()
    assert check_token(db_session, brief).name == "brief"
    row = db_session.scalar(select(ApiToken).where(ApiToken.name == "brief"))
    row.expires_at = utcnow() - timedelta(seconds=1)
    db_session.commit()
    db_session.expire_all()  # read back from the store, as a later request would
    assert check_token(db_session, brief) is None
    assert check_token(db_session, lasting).name == "lasting"


@pytest.mark.parametrize(
    ("text", "lifetime"),
    [("90m", timedelta(minutes=90)), ("12h", timedelta(hours=12)), (" 30d", timedelta(days=30))],
)
def test_token_lifetimes_read(text, lifetime):
    assert parse_lifetime(text) == lifetime


@pytest.mark.parametrize("text", ["", "30", "0m", "1w", "1.5h", "+3d", "3651d", "9999999d"])
def test_token_lifetimes_refused(text):
    with pytest.raises(ValueError, match="must be"):
        parse_lifetime(text)


def test_a_new_password_revokes_only_that_users_tokens(db_session):
    alice, bob = gen_user(db_session, "alice", "correct horse"), gen_user(db_session, "bob")
    mine = [create_token(db_session, f"alice-{i}", alice) for i in range(2)]
    revoke_token(db_session, "alice-1")
    theirs = create_token(db_session, "bob-ci", bob)
    db_session.commit()
    with pytest.raises(ValueError):
        change_password(db_session, alice, "short")
    assert check_token(db_session, mine[0]) is not None
    assert change_password(db_session, alice, "a different horse") == 1  # one was still active
    db_session.commit()
    db_session.expire_all()
    assert [check_token(db_session, t) for t in mine] == [None, None]
    assert check_token(db_session, theirs).name == "bob-ci"
    assert authenticate(db_session, "alice", "a different horse") == alice


def test_disabling_refuses_login_and_revokes_tokens_for_good(db_session):
    alice, bob = gen_user(db_session, "alice", "correct horse"), gen_user(db_session, "bob")
    mine = [create_token(db_session, f"alice-{i}", alice) for i in range(2)]
    theirs = create_token(db_session, "bob-ci", bob)
    db_session.commit()
    assert disable_user(db_session, alice) == 2
    db_session.commit()
    db_session.expire_all()
    assert alice.disabled and authenticate(db_session, "alice", "correct horse") is None
    assert [check_token(db_session, t) for t in mine] == [None, None]
    assert check_token(db_session, theirs).name == "bob-ci"
    with pytest.raises(ValueError, match="'alice' is already disabled"):
        disable_user(db_session, alice)

    enable_user(db_session, alice)
    db_session.commit()
    db_session.expire_all()
    assert not alice.disabled and authenticate(db_session, "alice", "correct horse") == alice
    assert [check_token(db_session, t) for t in mine] == [None, None]  # still revoked
    with pytest.raises(ValueError, match="'alice' is not disabled"):
        enable_user(db_session, alice)


def test_a_disabled_users_token_is_refused_even_if_not_revoked(db_session):
    alice = gen_user(db_session, "alice")
    token = create_token(db_session, "alice-ci", alice)
    alice.disabled_at = utcnow()  # as if its tokens were not revoked with it
    db_session.commit()
    db_session.expire_all()
    assert check_token(db_session, token) is None
    assert db_session.scalar(select(ApiToken)).revoked_at is None
    alice.disabled_at = None
    db_session.commit()
    assert check_token(db_session, token).name == "alice-ci"


def test_the_last_enabled_admin_cannot_be_disabled(db_session):
    admin, root = builtin_admin(db_session), gen_user(db_session, "root", is_admin=True)
    assert disable_user(db_session, admin) == 0  # root is still an enabled admin
    db_session.commit()
    with pytest.raises(ValueError, match="'root' is the last enabled admin"):
        disable_user(db_session, root)
    db_session.rollback()
    db_session.expire_all()
    assert not root.disabled and admin.disabled
    enable_user(db_session, admin)
    disable_user(db_session, root)
    db_session.commit()
    assert root.disabled and not admin.disabled


def test_session_check_changes_while_disabled_and_after(db_session):
    """A cookie from before a disable stays dead after the enable (it came back to life)."""
    alice = gen_user(db_session, "alice", "correct horse")
    before = alice.session_check
    disable_user(db_session, alice)
    while_disabled = alice.session_check
    assert while_disabled != before
    enable_user(db_session, alice)
    assert alice.session_check not in (before, while_disabled)


def test_history_indexes_exist(database_url):
    names = {ix["name"] for ix in inspect(get_engine(database_url)).get_indexes("jobs")}
    assert {"ix_jobs_created_at", "ix_jobs_status_created_at"} <= names


def test_timestamps_are_utc(db_session):
    job = gen_job(db_session)
    db_session.expire_all()
    from models.db import as_utc

    created = as_utc(db_session.get(Job, job.id).created_at)
    assert abs(created - utcnow()) < timedelta(minutes=1)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:hunter2@h:6379/0", "redis://:***@h:6379/0"),
        ("redis://user:pw@h/1", "redis://user:***@h/1"),
        ("redis://h:6379/0", "redis://h:6379/0"),
        (None, None),
    ],
)
def test_redis_password_redacted(url, shown):
    from specpipe.swarm.redact import redact_url

    assert redact_url(url) == shown


def test_accepted_drafts_is_renamed_both_ways(fresh_database_url):
    url = fresh_database_url
    upgrade(url)
    with make_session_factory(url)() as session:
        gen_job(session, accepted_drafts=[1, 2, 0])
        session.commit()
    downgrade(url, BEFORE_ACCEPTED_DRAFTS)
    engine = get_engine(url)
    jobs = Table("jobs", MetaData(), autoload_with=engine)
    assert "accepted_drafts" not in jobs.c
    with engine.connect() as conn:
        assert conn.execute(select(jobs.c.accepted_per_round)).scalar_one() == [1, 2, 0]
    upgrade(url)
    with make_session_factory(url)() as session:
        assert session.scalars(select(Job)).one().accepted_drafts == [1, 2, 0]


def test_node_fields_that_do_not_fit_are_cut_or_left_unknown(db_session):
    node = upsert_node(
        db_session,
        "h" * 300,
        geo="G" * 500,
        public_ip="1.2.3.4\x00evil",
        memory_bytes=2**70,
        layer_start="0",
        layer_end=2**40,
        gpu_name=12,
    )
    db_session.commit()
    stored = db_session.get(Node, node.id)
    assert stored.host == "h" * 255 and stored.geo == "G" * 200
    assert stored.public_ip == "1.2.3.4evil" and stored.gpu_name == "12"
    assert (stored.memory_bytes, stored.layer_start, stored.layer_end) == (None, None, None)


def test_output_text_from_before_the_escape_reads_back_unchanged(fresh_database_url):
    url = fresh_database_url
    upgrade(url, BEFORE_NUL_SAFE_TEXT)
    engine = get_engine(url)
    jobs = Table("jobs", MetaData(), autoload_with=engine)
    old = "a path C:\\new\\0 and \\\\ two"
    with engine.begin() as conn:
        conn.execute(jobs.insert().values(**old_job_row(accepted_drafts=[0, 0, 0])))
        conn.execute(jobs.update().values(output_text=old))
    upgrade(url)
    with make_session_factory(url)() as session:
        job = session.scalars(select(Job)).one()
        assert (job.output_text, job.attempts) == (old, 0)
        job.output_text = "nul \x00 here"
        session.commit()
    downgrade(url, BEFORE_NUL_SAFE_TEXT)
    with engine.connect() as conn:
        assert conn.execute(select(jobs.c.output_text)).scalar_one() == "nul \ufffd here"


def test_rows_from_before_users_belong_to_the_builtin_admin(fresh_database_url):
    url = fresh_database_url
    upgrade(url, BEFORE_USERS)
    engine = get_engine(url)
    jobs = Table("jobs", MetaData(), autoload_with=engine)
    tokens = Table("api_tokens", MetaData(), autoload_with=engine)
    with engine.begin() as conn:
        conn.execute(jobs.insert().values(**old_job_row(accepted_drafts=[0])))
        conn.execute(tokens.insert().values(name="old", token_hash="0" * 64, created_at=utcnow()))
    upgrade(url)
    with make_session_factory(url)() as session:
        admin = session.scalars(select(User)).one()
        assert (admin.name, admin.is_admin, admin.has_password) == (BUILTIN_ADMIN, True, False)
        assert session.scalars(select(Job)).one().owner.name == BUILTIN_ADMIN
        assert session.scalars(select(ApiToken)).one().user_id == admin.id
        assert authenticate(session, BUILTIN_ADMIN, "") is None  # no usable password yet
    downgrade(url, BEFORE_USERS)
    assert "users" not in inspect(engine).get_table_names()
    assert "user_id" not in {c["name"] for c in inspect(engine).get_columns("jobs")}


def test_jobs_from_before_starts_since_progress_have_made_none(fresh_database_url):
    url = fresh_database_url
    upgrade(url, BEFORE_STARTS_SINCE_PROGRESS)
    engine = get_engine(url)
    jobs = Table("jobs", MetaData(), autoload_with=engine)
    with engine.begin() as conn:
        admin = conn.execute(select(Table("users", MetaData(), autoload_with=engine).c.id))
        row = old_job_row(accepted_drafts=[0], user_id=admin.scalar_one(), attempts=2)
        conn.execute(jobs.insert().values(**{**row, "status": "running"}))
    upgrade(url)
    with make_session_factory(url)() as session:
        job = session.scalars(select(Job)).one()
        assert (job.attempts, job.starts_since_progress) == (2, 0)
    downgrade(url, BEFORE_STARTS_SINCE_PROGRESS)
    assert "starts_since_progress" not in {c["name"] for c in inspect(engine).get_columns("jobs")}


def test_users_from_before_disabled_at_are_enabled(fresh_database_url):
    url = fresh_database_url
    upgrade(url, BEFORE_DISABLED_AT)
    upgrade(url)
    with make_session_factory(url)() as session:
        admin = session.scalars(select(User)).one()
        assert admin.name == BUILTIN_ADMIN and admin.disabled_at is None and not admin.disabled
        assert admin.session_epoch == 0
    downgrade(url, BEFORE_DISABLED_AT)
    columns = {c["name"] for c in inspect(get_engine(url)).get_columns("users")}
    assert not {"disabled_at", "session_epoch"} & columns and "password_hash" in columns


def test_jobs_from_before_tools_offered_none(fresh_database_url):
    url = fresh_database_url
    upgrade(url, BEFORE_TOOLS)
    engine = get_engine(url)
    jobs = Table("jobs", MetaData(), autoload_with=engine)
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    with engine.begin() as conn:
        admin = conn.execute(select(Table("users", MetaData(), autoload_with=engine).c.id))
        row = old_job_row(accepted_drafts=[0], user_id=admin.scalar_one(), messages=chat)
        conn.execute(jobs.insert().values(**row))
    upgrade(url)
    with make_session_factory(url)() as session:
        job = session.scalars(select(Job)).one()
        assert job.messages == chat and job.tools is None
        job.tools = [{"type": "function", "function": {"name": "now", "description": ""}}]
        session.commit()
        session.expire_all()
        assert job.prompt_form()["tools"][0]["function"]["name"] == "now"
    downgrade(url, BEFORE_TOOLS)
    assert "tools" not in {c["name"] for c in inspect(engine).get_columns("jobs")}


def test_users_passwords_and_deletion(db_session):
    alice = gen_user(db_session, "alice", "correct horse")
    assert alice.password_hash.startswith("scrypt:") and "correct horse" not in alice.password_hash
    assert authenticate(db_session, "alice", "correct horse") == alice
    assert authenticate(db_session, "alice", "wrong horse") is None
    assert authenticate(db_session, "nobody", "correct horse") is None
    assert authenticate(db_session, "al\x00ice", "correct horse") is None  # no query with NUL
    with pytest.raises(ValueError, match="already exists"):
        gen_user(db_session, "alice")
    with pytest.raises(ValueError, match="must be 8 to 1024 characters"):
        alice.set_password("short")
    job = gen_job(db_session, owner=alice)
    create_token(db_session, "alice-ci", alice)
    db_session.commit()
    assert delete_user(db_session, "alice") == 1
    db_session.commit()
    db_session.expire_all()
    assert db_session.get(Job, job.id).owner.name == BUILTIN_ADMIN
    assert db_session.scalars(select(ApiToken)).all() == []
    with pytest.raises(ValueError, match="built in"):
        delete_user(db_session, BUILTIN_ADMIN)
    with pytest.raises(LookupError):
        delete_user(db_session, "alice")


def test_first_password_only_while_nobody_can_log_in(db_session):
    assert first_password(db_session, "generated-password-1")
    assert authenticate(db_session, BUILTIN_ADMIN, "generated-password-1") is not None
    assert not first_password(db_session, "generated-password-2")
    assert authenticate(db_session, BUILTIN_ADMIN, "generated-password-2") is None
