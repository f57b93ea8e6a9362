"""Odd requests get a 4xx (or an ordinary page), never a 500."""

from __future__ import annotations

import pytest

from tests.factories import gen_job

PAGES = [
    "/jobs/99999999999999999999",
    "/jobs/-1",
    "/jobs/abc",
    "/jobs/99999999999999999999/progress",
    "/proofs/99999999999999999999",
    "/proofs/plots/99999999999999999999/tv.png",
    "/proofs/plots/cases/99999999999999999999.png",
    "/runs/99999999999999999999/record.json",
    "/history?page=99999999999999999999",
    "/history?page=abc",
    "/history?q=%00nul",
    "/history?q=%FF%FE",
    "/history?q=" + "x" * 5000,
    "/history?status=%00&sort=%00",
]
API = [
    "/api/v1/jobs/99999999999999999999",
    "/api/v1/runs/99999999999999999999",
    "/api/v1/jobs?page=99999999999999999999",
    "/api/v1/jobs?per_page=99999999999999999999",
    "/api/v1/jobs?q=%00",
]


@pytest.mark.parametrize("path", PAGES)
def test_pages_never_500(client, session, path):
    gen_job(session, prompt="something")
    assert client.get(path).status_code < 500


@pytest.mark.parametrize("path", API)
def test_api_never_500(api, path):
    response = api.get(path)
    assert response.status_code < 500
    assert response.is_json


def test_api_cancel_huge_id(api):
    response = api.post("/jobs/99999999999999999999/cancel")
    assert response.status_code == 404 and response.is_json


def test_form_with_repeated_and_missing_fields(client, queue):
    from werkzeug.datastructures import MultiDict

    from tests.web.conftest import csrf_token

    data = MultiDict([("csrf_token", csrf_token(client)), ("prompt", "a"), ("prompt", "b")])
    response = client.post("/", data=data)
    assert response.status_code == 400  # the numbers are missing
    assert "Max new tokens is required" in response.get_data(as_text=True)
