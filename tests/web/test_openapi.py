"""The API against its own OpenAPI document: every operation driven by Schemathesis with
generated requests, valid and not, must answer without a 5xx and as the document says."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.factories import gen_job, gen_node, gen_proof_run


def test_the_document_is_served_without_a_token(client):
    response = client.get("/api/v1/openapi.json")
    assert response.status_code == 200
    document = response.get_json()
    assert document["openapi"].startswith("3.")
    request = document["components"]["schemas"]["JobRequest"]["properties"]
    assert request["max_new_tokens"]["maximum"] == 1024  # the app's own limit (see conftest)


@pytest.mark.slow
def test_every_operation_answers_as_documented(app, session, api_token):
    # Something to find: jobs, a node and a run, so reads of ids 1, 2 … answer 200 too.
    gen_job(session)
    gen_job(session, status="done", output_ids=[1, 2], output_text="ab")
    gen_node(session, "h1")
    gen_proof_run(session)
    api = schemathesis.openapi.from_wsgi("/api/v1/openapi.json", app)
    headers = {"Authorization": f"Bearer {api_token}"}
    operations = [result.ok() for result in api.get_all_operations()]
    assert len(operations) == 6

    for operation in operations:

        @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy())
        def answers_as_documented(case):
            case.call_and_validate(headers=headers)

        answers_as_documented()
