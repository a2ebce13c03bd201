"""pg_idempotency: idempotency keys done inside PostgreSQL.

The semantics live in the SQL functions of schema ``idempotency``; this package installs them
(:mod:`pg_idempotency.migrate`, the ``pg-idempotency`` command in :mod:`pg_idempotency.cli`)
and, later, wraps them. :mod:`pg_idempotency.fingerprint` computes ``canonical_json``,
``fingerprint`` and ``derive_key`` in pure Python, byte-identical to the SQL functions.
"""

__version__ = "0.1.0"
