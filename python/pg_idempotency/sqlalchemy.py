"""SQLAlchemy 2 (sync and asyncio, any PostgreSQL driver: psycopg, asyncpg, pg8000, ...):
idempotent operations whose ORM writes and stored response commit together. Never imported by
the core; needs ``pg-idempotency[sqlalchemy]``. Guide: docs/sqlalchemy.md.

On a Session of your own (no middleware)::

    with pg_idempotency.sqlalchemy.operation(session, scope, key, request) as op:
        if op.replay:
            return op.replay                    # the stored response, nothing runs again
        session.add(LedgerEntry(...))           # the business writes, on this session
        op.complete(201, {"id": 7})             # flush + complete() + session.commit()

``aoperation(async_session, ...)`` is the same for an ``AsyncSession`` (``async with``,
``await op.complete(...)``). The claim is committed on the session first, in a transaction of
its own (concurrent retries must see it at once); then the session's next transaction holds
the ORM writes and ``complete()``, and ``op.complete()`` commits it. The package's statements
run on the session's own connection: through ``text()`` (:mod:`pg_idempotency._sa_exec`),
or, on psycopg, on the psycopg connection under it (:data:`PSYCOPG_DIRECT`).

Behind :class:`pg_idempotency.asgi.IdempotencyMiddleware`::

    @app.post("/payments")
    async def pay(payment: Payment, session: AsyncSession = Depends(request_session)):
        session.add(LedgerEntry(...))
        await session.commit()       # releases a savepoint: the middleware commits later

:func:`request_session` gives an ``AsyncSession`` inside the operation's transaction (on
``op.conn``, a psycopg connection of the middleware's pool), in SQLAlchemy's
``join_transaction_mode="create_savepoint"``: its ``commit()`` keeps the writes in that
transaction, its ``rollback()`` undoes them; the middleware closes it
when the handler returns, stores the response and commits once. :func:`bind_session` is the
same for an :func:`pg_idempotency.aio.operation` of your own.

Writes on any other session would not be fenced by the key: committed early, a crash or a lease
takeover after that commit runs them a second time. So while an operation is open (between
its claim and its completion, and while a handler runs behind the middleware) every commit on
another SQLAlchemy connection raises :class:`ForeignCommitError`, and the operation rolls back.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime, timedelta
from types import TracebackType
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus
from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

try:
    from sqlalchemy.util import await_ as _await
except ImportError:  # SQLAlchemy 2.0
    from sqlalchemy.util import await_only as _await

from . import _exec, _sa_exec, _wire, aio, contract
from ._calls import DEFAULT_LEASE
from ._exec import Call, Gen, Query, Tx
from ._operation import (
    DEFAULT_MAX_HEADERS_BYTES,
    DEFAULT_MAX_RESPONSE_BYTES,
    OperationCore,
    OperationFields,
)
from ._results import StoredResponse
from .errors import UsageError

try:  # for FastAPI's dependency injection of request_session(request: Request)
    from starlette.requests import Request
except ImportError:  # pragma: no cover - sync use needs no starlette
    Request = Any  # type: ignore[misc,assignment]

__all__ = ["AsyncSessionOperation", "ForeignCommitError", "SessionOperation", "aoperation",
           "bind_session", "operation", "refuse_foreign_commits", "request_session"]


class ForeignCommitError(UsageError):
    """A SQLAlchemy connection other than the operation's committed while the operation was
    open. Its writes would not be covered by the key (a crash or a takeover after that commit
    repeats them), so the commit is refused; do the writes on the operation's session."""


# -- the guard against commits outside the operation -----------------------------------------

@dataclass
class _Guard:
    what: str
    allow: bool = False  # True while the operation itself commits its own session


_guard: ContextVar[_Guard | None] = ContextVar("pg_idempotency_sqlalchemy_guard", default=None)


