"""The async API (psycopg's ``AsyncConnection``, or asyncpg's ``Connection``):
:mod:`pg_idempotency.api` made async, from the same generators of :mod:`pg_idempotency._calls`.
Every function and ``operation()`` take either driver's connection (asyncpg's:
:mod:`pg_idempotency._asyncpg`); the driver is chosen once a call or an operation.

    async with aio.operation(conn, scope, key, request) as op:
        if op.replay:
            return op.replay                     # the stored response
        await conn.execute("INSERT INTO ledger ...")   # the business write
        await op.complete(201, {"id": 7})        # commits it together with the response

Given a ``psycopg_pool.AsyncConnectionPool`` or an ``asyncpg.Pool`` instead of a connection,
the operation takes a connection only while its SQL runs (:mod:`pg_idempotency._pooled`,
:mod:`pg_idempotency._asyncpg_pool`): write on ``op.conn``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any

import psycopg

from . import _calls
from ._asyncpg import is_asyncpg_pool
from ._calls import DEFAULT_LEASE
from ._exec import Gen, arunner, block_outage, make_async
from ._operation import (
    DEFAULT_MAX_HEADERS_BYTES,
    DEFAULT_MAX_RESPONSE_BYTES,
    OperationCore,
    OperationFields,
    idempotent_wrapper,
    refuse_managed,
)
from ._pooled import AsyncHold, PooledAsyncConnection, arun_pooled, is_pool
from ._results import StoredResponse
from .fingerprint import derive_key

if TYPE_CHECKING:
    import asyncpg
    from psycopg_pool import AsyncConnectionPool

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
    """One idempotent operation on ``conn`` (or on a pool); made by :func:`operation`. See
    :class:`pg_idempotency._operation.OperationCore` for the transaction rules."""

    def __init__(self, core_: OperationCore, conn: Any, hold: Any = None) -> None:
        self._core = core_
        self._hold = hold
        #: The connection of the business transaction: do the business writes on it, inside
        #: the block. Over a pool, a :class:`~pg_idempotency._pooled.PooledAsyncConnection`
        #: (asyncpg's: :class:`~pg_idempotency._asyncpg_pool.PooledAsyncpgConnection`) that
        #: takes a connection of the pool at its first statement.
        self.conn: Any
        # The driver, chosen once for the operation: each step is self._arun(self._on, gen).
        self._arun: Callable[[Any, Gen[Any]], Any]
        if hold is None:
            self.conn, self._on = conn, conn
            self._arun = arunner(conn)
        elif isinstance(hold, AsyncHold):
            self.conn, self._on, self._arun = PooledAsyncConnection(hold), hold, arun_pooled
        else:  # an asyncpg pool's (_asyncpg_pool.AsyncpgHold)
            self.conn, self._on, self._arun = hold.proxy(), hold, type(hold).run

    def _run(self, gen: Gen[Any]) -> Any:
        return self._arun(self._on, gen)

    async def connection(self) -> Any:
        """The connection of the business transaction (psycopg's, or asyncpg's). Over a pool
        it is taken now (if no statement took it yet) and kept until the operation ends."""
        if self._hold is None:
            return self.conn
        return await self._hold.pin("op.connection()")

    async def __aenter__(self) -> Operation:
        try:
            await self._run(self._core.g_enter())
        except BaseException:
            if self._hold is not None:
                await self._hold.close()
            raise
        if self._hold is not None and self._core.lease_token is None:
            await self._hold.close()  # a replay (or accepted): the block has nothing to run
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        try:
            await self._run(self._core.g_exit(exc))
        finally:
            if self._hold is not None:
                await self._hold.close()
        lost = block_outage(exc)
        if lost is not None:  # the block's own statement on a lost connection
            raise lost

    async def checkpoint(self, recovery_point: str, *,
                         extend: timedelta | float | None = None) -> datetime:
        """Record ``recovery_point`` and commit it with the writes made so far. Over a pool,
        the connection goes back to it until the block's next statement."""
        return await self._run(  # type: ignore[no-any-return]
            self._core.g_checkpoint(recovery_point, extend))

    async def complete(self, status: int, body: Any = None, *,
                       headers: Mapping[str, str] | None = None,
                       content_type: str | None = None) -> StoredResponse:
        """Store the response and commit it with the business writes."""
        return await self._run(  # type: ignore[no-any-return]
            self._core.g_complete(status, body, headers, content_type))

    async def accept(self, status: int, body: Any = None, *,
                     headers: Mapping[str, str] | None = None,
                     lease: timedelta | float | None = None) -> StoredResponse:
        """Hand the operation over to a worker (see :meth:`pg_idempotency.Operation.accept`)."""
        return await self._run(  # type: ignore[no-any-return]
            self._core.g_accept(status, body, headers, lease))

    async def release(self) -> None:
        """A definite failure before any side effect: roll back and release the key (see
        :meth:`pg_idempotency.Operation.release`)."""
        await self._run(self._core.g_release())


def operation(conn: psycopg.AsyncConnection[Any] | AsyncConnectionPool[Any]
              | asyncpg.Connection | asyncpg.Pool, scope: str,
              key: str,
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
    back, key released).

    ``conn`` may be a ``psycopg_pool.AsyncConnectionPool`` or an ``asyncpg.Pool``: then the
    operation holds a
    connection of it only while its SQL runs. The claim runs on one given back as soon as it
    answered; ``op.conn`` takes one for the business transaction at its first statement (or
    ``complete()`` does, when the block wrote nothing), and ``complete()`` commits on that
    one; ``checkpoint()`` gives it back until the next statement. A block waiting on a slow
    call holds no connection."""
    core_ = OperationCore(scope, key, request, lease=lease, fingerprint=fingerprint,
                          reference_time=reference_time, max_response_bytes=max_response_bytes,
                          max_headers_bytes=max_headers_bytes)
    if is_pool(conn):
        return Operation(core_, None, AsyncHold(conn))
    if is_asyncpg_pool(conn):
        from ._asyncpg_pool import AsyncpgHold  # noqa: PLC0415 - only with asyncpg

        return Operation(core_, None, AsyncpgHold(conn))
    refuse_managed(conn)
    return Operation(core_, conn)


def idempotent(*, lease: timedelta | float = DEFAULT_LEASE, status: int = 200
               ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Make ``async fn(conn, *args, **kwargs)`` idempotent: call it as
    ``await fn(conn, scope, key, *args, **kwargs)``. Its return value (a JSON value) is
    stored with ``status`` in the transaction of its writes; a retry with the same arguments
    returns the stored value without running it. A parameter named ``op`` receives the
    :class:`Operation`."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        run = idempotent_wrapper(fn, lease=lease, status=status,
                                 driver=lambda conn, gen: arunner(conn)(conn, gen),
                                 make_op=lambda c, conn: Operation(c, conn))

        @functools.wraps(run)
        async def call(*args: Any, **kwargs: Any) -> Any:  # a coroutine function, as fn was
            return await run(*args, **kwargs)

        return call

    return decorate
