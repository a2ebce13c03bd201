"""Execution and errors: what the generators of :mod:`pg_idempotency._calls` and
:mod:`pg_idempotency._operation` ask for (a :class:`Query`, a :class:`Call` of the caller's
function, a :class:`Tx` boundary), the sync driver (:func:`run`) and the async one
(:func:`arun`) that answer them on the caller's connection, and the errors they throw back
into the generator (:func:`translate`: psycopg's errors as the classes of
:mod:`pg_idempotency.errors`). So the logic (which statement, which transaction boundary, what
to do on an error) exists once, and the two APIs cannot drift apart.

A statement goes through a psycopg cursor, or, for claim and complete + COMMIT when nothing is
prepared and no pipeline is open, through the package's own sends (:mod:`pg_idempotency._wire`,
the only module that touches psycopg's internals).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable, Generator, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, Concatenate, Final, ParamSpec, TypeVar

import psycopg
from psycopg.pq import PipelineStatus, TransactionStatus

from . import _wire
from . import queries as Q
from .errors import (
    DatabaseUnavailable,
    IdempotencyError,
    connection_lost,
    from_psycopg,
    invalid_argument,
    is_unavailable,
)

P = ParamSpec("P")
T = TypeVar("T")


#: psycopg's ``prepare`` for every statement the package sends: never a named server-side
#: prepared statement, whatever the connection's ``prepare_threshold``. Behind a
#: transaction-mode pooler (pgbouncer) the server connection changes between transactions, so
#: a name prepared by one client can be executed by another: in issue 13 one client's
#: heartbeat() ran another's prepared release() and deleted its key. Unnamed statements (Parse
#: and Bind of "") live for one statement only; bench/prepare.py measures what that costs
#: (docs/design.md, "Performance decisions"). Tests set it to None (psycopg's default) to show
#: what it prevents. allow_prepared_statements() sets it, for processes with no such pooler in
#: between.
PREPARE: bool | None = False


def allow_prepared_statements(allowed: bool = True) -> None:
    """Let psycopg prepare the package's statements as each connection's ``prepare_threshold``
    says (``allowed=True``), or never (``False``: the default). For the whole process.

    Preparing saves the server the parse and plan of every call (claim and complete are
    function calls with a dozen casts and columns; bench/prepare.py measures it). Allow it only
    when no transaction-mode pooler (pgbouncer before 1.21 without ``max_prepared_statements``)
    sits between this process and the server: there a statement prepared by one client can run
    as another's (docs/install.md, "Connection poolers"). A connection with
    ``prepare_threshold=None`` still prepares nothing."""
    if not isinstance(allowed, bool):
        raise TypeError(f"allow_prepared_statements: allowed must be True or False, "
                        f"not {allowed!r}")
    global PREPARE
    PREPARE = None if allowed else False


# -- what the generators ask the drivers for -------------------------------------------------

#: The calls Citus delegates by their first argument (docs/scale-out.md), with its name. A NULL
#: there crashes a Citus 14.0.1 node's backend before the function can refuse it, so the
#: package refuses it first, with the engine's own error (IK010), and sends nothing.
DELEGATED_BY: Final = {
    Q.CLAIM: ("idempotency.claim", "scope"), Q.TAKEOVER: ("idempotency.takeover", "scope"),
    Q.CHECKPOINT: ("idempotency.checkpoint", "scope"),
    Q.HEARTBEAT: ("idempotency.heartbeat", "scope"),
    Q.COMPLETE: ("idempotency.complete", "scope"),
    Q.COMPLETE_BYTES: ("idempotency.complete_bytes", "scope"),
    Q.ACCEPT: ("idempotency.accept", "scope"), Q.RELEASE: ("idempotency.release", "scope"),
    Q.HEARTBEAT_OUTCOME: ("idempotency.heartbeat_outcome", "scope"),
    Q.CHECKPOINT_OUTCOME: ("idempotency.checkpoint_outcome", "scope"),
    Q.RELEASE_OUTCOME: ("idempotency.release_outcome", "scope"),
    Q.INBOX_ACCEPT: ("idempotency.inbox_accept", "consumer"),
}


class Query:
    """One statement for a driver to run (a plain class with slots: one is made per call)."""

    __slots__ = ("sql", "params", "fetch", "fenced", "alone", "commit", "binary_sql")

    def __init__(self, sql: str, params: Mapping[str, Any], fetch: str = "one", *,
                 fenced: bool = False, alone: bool = False, commit: bool = False,
                 binary_sql: str | None = None) -> None:
        delegated = DELEGATED_BY.get(sql)
        if delegated is not None and params.get(delegated[1]) is None:
            raise invalid_argument(*delegated, "IK010", "must not be NULL")
        self.sql = sql
        self.params = params
        #: "one" (a dict row or None) or "all" (a list of dict rows)
        self.fetch = fetch
        #: The call takes a lease token: its IK003/IK004 become LeaseLost subclasses.
        self.fenced = fenced
        #: Run it as a transaction of its own: on an idle connection that is not in
        #: autocommit, switch autocommit on for this one statement (1 round trip instead of
        #: BEGIN, the statement and COMMIT).
        self.alone = alone
        #: Commit right after it, in the same round trip (one simple Query, or the caller's
        #: pipeline).
        self.commit = commit
        #: The same call as ``sql`` with the whole claim_result in binary
        #: (queries.CLAIM_BINARY): the package's own drivers run it and return its
        #: :func:`~pg_idempotency._wire.claim_result_of`; a driver that reads rows (the
        #: SQLAlchemy session's) runs ``sql`` and hands over a dict row.
        self.binary_sql = binary_sql


@dataclass(frozen=True)
class Call:
    """Call the user's function; the async driver awaits what it returns if awaitable."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]


