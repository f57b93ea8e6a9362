"""Pages: history paging and filters, the job page and its actions, proofs, nodes, records,
health and metrics."""

from __future__ import annotations

import json
import re

import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import select

from app import create_app
from models.db import as_utc
from models.jobs import Job
from models.runs import start_run
from specpipe.ops.redis_server import free_port
from specpipe.swarm import inventory, streams
from tests.factories import gen_job, gen_node, gen_proof_run, gen_ring
from tests.web.conftest import csrf_token


def history_ids(html: str) -> list[int]:
    return [int(i) for i in re.findall(r'<td><a href="/jobs/(\d+)">', html)]


def test_history_newest_first_25_a_page(client, session):
    jobs = [gen_job(session, prompt=f"p{i}") for i in range(60)]
    first = client.get("/history").get_data(as_text=True)
    assert history_ids(first) == [j.id for j in reversed(jobs)][:25]
    assert "Page 1 of 3" in first and "60 jobs" in first
    third = client.get("/history?page=3").get_data(as_text=True)
    assert history_ids(third) == [j.id for j in reversed(jobs)][50:]
    assert client.get("/history?page=99").status_code == 200
    assert client.get("/history?page=-3").status_code == 200


def test_history_filters_search_sort(client, session):
    gen_job(session, prompt="alpha 100% sure", status="done", tok_s=3.0, generated_tokens=9)
    gen_job(session, prompt="beta_gamma", status="failed", error="boom")
    gen_job(session, prompt="alphabet soup", status="done", tok_s=5.0, generated_tokens=4)
    ids = {j.prompt: j.id for j in session.scalars(select(Job))}
    html = client.get("/history?status=failed").get_data(as_text=True)
    assert history_ids(html) == [ids["beta_gamma"]]
    html = client.get("/history?q=ALPHA").get_data(as_text=True)
    assert sorted(history_ids(html)) == sorted([ids["alpha 100% sure"], ids["alphabet soup"]])
    # % and _ are searched for literally, not as wildcards
    assert history_ids(client.get("/history?q=100%25").get_data(as_text=True)) == [
        ids["alpha 100% sure"]
    ]
    assert history_ids(client.get("/history?q=a_g").get_data(as_text=True)) == [ids["beta_gamma"]]
    fastest = history_ids(client.get("/history?sort=fastest").get_data(as_text=True))
    assert fastest[:2] == [ids["alphabet soup"], ids["alpha 100% sure"]]
    oldest = history_ids(client.get("/history?sort=oldest").get_data(as_text=True))
    assert oldest == sorted(ids.values())
    assert client.get("/history?status=bogus&sort=bogus").status_code == 200


def test_history_shows_columns(client, session):
    gen_job(
        session,
        prompt="cols",
        status="done",
        seed=987654321,
        generated_tokens=12,
        tok_s=4.56,
        accepted_drafts=[2, 3, 1],
        rounds=3,
        draft_k=3,
        temp=0.5,
        top_p=0.9,
        top_k=7,
    )
    html = client.get("/history").get_data(as_text=True)
    # Tokens per round: 12 tokens in 3 rounds.
    for text in ("987654321", ">12<", "4.6", "4.00", "T 0.50 · p 0.90 · k 7 · K 3", "done"):
        assert text in html


def test_job_page_and_progress(client, session):
    gen_ring(session, 2)
    job = gen_job(session, status="running", seed=5)
    job.run = start_run(session, model="tiny-test")
    job.record_progress([1, 2, 3], "The cat", [1, 2], elapsed_s=1.5)
    session.commit()
    html = client.get(f"/jobs/{job.id}").get_data(as_text=True)
    for text in (
        "The cat",
        "Run again with this seed",
        "Cancel",
        "host0.example",
        "layers 0–17",
        f"/runs/{job.run_id}/record.json",
        "data-progress-url",
    ):
        assert text in html
    progress = client.get(f"/jobs/{job.id}/progress").get_json()
    assert (progress["generated_tokens"], progress["output_text"], progress["rounds"]) == (
        3,
        "The cat",
        2,
    )
    assert progress["tok_s"] == pytest.approx(2.0)
    assert progress["queue"] is None
    assert client.get("/jobs/424242").status_code == 404
    assert client.get("/jobs/424242/progress").status_code == 404


