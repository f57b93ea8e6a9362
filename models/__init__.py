"""The store: SQLAlchemy models for jobs, runs, proofs and the node inventory."""
