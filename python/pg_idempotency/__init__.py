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
- :func:`canonical_json`, :func:`fingerprint` and :func:`derive_key` in pure Python,
  byte-identical to the SQL functions (defined in the submodule ``pg_idempotency.fingerprint``,
  which the function of the same name shadows as a package attribute; ``from
  pg_idempotency.fingerprint import ...`` still works).
"""

from importlib import metadata as _metadata

# pg_idempotency.core, an attribute of the package as it always was (it re-exports the modules
# the core was split into)
from . import core  # noqa: F401
from ._calls import DEFAULT_LEASE
from ._exec import allow_prepared_statements
from ._results import AbandonedKey, ClaimResult, Outcome, StoredResponse
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
from .errors import (
    AlreadyCompleted,
    ArgumentTooLarge,
    DatabaseUnavailable,
    IdempotencyError,
    InvalidArgument,
    IsolationNotSupported,
    KeyExpired,
    KeyInProgress,
    KeyMismatch,
    KeyNotFound,
    LeaseLost,
    LeaseLostCompleted,
    LeaseLostNotFound,
    PgCronNotInstalled,
    ScopeNotGranted,
    UsageError,
)
from .fingerprint import canonical_json, derive_key, fingerprint
from .schema import REQUIRED_MIGRATION, SCHEMA_VERSION

try:
    __version__ = _metadata.version("pg-idempotency")
except _metadata.PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "DEFAULT_LEASE", "AbandonedKey", "AlreadyCompleted", "ArgumentTooLarge", "ClaimResult",
    "DatabaseUnavailable", "IdempotencyError",
    "InvalidArgument", "IsolationNotSupported", "KeyExpired", "KeyInProgress", "KeyMismatch",
    "KeyNotFound", "LeaseLost", "LeaseLostCompleted", "LeaseLostNotFound", "Operation",
    "Outcome", "PgCronNotInstalled", "REQUIRED_MIGRATION", "SCHEMA_VERSION", "ScopeNotGranted",
    "StoredResponse", "UsageError", "accept",
    "allow_prepared_statements",
    "canonical_json", "checkpoint", "claim", "complete", "derive_key", "fingerprint",
    "heartbeat", "idempotent", "inbox_accept", "list_abandoned", "operation", "release",
    "takeover",
]