def test_the_ring_panel_follows_the_job_in_the_json_the_page_polls(client, session):
    """The job page redraws its Ring panel from the JSON it polls: a job opened while queued
    shows its ring once it has run, without a reload."""
    job = gen_job(session)
    session.commit()
    html = client.get(f"/jobs/{job.id}").get_data(as_text=True)
    assert 'id="job-ring" hidden' in html and "Not assigned to a ring yet." in html
    assert client.get(f"/jobs/{job.id}/progress").get_json()["ring"] == {
        "stages": [],
        "record_url": None,
        "empty": "Not assigned to a ring yet.",
    }

    gen_ring(session, 2)
    job.run = start_run(session, model="tiny-test")
    job.status = "done"
    session.commit()
    ring = client.get(f"/jobs/{job.id}/progress").get_json()["ring"]
    assert ring == {
        "stages": [
            {"role": "stage0", "host": "host0.example", "layers": "0–17", "geo": "WA"},
            {"role": "tail", "host": "host1.example", "layers": "18–35", "geo": "MN"},
        ],
        "record_url": f"/runs/{job.run_id}/record.json",
        "empty": None,
    }
    html = client.get(f"/jobs/{job.id}").get_data(as_text=True)
    assert "Not assigned to a ring yet." not in html and 'id="job-ring-empty" hidden' in html

    never_ran = gen_job(session, status="cancelled")
    session.commit()
    assert client.get(f"/jobs/{never_ran.id}/progress").get_json()["ring"]["empty"] == (
        "Did not run on a ring."
    )


def test_new_job_page_names_where_drafts_come_from(client):
    """Drafts come from the n-gram drafter and the tail's draft head
    (`specpipe.decoding.generation`), and the page says both."""
    lede = " ".join(client.get("/").get_data(as_text=True).split('class="lede">')[1].split())
    assert "n-gram drafter" in lede and "the tail's learned draft head" in lede
    assert "an n-gram drafter proposes tokens" not in lede


def test_a_queued_job_shows_its_place_in_line(client, session, api_token):
    first, second = gen_job(session), gen_job(session)
    session.commit()
    html = client.get(f"/jobs/{second.id}").get_data(as_text=True)
    position = html.split('id="job-queue-position">', 1)[1].split("<", 1)[0]
    size = html.split('id="job-queue-size">', 1)[1].split("<", 1)[0]
    assert (position, size) == ("2", "2")
    assert client.get(f"/jobs/{first.id}/progress").get_json()["queue"] == {
        "position": 1,
        "queued": 2,
    }
    first.status = "running"
    session.commit()
    headers = {"Authorization": f"Bearer {api_token}"}
    assert client.get(f"/api/v1/jobs/{second.id}", headers=headers).get_json()["queue"] == {
        "position": 1,
        "queued": 1,
    }
    assert 'id="job-queue" hidden' in client.get(f"/jobs/{first.id}").get_data(as_text=True)


def test_job_page_shows_stop_strings_quoted(client, session):
    job = gen_job(session, stop=["\n\nUser:", "<b>"])
    html = client.get(f"/jobs/{job.id}").get_data(as_text=True)
    shown = html[html.index('id="job-stop"') :].split("</dd>")[0]
    assert "<code>&#34;\\n\\nUser:&#34;</code>" in shown
    assert "<code>&#34;&lt;b&gt;&#34;</code>" in shown
    none = gen_job(session)
    html = client.get(f"/jobs/{none.id}").get_data(as_text=True)
    assert 'id="job-stop"><span class="muted">none</span>' in html


