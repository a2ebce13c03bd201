"""The async API on asyncpg: the statements that the generators of
:mod:`pg_idempotency._calls` and :mod:`pg_idempotency._operation` yield, run on an
``asyncpg.Connection`` (or a connection of an asyncpg pool) instead of psycopg's.

The same SQL (queries.py), its psycopg placeholders numbered once (``$1``, ``$2`` ...; at
import for every statement of queries.py), the same results (the text variants of the
statements: times as epoch seconds, JSON as text, read by :mod:`pg_idempotency._results`, so no
codec an application registered on the connection and no session setting changes them), and
the same exceptions per SQLSTATE (:func:`translate`). A jsonb parameter is sent as text and
cast by the server (``$n::text::jsonb``): an application's jsonb codec (``set_type_codec``,
often ``json.dumps``) would otherwise encode the package's JSON text a second time.

Transactions: asyncpg has no implicit transaction, so a statement outside one commits on its
own (the claim). The operation's business transaction is an asyncpg ``Transaction`` started by
the package (:class:`Session`): a ``conn.transaction()`` block inside the operation's block is
then a savepoint of it, as asyncpg nests them. ``complete()`` runs and then commits it (two
round trips: asyncpg sends one statement at a time).

asyncpg itself is imported only when a connection of it is used: the package does not need it.
"""

from __future__ import annotations

import inspect
import json
import re
import weakref
from collections.abc import Callable, Mapping
from typing import Any, Final

from psycopg.pq import TransactionStatus
from psycopg.types.json import Jsonb

from . import queries as Q
from ._exec import Call, Gen, Query, Request, Tx
from .errors import DatabaseUnavailable, IdempotencyError, from_sqlstate, is_unavailable

_PLACEHOLDER = re.compile(r"%\((\w+)\)s(::jsonb)?")


def numbered(sql: str) -> tuple[str, tuple[str, ...]]:
    """A statement of queries.py with its psycopg placeholders as asyncpg's ``$1``, ``$2`` ...
    in order of first use (a name used twice is one parameter), a jsonb one sent as text
    (``$n::text::jsonb``), and the parameters' names in that order."""
    names: list[str] = []

    def number(m: re.Match[str]) -> str:
        if m[1] not in names:
            names.append(m[1])
        n = names.index(m[1]) + 1
        return f"${n}::text::jsonb" if m[2] else f"${n}"

    text = _PLACEHOLDER.sub(number, sql)
    if "%" in text:
        raise ValueError(f"unexpected % in a statement: {sql!r}")
    return text, tuple(names)


def _all_statements() -> dict[str, tuple[str, tuple[str, ...]]]:
    done: dict[str, tuple[str, tuple[str, ...]]] = {}
    for name, value in vars(Q).items():
        if name.isupper() and isinstance(value, str) and "%" in value:
            done[value] = numbered(value)
    return done


#: Every statement of queries.py, numbered once: a call looks its text up here.
STATEMENTS: Final = _all_statements()


def _statement(sql: str) -> tuple[str, tuple[str, ...]]:
    found = STATEMENTS.get(sql)
    if found is None:  # not one of queries.py's (none is built at run time today)
        found = STATEMENTS[sql] = numbered(sql)
    return found


def _args(names: tuple[str, ...], params: Mapping[str, Any]) -> list[Any]:
    """The values in asyncpg's terms: a Jsonb as its JSON text (the statement casts it)."""
    args = []
    for name in names:
        value = params[name]
        if type(value) is Jsonb:
            dumps = value.dumps or json.dumps
            value = dumps(value.obj)
        args.append(value)
    return args


def is_asyncpg(obj: Any) -> bool:
    """Whether ``obj`` is asyncpg's (a connection, a pool's connection, a pool): recognised by
    its class's module, so that asyncpg is imported only when it is in use."""
    return type(obj).__module__.partition(".")[0] == "asyncpg"


def is_asyncpg_pool(obj: Any) -> bool:
    if not is_asyncpg(obj):
        return False
    import asyncpg  # noqa: PLC0415 - it is in use: obj is one of its objects

    return isinstance(obj, asyncpg.Pool)


def gone(conn: Any) -> bool:
    """Whether ``conn`` is closed, or is a pool's connection that its pool took back under us
    (asyncpg detaches a lost connection's proxy: every method of it raises then)."""
    try:
        return bool(conn.is_closed())
    except Exception:  # noqa: BLE001 - InterfaceError: released back to the pool
        return True


# -- errors ------------------------------------------------------------------------------------

