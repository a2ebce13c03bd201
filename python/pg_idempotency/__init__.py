"""pg_idempotency: idempotency keys done inside PostgreSQL.

The semantics live in the SQL functions of schema ``idempotency``; this package is a thin
layer over them (docs/python.md):

- the SQL API with typed results, sync here and async in :mod:`pg_idempotency.aio`, each
  call on the caller's connection: :func:`claim`, :func:`complete`, ... and the guided flow
  ``with operation(conn, scope, key, request) as op:`` and ``@idempotent``;
- :mod:`pg_idempotency.errors`: one exception class per documented SQLSTATE;
- :mod:`pg_idempotency.asgi`: Starlette/FastAPI middleware (extra ``asgi``);
- :mod:`pg_idempotency.client`: a retrying httpx client (extra ``client``);
- :mod:`pg_idempotency.migrate` and the ``pg-idempotency`` command (:mod:`pg_idempotency.cli`);
- :mod:`pg_idempotency.fingerprint`: ``canonical_json``, ``fingerprint`` and ``derive_key`` in
  pure Python, byte-identical to the SQL functions.
"""

from .api import (
    Operation,
    accept,
    checkpoint,
    claim,
    complete,
    heartbeat,
    idempotent,
    inbox_accept,
    list_abandoned,
    operation,
    release,
    takeover,
)
from .core import DEFAULT_LEASE, AbandonedKey, ClaimResult, Outcome, StoredResponse
from .errors import (
    AlreadyCompleted,
    IdempotencyError,
    InvalidArgument,
    IsolationNotSupported,
    KeyInProgress,
    KeyMismatch,
    KeyNotFound,
    LeaseLost,
    UsageError,
)
from .fingerprint import derive_key

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_LEASE", "AbandonedKey", "AlreadyCompleted", "ClaimResult", "IdempotencyError",
    "InvalidArgument", "IsolationNotSupported", "KeyInProgress", "KeyMismatch", "KeyNotFound",
    "LeaseLost", "Operation", "Outcome", "StoredResponse", "UsageError", "accept", "checkpoint",
    "claim", "complete", "derive_key", "heartbeat", "idempotent", "inbox_accept", "list_abandoned",
    "operation", "release", "takeover",
]