def test_job_page_shows_failure_reason(client, session):
    job = gen_job(session, status="failed", error="stage host2 went away")
    html = client.get(f"/jobs/{job.id}").get_data(as_text=True)
    assert "stage host2 went away" in html


def test_cancel_from_page(client, session, queue):
    job = gen_job(session, status="running")
    response = client.post(f"/jobs/{job.id}/cancel", data={"csrf_token": csrf_token(client)})
    assert response.status_code == 302
    session.expire_all()
    assert session.get(Job, job.id).cancel_requested is True


@pytest.mark.parametrize("status", ["queued", "running"])
def test_a_cancel_from_the_page_leaves_a_job_that_finished_since_the_read_done(
    client, session, finished_after_load, status
):
    import app.jobs

    job = gen_job(session, status=status)
    finished_after_load(app.jobs, "_get_job")
    response = client.post(f"/jobs/{job.id}/cancel", data={"csrf_token": csrf_token(client)})
    assert response.status_code == 302
    page = client.get(response.headers["Location"]).get_data(as_text=True)
    assert "has already finished (done)" in page and "Cancel requested" not in page
    session.expire_all()
    stored = session.get(Job, job.id)
    assert (stored.status, stored.cancel_requested) == ("done", False)


def test_rerun_with_same_seed(client, session, queue):
    job = gen_job(
        session,
        status="done",
        seed=2**64 - 2,
        prompt="again",
        temp=1.1,
        top_k=3,
        stop=["\n\nUser:", "END"],
        sampler="icdf",
    )
    response = client.post(f"/jobs/{job.id}/rerun", data={"csrf_token": csrf_token(client)})
    assert response.status_code == 302
    new = session.scalars(select(Job).where(Job.id != job.id)).one()
    assert new.params() == job.params() and new.prompt == "again"
    assert new.stop == ["\n\nUser:", "END"] and new.sampler == "icdf"  # not the default
    assert new.seed_was_random is False and new.status == "queued"
    assert queue.job_ids() == [new.id]


def test_proofs_pages_and_plots(client, session):
    gen_ring(session, 4)
    manual = gen_proof_run(session)
    nightly = gen_proof_run(session, kind="nightly", passed=False)
    html = client.get("/proofs/").get_data(as_text=True)
    assert manual.name in html and nightly.name in html and "nightly" in html
    detail = client.get(f"/proofs/{nightly.id}").get_data(as_text=True)
    assert "T=1.3 p=0.8 k=10" in detail and "stop 3" in detail and "badge-fail" in detail
    pngs = re.findall(r'src="(/proofs/plots/[^"]+\.png)"', detail)
    assert len(pngs) == 2 + 3  # a TV plot per proof, a histogram per stop
    for url in pngs:
        response = client.get(url)
        assert response.status_code == 200 and response.mimetype == "image/png"
        assert response.data[:8] == b"\x89PNG\r\n\x1a\n" and len(response.data) > 5000
    assert client.get("/proofs/99999").status_code == 404
    assert client.get("/proofs/plots/99999/tv.png").status_code == 404
    local_case = nightly.proofs[0].cases[0]
    assert client.get(f"/proofs/plots/cases/{local_case.id}.png").status_code == 404


def test_proofs_page_empty(client):
    assert "No proof runs yet" in client.get("/proofs/").get_data(as_text=True)


def test_nodes_page(client, session):
    gen_ring(session, 4)
    gen_node(session, "late.example", age_s=60, role="stage9")
    gen_node(session, "gone.example", age_s=600, role="stage8")
    html = client.get("/nodes/").get_data(as_text=True)
    assert html.count('class="ring-node status-online"') == 4
    assert "status-stale" in html and "status-offline" in html
    assert "WA → MN → NC → gone.example → late.example → NJ → back" in html
    assert "<svg" in html
    assert "24.0 GiB" in html and "GPU-00000003-test" in html


