"""Operations over a connection pool: the connection follows the SQL, not the request.

An operation made on a pool (``aio.operation(pool, ...)``, ``operation(pool, ...)``, and the
HTTP adapters, which make theirs so) holds a connection of the pool only while a statement
runs or a transaction of its own is open on it:

- the claim runs on a connection that goes back to the pool as soon as it answered (the claim
  commits on its own);
- the business transaction takes a connection at its first statement (``op.conn.execute``,
  ``op.conn.cursor()``, ``op.conn.transaction()``, ``await op.connection()``), or at
  ``complete()`` when the block wrote nothing, and ``complete()`` commits on that one, with the
  writes: the guarantee of every operation;
- ``checkpoint()`` commits and gives it back; the block's next statement takes one again;
- a block that ends without completing rolls back and releases (or keeps) the key on whatever
  connection it holds, or on one taken for that statement alone.

Between its statements the operation holds nothing but its lease token, which is what owns the
key: a request waiting on a payment provider for a second keeps no connection idle in
transaction, so a pool serves as many such requests as its connections can run SQL for
(docs/python.md, "Sizing the pool").

A connection goes back to the pool clean: rolled back when a transaction was open on it, and a
lost one, or one a cancellation left with a statement running, is given to the pool to discard.
Giving a connection back runs in a task of its own, awaited shielded, so that a request
cancelled at that moment cannot leave the connection out of its pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import AsyncIterator, Callable
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus

from . import _exec, _wire
from . import queries as Q
from ._exec import Call, Gen, Query, Request, Tx, aexecute, execute, translate
from .errors import UsageError

try:  # the [pool] extra; an operation over a pool has it by construction
    from psycopg_pool import PoolTimeout
except ImportError:  # pragma: no cover
    PoolTimeout = psycopg.OperationalError  # type: ignore[misc,assignment]

_BUSY = (TransactionStatus.INTRANS, TransactionStatus.INERROR)


def is_pool(obj: Any) -> bool:
    """Whether ``obj`` is a psycopg_pool pool (recognised by its methods: the core does not
    import psycopg_pool)."""
    return hasattr(obj, "getconn") and hasattr(obj, "putconn") and hasattr(obj, "max_size")


def _not_now(what: str) -> UsageError:
    return UsageError(
        f"{what}: the operation's transaction is not open (the operation was not entered, does "
        "not own its key, or has ended), so it has no connection to run on")


# -- async -----------------------------------------------------------------------------------

class AsyncHold:
    """The pooled connection of one operation (or of an HTTP adapter's request), taken when a
    statement needs one and given back when no transaction of the operation is open on it.

    ``slots``: a semaphore (anyio's, or asyncio's) taken before a connection for the business
    transaction: the ASGI middleware's ``pool_reserve``. ``timeout``: the pool's wait."""

    __slots__ = ("pool", "slots", "timeout", "conn", "in_tx", "pinned", "_slot", "lost",
                 "timed_out", "ended")

    def __init__(self, pool: Any, slots: Any = None, timeout: float | None = None) -> None:
        self.pool = pool
        self.slots = slots
        self.timeout = timeout
        self.conn: psycopg.AsyncConnection[Any] | None = None
        #: The operation's business transaction is open (between its claim and the commit or
        #: rollback that ends it), whether or not a connection holds it yet.
        self.in_tx = False
        #: The connection itself was handed out (``await op.connection()``, a cursor): kept
        #: until the operation ends, since the caller may use it between statements.
        self.pinned = False
        self._slot = False
        #: A connection of this operation was lost (a handler's 500 is then an outage).
        self.lost = False
        #: The pool had no connection free in time for this operation.
        self.timed_out = False
        #: The operation ended: nothing may take a connection for it any more.
        self.ended = False

    async def take(self, business: bool = False) -> psycopg.AsyncConnection[Any]:
        """The connection held, or one of the pool (PoolTimeout when none is free in time).
        ``business``: for the operation's transaction (after a slot; BEGIN on an autocommit
        connection, as ``Tx.BEGIN`` does)."""
        conn = self.conn
        if conn is not None:
            return conn
        if business and self.slots is not None:
            await self.slots.acquire()
            self._slot = True
        try:
            taken: psycopg.AsyncConnection[Any] = await self.pool.getconn(self.timeout)
        except BaseException as exc:
            self._free_slot()
            if isinstance(exc, PoolTimeout):
                self.timed_out = True
            raise
        self.conn = taken
        if business and taken.autocommit:
            try:
                if not await _wire.abegin(taken):
                    await taken.execute(Q.BEGIN, prepare=_exec.PREPARE)
            except BaseException:
                await self.give_back()
                raise
        return taken

    async def business(self, what: str) -> psycopg.AsyncConnection[Any]:
        """The connection of the operation's open transaction, taken now if need be."""
        if not self.in_tx or self.ended:
            raise _not_now(what)
        return await self.take(business=True)

    async def pin(self, what: str) -> psycopg.AsyncConnection[Any]:
        conn = await self.business(what)
        self.pinned = True
        return conn

    def _free_slot(self) -> None:
        if self._slot:
            self._slot = False
            self.slots.release()

    async def give_back(self) -> None:
        """The connection back to the pool: rolled back if a transaction is open on it, given
        to the pool to discard if it was lost or a statement still runs on it."""
        conn, self.conn = self.conn, None
        self.pinned = False
        try:
            if conn is not None:
                if conn.broken or conn.closed:
                    self.lost = True
                # In a task of its own, awaited shielded: a cancellation of the request
                # (anyio's, or asyncio's own, which no cancel scope holds back) cannot stop it
                # half way, between the pool's hands and ours.
                await asyncio.shield(asyncio.ensure_future(self._return(conn)))
        finally:
            self._free_slot()

    async def _return(self, conn: psycopg.AsyncConnection[Any]) -> None:
        try:
            if not (conn.broken or conn.closed) and \
                    conn.pgconn.transaction_status in _BUSY:
                try:
                    await conn.rollback()
                except Exception:  # noqa: BLE001 - lost: the pool discards it
                    self.lost = True
        finally:
            await self.pool.putconn(conn)

    async def settle(self) -> None:
        """After a step: give the connection back unless the operation's transaction is open on
        it (or it was handed out)."""
        conn = self.conn
        if conn is None:
            return
        status = conn.pgconn.transaction_status
        if conn.broken or status in (TransactionStatus.ACTIVE, TransactionStatus.UNKNOWN):
            await self.give_back()
        elif status == TransactionStatus.IDLE and not (self.pinned and self.in_tx):
            await self.give_back()

    async def close(self) -> None:
        """The operation ended: give back what is held."""
        self.ended = True
        self.in_tx = False
        await self.give_back()