class Tx(Enum):
    STATE = "state"  # -> (TransactionStatus, autocommit)
    BEGIN = "begin"  # open a transaction now (explicit BEGIN on an autocommit connection)
    COMMIT = "commit"
    ROLLBACK = "rollback"


Request = Query | Call | Tx
Gen = Generator[Request, Any, T]


def run(conn: psycopg.Connection[Any], gen: Gen[T]) -> T:
    """Drive ``gen`` on a sync connection. Engine errors are thrown into the generator (so it
    can clean up) as the classes of :mod:`pg_idempotency.errors`."""
    send: Callable[[Any], Request] = gen.send
    value: Any = None
    while True:
        try:
            request = send(value)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        try:
            if isinstance(request, Query):
                value = execute(conn, request)
            elif isinstance(request, Call):
                value = request.fn(*request.args, **request.kwargs)
            elif request is Tx.STATE:
                # (libpq's status as conn.info gives it, without a ConnectionInfo per call)
                value = (TransactionStatus(conn.pgconn.transaction_status), conn.autocommit)
            elif request is Tx.BEGIN:
                if conn.autocommit and conn.pgconn.transaction_status == TransactionStatus.IDLE:
                    if not _wire.begin(conn):
                        conn.execute(Q.BEGIN, prepare=PREPARE)
                value = None
            elif request is Tx.COMMIT:
                conn.commit()
                value = None
            else:
                conn.rollback()
                value = None
            send = gen.send
        except Exception as exc:  # noqa: BLE001 - handed to the generator, which re-raises
            value, send = translate(exc, request), gen.throw