def test_run_record_download(client, session):
    gen_ring(session, 2)
    run = gen_proof_run(session)
    response = client.get(f"/runs/{run.id}/record.json")
    assert response.status_code == 200
    assert "attachment" in response.headers["Content-Disposition"]
    record = json.loads(response.data)
    assert record["run_id"] == run.name and record["nodes"][1]["role"] == "tail"
    assert client.get("/runs/99999/record.json").status_code == 404


def test_healthz(client, app):
    response = client.get("/healthz")
    assert response.status_code == 200
    assert response.get_json() == {"status": "ok", "database": "ok", "redis": "ok"}
    app.config["REDIS_URL"] = "redis://127.0.0.1:1/0"
    response = client.get("/healthz")
    assert response.status_code == 503 and response.get_json()["redis"].startswith("error")


def test_metrics(client, session):
    gen_job(session, status="done", generated_tokens=10, tok_s=4.0, accepted_drafts=[1, 3])
    gen_job(session, status="done", generated_tokens=20, tok_s=6.0, accepted_drafts=[2])
    gen_job(session, status="queued")
    gen_ring(session, 2)
    gen_node(session, "old.example", age_s=500)
    response = client.get("/metrics")
    assert response.content_type == "text/plain; version=0.0.4; charset=utf-8"
    text = response.get_data(as_text=True)
    for line in (
        'specpipe_jobs{status="done"} 2.0',
        'specpipe_jobs{status="queued"} 1.0',
        "specpipe_tokens_generated_total 30.0",
        "specpipe_tokens_per_second 5.0",
        "specpipe_accepted_per_round 2.0",
        'specpipe_nodes{status="online"} 2.0',
        'specpipe_nodes{status="offline"} 1.0',
        "# TYPE specpipe_jobs gauge",
        "# TYPE specpipe_tokens_generated_total counter",
        "# HELP specpipe_nightly_failures_total Nightly regression runs that failed or errored.",
    ):
        assert line in text.splitlines(), line
    assert "_created" not in text


def scrape(client) -> dict[str, tuple[str, dict]]:
    """/metrics parsed: each family's type and its samples, {sample name and labels: value}."""
    text = client.get("/metrics").get_data(as_text=True)
    return {
        family.name: (
            family.type,
            {(s.name, tuple(sorted(s.labels.items()))): s.value for s in family.samples},
        )
        for family in text_string_to_metric_families(text)
    }


def test_metrics_parse_as_prometheus_text(app, client, session):
    for status, tokens, speed, accepted in [
        ("done", 7, 3.0, [4, 4]),
        ("done", 5, 9.0, [1]),
        ("failed", 2, None, []),
        ("running", 1, 2.5, []),
        ("running", 0, 1.5, []),
    ]:
        gen_job(
            session,
            status=status,
            generated_tokens=tokens,
            tok_s=speed,
            accepted_drafts=accepted,
        )
    gen_node(session, "a.example", age_s=1)
    gen_node(session, "b.example", age_s=60)
    gen_proof_run(session, kind="nightly", passed=True)
    failed = gen_proof_run(session, kind="nightly", passed=False)

    def by_status(name: str, values: dict[str, float]) -> dict:
        return {(name, (("status", s),)): v for s, v in values.items()}

    metrics = scrape(client)
    jobs = {"queued": 0, "running": 2, "done": 2, "failed": 1, "cancelled": 0}
    assert metrics == {
        "specpipe_jobs": ("gauge", by_status("specpipe_jobs", jobs)),
        # the parser names a counter's family without `_total`; its sample keeps it
        "specpipe_tokens_generated": (
            "counter",
            {("specpipe_tokens_generated_total", ()): 15.0},
        ),
        "specpipe_tokens_per_second": ("gauge", {("specpipe_tokens_per_second", ()): 6.0}),
        "specpipe_accepted_per_round": ("gauge", {("specpipe_accepted_per_round", ()): 3.0}),
        "specpipe_queue_depth": ("gauge", {("specpipe_queue_depth", ()): 0.0}),
        "specpipe_active_sessions": ("gauge", {("specpipe_active_sessions", ()): 2.0}),
        "specpipe_running_tokens_per_second": (
            "gauge",
            {("specpipe_running_tokens_per_second", ()): 4.0},
        ),
        "specpipe_nodes": (
            "gauge",
            by_status("specpipe_nodes", {"online": 1, "stale": 1, "offline": 0}),
        ),
        "specpipe_nightly_last_verdict": ("gauge", {("specpipe_nightly_last_verdict", ()): 0.0}),
        "specpipe_nightly_last_run_timestamp_seconds": (
            "gauge",
            {
                ("specpipe_nightly_last_run_timestamp_seconds", ()): pytest.approx(
                    as_utc(failed.created_at).timestamp()
                )
            },
        ),
        "specpipe_nightly_failures": (
            "counter",
            {("specpipe_nightly_failures_total", ()): 1.0},
        ),
        # no stage of the test's swarm in the live inventory: the families, without samples
        "specpipe_stage_rounds": ("counter", {}),
        "specpipe_stage_forwards": ("counter", {}),
        "specpipe_stage_batch_size": ("gauge", {}),
        "specpipe_stage_forward_ms": ("gauge", {}),
        "specpipe_stage_kept_prefix_tokens": ("gauge", {}),
        "specpipe_stage_prefix_hits": ("counter", {}),
        "specpipe_stage_prefix_misses": ("counter", {}),
    }
    # Each app has its own registry: a second app on the same store reads the same numbers.
    other = create_app({**app.config, "TESTING": True})
    assert other.extensions["specpipe.metrics"] is not app.extensions["specpipe.metrics"]
    assert scrape(other.test_client()) == metrics


