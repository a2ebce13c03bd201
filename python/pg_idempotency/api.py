"""The sync API (psycopg ``Connection``); :mod:`pg_idempotency.aio` is the same for
``AsyncConnection``. Both are made from the generators of :mod:`pg_idempotency._calls`.

    with pg_idempotency.operation(conn, scope, key, request) as op:
        if op.replay:
            return op.replay                     # the stored response
        conn.execute("INSERT INTO ledger ...")   # the business write
        op.complete(201, {"id": 7})              # commits it together with the response
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime, timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any

import psycopg

from . import _calls
from ._calls import DEFAULT_LEASE
from ._exec import Gen, block_outage, make_sync, run
from ._operation import (
    DEFAULT_MAX_HEADERS_BYTES,
    DEFAULT_MAX_RESPONSE_BYTES,
    OperationCore,
    OperationFields,
    idempotent_wrapper,
    refuse_managed,
)
from ._pooled import Hold, PooledConnection, is_pool, run_pooled
from ._results import StoredResponse
from .fingerprint import derive_key

if TYPE_CHECKING:
    from psycopg_pool import ConnectionPool

__all__ = ["Operation", "accept", "checkpoint", "claim", "complete", "derive_key", "heartbeat",
           "idempotent", "inbox_accept", "list_abandoned", "operation", "release", "takeover"]

claim = make_sync(_calls.claim)
takeover = make_sync(_calls.takeover)
checkpoint = make_sync(_calls.checkpoint)
heartbeat = make_sync(_calls.heartbeat)
complete = make_sync(_calls.complete)
accept = make_sync(_calls.accept)
release = make_sync(_calls.release)
list_abandoned = make_sync(_calls.list_abandoned)
inbox_accept = make_sync(_calls.inbox_accept)


class Operation(OperationFields):
    """One idempotent operation on ``conn`` (or on a pool); made by :func:`operation`. See
    :class:`pg_idempotency._operation.OperationCore` for the transaction rules."""

    def __init__(self, core_: OperationCore, conn: Any, hold: Hold | None = None) -> None:
        self._core = core_
        self._hold = hold
        #: The connection of the business transaction: do the business writes on it, inside
        #: the block. Over a pool, a :class:`~pg_idempotency._pooled.PooledConnection` that
        #: takes a connection of the pool at its first use.
        self.conn: Any = PooledConnection(hold) if hold is not None else conn

    def _run(self, gen: Gen[Any]) -> Any:
        if self._hold is None:
            return run(self.conn, gen)
        return run_pooled(self._hold, gen)

    def connection(self) -> psycopg.Connection[Any]:
        """The psycopg connection of the business transaction. Over a pool it is taken now
        (if no statement took it yet) and kept until the operation ends."""
        if self._hold is None:
            return self.conn  # type: ignore[no-any-return]
        return self._hold.pin("op.connection()")

    def __enter__(self) -> Operation:
        try:
            self._run(self._core.g_enter())
        except BaseException:
            if self._hold is not None:
                self._hold.close()
            raise
        if self._hold is not None and self._core.lease_token is None:
            self._hold.close()  # a replay (or accepted): the block has nothing to run
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            self._run(self._core.g_exit(exc))
        finally:
            if self._hold is not None:
                self._hold.close()
        lost = block_outage(exc)
        if lost is not None:  # the block's own statement on a lost connection
            raise lost

    def checkpoint(self, recovery_point: str, *, extend: timedelta | float | None = None
                   ) -> datetime:
        """Record ``recovery_point`` and commit it with the writes made so far. Over a pool,
        the connection goes back to it until the block's next statement."""
        return self._run(  # type: ignore[no-any-return]
            self._core.g_checkpoint(recovery_point, extend))

    def complete(self, status: int, body: Any = None, *, headers: Mapping[str, str] | None = None,
                 content_type: str | None = None) -> StoredResponse:
        """Store the response and commit it with the business writes."""
        return self._run(  # type: ignore[no-any-return]
            self._core.g_complete(status, body, headers, content_type))

    def accept(self, status: int, body: Any = None, *,
               headers: Mapping[str, str] | None = None,
               lease: timedelta | float | None = None) -> StoredResponse:
        """Hand the operation over to a worker: store the interim response (e.g. 202 and a
        status URL) and commit it with the writes made so far (the enqueued job). Retries
        get it back (``op.accepted``) until the worker completes with ``op.lease_token``."""
        return self._run(  # type: ignore[no-any-return]
            self._core.g_accept(status, body, headers, lease))

    def release(self) -> None:
        """A definite failure before any side effect (a declined card, a 402 not worth
        storing): roll the business transaction back and release the key, so that a retry
        runs afresh, even with another request. The block may then return normally."""
        self._run(self._core.g_release())


def operation(conn: psycopg.Connection[Any] | ConnectionPool[Any], scope: str, key: str,
              request: Any = None, *,
              lease: timedelta | float = DEFAULT_LEASE, fingerprint: bytes | None = None,
              reference_time: datetime | None = None,
              max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
              max_headers_bytes: int = DEFAULT_MAX_HEADERS_BYTES) -> Operation:
    """``with operation(conn, scope, key, request) as op:`` claims the key (committed on its
    own), then runs the block in a transaction on ``conn``. Raises
    :class:`~pg_idempotency.errors.KeyMismatch` (422) or
    :class:`~pg_idempotency.errors.KeyInProgress` (409) on entry; ``op.replay`` is the stored
    response when the key was completed before. ``conn`` must be idle (no open transaction).
    ``op.complete()`` raises :class:`~pg_idempotency.errors.ArgumentTooLarge` (IK018) for a
    body over ``max_response_bytes`` or headers over ``max_headers_bytes`` (the server's
    defaults) before sending anything, and ends the operation as an exception would (rolled
    back, key released).

    ``conn`` may be a ``psycopg_pool.ConnectionPool``: then the operation holds a connection
    of it only while its SQL runs (see :func:`pg_idempotency.aio.operation`)."""
    core_ = OperationCore(scope, key, request, lease=lease, fingerprint=fingerprint,
                          reference_time=reference_time, max_response_bytes=max_response_bytes,
                          max_headers_bytes=max_headers_bytes)
    if is_pool(conn):
        return Operation(core_, None, Hold(conn))
    refuse_managed(conn)
    return Operation(core_, conn)


def idempotent(*, lease: timedelta | float = DEFAULT_LEASE, status: int = 200
               ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Make ``fn(conn, *args, **kwargs)`` idempotent: call it as
    ``fn(conn, scope, key, *args, **kwargs)``. Its return value (a JSON value) is stored with
    ``status`` in the transaction of its writes; a retry with the same arguments returns the
    stored value without running it. A parameter named ``op`` receives the :class:`Operation`."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        return idempotent_wrapper(fn, lease=lease, status=status, driver=run,
                                  make_op=lambda c, conn: Operation(c, conn))

    return decorate