def execute(conn: psycopg.Connection[Any], q: Query) -> Any:
    if q.alone and not conn.autocommit and conn.info.transaction_status == TransactionStatus.IDLE:
        conn.autocommit = True
        try:
            return execute(conn, q)
        finally:
            if not conn.broken:  # a lost connection cannot switch (its status is UNKNOWN)
                conn.autocommit = False
    if q.binary_sql is not None and conn.pgconn.pipeline_status == PipelineStatus.OFF:
        if PREPARE is False:
            result = _wire.send_claim(conn, q.binary_sql, q.params)
            if result is not None:
                return result
        # psycopg's own cursor class, not the connection's cursor_factory (a ClientCursor
        # cannot ask for binary results)
        with psycopg.Cursor(conn) as bcur:
            bcur.execute(q.binary_sql, q.params, prepare=PREPARE, binary=True)
            return _wire.claim_result_of(bcur.pgresult, _wire.codec(conn.pgconn))
    if q.commit and PREPARE is False and conn.pgconn.pipeline_status == PipelineStatus.OFF:
        # The statement and COMMIT in one simple Query message: one round trip, with the
        # values bound here (psycopg quotes them for the connection's settings) and none of
        # a pipeline's machinery, which costs the app more CPU than the round trip it saves
        # (docs/design.md, "Performance decisions"). An error in the statement skips the
        # COMMIT.
        row = _wire.send_commit(conn, q)
        if row is not _wire.UNSENT:
            return row
        with psycopg.ClientCursor(conn, row_factory=_wire.dict_rows(conn)) as ccur:
            ccur.execute(q.sql + Q.AND_COMMIT, q.params, prepare=False)
            return ccur.fetchone() if q.fetch == "one" else ccur.fetchall()
    with conn.cursor(row_factory=_wire.dict_rows(conn)) as cur:
        if q.commit and conn.pgconn.pipeline_status != PipelineStatus.OFF:
            # the caller's pipeline (opt-in): their writes, complete and COMMIT go together
            cur.execute(q.sql, q.params, prepare=PREPARE)
            conn.execute(Q.COMMIT, prepare=PREPARE)
        elif q.commit and PIPELINE:
            # one Sync for both: conn.commit() in a pipeline would send a second one
            with conn.pipeline():
                cur.execute(q.sql, q.params, prepare=PREPARE)
                conn.execute(Q.COMMIT, prepare=PREPARE)
        else:
            cur.execute(q.sql, q.params, prepare=PREPARE)
            if q.commit:
                conn.commit()
        return cur.fetchone() if q.fetch == "one" else cur.fetchall()


async def aexecute(conn: psycopg.AsyncConnection[Any], q: Query) -> Any:
    if q.alone and not conn.autocommit and conn.info.transaction_status == TransactionStatus.IDLE:
        await conn.set_autocommit(True)
        try:
            return await aexecute(conn, q)
        finally:
            if not conn.broken:  # a lost connection cannot switch (its status is UNKNOWN)
                await conn.set_autocommit(False)
    if q.binary_sql is not None and conn.pgconn.pipeline_status == PipelineStatus.OFF:
        if PREPARE is False:
            result = await _wire.asend_claim(conn, q.binary_sql, q.params)
            if result is not None:
                return result
        async with psycopg.AsyncCursor(conn) as bcur:
            await bcur.execute(q.binary_sql, q.params, prepare=PREPARE, binary=True)
            return _wire.claim_result_of(bcur.pgresult, _wire.codec(conn.pgconn))
    if q.commit and PREPARE is False and conn.pgconn.pipeline_status == PipelineStatus.OFF:
        row = await _wire.asend_commit(conn, q)
        if row is not _wire.UNSENT:
            return row
        async with psycopg.AsyncClientCursor(conn, row_factory=_wire.dict_rows(conn)) as ccur:
            await ccur.execute(q.sql + Q.AND_COMMIT, q.params, prepare=False)
            return await (ccur.fetchone() if q.fetch == "one" else ccur.fetchall())
    async with conn.cursor(row_factory=_wire.dict_rows(conn)) as cur:
        if q.commit and conn.pgconn.pipeline_status != PipelineStatus.OFF:
            await cur.execute(q.sql, q.params, prepare=PREPARE)
            await conn.execute(Q.COMMIT, prepare=PREPARE)
        elif q.commit and PIPELINE:
            async with conn.pipeline():
                await cur.execute(q.sql, q.params, prepare=PREPARE)
                await conn.execute(Q.COMMIT, prepare=PREPARE)
        else:
            await cur.execute(q.sql, q.params, prepare=PREPARE)
            if q.commit:
                await conn.commit()
        return await (cur.fetchone() if q.fetch == "one" else cur.fetchall())


