"""The OpenAPI 3.0 document of `/api/v1`, served at `/api/v1/openapi.json`.

Written by hand next to the API it describes, but for a node's schema, read from the store's
columns, and a job request's, from its fields (`workers.job_request`); the test suite drives
every operation with Schemathesis against it (no 5xx, every response matching its schema), so
the two cannot drift apart unnoticed.
"""

from __future__ import annotations

from sqlalchemy import Boolean, Column, Integer

from app.history import MAX_PAGE, SORTS
from models.jobs import JOB_STATUSES
from models.nodes import NODE_FIELDS, Node
from specpipe import __version__
from specpipe.core.sampling import MAX_SEED, SAMPLERS
from specpipe.settings import JobLimits
from specpipe.swarm.kvbudget import WAITING_FIELDS
from workers.job_request import json_schema as job_request_schema

_NULLABLE_INT = {"type": "integer", "nullable": True}
_NULLABLE_NUMBER = {"type": "number", "nullable": True}
_NULLABLE_TEXT = {"type": "string", "nullable": True}


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict, description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _error(description: str) -> dict:
    return _json(_ref("Error"), description)


_JOB = {
    "type": "object",
    "required": ["id", "status", "prompt", "seed", "output_ids", "accepted_drafts"],
    "properties": {
        "id": {"type": "integer"},
        "status": {"type": "string", "enum": list(JOB_STATUSES)},
        "created_at": _NULLABLE_TEXT,
        "started_at": _NULLABLE_TEXT,
        "finished_at": _NULLABLE_TEXT,
        "prompt": {"type": "string"},
        "model": {"type": "string"},
        "max_new_tokens": {"type": "integer"},
        "temp": {"type": "number"},
        "top_p": {"type": "number"},
        "top_k": {"type": "integer"},
        "seed": {"type": "integer", "minimum": 0, "maximum": MAX_SEED},
        "draft_k": {"type": "integer"},
        "stop": {"type": "array", "items": {"type": "string"}},
        "sampler": {"type": "string", "enum": list(SAMPLERS)},
        "seed_was_random": {"type": "boolean"},
        "cancel_requested": {"type": "boolean"},
        "output_text": {"type": "string"},
        "reply": {
            "type": ["object", "null"],
            "description": "One job's reads only: a chat on a model that writes harmony's "
            "channels (gpt-oss), its reasoning, its answer and its calls of the chat's functions "
            "(each with its arguments' JSON text as written, and whether its message ended) "
            "apart; null for any other job.",
            "properties": {
                "reasoning": {"type": "string"},
                "content": {"type": "string"},
                "calls": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["name", "arguments", "done"],
                        "properties": {
                            "name": {"type": "string"},
                            "arguments": {"type": "string"},
                            "done": {"type": "boolean"},
                        },
                    },
                },
            },
        },
        "output_ids": {"type": "array", "items": {"type": "integer"}},
        "prompt_tokens": _NULLABLE_INT,
        "generated_tokens": {"type": "integer"},
        "tok_s": _NULLABLE_NUMBER,
        "rounds": {"type": "integer"},
        "accepted_drafts": {"type": "array", "items": {"type": "integer"}},
        "accepted_drafts_mean": _NULLABLE_NUMBER,
        "tokens_per_round": _NULLABLE_NUMBER,
        "error": _NULLABLE_TEXT,
        "attempts": {"type": "integer"},
        "run_id": _NULLABLE_INT,
        "owner": {"type": "string", "description": "The name of the user who submitted it."},
        "queue": {
            "type": ["object", "null"],
            "description": "One job's reads only: a queued job's place in line (1 = next), "
            "null once it runs.",
            "properties": {"position": {"type": "integer"}, "queued": {"type": "integer"}},
        },
        "waiting_for_room": {
            "type": ["object", "null"],
            "description": "One job's reads only: while the job waits for KV-cache room on its "
            "route, the stage that is full (`host`), the tokens reserved there (`used`) of its "
            "`budget`, and the tokens the job `need`s; null otherwise.",
            "required": list(WAITING_FIELDS),
            "properties": {
                "host": {"type": "string"},
                "used": {"type": "integer"},
                "budget": {"type": "integer"},
                "need": {"type": "integer"},
            },
        },
    },
}


def _column_schema(column: Column) -> dict:
    """How the JSON API writes a value of `column`: a time as ISO text, null where it may be."""
    if isinstance(column.type, Boolean):
        kind = "boolean"
    elif isinstance(column.type, Integer):
        kind = "integer"
    else:  # text, and times as ISO text
        kind = "string"
    return {"type": kind, "nullable": True} if column.nullable else {"type": kind}


