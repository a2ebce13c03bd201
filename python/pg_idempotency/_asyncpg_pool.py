"""Operations over an asyncpg pool: :mod:`pg_idempotency._pooled`'s "the connection follows
the SQL" for ``asyncpg.Pool``.

- the claim runs on a connection acquired for it and released as soon as it answered (asyncpg
  commits a statement outside a transaction on its own);
- the business transaction acquires a connection at its first statement (``op.conn.execute``,
  ``fetch``, ``fetchrow``, ``fetchval``, ``executemany``, ``op.conn.transaction()``, ``await
  op.connection()``), or at ``complete()`` when the block wrote nothing; the package starts an
  asyncpg ``Transaction`` on it, and ``complete()`` commits that one, with the writes;
- ``checkpoint()`` commits and releases it; the block's next statement acquires one again;
- a block that ends without completing rolls back and releases (or keeps) the key.

A connection goes back to the pool rolled back (asyncpg's own reset would roll back too, but
warns of a transaction left open), in a task of its own awaited shielded, so that a request
cancelled at that moment cannot keep it from its pool; asyncpg's release waits for a
cancelled statement and terminates a connection it cannot reset. No connection of the pool
free within ``timeout`` seconds raises psycopg_pool's ``PoolTimeout``, as a psycopg pool
does, so that the adapters answer it alike (503); a database that refuses the connection
raises :class:`~pg_idempotency.errors.DatabaseUnavailable`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from psycopg.pq import TransactionStatus

from ._asyncpg import Session, drive, gone, is_asyncpg
from ._exec import Gen, Query, Tx
from ._pooled import PoolTimeout, _not_now
from .errors import DatabaseUnavailable, UsageError, is_unavailable

#: How long an operation waits for a connection of the pool (seconds), unless told: psycopg
#: pool's default, so that both pools answer a starved request alike.
DEFAULT_TIMEOUT = 30.0


class AsyncpgHold:
    """:class:`pg_idempotency._pooled.AsyncHold` for an ``asyncpg.Pool``: the connection of
    one operation (or of an HTTP adapter's request), acquired when a statement needs one and
    released when no transaction of the operation is open on it."""

    __slots__ = ("pool", "slots", "timeout", "conn", "session", "in_tx", "pinned", "_slot",
                 "lost", "timed_out", "ended")

    def __init__(self, pool: Any, slots: Any = None, timeout: float | None = None) -> None:
        self.pool = pool
        self.slots = slots
        self.timeout = DEFAULT_TIMEOUT if timeout is None else timeout
        self.conn: Any = None
        self.session: Session | None = None
        self.in_tx = False
        self.pinned = False
        self._slot = False
        self.lost = False
        self.timed_out = False
        self.ended = False

    async def take(self, business: bool = False) -> Session:
        """The session of the connection held, or of one acquired now. ``business``: for the
        operation's transaction (after a slot; the package's transaction begun on it)."""
        if self.session is not None:
            return self.session
        if business and self.slots is not None:
            await self.slots.acquire()
            self._slot = True
        try:
            conn = await self.pool.acquire(timeout=self.timeout)
        except BaseException as exc:
            self._free_slot()
            if isinstance(exc, asyncio.TimeoutError):
                self.timed_out = True
                raise PoolTimeout(f"no connection of the asyncpg pool free in "
                                  f"{self.timeout:g} s") from exc
            if isinstance(exc, Exception) and (isinstance(exc, OSError) or is_unavailable(exc)):
                self.lost = True
                raise DatabaseUnavailable(f"the database is unavailable: {exc}",
                                          pgerror=exc) from exc
            raise
        self.conn = conn
        self.session = Session(conn)
        if business:
            try:
                await self.session.begin()
            except BaseException:
                await self.give_back()
                raise
        return self.session

    async def business(self, what: str) -> Any:
        """The connection of the operation's open transaction, acquired now if need be."""
        if not self.in_tx or self.ended:
            raise _not_now(what)
        return (await self.take(business=True)).conn

    async def pin(self, what: str) -> Any:
        conn = await self.business(what)
        self.pinned = True
        return conn

    def _free_slot(self) -> None:
        if self._slot:
            self._slot = False
            self.slots.release()

    async def give_back(self) -> None:
        conn, session = self.conn, self.session
        self.conn = self.session = None
        self.pinned = False
        try:
            if conn is not None:
                if gone(conn):
                    self.lost = True
                await asyncio.shield(asyncio.ensure_future(self._return(conn, session)))
        finally:
            self._free_slot()

    async def _return(self, conn: Any, session: Session | None) -> None:
        try:
            if self.lost and not gone(conn):
                # broken under us (an InternalClientError, an outage): not to be reused
                conn.terminate()
            if not gone(conn) and conn.is_in_transaction():
                try:
                    if session is not None and session.tx is not None:
                        await session.end(False)
                    else:
                        await conn.execute("ROLLBACK")
                except Exception:  # noqa: BLE001 - lost, or busy: asyncpg's release ends it
                    self.lost = True
        finally:
            try:
                await self.pool.release(conn)
            except Exception:  # noqa: BLE001 - it could not reset it: terminated, not reused
                self.lost = True

    async def settle(self) -> None:
        """After a step: release the connection unless the operation's transaction is open on
        it (or it was handed out)."""
        conn = self.conn
        if conn is None:
            return
        if gone(conn) or not (conn.is_in_transaction() or (self.pinned and self.in_tx)):
            await self.give_back()

    async def close(self) -> None:
        self.ended = True
        self.in_tx = False
        await self.give_back()

    def proxy(self) -> PooledAsyncpgConnection:
        return PooledAsyncpgConnection(self)

    async def run(self, gen: Gen[Any]) -> Any:
        """:func:`pg_idempotency._pooled.arun_pooled` on this pool's connections."""
        async def execute(q: Query) -> Any:
            session = await self.take(business=self.in_tx)
            try:
                value = await session.execute(q)
            except Exception as exc:
                if is_unavailable(exc):
                    self.lost = True
                raise
            if q.commit:
                self.in_tx = False
            return value

        async def tx(request: Tx) -> Any:
            session = self.session
            if request is Tx.STATE:
                return session.state() if session is not None else (TransactionStatus.IDLE, True)
            if request is Tx.BEGIN:
                # The claim's connection (or a checkpoint's) goes back: the transaction takes
                # one at its first statement.
                if session is not None and not self.pinned:
                    await self.give_back()
                self.in_tx = True
                if self.session is not None:  # handed out: the transaction opens on it now
                    await self.session.begin()
                return None
            self.in_tx = False
            if session is not None:
                await session.end(request is Tx.COMMIT)
            return None

        try:
            return await drive(self, gen, execute, tx)
        finally:
            await self.settle()