async def arun(conn: psycopg.AsyncConnection[Any], gen: Gen[T]) -> T:
    """:func:`run` for an async connection."""
    send: Callable[[Any], Request] = gen.send
    value: Any = None
    while True:
        try:
            request = send(value)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        try:
            if isinstance(request, Query):
                value = await aexecute(conn, request)
            elif isinstance(request, Call):
                value = request.fn(*request.args, **request.kwargs)
                if inspect.isawaitable(value):
                    value = await value
            elif request is Tx.STATE:
                value = (TransactionStatus(conn.pgconn.transaction_status), conn.autocommit)
            elif request is Tx.BEGIN:
                if conn.autocommit and conn.pgconn.transaction_status == TransactionStatus.IDLE:
                    if not await _wire.abegin(conn):
                        await conn.execute(Q.BEGIN, prepare=PREPARE)
                value = None
            elif request is Tx.COMMIT:
                await conn.commit()
                value = None
            else:
                await conn.rollback()
                value = None
            send = gen.send
        except Exception as exc:  # noqa: BLE001
            value, send = translate(exc, request), gen.throw


#: libpq 14 or later: complete() and its COMMIT go in one round trip.
PIPELINE = psycopg.Pipeline.is_supported()


def translate(exc: Exception, request: Request) -> Exception:
    if isinstance(exc, psycopg.Error):
        mapped = from_psycopg(exc, lease_token=isinstance(request, Query) and request.fenced)
        if mapped is not exc:
            mapped.__cause__ = exc
        return mapped
    if not isinstance(exc, DatabaseUnavailable) and not isinstance(request, Call) \
            and connection_lost(exc):
        # A driver's wrapper of psycopg's error (SQLAlchemy's OperationalError, when the
        # session runs the generator): the same outage, the same exception.
        mapped = DatabaseUnavailable(f"the database is unavailable: {exc}")
        mapped.__cause__ = exc
        return mapped
    return exc


def block_outage(exc: BaseException | None) -> DatabaseUnavailable | None:
    """What an operation block's exception becomes when the database cannot be reached: the
    caller's own statement on the lost connection (psycopg's OperationalError, or SQLAlchemy's
    wrapper of it) surfaces from the block as :class:`DatabaseUnavailable`, as every call of
    the package does; None for any other exception (it propagates as it is)."""
    if not isinstance(exc, Exception) or isinstance(exc, IdempotencyError) \
            or not connection_lost(exc):
        return None
    cause: BaseException | None = exc
    while cause is not None and not isinstance(cause, psycopg.Error) \
            and not is_unavailable(cause):
        cause = cause.__cause__ or cause.__context__
    mapped = DatabaseUnavailable(f"the database is unavailable: {exc}",
                                 pgerror=cause if isinstance(cause, Exception) else None)
    mapped.__cause__ = exc
    return mapped


def make_sync(op: Callable[P, Gen[T]]) -> Callable[Concatenate[psycopg.Connection[Any], P], T]:
    @functools.wraps(op)
    def call(conn: psycopg.Connection[Any], /, *args: P.args, **kwargs: P.kwargs) -> T:
        return run(conn, op(*args, **kwargs))

    return call


#: The async driver of each class of connection seen so far (:func:`arunner`).
_ARUNNERS: dict[type, Callable[[Any, Gen[Any]], Awaitable[Any]]] = {}


def arunner(conn: Any) -> Callable[[Any, Gen[Any]], Awaitable[Any]]:
    """The async driver for ``conn``: :func:`arun` for psycopg's connections,
    :func:`pg_idempotency._asyncpg.arun` for asyncpg's. Decided once a class of connection."""
    cls = type(conn)
    runner = _ARUNNERS.get(cls)
    if runner is None:
        if cls.__module__.partition(".")[0] == "asyncpg":
            from . import _asyncpg  # noqa: PLC0415 - only where asyncpg is in use

            runner = _asyncpg.arun
        else:
            runner = arun
        _ARUNNERS[cls] = runner
    return runner


def make_async(op: Callable[P, Gen[T]]) -> Callable[Concatenate[Any, P], Awaitable[T]]:
    """The async function of ``op``, on a psycopg ``AsyncConnection`` or an asyncpg
    connection."""
    @functools.wraps(op)
    async def call(conn: Any, /, *args: P.args,
                   **kwargs: P.kwargs) -> T:
        return await arunner(conn)(conn, op(*args, **kwargs))  # type: ignore[no-any-return]

    return call
