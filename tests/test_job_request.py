"""The one job request schema: what it documents (the OpenAPI schema, the form's bounds) is what
its check accepts, and each front door names its fields as the schema says."""

from __future__ import annotations

import pytest

from specpipe.settings import JOB_DEFAULTS, JobLimits
from workers.job_request import (
    FIELD_BY_NAME,
    FIELDS,
    JOB_FIELDS,
    JobRequestError,
    json_schema,
    number_bounds,
    parse_job_request,
)

LIMITS = JobLimits(max_new_tokens=300, max_draft_k=7)
NUMBERS = sorted(number_bounds(LIMITS))


def refusal(name: str, value: object, from_text: bool = False) -> str | None:
    """The reason `value` of field `name` is refused, None when it is accepted."""
    try:
        parse_job_request({"prompt": "hi", name: value}, LIMITS, from_text)
    except JobRequestError as exc:
        return exc.errors[name]
    return None


@pytest.mark.parametrize("name", NUMBERS)
def test_a_number_field_takes_its_bounds_and_nothing_past_them(name):
    bounds = number_bounds(LIMITS)[name]
    schema = json_schema(LIMITS)["properties"][name]
    assert (schema["minimum"], schema["maximum"]) == bounds
    whole = schema["type"] == "integer"
    step = 1 if whole else 1e-6
    above_low = schema.get("exclusiveMinimum", False)
    assert refusal(name, bounds.high) is None
    assert refusal(name, bounds.low) == (FIELD_BY_NAME[name].rule.reason if above_low else None)
    assert refusal(name, bounds.high + step) is not None
    assert refusal(name, bounds.low - step) is not None
    assert refusal(name, str(bounds.high), from_text=True) is None


def test_the_bounds_follow_the_limits():
    bounds = number_bounds(LIMITS)
    assert bounds["max_new_tokens"] == (1, 300)
    assert bounds["draft_k"] == (0, 7)
    assert refusal("max_new_tokens", 301) == "must be between 1 and 300"
    assert refusal("draft_k", 8) == "must be between 0 (no speculation) and 7"
    assert refusal("temp", 101) == "must be between 0 (greedy) and 100"


def test_the_schema_lists_every_field_once_and_requires_what_has_no_default():
    schema = json_schema(LIMITS)
    assert list(schema["properties"]) == list(FIELDS) == [f.name for f in JOB_FIELDS]
    assert schema["required"] == ["prompt"]
    assert set(FIELDS) - {"prompt"} == set(JOB_DEFAULTS)
    assert parse_job_request({"prompt": "hi"}, LIMITS, False) == {"prompt": "hi", **JOB_DEFAULTS}


def test_openai_names_and_defaults():
    names = {f.name: f.openai_param for f in JOB_FIELDS}
    assert names["max_new_tokens"] == "max_tokens"
    assert names["temp"] == "temperature"
    assert names["top_k"] == "top_k"
    defaults = {f.name: f.openai_default for f in JOB_FIELDS if f.openai_default is not None}
    assert defaults == {"temp": 1.0, "top_p": 1.0}
