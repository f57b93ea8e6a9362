"""The web UI in a real headless Chromium: log in, submit a job, watch it update, find it in
history, open the proofs and nodes pages, log out. Screenshots go to test-artifacts/ for people
to look at. The Content-Security-Policy must not block anything the pages use.

Chromium is Debian's (`apt-get install -y chromium`, which `make test` tries); Playwright drives
it through `executable_path`, so no browser is ever downloaded.
"""

from __future__ import annotations

import os
import secrets
import threading
import uuid
from pathlib import Path

import pytest
from werkzeug.serving import make_server

from models.db import make_session_factory, utcnow
from models.jobs import Job
from models.runs import start_run
from specpipe.swarm.kvbudget import Full, room_name
from tests.dbfixtures import backend_name
from tests.factories import gen_job, gen_node, gen_proof_run, gen_ring, gen_user

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "web"
PASSWORD = "browser test secret"

pytestmark = pytest.mark.skipif(
    not os.access(CHROMIUM, os.X_OK),
    reason=f"{CHROMIUM} is missing: apt-get install -y chromium",
)


@pytest.fixture
def server(app):
    """The app served over HTTP on a free port in a background thread."""
    httpd = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_port}"
    httpd.shutdown()
    thread.join(timeout=5)


@pytest.fixture(scope="module")
def browser():
    """One headless Chromium for the module."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser, server, session):
    """A fresh desktop-sized page, logged in as alice through the login form; any message the
    Content-Security-Policy writes to the console fails the test."""
    gen_user(session, "alice", PASSWORD)
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    page = context.new_page()
    blocked = []
    page.on("console", lambda m: blocked.append(m.text) if "Security Policy" in m.text else None)
    page.goto(server + "/history")
    page.wait_for_url("**/login?next=/history")
    page.fill("#f-username", "alice")
    page.fill("#f-password", PASSWORD)
    shot(page, "00-login")
    page.click("button[type=submit]")
    page.wait_for_url("**/history")
    assert page.text_content("#whoami").strip() == "alice"
    yield page
    context.close()
    assert blocked == []


def shot(page, name: str) -> None:
    """Save a full-page screenshot as a test artifact, CSS transitions run to their end."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = str(ARTIFACTS / f"{backend_name()}-{name}.png")
    page.screenshot(path=path, full_page=True, animations="disabled")


def submit_job(page, server: str, prompt: str) -> int:
    """Fill in and send the form; return the new job's id from the job page's URL."""
    page.goto(server + "/")
    page.fill("#f-prompt", prompt)
    page.fill("#f-max_new_tokens", "24")
    page.fill("#f-temp", "0.7")
    page.fill("#f-seed", "31337")
    shot(page, "01-submit")
    page.click("button:has-text('Generate')")
    page.wait_for_url("**/jobs/*")
    return int(page.url.rsplit("/", 1)[1])


