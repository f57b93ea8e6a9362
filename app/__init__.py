"""The Flask web app: job submission, history, proofs, nodes and the JSON API."""
