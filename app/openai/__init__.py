"""The OpenAI-compatible API under /v1: chat and raw completions, and the model the swarm serves.

Every request is an ordinary job of the bearer token's owner, made by the one submission path
(`workers.submission.Submitter`); the request then waits for the job by reading its row, which
the coordinator updates after every round. What it accepts and answers (fields, streaming,
log-probabilities, errors): docs/api.md.

`requests` checks a request's body, `waiting` follows its job, `answers` shapes the JSON of a
reply and of a stream's chunks, `streaming` sends those as Server-Sent Events, and `routes` is
the blueprint; `errors` is the error shape they all raise.
"""