def test_submit_watch_history_proofs_nodes(server, page, session, queue):
    prompt = "The <b>quick</b> brown fox"
    job_id = submit_job(page, server, prompt)
    assert queue.job_ids() == [job_id]
    assert page.text_content("#job-prompt") == prompt  # shown as text, not markup
    assert page.text_content("#job-status .badge") == "queued"
    assert page.text_content("#job-seed").startswith("31337")
    assert page.is_visible("#job-queue") and page.text_content("#job-queue-position") == "1"

    # Write progress the way the coordinator does; the page must follow without a reload.
    gen_ring(session, 4)
    job = session.get(Job, job_id)
    job.run = start_run(session, model="tiny-test")
    job.status, job.started_at = "running", utcnow()
    job.record_progress(list(range(10)), "jumps over the lazy dog", [3, 2, 4], elapsed_s=2.0)
    session.commit()
    # Functions, not expression strings: Playwright evaluates a string with eval, which the
    # page's Content-Security-Policy (rightly) forbids.
    page.wait_for_function("() => document.getElementById('stat-tokens').textContent === '10'")
    assert page.text_content("#job-output") == "jumps over the lazy dog"
    assert page.text_content("#job-status .badge") == "running"
    assert page.is_hidden("#job-queue")
    assert page.locator("#rounds-strip span").count() == 3
    heights = page.locator("#rounds-strip span").evaluate_all("s => s.map(e => e.style.height)")
    assert all(h.endswith("%") for h in heights), heights
    assert page.text_content("#stat-per-round") == "3.33"  # 10 tokens in 3 rounds
    # The Ring panel follows too: the run's ring, where the page said it had none.
    page.wait_for_function("() => document.querySelectorAll('#job-ring li').length === 4")
    assert page.is_hidden("#job-ring-empty") and page.is_visible("#job-ring-record")
    assert page.text_content("#job-ring li:last-child") == "tail host3.example layers 27–35 · NJ"
    shot(page, "02-job-running")
    job.status, job.finished_at = "done", utcnow()
    job.record_progress(
        list(range(24)), "jumps over the lazy dog. The end.", [3, 2, 4, 4], elapsed_s=4.0
    )
    session.commit()
    page.wait_for_function(
        "() => document.querySelector('#job-status .badge').textContent === 'done'"
    )
    assert page.text_content("#stat-toks") == "6.0"
    assert page.is_hidden("#cancel-form")
    assert page.text_content("#job-started").endswith("UTC")
    page.reload()
    assert page.locator(".ring-list li").count() == 4
    assert page.eval_on_selector("#progress-bar", "e => e.style.width") == "100%"
    shot(page, "03-job-done")

    page.click("text=Run again with this seed")
    page.wait_for_url(lambda url: not url.endswith(f"/jobs/{job_id}"))
    rerun_id = int(page.url.rsplit("/", 1)[1])
    assert page.text_content("#job-seed").startswith("31337")
    assert page.text_content("#job-prompt") == prompt
    assert queue.job_ids() == [job_id, rerun_id]

    page.click("nav >> text=History")
    assert page.locator("#history tbody tr", has_text="quick").count() == 2  # and its rerun
    row = page.locator(f'#history tbody tr:has(a[href="/jobs/{job_id}"])')
    assert row.count() == 1
    assert "done" in row.inner_text().lower() and "31337" in row.inner_text()
    shot(page, "04-history")
    page.fill("input[name=q]", "no such prompt")
    page.click("form.filters button")
    page.wait_for_url("**/history?q=no+such+prompt*")
    page.wait_for_selector(".card.empty")
    assert page.locator("#history").count() == 0
    assert "No jobs match" in page.text_content(".card.empty")

    page.click("text=Log out")
    page.wait_for_url("**/login")
    page.goto(server + f"/jobs/{job_id}")
    assert page.url == f"{server}/login?next=/jobs/{job_id}"


def test_a_job_waiting_for_room_says_so_until_it_runs(server, page, session, queue, rooms, holders):
    job_id = submit_job(page, server, "a long story")
    lock = holders("lock")
    rooms.mark_waiting(room_name(job_id), lock, Full("stage-b.example", 900, 1000), 160)
    # The page follows the wait without a reload, as it does the queue.
    page.wait_for_function("() => !document.getElementById('job-room').hidden")
    assert page.text_content("#job-room") == (
        "Waiting for room: stage stage-b.example holds 900 of 1000 tokens of KV cache; "
        "this job needs 160."
    )
    assert page.is_visible("#job-queue")
    shot(page, "11-job-waiting-for-room")
    rooms.client.delete(lock)  # its coordinator died: the lock lapsed
    page.wait_for_function("() => document.getElementById('job-room').hidden")

    lock = holders("next-lock")  # another coordinator took the job, and waits too
    rooms.mark_waiting(room_name(job_id), lock, Full("stage-a.example", 700, 800), 160)
    page.wait_for_function(
        "() => document.getElementById('job-room-host').textContent === 'stage-a.example'"
    )
    assert page.is_visible("#job-room") and page.text_content("#job-room-used") == "700"

    # Its room is free: the coordinator clears the wait and runs the job.
    rooms.clear_waiting(room_name(job_id))
    job = session.get(Job, job_id)
    job.status, job.started_at = "running", utcnow()
    session.commit()
    page.wait_for_function(
        "() => document.querySelector('#job-status .badge').textContent === 'running'"
    )
    assert page.is_hidden("#job-room") and page.is_hidden("#job-queue")
    page.reload()
    assert page.is_hidden("#job-room")