class PooledAsyncpgConnection:
    """``op.conn`` of an operation over an asyncpg pool: the connection of the operation's
    transaction, acquired at its first statement. ``await execute()``, ``executemany()``,
    ``fetch()``, ``fetchrow()``, ``fetchval()`` and ``transaction()`` (``async with``: a
    savepoint in the operation's transaction) are the connection's; any other attribute is the
    connection's once one is held (``await op.connection()`` acquires it and returns it)."""

    __slots__ = ("_hold",)

    def __init__(self, hold: AsyncpgHold) -> None:
        self._hold = hold

    async def _on(self, name: str, *args: Any, **kwargs: Any) -> Any:
        conn = await self._hold.business(f"op.conn.{name}()")
        return await getattr(conn, name)(*args, **kwargs)

    async def execute(self, query: str, *args: Any, **kwargs: Any) -> Any:
        return await self._on("execute", query, *args, **kwargs)

    async def executemany(self, command: str, args: Any, **kwargs: Any) -> Any:
        return await self._on("executemany", command, args, **kwargs)

    async def fetch(self, query: str, *args: Any, **kwargs: Any) -> Any:
        return await self._on("fetch", query, *args, **kwargs)

    async def fetchrow(self, query: str, *args: Any, **kwargs: Any) -> Any:
        return await self._on("fetchrow", query, *args, **kwargs)

    async def fetchval(self, query: str, *args: Any, **kwargs: Any) -> Any:
        return await self._on("fetchval", query, *args, **kwargs)

    @contextlib.asynccontextmanager
    async def transaction(self, **kwargs: Any) -> AsyncIterator[Any]:
        conn = await self._hold.pin("op.conn.transaction()")
        async with conn.transaction(**kwargs) as tx:
            yield tx

    def is_in_transaction(self) -> bool:
        conn = self._hold.conn
        return conn is not None and not gone(conn) and conn.is_in_transaction()

    def is_closed(self) -> bool:
        conn = self._hold.conn
        return conn is not None and gone(conn)

    @property
    def broken(self) -> bool:
        """A connection of the operation was lost (a handler's 500 made of that is a 503)."""
        return self._hold.lost or self.is_closed()

    @property
    def closed(self) -> bool:
        return self.is_closed()

    @property
    def starved(self) -> bool:
        """The pool had no connection free in time for the operation."""
        return self._hold.timed_out

    def __getattr__(self, name: str) -> Any:
        conn = self._hold.conn
        if conn is None or not is_asyncpg(conn):
            raise UsageError(
                f"op.conn.{name}: the operation takes its connection from the pool at its first "
                "statement and has none yet; use `conn = await op.connection()` for the "
                "connection itself")
        return getattr(conn, name)
