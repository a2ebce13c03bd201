"""The Python API's core, as it was importable before it was split along its seams: every name
of ``pg_idempotency.core`` that users, docs and scripts use, re-exported from the modules that
hold it now. The package's own modules import from those:

- :mod:`pg_idempotency._results`: the typed results and their decoding;
- :mod:`pg_idempotency._wire`: the package's own sends, the one module that drives psycopg's
  private, protocol-level methods;
- :mod:`pg_idempotency._exec`: what the generators ask for, the sync and async drivers that
  answer on the caller's connection, and the errors they raise;
- :mod:`pg_idempotency._calls`: one generator per function of the SQL API;
- :mod:`pg_idempotency._operation`: ``operation()``'s state and steps, and ``@idempotent``;
- :mod:`pg_idempotency._log`: the package's logger.

Nothing here opens a connection: every call takes the caller's, so ``complete()`` joins the
caller's business transaction. Connections from ``psycopg_pool`` work as any other.
"""

from __future__ import annotations

import sys
import types

from . import _exec
from ._calls import (
    DEFAULT_LEASE,
    accept,
    checkpoint,
    claim,
    claim_query,
    complete,
    heartbeat,
    inbox_accept,
    list_abandoned,
    release,
    takeover,
)
from ._exec import allow_prepared_statements, block_outage
from ._log import logger
from ._operation import (
    DEFAULT_MAX_HEADERS_BYTES,
    DEFAULT_MAX_RESPONSE_BYTES,
    OperationCore,
    idempotent_wrapper,
    refuse_managed,
)
from ._results import (
    AbandonedKey,
    ClaimResult,
    Outcome,
    StoredResponse,
    json_bytes,
    load_interval,
    load_json,
    load_time,
)
from ._wire import claim_result_of, codec, dict_rows, iso_time
from .fingerprint import canonical_json, derive_key, key_hash, request_fingerprint

__all__ = [
    "DEFAULT_LEASE", "DEFAULT_MAX_HEADERS_BYTES", "DEFAULT_MAX_RESPONSE_BYTES", "AbandonedKey",
    "ClaimResult", "OperationCore", "Outcome", "StoredResponse", "accept",
    "allow_prepared_statements", "block_outage", "canonical_json", "checkpoint", "claim",
    "claim_result_of", "complete", "derive_key", "dict_rows", "heartbeat", "idempotent_wrapper",
    "inbox_accept", "json_bytes", "key_hash", "list_abandoned", "load_interval", "load_json",
    "load_time", "logger", "refuse_managed", "release", "request_fingerprint", "takeover",
]

# The private names that bench/ scripts and docs/benchmarks.md use, from before the split.
_claim_query = claim_query
_codec = codec
_iso_time = iso_time


class _Core(types.ModuleType):
    """``core._PREPARE`` reads and sets :data:`pg_idempotency._exec.PREPARE`, where the drivers
    read it (bench/prepare.py and bench/instructions.py set it to measure prepared
    statements)."""

    @property
    def _PREPARE(self) -> bool | None:
        return _exec.PREPARE

    @_PREPARE.setter
    def _PREPARE(self, value: bool | None) -> None:
        _exec.PREPARE = value


sys.modules[__name__].__class__ = _Core