@event.listens_for(Engine, "commit")
def _refuse_commit(conn: Connection) -> None:
    # ConnectionEvents.commit runs before the DBAPI commit, so raising here keeps the writes
    # uncommitted. They must also be rolled back now: SQLAlchemy counts the transaction as
    # ended, and its pool would not reset the connection (the next user's commit would commit
    # them).
    guard = _guard.get()
    if guard is not None and not guard.allow:
        conn.engine.dialect.do_rollback(conn.connection)
        raise ForeignCommitError(
            f"a SQLAlchemy connection committed while {guard.what} was open: its writes would "
            "not be fenced by the idempotency key (a crash or a lease takeover after this "
            "commit would repeat them). Write on the operation's session "
            "(pg_idempotency.sqlalchemy.request_session / operation), or commit after the "
            "operation completed.")


@contextlib.contextmanager
def refuse_foreign_commits(what: Any = "an idempotent operation") -> Iterator[_Guard]:
    """While the block runs (in this thread or task, and tasks started from it), a commit on
    any SQLAlchemy connection raises :class:`ForeignCommitError`. The middleware wraps the
    handler in it; the session operations wrap their business transaction."""
    guard = _Guard(what if isinstance(what, str) else "an idempotent operation")
    token = _guard.set(guard)
    try:
        yield guard
    finally:
        _guard.reset(token)


@contextlib.contextmanager
def _allowing(guard: _Guard | None) -> Iterator[None]:
    if guard is None:
        yield
        return
    guard.allow = True
    try:
        yield
    finally:
        guard.allow = False


# -- operations on a Session / AsyncSession of your own --------------------------------------

def _state(session: Session) -> tuple[TransactionStatus, bool]:
    # What OperationCore asks for: is a transaction open? The session's, not the driver's:
    # SQLAlchemy begins lazily, so an idle session may sit on a connection it has not used.
    busy = session.in_transaction()
    return (TransactionStatus.INTRANS if busy else TransactionStatus.IDLE), False


#: On a psycopg session (``postgresql+psycopg``), the package's statements go to the psycopg
#: connection under SQLAlchemy's, as the package's own API sends them: never prepared
#: (docs/install.md, "Connection poolers"; through SQLAlchemy psycopg would prepare them after
#: ``prepare_threshold`` uses), and without SQLAlchemy's execution machinery, which costs the
#: app more CPU per operation (bench/sa_session.py measures both paths). Every other driver
#: gets them through ``text()``. False sends psycopg's through ``text()`` too (the tests run
#: both ways).
PSYCOPG_DIRECT = True


def _run_session(session: Session, gen: Gen[Any], guard: _Guard | None) -> Any:
    """Drive a core generator on a Session: queries on the session's own connection (so they
    are in its transaction), commit and rollback through the session (so its ORM state
    follows, and pending objects are flushed into the same transaction)."""
    send = gen.send
    value: Any = None
    while True:
        try:
            request = send(value)
        except StopIteration as stop:
            return stop.value
        try:
            if isinstance(request, Query):
                conn = session.connection()
                raw = conn.connection.driver_connection
                if PSYCOPG_DIRECT and isinstance(raw, psycopg.Connection):
                    with raw.cursor(row_factory=_wire.dict_rows(raw)) as cur:
                        cur.execute(request.sql, request.params, prepare=_exec.PREPARE)
                        value = cur.fetchone() if request.fetch == "one" else cur.fetchall()
                else:
                    value = _sa_exec.execute(conn, request)
                if request.commit:  # complete(): the ORM's writes commit with it
                    with _allowing(guard):
                        session.commit()
            elif isinstance(request, Call):
                value = request.fn(*request.args, **request.kwargs)
            elif request is Tx.STATE:
                value = _state(session)
            elif request is Tx.BEGIN:
                session.connection()
                value = None
            elif request is Tx.COMMIT:
                with _allowing(guard):
                    session.commit()
                value = None
            else:
                session.rollback()
                value = None
            send = gen.send
        except Exception as exc:  # noqa: BLE001 - handed to the generator, which re-raises
            value, send = _sa_exec.translate(exc, request), gen.throw


