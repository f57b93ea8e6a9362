"""The store: SQLAlchemy models for users, jobs, runs, proofs and the node inventory.

Importing this package registers every table on `Base.metadata`, which Alembic compares
against the migrations.
"""

from models.db import Base
from models.jobs import Job
from models.nodes import Node, RunNode
from models.runs import Proof, ProofCase, Run
from models.tokens import ApiToken
from models.users import User

__all__ = ["ApiToken", "Base", "Job", "Node", "Proof", "ProofCase", "Run", "RunNode", "User"]
