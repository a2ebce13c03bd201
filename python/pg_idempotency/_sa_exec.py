"""The package's statements on a SQLAlchemy connection, whatever its driver (psycopg, asyncpg,
pg8000, ...), and the driver's errors as the classes of :mod:`pg_idempotency.errors`. Used by
:mod:`pg_idempotency.sqlalchemy` only (it imports SQLAlchemy).

A statement of queries.py goes through ``Connection.execute(text(...))``: its psycopg
placeholders (``%(name)s``) become SQLAlchemy's (``(:name)``, parenthesised so that the casts
after them stay casts), once per statement; SQLAlchemy renders them in the driver's own style
and caches the compiled form. jsonb parameters go as JSON text (each statement casts them),
and the results are the text columns queries.py selects, so no type of any driver is
involved in reading them.

SQLAlchemy wraps the driver's error in a ``DBAPIError``; the driver's own error, reached
through ``.orig`` and its causes, carries the SQLSTATE and the server's fields, each driver in
its own attributes (:func:`server_error`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from typing import Any

import psycopg
from psycopg.types.json import Jsonb
from sqlalchemy import TextClause, text
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection

from ._exec import Call, Query, Request
from .errors import (
    DatabaseUnavailable,
    IdempotencyError,
    from_sqlstate,
    is_unavailable,
    unavailable_state,
)

_PLACEHOLDER = re.compile(r"%\((\w+)\)s")
_TEXTS: dict[str, TextClause] = {}


def statement(sql: str) -> TextClause:
    """``sql`` (psycopg's named placeholders) as a SQLAlchemy ``text()``, made once: the same
    object every time, so SQLAlchemy finds its compiled form in the engine's cache."""
    clause = _TEXTS.get(sql)
    if clause is None:
        # (:name)::type, not :name::type, which text() would not take for a parameter
        clause = _TEXTS[sql] = text(_PLACEHOLDER.sub(r"(:\1)", sql.replace(":", r"\:")))
    return clause


def bind(params: Mapping[str, Any]) -> dict[str, Any]:
    """The parameters as any driver takes them: a Jsonb as its JSON text (the statement casts
    it; asyncpg, for one, has no adapter for psycopg's wrapper)."""
    return {name: _json_text(value) if isinstance(value, Jsonb) else value
            for name, value in params.items()}


def _json_text(value: Jsonb) -> Any:
    return (value.dumps or json.dumps)(value.obj)


def _rows(result: Any, fetch: str) -> Any:
    rows = result.mappings()
    if fetch == "one":
        row = rows.fetchone()
        return None if row is None else dict(row)
    return [dict(row) for row in rows]


def execute(conn: Connection, q: Query) -> Any:
    """Run ``q`` on a sync connection, in its transaction: a dict row (or None) for
    ``fetch="one"``, a list of them for ``"all"``. The caller commits."""
    return _rows(conn.execute(statement(q.sql), bind(q.params)), q.fetch)


async def aexecute(conn: AsyncConnection, q: Query) -> Any:
    """:func:`execute` on an async connection."""
    return _rows(await conn.execute(statement(q.sql), bind(q.params)), q.fetch)


# -- errors ----------------------------------------------------------------------------------

def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    """``exc``, then what it wraps: a DBAPIError's ``orig``, any other's cause or context."""
    seen = 0
    while exc is not None and seen < 16:
        yield exc
        orig = exc.orig if isinstance(exc, DBAPIError) else None
        exc = orig if isinstance(orig, BaseException) else exc.__cause__ or exc.__context__
        seen += 1


#: (sqlstate, message, detail, hint, column) as the server sent them
Fields = tuple[str, str, str | None, str | None, str | None]


def _fields(exc: BaseException) -> Fields | None:
    """The server's fields when ``exc`` is a driver's error that carries them, else None."""
    if isinstance(exc, psycopg.Error):
        if exc.sqlstate is None:
            return None
        diag = exc.diag
        return (exc.sqlstate, diag.message_primary or str(exc), diag.message_detail,
                diag.message_hint, diag.column_name)
    module = type(exc).__module__
    if module.startswith("asyncpg"):
        # asyncpg's PostgresError; SQLAlchemy's adapter of it (which comes first in the chain)
        # copies the sqlstate only
        state = getattr(exc, "sqlstate", None)
        if not isinstance(state, str):
            return None
        return (state, getattr(exc, "message", None) or str(exc), getattr(exc, "detail", None),
                getattr(exc, "hint", None), getattr(exc, "column_name", None))
    if module.startswith("pg8000") and exc.args and isinstance(exc.args[0], dict):
        raw = exc.args[0]  # the ErrorResponse's fields by their protocol letters
        if not isinstance(raw.get("C"), str):
            return None
        return raw["C"], raw.get("M") or str(exc), raw.get("D"), raw.get("H"), raw.get("c")
    return None


def server_error(exc: BaseException) -> tuple[Exception, Fields] | None:
    """The driver's error under ``exc`` with the server's fields, or None (no server error:
    not a database error, or the connection failed)."""
    for cause in _chain(exc):
        fields = _fields(cause)
        if fields is not None and isinstance(cause, Exception):
            return cause, fields
    return None


def _driver_error(exc: DBAPIError) -> BaseException:
    """The driver's own error under SQLAlchemy's: the one with the server's fields, else the
    first that is not SQLAlchemy's (asyncpg's, under the dialect's adapter of it)."""
    chain = list(_chain(exc.orig))
    return next((c for c in chain if _fields(c) is not None),
                next((c for c in chain if not type(c).__module__.startswith("sqlalchemy")),
                     exc))


def lost(exc: BaseException | None) -> BaseException | None:
    """The driver's error that says the database cannot be reached, if ``exc`` is or wraps one
    (what :func:`pg_idempotency.errors.is_unavailable` says of psycopg's errors, for any
    driver): SQLSTATE class 08 or 57P01..57P03, a Citus coordinator's XX000 for a lost worker,
    a connection SQLAlchemy found broken (its dialect's verdict: ``connection_invalidated``),
    or an OS error under a SQLAlchemy database error (refused, reset). None otherwise, and for
    the package's own errors (a DatabaseUnavailable is already one)."""
    if exc is None or isinstance(exc, IdempotencyError):
        return None
    from_database = False
    for cause in _chain(exc):
        if isinstance(cause, psycopg.Error):
            return cause if is_unavailable(cause) else None
        if isinstance(cause, DBAPIError):
            from_database = True
            if cause.connection_invalidated:
                return _driver_error(cause)
            continue
        fields = _fields(cause)
        if fields is not None and unavailable_state(fields[0], fields[1]):
            return cause
        if from_database and isinstance(cause, OSError):
            return cause
    return None


def unavailable(exc: BaseException, driver_error: BaseException) -> DatabaseUnavailable:
    reason = str(driver_error).strip() or type(driver_error).__name__
    mapped = DatabaseUnavailable(f"the database is unavailable: {reason}", pgerror=driver_error)
    mapped.__cause__ = exc
    return mapped


def translate(exc: Exception, request: Request) -> Exception:
    """What the generator gets thrown for ``exc``, raised by ``request`` on a session: the
    package's exception for an engine SQLSTATE (:func:`errors.from_sqlstate`), or
    :class:`DatabaseUnavailable`; any other error as it is."""
    if isinstance(request, Call) or isinstance(exc, IdempotencyError):
        return exc
    driver_error = lost(exc)
    if driver_error is None:
        # The package's own statement (or the session's connect for it) failed with an OS
        # error: the network's, as asyncpg's refused connect is (SQLAlchemy does not wrap it).
        driver_error = next((c for c in _chain(exc) if isinstance(c, OSError)), None)
    if driver_error is not None:
        return unavailable(exc, driver_error)
    found = server_error(exc)
    if found is None:
        return exc
    error, (state, message, detail, hint, column) = found
    mapped = from_sqlstate(error, state, message, detail=detail, hint=hint, column=column,
                           lease_token=isinstance(request, Query) and request.fenced)
    if mapped is error:
        return exc  # not the engine's: SQLAlchemy's error, as the application knows it
    mapped.__cause__ = exc
    return mapped


def block_outage(exc: BaseException | None) -> DatabaseUnavailable | None:
    """What an operation block's exception becomes when the database cannot be reached (the
    block's own statement, or a flush, on a lost connection): :class:`DatabaseUnavailable`,
    as every call of the package raises; None for any other exception."""
    if not isinstance(exc, Exception):
        return None
    driver_error = lost(exc)
    return None if driver_error is None else unavailable(exc, driver_error)