async def arun_pooled(hold: AsyncHold, gen: Gen[Any]) -> Any:
    """:func:`pg_idempotency._exec.arun` on the connections of ``hold``: each statement on the
    connection held, or one taken for it; a transaction boundary where no connection is held
    is a no-op (nothing of the operation's is open anywhere); after the step, the connection
    goes back unless the operation's transaction is open on it."""
    send: Callable[[Any], Request] = gen.send
    value: Any = None
    try:
        while True:
            try:
                request = send(value)
            except StopIteration as stop:
                return stop.value
            try:
                if isinstance(request, Query):
                    conn = await hold.take(business=hold.in_tx)
                    value = await aexecute(conn, request)
                    if request.commit:
                        hold.in_tx = False
                elif isinstance(request, Call):
                    value = request.fn(*request.args, **request.kwargs)
                    if inspect.isawaitable(value):
                        value = await value
                elif request is Tx.STATE:
                    held = hold.conn
                    # a connection of the pool is idle when it is taken
                    value = ((TransactionStatus(held.pgconn.transaction_status), held.autocommit)
                             if held is not None else (TransactionStatus.IDLE, False))
                elif request is Tx.BEGIN:
                    # The claim's connection (or a checkpoint's) goes back: the transaction
                    # takes one at its first statement.
                    if hold.conn is not None and not hold.pinned:
                        await hold.give_back()
                    hold.in_tx = True
                    held = hold.conn
                    if held is not None and held.autocommit and \
                            held.pgconn.transaction_status == TransactionStatus.IDLE:
                        # handed out: the transaction opens on it now
                        await held.execute(Q.BEGIN, prepare=_exec.PREPARE)
                    value = None
                else:  # COMMIT or ROLLBACK of the operation's transaction
                    hold.in_tx = False
                    if hold.conn is not None:
                        await (hold.conn.commit() if request is Tx.COMMIT
                               else hold.conn.rollback())
                    value = None
                send = gen.send
            except PoolTimeout as exc:
                value, send = exc, gen.throw  # the adapters answer it (503), as it is
            except Exception as exc:  # noqa: BLE001 - handed to the generator, which re-raises
                value, send = translate(exc, request), gen.throw
    finally:
        await hold.settle()