def test_a_gpt_oss_chat_job_shows_its_reasoning_then_its_answer_as_they_are_written(
    server, page, session, tmp_path, monkeypatch
):
    from sqlalchemy import select

    from models.users import User
    from tests.harmony_checkpoint import write_checkpoint

    model = str(write_checkpoint(tmp_path / "oss", monkeypatch))
    alice = session.scalars(select(User).where(User.name == "alice")).one()
    reasoning = "<|channel|>analysis<|message|>User says hi. Keep it short."
    job = gen_job(session, alice, model=model, status="running", output_text=reasoning)
    page.goto(f"{server}/jobs/{job.id}")
    assert page.text_content("#job-reasoning") == "User says hi. Keep it short."
    assert page.text_content("#job-output") == ""
    job.record_progress(
        list(range(12)),
        reasoning + "<|end|><|start|>assistant<|channel|>final<|message|>Hello there.<|return|>",
        [1] * 12,
        elapsed_s=2.0,
    )
    session.commit()
    page.wait_for_function("() => document.getElementById('job-output').textContent !== ''")
    assert page.text_content("#job-output") == "Hello there."
    assert page.text_content("#job-reasoning") == "User says hi. Keep it short."
    shot(page, "05-gpt-oss-reasoning")


def test_form_errors_shown(server, page, session, queue):
    page.goto(server + "/")
    page.fill("#f-prompt", "   ")
    page.fill("#f-top_p", "1.5")
    page.fill("#f-seed", "-4")
    page.click("button:has-text('Generate')")
    # The re-rendered form, not the old one mid-navigation.
    page.wait_for_selector("text=Prompt is empty")
    assert "Prompt is empty" in page.content()
    assert "Top-p must be above 0 and at most 1" in page.content()
    assert "Seed must be between 0 and 2^64-1" in page.content()
    shot(page, "05-form-errors")
    assert session.query(Job).count() == 0 and queue.messages() == []


def test_proofs_and_nodes_pages(server, page, session):
    gen_ring(session, 4)
    gen_node(
        session,
        "spare.example",
        age_s=75,
        role="stage9",
        layer_start=None,
        layer_end=None,
        geo="TX",
    )
    gen_proof_run(session, kind="nightly")
    run = gen_proof_run(session, passed=False)
    page.goto(server + "/proofs/")
    assert page.locator("#proof-runs tbody tr").count() == 2
    shot(page, "06-proofs")
    page.click(f"text={run.name}")
    page.wait_for_load_state("networkidle")
    images = page.locator("img.plot")
    assert images.count() == 5
    widths = images.evaluate_all("imgs => imgs.map(i => i.complete && i.naturalWidth)")
    assert all(w and w > 300 for w in widths), widths
    shot(page, "07-proof-detail")

    page.goto(server + "/nodes/")
    assert page.locator("svg.ring g.ring-node").count() == 5
    assert page.locator("#nodes tbody tr").count() == 5
    shot(page, "08-nodes")
    page.set_viewport_size({"width": 390, "height": 800})
    page.goto(server + "/")
    shot(page, "09-submit-phone")


def test_job_finished_by_a_real_worker(server, page, app, db_url, queue, tmp_path):
    """The form's job runs on real stage workers serving a tiny checkpoint, through a real
    Celery coordinator, and the page follows it to the end."""
    from tests.swarmprocs import Swarm, write_tiny_model

    tiny = write_tiny_model(tmp_path / "tiny")
    app.extensions["specpipe.submitter"].model = str(tiny)
    swarm = Swarm(
        app.config["REDIS_URL"],
        f"web{uuid.uuid4().hex[:8]}",
        secrets.token_hex(16),
        tiny,
        DATABASE_URL=db_url,
    )
    try:
        swarm.start_stage("s0", "0:2")
        swarm.start_stage("s1", "2:4")
        swarm.start_coordinator(queue.name)
        swarm.wait_stages(["s0", "s1"])
        job_id = submit_job(page, server, "hello world")
        page.wait_for_function(
            "() => ['done', 'failed'].includes("
            "document.querySelector('#job-status .badge').textContent)",
            timeout=120_000,
        )
        shot(page, "10-job-finished-by-worker")
        assert page.text_content("#job-status .badge") == "done", page.text_content("#job-error")
        assert page.text_content("#job-output").strip()
        assert page.locator("#job-ring li").count() == 2  # followed without a reload
        assert page.is_hidden("#job-ring-empty")
        page.reload()
        assert page.locator(".ring-list li").count() == 2  # the run's snapshot of the ring
    finally:
        swarm.stop()
    with make_session_factory(db_url)() as session:
        job = session.get(Job, job_id)
        assert job.model == str(tiny) and job.generated_tokens == len(job.output_ids) > 0