async def _arun_session(session: AsyncSession, gen: Gen[Any], guard: _Guard | None) -> Any:
    """:func:`_run_session` for an AsyncSession."""
    send = gen.send
    value: Any = None
    while True:
        try:
            request = send(value)
        except StopIteration as stop:
            return stop.value
        try:
            if isinstance(request, Query):
                conn = await session.connection()
                raw = (await conn.get_raw_connection()).driver_connection
                if PSYCOPG_DIRECT and isinstance(raw, psycopg.AsyncConnection):
                    async with raw.cursor(row_factory=_wire.dict_rows(raw)) as cur:
                        await cur.execute(request.sql, request.params, prepare=_exec.PREPARE)
                        value = await (cur.fetchone() if request.fetch == "one"
                                       else cur.fetchall())
                else:
                    value = await _sa_exec.aexecute(conn, request)
                if request.commit:
                    with _allowing(guard):
                        await session.commit()
            elif isinstance(request, Call):
                value = request.fn(*request.args, **request.kwargs)
            elif request is Tx.STATE:
                value = _state(session.sync_session)
            elif request is Tx.BEGIN:
                await session.connection()
                value = None
            elif request is Tx.COMMIT:
                with _allowing(guard):
                    await session.commit()
                value = None
            else:
                await session.rollback()
                value = None
            send = gen.send
        except Exception as exc:  # noqa: BLE001
            value, send = _sa_exec.translate(exc, request), gen.throw


@contextlib.contextmanager
def _outage() -> Iterator[None]:
    """The session's own flush on a lost connection raises SQLAlchemy's OperationalError:
    raise :class:`~pg_idempotency.errors.DatabaseUnavailable` instead, as every call of the
    package does."""
    try:
        yield
    except Exception as exc:
        lost = _sa_exec.block_outage(exc)
        if lost is None:
            raise
        raise lost from exc


class _Common(OperationFields):
    def _what(self) -> str:
        return f"the operation on key {self._core.key!r}"


class SessionOperation(_Common):
    """One idempotent operation on a :class:`sqlalchemy.orm.Session`; made by
    :func:`operation`."""

    def __init__(self, core_: OperationCore, session: Session) -> None:
        self._core = core_
        #: The session: do the business writes on it, inside the block.
        self.session = session
        self._guard: contextlib.ExitStack | None = None
        self._active: _Guard | None = None

    def __enter__(self) -> SessionOperation:
        try:
            _run_session(self.session, self._core.g_enter(), None)
        except BaseException:
            if self.session.in_transaction():
                self.session.rollback()
            raise
        if self._core.lease_token is not None:  # we own the key: guard the business writes
            self._guard = contextlib.ExitStack()
            self._active = self._guard.enter_context(refuse_foreign_commits(self._what()))
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._guard is not None:
            self._guard.close()
        _run_session(self.session, self._core.g_exit(exc), None)
        lost = _sa_exec.block_outage(exc)
        if lost is not None:  # a statement of the block (a flush, an execute) on a lost connection
            raise lost

    def complete(self, status: int, body: Any = None, *, headers: Mapping[str, str] | None = None,
                 content_type: str | None = None) -> StoredResponse:
        """Flush the session, store the response in its transaction and commit both."""
        with _outage():
            self.session.flush()
        return _run_session(self.session,  # type: ignore[no-any-return]
                            self._core.g_complete(status, body, headers, content_type),
                            self._active)

    def checkpoint(self, recovery_point: str, *, extend: timedelta | float | None = None
                   ) -> datetime:
        """Record ``recovery_point`` and commit it with the session's writes so far."""
        with _outage():
            self.session.flush()
        return _run_session(self.session,  # type: ignore[no-any-return]
                            self._core.g_checkpoint(recovery_point, extend), self._active)