def _node_schema() -> dict:
    """A node as `Node.to_dict` writes it: its host, its status and the store's columns."""
    columns = Node.__table__.c
    return {
        "type": "object",
        "required": ["host", "status"],
        "properties": {
            "host": {"type": "string"},
            "status": {"type": "string", "enum": ["online", "stale", "offline"]},
            **{name: _column_schema(columns[name]) for name in NODE_FIELDS},
        },
    }


_NODE = _node_schema()


_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {"type": "string"},
        "fields": {"type": "object", "additionalProperties": {"type": "string"}},
        "allowed": {"type": "array", "items": {"type": "string"}},
        "job": _ref("Job"),
        "retry_after": {"type": "integer", "minimum": 1},
    },
}


def _id_parameter(name: str) -> dict:
    return {
        "name": name,
        "in": "path",
        "required": True,
        "schema": {"type": "integer", "minimum": 0, "maximum": 2**31 - 1},
    }


def document(limits: JobLimits) -> dict:
    """The OpenAPI document for an app with these job limits."""
    unauthorised = _error(
        "No valid API token (`Authorization: Bearer <token>`): none, unknown, revoked or expired."
    )
    listing = [
        {"name": "status", "in": "query", "schema": {"type": "string", "enum": list(JOB_STATUSES)}},
        {"name": "q", "in": "query", "schema": {"type": "string"}},
        {"name": "sort", "in": "query", "schema": {"type": "string", "enum": list(SORTS)}},
        {
            "name": "page",
            "in": "query",
            "schema": {"type": "integer", "minimum": 1, "maximum": MAX_PAGE},
        },
        {"name": "per_page", "in": "query", "schema": {"type": "integer", "minimum": 1}},
    ]
    page = {
        "type": "object",
        "required": ["jobs", "page", "per_page", "pages", "total"],
        "properties": {
            "jobs": {"type": "array", "items": _ref("Job")},
            **{name: {"type": "integer"} for name in ("page", "per_page", "pages", "total")},
        },
    }
    return {
        "openapi": "3.0.3",
        "info": {"title": "specpipe", "version": __version__},
        "servers": [{"url": "/"}],
        "security": [{"bearer": []}],
        "paths": {
            "/api/v1/jobs": {
                "post": {
                    "summary": "Create and enqueue a job.",
                    "requestBody": {
                        "required": True,
                        "content": {"application/json": {"schema": _ref("JobRequest")}},
                    },
                    "responses": {
                        "201": _json(_ref("Job"), "The job, queued."),
                        "400": _error("Bad fields, each named with its reason."),
                        "401": unauthorised,
                        "429": {
                            **_error(
                                "Too many jobs submitted lately, or queued and running at once"
                                " (`retry_after`: seconds to wait)."
                            ),
                            "headers": {
                                "Retry-After": {
                                    "description": "Seconds to wait before submitting again.",
                                    "schema": {"type": "integer", "minimum": 1},
                                },
                            },
                        },
                        "503": _error("The job was stored, but the queue could not be reached."),
                    },
                },
                "get": {
                    "summary": "Jobs, newest first, one page at a time.",
                    "parameters": listing,
                    "responses": {
                        "200": _json(page, "A page of jobs."),
                        "400": _error("Bad paging or sorting."),
                        "401": unauthorised,
                    },
                },
            },
            "/api/v1/jobs/{job_id}": {
                "get": {
                    "summary": "One job with its progress and output.",
                    "parameters": [_id_parameter("job_id")],
                    "responses": {
                        "200": _json(_ref("Job"), "The job."),
                        "401": unauthorised,
                        "404": _error("No such job."),
                    },
                }
            },
            "/api/v1/jobs/{job_id}/cancel": {
                "post": {
                    "summary": "Ask a job to stop at its next round.",
                    "parameters": [_id_parameter("job_id")],
                    "responses": {
                        "200": _json(_ref("Job"), "The job, cancel requested."),
                        "401": unauthorised,
                        "404": _error("No such job."),
                        "409": _error("The job has already finished."),
                    },
                }
            },
            "/api/v1/nodes": {
                "get": {
                    "summary": "The node inventory in ring order.",
                    "responses": {
                        "200": _json(
                            {
                                "type": "object",
                                "required": ["nodes"],
                                "properties": {"nodes": {"type": "array", "items": _ref("Node")}},
                            },
                            "The nodes.",
                        ),
                        "401": unauthorised,
                    },
                }
            },
            "/api/v1/runs/{run_id}": {
                "get": {
                    "summary": "A run record (docs/architecture.md, 'The store').",
                    "parameters": [_id_parameter("run_id")],
                    "responses": {
                        "200": _json({"type": "object"}, "The run record."),
                        "401": unauthorised,
                        "404": _error("No such run."),
                    },
                }
            },
        },
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {
                "JobRequest": job_request_schema(limits),
                "Job": _JOB,
                "Node": _NODE,
                "Error": _ERROR,
            },
        },
    }