def translate(exc: Exception, request: Request | None) -> Exception:
    """asyncpg's error as the package's: :class:`DatabaseUnavailable` for an unreachable
    database (:func:`~pg_idempotency.errors.is_unavailable`, or an OSError of the package's
    own statement), the :class:`~pg_idempotency.errors.IdempotencyError` of an engine SQLSTATE,
    or ``exc`` itself."""
    if isinstance(exc, IdempotencyError):
        return exc
    if is_unavailable(exc) or (isinstance(exc, OSError) and not isinstance(request, Call)):
        reason = str(exc).strip() or type(exc).__name__
        mapped: Exception = DatabaseUnavailable(f"the database is unavailable: {reason}",
                                                pgerror=exc)
    elif is_asyncpg(exc) and getattr(exc, "sqlstate", None) is not None:
        mapped = from_sqlstate(
            exc, exc.sqlstate, getattr(exc, "message", None) or str(exc),  # type: ignore[attr-defined]
            detail=getattr(exc, "detail", None), hint=getattr(exc, "hint", None),
            column=getattr(exc, "column_name", None),
            lease_token=isinstance(request, Query) and request.fenced)
    else:
        from ._exec import translate as translate_psycopg  # noqa: PLC0415

        return translate_psycopg(exc, request)  # type: ignore[arg-type]
    if mapped is not exc:
        mapped.__cause__ = exc
    return mapped


# -- one connection ----------------------------------------------------------------------------

class Session:
    """What the package keeps of an asyncpg connection: the transaction it started (the
    operation's business transaction), which a later step commits or rolls back. One per
    connection (:func:`session`), so that the steps of an operation, and ``@idempotent``'s
    function calling ``op.checkpoint()``, see the same."""

    __slots__ = ("conn", "tx", "__weakref__")

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.tx: Any = None

    def state(self) -> tuple[TransactionStatus, bool]:
        """psycopg's view of the connection: its status, and autocommit (asyncpg's always is:
        a statement outside a transaction commits on its own)."""
        conn = self.conn
        if gone(conn):
            return TransactionStatus.UNKNOWN, True
        return (TransactionStatus.INTRANS if conn.is_in_transaction()
                else TransactionStatus.IDLE), True

    def _raise_lost(self, exc: Exception) -> None:
        """Raise DatabaseUnavailable for ``exc`` when the connection is gone after it
        (asyncpg's errors on a connection that broke mid-statement are not all of a lost
        connection's kinds: a released proxy's InterfaceError, say); else return."""
        if not is_unavailable(exc) and not isinstance(exc, IdempotencyError) \
                and gone(self.conn):
            raise DatabaseUnavailable(f"the database is unavailable: {exc}",
                                      pgerror=exc) from exc

    async def begin(self) -> None:
        """Start the business transaction, unless one is open (a transaction of the package's
        that ended outside it, by a ROLLBACK of the caller's, is forgotten: never write in
        autocommit believing a transaction open)."""
        try:
            if not self.conn.is_in_transaction():
                self.tx = None
                tx = self.conn.transaction()
                await tx.start()
                self.tx = tx
        except Exception as exc:
            self._raise_lost(exc)
            raise

    async def end(self, commit: bool) -> None:
        """Commit or roll back the transaction the package started (nothing else is the
        package's to end)."""
        tx, self.tx = self.tx, None
        if tx is not None:
            try:
                await (tx.commit() if commit else tx.rollback())
            except Exception as exc:
                self._raise_lost(exc)
                raise

    async def execute(self, q: Query) -> Any:
        sql, names = _statement(q.sql)
        args = _args(names, q.params)
        try:
            if q.fetch == "one":
                row = await self.conn.fetchrow(sql, *args)
            else:
                row = await self.conn.fetch(sql, *args)
        except Exception as exc:
            self._raise_lost(exc)
            raise
        if q.commit:
            await self.end(True)
        return row


async def drive(target: Any, gen: Gen[Any], execute: Callable[[Query], Any],
                tx: Callable[[Tx], Any]) -> Any:
    """The driver loop of :func:`pg_idempotency._exec.arun` for asyncpg: ``execute`` runs a
    Query, ``tx`` answers a transaction request; errors go back into the generator as the
    package's (:func:`translate`)."""
    send: Callable[[Any], Request] = gen.send
    value: Any = None
    while True:
        try:
            request = send(value)
        except StopIteration as stop:
            return stop.value
        try:
            if isinstance(request, Query):
                value = await execute(request)
            elif isinstance(request, Call):
                value = request.fn(*request.args, **request.kwargs)
                if inspect.isawaitable(value):
                    value = await value
            else:
                value = await tx(request)
            send = gen.send
        except Exception as exc:  # noqa: BLE001 - handed to the generator, which re-raises
            value, send = translate(exc, request), gen.throw


_SESSIONS: weakref.WeakKeyDictionary[Any, Session] = weakref.WeakKeyDictionary()


def session(conn: Any) -> Session:
    """The :class:`Session` of ``conn``. A pool's connection (asyncpg's proxy) is keyed by the
    connection it wraps, which outlives the proxy."""
    key = getattr(conn, "_con", None) or conn
    found = _SESSIONS.get(key)
    if found is None or found.conn is not conn:
        found = _SESSIONS[key] = Session(conn)
    return found


async def run_session(s: Session, gen: Gen[Any]) -> Any:
    async def tx(request: Tx) -> Any:
        if request is Tx.STATE:
            return s.state()
        if request is Tx.BEGIN:
            await s.begin()
        else:
            await s.end(request is Tx.COMMIT)
        return None

    return await drive(s, gen, s.execute, tx)


async def arun(conn: Any, gen: Gen[Any]) -> Any:
    """:func:`pg_idempotency._exec.arun` for an asyncpg connection."""
    return await run_session(session(conn), gen)