class AsyncSessionOperation(_Common):
    """:class:`SessionOperation` for an ``AsyncSession``; made by :func:`aoperation`."""

    def __init__(self, core_: OperationCore, session: AsyncSession) -> None:
        self._core = core_
        self.session = session
        self._guard: contextlib.ExitStack | None = None
        self._active: _Guard | None = None

    async def __aenter__(self) -> AsyncSessionOperation:
        try:
            await _arun_session(self.session, self._core.g_enter(), None)
        except BaseException:
            if self.session.in_transaction():
                await self.session.rollback()
            raise
        if self._core.lease_token is not None:
            self._guard = contextlib.ExitStack()
            self._active = self._guard.enter_context(refuse_foreign_commits(self._what()))
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._guard is not None:
            self._guard.close()
        await _arun_session(self.session, self._core.g_exit(exc), None)
        lost = _sa_exec.block_outage(exc)
        if lost is not None:
            raise lost

    async def complete(self, status: int, body: Any = None, *,
                       headers: Mapping[str, str] | None = None,
                       content_type: str | None = None) -> StoredResponse:
        """Flush the session, store the response in its transaction and commit both."""
        with _outage():
            await self.session.flush()
        return await _arun_session(  # type: ignore[no-any-return]
            self.session, self._core.g_complete(status, body, headers, content_type),
            self._active)

    async def checkpoint(self, recovery_point: str, *,
                         extend: timedelta | float | None = None) -> datetime:
        """Record ``recovery_point`` and commit it with the session's writes so far."""
        with _outage():
            await self.session.flush()
        return await _arun_session(  # type: ignore[no-any-return]
            self.session, self._core.g_checkpoint(recovery_point, extend), self._active)


def operation(session: Session, scope: str, key: str, request: Any = None, *,
              lease: timedelta | float = DEFAULT_LEASE, fingerprint: bytes | None = None,
              reference_time: datetime | None = None,
              max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
              max_headers_bytes: int = DEFAULT_MAX_HEADERS_BYTES) -> SessionOperation:
    """``with operation(session, scope, key, request) as op:`` claims the key and commits the
    claim on its own, then runs the block in the session's next transaction; ``op.complete()``
    commits the ORM writes and the response together. Same outcomes and exceptions as
    :func:`pg_idempotency.operation`. The session must not be in a transaction on entry."""
    return SessionOperation(OperationCore(scope, key, request, lease=lease,
                                          fingerprint=fingerprint,
                                          reference_time=reference_time,
                                          max_response_bytes=max_response_bytes,
                                          max_headers_bytes=max_headers_bytes), session)


def aoperation(session: AsyncSession, scope: str, key: str, request: Any = None, *,
               lease: timedelta | float = DEFAULT_LEASE, fingerprint: bytes | None = None,
               reference_time: datetime | None = None,
               max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
               max_headers_bytes: int = DEFAULT_MAX_HEADERS_BYTES) -> AsyncSessionOperation:
    """:func:`operation` for an ``AsyncSession``: ``async with aoperation(...) as op:``."""
    return AsyncSessionOperation(OperationCore(scope, key, request, lease=lease,
                                               fingerprint=fingerprint,
                                               reference_time=reference_time,
                                               max_response_bytes=max_response_bytes,
                                               max_headers_bytes=max_headers_bytes), session)


# -- an AsyncSession inside an aio.Operation's transaction (the middleware's) ---------------

class _Borrowed:
    """The operation's psycopg connection as SQLAlchemy's engine sees it: the operation owns
    its transaction (commits it with the stored response) and its life (a pool's connection),
    so commit is refused and rollback/close are left to the owner. Savepoints, which the
    session uses, are plain SQL and go through.

    The connection itself is asked of the operation at the session's first statement, not
    when the session is made: an operation over a pool (the middleware's) takes one then, so a
    handler that awaits a slow call before it writes holds no connection meanwhile. SQLAlchemy
    calls its driver's connection inside its greenlet, where the operation can be awaited."""

    __slots__ = ("_op", "_conn")

    def __init__(self, op: aio.Operation) -> None:
        object.__setattr__(self, "_op", op)
        object.__setattr__(self, "_conn", None)

    def _real(self) -> Any:
        conn = self._conn
        if conn is None:
            conn = _await(self._op.connection())
            object.__setattr__(self, "_conn", conn)
        return conn

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._real(), name, value)

    async def commit(self) -> None:
        raise UsageError("the operation's transaction is committed with its stored response "
                         "(by the middleware, or op.complete()), not by SQLAlchemy")

    async def rollback(self) -> None:
        pass  # the session's own work is undone by ROLLBACK TO SAVEPOINT

    async def close(self) -> None:
        pass

    def add_notice_handler(self, handler: Any) -> None:
        pass  # one per checkout would pile up on a pooled connection


