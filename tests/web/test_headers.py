"""Security headers on every response, and pages that need no inline script or style."""

from __future__ import annotations

import re

import pytest

from app.security import CONTENT_SECURITY_POLICY
from tests.factories import gen_job, gen_node, gen_proof_run

EXPECTED = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
}


def test_policy_allows_nothing_inline_and_no_framing():
    directives = dict(d.split(" ", 1) for d in CONTENT_SECURITY_POLICY.split("; "))
    assert directives["script-src"] == "'self'" and directives["style-src"] == "'self'"
    assert directives["frame-ancestors"] == "'none'"
    assert "unsafe-inline" not in CONTENT_SECURITY_POLICY


@pytest.mark.parametrize(
    ("who", "method", "path"),
    [
        ("client", "get", "/"),
        ("client", "get", "/history"),
        ("client", "get", "/no/such/page"),
        ("client", "post", "/"),  # a bad form, and no CSRF token
        ("anon", "get", "/login"),
        ("anon", "get", "/history"),
        ("anon", "get", "/healthz"),
        ("anon", "get", "/metrics"),
        ("anon", "get", "/static/app.js"),
        ("anon", "get", "/api/v1/jobs"),
        ("anon", "get", "/api/v1/openapi.json"),
    ],
)
def test_headers_on_every_response(request, who, method, path):
    response = getattr(request.getfixturevalue(who), method)(path)
    for name, value in EXPECTED.items():
        assert response.headers.get(name) == value, (path, name)


def test_pages_have_no_inline_script_or_style(client, session):
    job = gen_job(session, status="running", accepted_drafts=[1, 2], generated_tokens=3, rounds=2)
    run = gen_proof_run(session)
    gen_node(session, "h1")
    for path in (
        "/",
        "/history",
        f"/jobs/{job.id}",
        "/proofs/",
        f"/proofs/{run.id}",
        "/nodes/",
        "/login",
    ):
        html = client.get(path).get_data(as_text=True)
        assert not re.search(r"<script(?![^>]*\bsrc=)", html), path
        assert "<style" not in html and not re.search(r"\sstyle=", html), path
        assert not re.search(r"\son[a-z]+=", html), path  # no inline event handlers