def test_metrics_give_each_verified_stage_its_counters_and_batch_size(app, client, monkeypatch):
    """Per-stage numbers come from each stage's own Redis, for verified inventory records only;
    a stage whose Redis is down is left out, not an error."""
    swarm, key = app.config["SWARM"], "the swarm key"
    monkeypatch.setenv("SPECPIPE_SWARM_KEY", key)
    # No coordinator key pinned: the shared-key mode, opted into out loud.
    monkeypatch.setenv("SPECPIPE_INSECURE_SHARED_KEY", "1")
    registry = redis.Redis.from_url(app.config["REDIS_URL"])
    url = app.config["REDIS_URL"]
    try:
        inventory.publish(registry, swarm, inventory.NodeInfo("wa", 0, 2, url), key)
        inventory.publish(registry, swarm, inventory.NodeInfo("nj", 2, 4, url), key)
        inventory.publish(registry, swarm, inventory.NodeInfo("tx", 2, 4, url), "forged key")
        down = inventory.NodeInfo("mn", 0, 2, f"redis://127.0.0.1:{free_port()}/0")
        inventory.publish(registry, swarm, down, key)
        stats = {"processed": 12, "forwards": 4, "batch_size": 2.5, "forward_ms": 3.25}
        stats.update(kept_tokens=640, prefix_hits=3, prefix_misses=1)
        registry.hset(streams.stats_key(swarm, "nj"), mapping=stats)
        registry.hset(streams.stats_key(swarm, "tx"), mapping=stats)
        idle = {"processed": 0, "forwards": 0, "batch_size": 0.0, "forward_ms": 0.0}
        registry.hset(streams.stats_key(swarm, "wa"), mapping=idle)
        metrics = scrape(client)
    finally:
        registry.delete(*(inventory.node_key(swarm, host) for host in ("wa", "nj", "tx", "mn")))
        for host in ("nj", "tx", "wa"):
            registry.delete(streams.stats_key(swarm, host))
        registry.close()
    assert metrics["specpipe_stage_rounds"][1] == {
        ("specpipe_stage_rounds_total", (("host", "nj"),)): 12.0,
        ("specpipe_stage_rounds_total", (("host", "wa"),)): 0.0,
    }
    assert metrics["specpipe_stage_forwards"][1] == {
        ("specpipe_stage_forwards_total", (("host", "nj"),)): 4.0,
        ("specpipe_stage_forwards_total", (("host", "wa"),)): 0.0,
    }
    assert metrics["specpipe_stage_batch_size"][1] == {
        ("specpipe_stage_batch_size", (("host", "nj"),)): 2.5
    }
    assert metrics["specpipe_stage_forward_ms"][1] == {
        ("specpipe_stage_forward_ms", (("host", "nj"),)): 3.25
    }
    assert metrics["specpipe_stage_kept_prefix_tokens"][1] == {
        ("specpipe_stage_kept_prefix_tokens", (("host", "nj"),)): 640.0
    }
    assert metrics["specpipe_stage_prefix_hits"][1] == {
        ("specpipe_stage_prefix_hits_total", (("host", "nj"),)): 3.0
    }
    assert metrics["specpipe_stage_prefix_misses"][1] == {
        ("specpipe_stage_prefix_misses_total", (("host", "nj"),)): 1.0
    }