_lending: ContextVar[aio.Operation | None] = ContextVar("pg_idempotency_sqlalchemy_lending",
                                                        default=None)
_engine: AsyncEngine | None = None


async def _lent() -> _Borrowed:
    op = _lending.get()
    if op is None:
        raise UsageError("the borrowing engine only connects inside bind_session()")
    return _Borrowed(op)


def _borrowing_engine() -> AsyncEngine:
    # One engine for every operation: it never opens a connection, it wraps the one being
    # lent. NullPool: nothing is kept; no reset on return: the operation owns the transaction;
    # no native hstore: its set-up would query and register types on the caller's connection.
    global _engine
    if _engine is None:
        _engine = create_async_engine("postgresql+psycopg://", async_creator=_lent,
                                      poolclass=NullPool, pool_reset_on_return=None,
                                      use_native_hstore=False)
    return _engine


@contextlib.asynccontextmanager
async def bind_session(op: aio.Operation, **session_options: Any
                       ) -> AsyncIterator[AsyncSession]:
    """An ``AsyncSession`` whose statements run on ``op.conn``, in the operation's open
    transaction; over a pool (the middleware's operation) the connection is taken at the
    session's first statement. ``commit()`` releases a savepoint (the writes stay in the operation's
    transaction, which ``op.complete()`` or the middleware commits), ``rollback()`` rolls back
    to it. Closed when the block ends: what was not committed is rolled back. Keyword
    arguments go to ``AsyncSession`` (``expire_on_commit`` defaults to False)."""
    if op.lease_token is None:
        raise UsageError("bind_session(): the operation does not own its key (replay, "
                         "accepted or not entered)")
    token = _lending.set(op)
    try:
        conn = await _borrowing_engine().connect()
    finally:
        _lending.reset(token)
    try:
        await conn.begin()  # the operation's transaction, as SQLAlchemy sees it
        options = {"expire_on_commit": False, **session_options}
        session = AsyncSession(bind=conn, join_transaction_mode="create_savepoint", **options)
        try:
            yield session
        finally:
            await session.close()
    finally:
        await conn.close()


_SESSION_KEY = "idempotency.sqlalchemy"


async def request_session(request: Request) -> AsyncSession:
    """The ``AsyncSession`` of a request behind the middleware (usable as a FastAPI
    dependency: ``session: AsyncSession = Depends(request_session)``), bound to the
    operation's transaction as in :func:`bind_session`; the same one on every call for the
    request. The handler counts as started at the session's first statement, so a request
    that fails validation before that is not stored. Raises UsageError without an operation
    (no Idempotency-Key on an optional route: use your usual session there)."""
    handling = contract.handling_of(request.scope.get("state"))
    if handling is None:
        raise UsageError("request_session(): this request has no idempotency operation (no "
                         "Idempotency-Key, or not behind IdempotencyMiddleware)")
    state = request.scope["state"]
    if _SESSION_KEY in state:
        return state[_SESSION_KEY]  # type: ignore[no-any-return]
    bound = bind_session(handling.op)
    session = await bound.__aenter__()

    def started(*_args: Any) -> None:
        handling.started = True

    event.listen(session.sync_session, "after_begin", started)

    async def close() -> None:
        await bound.__aexit__(None, None, None)

    handling.cleanups.append(close)
    state[_SESSION_KEY] = session
    return session



# Every adapter runs its handlers inside the registered guards (refuse_foreign_commits option).
contract.register_guard(refuse_foreign_commits)
