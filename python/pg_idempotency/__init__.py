"""pg_idempotency: idempotency keys done inside PostgreSQL.

The semantics live in the SQL functions of schema ``idempotency``; this package installs them
(:mod:`pg_idempotency.migrate`) and, later, wraps them.
"""

__version__ = "0.1.0"