class PooledAsyncConnection:
    """``op.conn`` of an async operation over a pool: the psycopg connection of the operation's
    transaction, taken from the pool at its first statement. ``await execute()``,
    ``cursor()``, ``transaction()`` and ``pipeline()`` (``async with``), ``commit()`` and
    ``rollback()`` are the connection's; any other attribute is the connection's once one is
    held (``await op.connection()`` takes it and returns the connection itself)."""

    __slots__ = ("_hold",)

    def __init__(self, hold: AsyncHold) -> None:
        self._hold = hold

    async def execute(self, query: Any, params: Any = None, **kwargs: Any
                      ) -> psycopg.AsyncCursor[Any]:
        conn = await self._hold.business("op.conn.execute()")
        return await conn.execute(query, params, **kwargs)

    def cursor(self, *args: Any, **kwargs: Any) -> _LazyCursor:
        return _LazyCursor(self._hold, args, kwargs)

    @contextlib.asynccontextmanager
    async def transaction(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        conn = await self._hold.pin("op.conn.transaction()")
        async with conn.transaction(*args, **kwargs) as tx:
            yield tx

    @contextlib.asynccontextmanager
    async def pipeline(self) -> AsyncIterator[Any]:
        conn = await self._hold.pin("op.conn.pipeline()")
        async with conn.pipeline() as p:
            yield p

    async def commit(self) -> None:
        if self._hold.conn is not None:
            await self._hold.conn.commit()

    async def rollback(self) -> None:
        if self._hold.conn is not None:
            await self._hold.conn.rollback()

    @property
    def broken(self) -> bool:
        return self._hold.lost or (self._hold.conn is not None and self._hold.conn.broken)

    @property
    def closed(self) -> bool:
        return self._hold.conn is not None and self._hold.conn.closed

    @property
    def starved(self) -> bool:
        """The pool had no connection free in time for the operation (a handler's 500 made of
        that is a 503)."""
        return self._hold.timed_out

    def __getattr__(self, name: str) -> Any:
        conn = self._hold.conn
        if conn is None:
            raise UsageError(
                f"op.conn.{name}: the operation takes its connection from the pool at its first "
                "statement and has none yet; use `conn = await op.connection()` for the "
                "connection itself")
        return getattr(conn, name)


class _LazyCursor:
    """``op.conn.cursor(...)``: the connection's cursor, made once the connection is taken
    (``async with``, or at the first ``await cur.execute()``)."""

    __slots__ = ("_hold", "_args", "_kwargs", "_cur")

    def __init__(self, hold: AsyncHold, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._hold = hold
        self._args = args
        self._kwargs = kwargs
        self._cur: Any = None

    async def _made(self) -> Any:
        if self._cur is None:
            conn = await self._hold.pin("op.conn.cursor()")
            self._cur = conn.cursor(*self._args, **self._kwargs)
        return self._cur

    async def __aenter__(self) -> Any:
        return await (await self._made()).__aenter__()

    async def __aexit__(self, *exc: Any) -> None:
        await self._cur.__aexit__(*exc)

    async def execute(self, *args: Any, **kwargs: Any) -> Any:
        return await (await self._made()).execute(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if self._cur is None:
            raise UsageError(f"cursor.{name}: execute a statement first")
        return getattr(self._cur, name)


# -- sync ------------------------------------------------------------------------------------

class Hold:
    """:class:`AsyncHold` for a sync ``psycopg_pool.ConnectionPool`` (Flask, WSGI)."""

    __slots__ = ("pool", "timeout", "conn", "in_tx", "pinned", "lost", "timed_out", "ended")

    def __init__(self, pool: Any, timeout: float | None = None) -> None:
        self.pool = pool
        self.timeout = timeout
        self.conn: psycopg.Connection[Any] | None = None
        self.in_tx = False
        self.pinned = False
        self.lost = False
        self.timed_out = False
        self.ended = False

    def take(self, business: bool = False) -> psycopg.Connection[Any]:
        conn = self.conn
        if conn is not None:
            return conn
        try:
            taken: psycopg.Connection[Any] = self.pool.getconn(self.timeout)
        except PoolTimeout:
            self.timed_out = True
            raise
        self.conn = taken
        if business and taken.autocommit:
            try:
                if not _wire.begin(taken):
                    taken.execute(Q.BEGIN, prepare=_exec.PREPARE)
            except BaseException:
                self.give_back()
                raise
        return taken

    def business(self, what: str) -> psycopg.Connection[Any]:
        if not self.in_tx or self.ended:
            raise _not_now(what)
        return self.take(business=True)

    def pin(self, what: str) -> psycopg.Connection[Any]:
        conn = self.business(what)
        self.pinned = True
        return conn

    def give_back(self) -> None:
        conn, self.conn = self.conn, None
        self.pinned = False
        if conn is None:
            return
        try:
            if conn.broken or conn.closed:
                self.lost = True
            elif conn.pgconn.transaction_status in _BUSY:
                try:
                    conn.rollback()
                except Exception:  # noqa: BLE001 - lost: the pool discards it
                    self.lost = True
        finally:
            self.pool.putconn(conn)

    def settle(self) -> None:
        conn = self.conn
        if conn is None:
            return
        status = conn.pgconn.transaction_status
        if conn.broken or status in (TransactionStatus.ACTIVE, TransactionStatus.UNKNOWN):
            self.give_back()
        elif status == TransactionStatus.IDLE and not (self.pinned and self.in_tx):
            self.give_back()

    def close(self) -> None:
        self.ended = True
        self.in_tx = False
        self.give_back()


def run_pooled(hold: Hold, gen: Gen[Any]) -> Any:
    """:func:`arun_pooled` for a sync pool."""
    send: Callable[[Any], Request] = gen.send
    value: Any = None
    try:
        while True:
            try:
                request = send(value)
            except StopIteration as stop:
                return stop.value
            try:
                if isinstance(request, Query):
                    value = execute(hold.take(business=hold.in_tx), request)
                    if request.commit:
                        hold.in_tx = False
                elif isinstance(request, Call):
                    value = request.fn(*request.args, **request.kwargs)
                elif request is Tx.STATE:
                    held = hold.conn
                    value = ((TransactionStatus(held.pgconn.transaction_status), held.autocommit)
                             if held is not None else (TransactionStatus.IDLE, False))
                elif request is Tx.BEGIN:
                    if hold.conn is not None and not hold.pinned:
                        hold.give_back()
                    hold.in_tx = True
                    held = hold.conn
                    if held is not None and held.autocommit and \
                            held.pgconn.transaction_status == TransactionStatus.IDLE:
                        held.execute(Q.BEGIN, prepare=_exec.PREPARE)
                    value = None
                else:
                    hold.in_tx = False
                    if hold.conn is not None:
                        (hold.conn.commit if request is Tx.COMMIT else hold.conn.rollback)()
                    value = None
                send = gen.send
            except PoolTimeout as exc:
                value, send = exc, gen.throw
            except Exception as exc:  # noqa: BLE001
                value, send = translate(exc, request), gen.throw
    finally:
        hold.settle()


class PooledConnection:
    """``op.conn`` of a sync operation over a pool: the psycopg connection of the operation's
    transaction, taken from the pool at its first use (any attribute: a sync connection can be
    taken right there). Everything but ``execute()`` hands the connection out, which keeps it
    until the operation ends."""

    __slots__ = ("_hold",)

    def __init__(self, hold: Hold) -> None:
        self._hold = hold

    def execute(self, query: Any, params: Any = None, **kwargs: Any) -> psycopg.Cursor[Any]:
        return self._hold.business("op.conn.execute()").execute(query, params, **kwargs)

    @property
    def broken(self) -> bool:
        return self._hold.lost or (self._hold.conn is not None and self._hold.conn.broken)

    @property
    def closed(self) -> bool:
        return self._hold.conn is not None and self._hold.conn.closed

    @property
    def starved(self) -> bool:
        """The pool had no connection free in time for the operation (a handler's 500 made of
        that is a 503)."""
        return self._hold.timed_out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._hold.pin(f"op.conn.{name}"), name)