def test_unknown_page_is_friendly_404(client):
    response = client.get("/no/such/page")
    assert response.status_code == 404 and "<!doctype html>" in response.get_data(as_text=True)


def test_static_assets_served(client):
    for name in ("style.css", "app.js", "favicon.svg"):
        assert client.get(f"/static/{name}").status_code == 200


def test_a_gpt_oss_chat_job_shows_its_reasoning_and_its_answer_apart(
    client, api, session, tmp_path, monkeypatch
):
    """The job page and the job's JSON give harmony's channels apart; a raw prompt's job, or
    any other model's, shows its text as generated."""
    from tests.harmony_checkpoint import write_checkpoint

    model = str(write_checkpoint(tmp_path / "oss", monkeypatch))
    generated = (
        "<|channel|>analysis<|message|>User says <b>hi</b>.<|end|><|start|>assistant"
        "<|channel|>final<|message|>Hello there.<|return|>"
    )
    chat = gen_job(session, model=model, status="done", output_text=generated)
    html = client.get(f"/jobs/{chat.id}").get_data(as_text=True)
    assert re.search(r'id="job-reasoning">User says &lt;b&gt;hi&lt;/b&gt;\.</pre>', html)
    assert re.search(r'id="job-output">Hello there\.</pre>', html)
    assert "<|" not in html.split('id="job-prompt"')[1].split("</section>")[0]
    state = client.get(f"/jobs/{chat.id}/progress").get_json()
    assert state["reply"] == {
        "reasoning": "User says <b>hi</b>.",
        "content": "Hello there.",
        "calls": [],
    }
    assert state["output_text"] == generated  # the record keeps the text as generated
    assert api.get(f"/jobs/{chat.id}").get_json()["reply"] == state["reply"]
    assert "reply" not in api.get("/jobs").get_json()["jobs"][0]  # one job's reads only

    assert re.search(r'<div id="job-calls" hidden>', html)
    # A reply that calls a function shows the call apart.
    calling = (
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"city":"Paris"}<|call|>'
    )
    called = gen_job(session, model=model, status="done", output_text=calling)
    html = client.get(f"/jobs/{called.id}").get_data(as_text=True)
    assert 'id="job-calls-text">get_weather({&#34;city&#34;:&#34;Paris&#34;})</pre>' in html
    assert re.search(r'id="job-output"></pre>', html)
    state = client.get(f"/jobs/{called.id}/progress").get_json()
    assert state["reply"]["calls"] == [
        {"name": "get_weather", "arguments": '{"city":"Paris"}', "done": True}
    ]

    raw = gen_job(session, model=model, status="done", output_text=generated, raw_prompt=True)
    other = gen_job(session, status="done", output_text=generated)  # a model that cannot open
    for job in (raw, other):
        html = client.get(f"/jobs/{job.id}").get_data(as_text=True)
        assert 'id="job-reasoning"' not in html
        assert "&lt;|channel|&gt;analysis" in html
        assert client.get(f"/jobs/{job.id}/progress").get_json()["reply"] is None
