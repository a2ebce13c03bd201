"""The async API (psycopg ``AsyncConnection``): :mod:`pg_idempotency.api` made async, from
the same generators of :mod:`pg_idempotency._calls`.

    async with aio.operation(conn, scope, key, request) as op:
        if op.replay:
            return op.replay                     # the stored response
        conn.execute("INSERT INTO ledger ...")   # the business write
        await op.complete(201, {"id": 7})        # commits it together with the response
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta
from types import TracebackType
from typing import Any

import psycopg

from . import _calls
from ._calls import DEFAULT_LEASE
from ._exec import arun, block_outage, make_async
from ._operation import (
    DEFAULT_MAX_HEADERS_BYTES,
    DEFAULT_MAX_RESPONSE_BYTES,
    OperationCore,
    OperationFields,
    idempotent_wrapper,
    refuse_managed,
)
from ._results import StoredResponse
from .fingerprint import derive_key

__all__ = ["Operation", "accept", "checkpoint", "claim", "complete", "derive_key", "heartbeat",
           "idempotent", "inbox_accept", "list_abandoned", "operation", "release", "takeover"]

claim = make_async(_calls.claim)
takeover = make_async(_calls.takeover)
checkpoint = make_async(_calls.checkpoint)
heartbeat = make_async(_calls.heartbeat)
complete = make_async(_calls.complete)
accept = make_async(_calls.accept)
release = make_async(_calls.release)
list_abandoned = make_async(_calls.list_abandoned)
inbox_accept = make_async(_calls.inbox_accept)


class Operation(OperationFields):
    """One idempotent operation on ``conn``; made by :func:`operation`. See
    :class:`pg_idempotency._operation.OperationCore` for the transaction rules."""

    def __init__(self, core_: OperationCore, conn: psycopg.AsyncConnection[Any]) -> None:
        self._core = core_
        #: The caller's connection: do the business writes on it, inside the block.
        self.conn = conn

    async def __aenter__(self) -> Operation:
        await arun(self.conn, self._core.g_enter())
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await arun(self.conn, self._core.g_exit(exc))
        lost = block_outage(exc)
        if lost is not None:  # the block's own statement on a lost connection
            raise lost

    async def checkpoint(self, recovery_point: str, *,
                         extend: timedelta | float | None = None) -> datetime:
        """Record ``recovery_point`` and commit it with the writes made so far."""
        return await arun(self.conn, self._core.g_checkpoint(recovery_point, extend))

    async def complete(self, status: int, body: Any = None, *,
                       headers: Mapping[str, str] | None = None,
                       content_type: str | None = None) -> StoredResponse:
        """Store the response and commit it with the business writes."""
        return await arun(self.conn, self._core.g_complete(status, body, headers, content_type))

    async def accept(self, status: int, body: Any = None, *,
                     headers: Mapping[str, str] | None = None,
                     lease: timedelta | float | None = None) -> StoredResponse:
        """Hand the operation over to a worker (see :meth:`pg_idempotency.Operation.accept`)."""
        return await arun(self.conn, self._core.g_accept(status, body, headers, lease))

    async def release(self) -> None:
        """A definite failure before any side effect: roll back and release the key (see
        :meth:`pg_idempotency.Operation.release`)."""
        await arun(self.conn, self._core.g_release())


def operation(conn: psycopg.AsyncConnection[Any], scope: str, key: str,
              request: Any = None, *, lease: timedelta | float = DEFAULT_LEASE,
              fingerprint: bytes | None = None, reference_time: datetime | None = None,
              max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
              max_headers_bytes: int = DEFAULT_MAX_HEADERS_BYTES) -> Operation:
    """``async with operation(conn, scope, key, request) as op:`` claims the key (committed
    on its own), then runs the block in a transaction on ``conn``. Raises
    :class:`~pg_idempotency.errors.KeyMismatch` (422) or
    :class:`~pg_idempotency.errors.KeyInProgress` (409) on entry; ``op.replay`` is the stored
    response when the key was completed before. ``conn`` must be idle (no open transaction).
    ``op.complete()`` raises :class:`~pg_idempotency.errors.ArgumentTooLarge` (IK018) for a
    body over ``max_response_bytes`` or headers over ``max_headers_bytes`` (the server's
    defaults) before sending anything, and ends the operation as an exception would (rolled
    back, key released)."""
    refuse_managed(conn)
    return Operation(OperationCore(scope, key, request, lease=lease, fingerprint=fingerprint,
                                   reference_time=reference_time,
                                   max_response_bytes=max_response_bytes,
                                   max_headers_bytes=max_headers_bytes), conn)


def idempotent(*, lease: timedelta | float = DEFAULT_LEASE, status: int = 200
               ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Make ``async fn(conn, *args, **kwargs)`` idempotent: call it as
    ``await fn(conn, scope, key, *args, **kwargs)``. Its return value (a JSON value) is
    stored with ``status`` in the transaction of its writes; a retry with the same arguments
    returns the stored value without running it. A parameter named ``op`` receives the
    :class:`Operation`."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        run = idempotent_wrapper(fn, lease=lease, status=status, driver=arun,
                                 make_op=lambda c, conn: Operation(c, conn))

        @functools.wraps(run)
        async def call(*args: Any, **kwargs: Any) -> Any:  # a coroutine function, as fn was
            return await run(*args, **kwargs)

        return call

    return decorate
