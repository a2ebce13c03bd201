"""The package's own sends: the one module that drives psycopg's private, protocol-level
methods (``Connection._check_connection_ok``, ``_start_query``, ``_exec_command``,
``pgconn._encoding``, ``psycopg.generators.execute``, ``psycopg.errors.error_from_result``) and
reads raw results (``PGresult``). :mod:`pg_idempotency._exec` decides when a statement may go
this way (nothing prepared, no pipeline) and calls :func:`send_claim`, :func:`send_commit` and
:func:`begin` (or their async twins); everything else takes a psycopg cursor.

claim (in binary) and complete + COMMIT (one simple Query) are the statements of every
payment. Through a psycopg cursor each costs the application a cursor, a Transformer, the
query's conversion, a dumper per parameter and a loader per result column, about as much CPU
as the round trip itself (docs/design.md, "Performance decisions"). Their parameters are few
and of known types, so the package binds them itself and sends them with psycopg's own
generators on the caller's connection, as psycopg's cursor does: under the connection's lock,
its state checked, a transaction begun first where psycopg would begin one, errors raised as
psycopg raises them (psycopg.errors.error_from_result: the same classes, SQLSTATEs and
diagnostics). Values of any other type, a text psycopg would refuse (NUL) or the client
encoding cannot hold, the opt-in to prepared statements and a pipeline take the cursor as
before. Nothing is prepared: claim goes as an unnamed extended-protocol statement (the same
Parse, Bind and Execute a cursor sends, with the same parameter types and formats), complete +
COMMIT as a simple Query with its values as literals (what psycopg's ClientCursor renders).
"""

from __future__ import annotations

import binascii
import functools
import json
import re
import struct
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from typing import Any, Final, Protocol

import psycopg
from psycopg import errors as _pgerrors
from psycopg import generators as _generators
from psycopg.pq import ExecStatus, Format
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from . import queries as Q
from ._results import ClaimResult, Outcome, StoredResponse, json_of_bytes


class Statement(Protocol):
    """What a send needs of a statement (:class:`pg_idempotency._exec.Query` is one)."""

    sql: str
    params: Mapping[str, Any]
    fetch: str


#: What :func:`send_commit` returns when it cannot send the statement itself (a row may be
#: None): the caller takes a psycopg cursor.
UNSENT: Final[Any] = object()


#: The psycopg internals the own sends rely on; with a psycopg that lacks one, every statement
#: takes a cursor.
OWN_SEND: Final = (
    all(hasattr(cls, name) for cls in (psycopg.Connection, psycopg.AsyncConnection)
        for name in ("_check_connection_ok", "_start_query", "wait"))
    and callable(getattr(_generators, "execute", None))
    and callable(getattr(_pgerrors, "error_from_result", None)))

_PLACEHOLDER = re.compile(r"%\((\w+)\)s")
_TEXT, _BINARY = Format.TEXT, Format.BINARY
_TUPLES_OK, _COMMAND_OK, _FATAL_ERROR = (ExecStatus.TUPLES_OK, ExecStatus.COMMAND_OK,
                                         ExecStatus.FATAL_ERROR)
#: psycopg's binary dumpers' OIDs and layouts for the types the package binds itself.
_BOOL_OID, _BYTEA_OID, _TIMESTAMPTZ_OID, _INTERVAL_OID = 16, 17, 1184, 1186
_PACK_INTERVAL = struct.Struct(">qii").pack
_PACK_INT8 = struct.Struct(">q").pack


@functools.lru_cache(maxsize=64)
def _numbered(sql: str) -> tuple[bytes, tuple[str, ...]]:
    """A statement of queries.py with its ``%(name)s`` placeholders as ``$1``, ``$2`` ... in
    order of first use (a name used twice is one parameter, as psycopg numbers them)."""
    names: list[str] = []

    def number(m: re.Match[str]) -> str:
        if m[1] not in names:
            names.append(m[1])
        return f"${names.index(m[1]) + 1}"

    text = _PLACEHOLDER.sub(number, sql)
    if "%" in text:
        raise ValueError(f"unexpected % in a statement: {sql!r}")
    return text.encode("ascii"), tuple(names)


@functools.lru_cache(maxsize=64)
def _split(sql: str) -> tuple[tuple[bytes, ...], tuple[str, ...]]:
    """A statement of queries.py as its text between placeholders (ASCII bytes: the same in
    every client encoding), and the placeholders' names:
    ``parts[0] + literal(names[0]) + parts[1] + ...``."""
    pieces = _PLACEHOLDER.split(sql)
    if any("%" in text for text in pieces[::2]):
        raise ValueError(f"unexpected % in a statement: {sql!r}")
    return tuple(text.encode("ascii") for text in pieces[::2]), tuple(pieces[1::2])


def bind(sql: str, params: Mapping[str, Any], encoding: str
           ) -> tuple[bytes, list[bytes | None], list[int], list[Format]] | None:
    """``sql`` numbered and its parameters as psycopg's dumpers send them (text as text of
    unknown type; bool, bytea, interval and an aware timestamptz in binary; NULL), or None
    when one of them is of another type, or a text psycopg would refuse or the encoding
    cannot hold: the cursor sends it then."""
    query, names = _numbered(sql)
    values: list[bytes | None] = []
    types: list[int] = []
    formats: list[Format] = []
    for name in names:
        value = params[name]
        kind = type(value)
        if value is None:
            values.append(None)
            types.append(0)
            formats.append(_TEXT)
        elif kind is str:
            if "\x00" in value:
                return None  # psycopg refuses it (DataError): let it
            try:
                values.append(value.encode(encoding))
            except UnicodeEncodeError:
                return None
            types.append(0)
            formats.append(_TEXT)
        elif kind is bytes:
            values.append(value)
            types.append(_BYTEA_OID)
            formats.append(_BINARY)
        elif kind is bool:
            values.append(b"\x01" if value else b"\x00")
            types.append(_BOOL_OID)
            formats.append(_BINARY)
        elif kind is timedelta:
            values.append(_PACK_INTERVAL(value.seconds * 1_000_000 + value.microseconds,
                                         value.days, 0))
            types.append(_INTERVAL_OID)
            formats.append(_BINARY)
        elif kind is datetime and value.utcoffset() is not None:
            # an aware time: microseconds since 2000-01-01 UTC (a naive one is a timestamp
            # the server reads in the session's TimeZone: psycopg's own dumper sends it)
            since = value - _EPOCH_2000
            values.append(_PACK_INT8((since.days * 86400 + since.seconds) * 1_000_000
                                     + since.microseconds))
            types.append(_TIMESTAMPTZ_OID)
            formats.append(_BINARY)
        else:
            return None
    return query, values, types, formats


def _quoted(text: str, conforming: bool) -> str:
    """A string literal of ``text`` (no NUL in it), as the server reads it whatever
    standard_conforming_strings (``conforming``) says."""
    text = text.replace("'", "''")
    if "\\" in text and not conforming:
        return "E'" + text.replace("\\", "\\\\") + "'"
    return "'" + text + "'"


def conforming_strings(conn: psycopg.BaseConnection[Any]) -> bool:
    """standard_conforming_strings is on for ``conn`` (as libpq last heard from the server)."""
    return conn.pgconn.parameter_status(b"standard_conforming_strings") == b"on"


def literal_query(sql: str, params: Mapping[str, Any], encoding: str, conforming: bool
                  ) -> bytes | None:
    """``sql`` with its values as literals (text, int, bytea, Jsonb, NULL) in the client
    ``encoding``, or None when a value is of another type, holds a NUL, or the encoding
    cannot hold it: psycopg's ClientCursor renders it then. Built as bytes, a body's hex in
    one piece, so that a large body is copied once into the statement (the HTTP adapters'
    memory bounds, tests/frameworks/test_http_bounds.py)."""
    parts, names = _split(sql)
    out = [parts[0]]
    try:
        for name, text in zip(names, parts[1:], strict=True):
            value = params[name]
            kind = type(value)
            if value is None:
                out.append(b"NULL")
            elif kind is str:
                if "\x00" in value:
                    return None
                out.append(_quoted(value, conforming).encode(encoding))
            elif kind is int:
                # in parentheses when negative: -9223372036854775808::bigint would cast the
                # positive number first (and fail), as psycopg's rendering does
                out.append(str(value if value >= 0 else f"({value})").encode())
            elif kind is bytes:
                out.append(b"'\\x" if conforming else b"E'\\\\x")
                out.append(binascii.hexlify(value))
                out.append(b"'")
            elif kind is Jsonb and value.dumps is not None:
                dumped = value.dumps(value.obj)
                if not isinstance(dumped, str) or "\x00" in dumped:
                    return None
                out.append(_quoted(dumped, conforming).encode(encoding))
            else:
                return None
            out.append(text)
    except UnicodeEncodeError:
        return None
    return b"".join(out)


# The texts the own sends run in place of a binary_sql (queries.CLAIM_SHORT says why), and in
# place of a complete + COMMIT's under DateStyle ISO (queries.COMPLETE_SHORT).
_SHORT = {Q.CLAIM_BINARY: Q.CLAIM_SHORT}
_SHORT_COMMIT = {Q.COMPLETE: Q.COMPLETE_SHORT, Q.COMPLETE_BYTES: Q.COMPLETE_BYTES_SHORT}

#: A timestamptz as DateStyle ISO prints it, for years 1000 to 9999 (the engine's times are in
#: 1970-9998): seconds' fraction without trailing zeros, the zone's offset as +HH, +HH:MM or
#: +HH:MM:SS (a local mean time).
_ISO_TIME = re.compile(rb"(\d{4})-(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)(?:\.(\d{1,6}))?"
                       rb"([+-])(\d\d)(?::(\d\d))?(?::(\d\d))?")


def iso_dates(conn: psycopg.BaseConnection[Any]) -> bool:
    """The server prints dates in DateStyle ISO to ``conn`` (as libpq last heard from it: the
    server reports every change of DateStyle, SET LOCAL included, before it is ready for the
    next query)."""
    style = conn.pgconn.parameter_status(b"DateStyle")
    return style is not None and style.startswith(b"ISO")


def iso_time(text: bytes | None) -> datetime | None:
    """A timestamptz printed in DateStyle ISO, in any TimeZone, as an aware datetime in UTC."""
    if text is None:
        return None
    m = _ISO_TIME.fullmatch(text)
    if m is None:
        raise psycopg.DataError(f"not a timestamptz in DateStyle ISO: {bytes(text)!r}")
    year, month, day, hour, minute, second, fraction, sign, zh, zm, zs = m.groups()
    offset = int(zh) * 3600 + int(zm or 0) * 60 + int(zs or 0)
    local = datetime(int(year), int(month), int(day), int(hour), int(minute), int(second),
                     int(fraction.ljust(6, b"0")) if fraction else 0, tzinfo=timezone.utc)
    return local - timedelta(seconds=offset if sign == b"+" else -offset)


def commit_text(conn: psycopg.BaseConnection[Any], q: Statement, encoding: str
                ) -> tuple[bytes | None, bool]:
    """A complete + COMMIT (any statement + COMMIT) as one simple Query's text with its values
    as literals (None: psycopg's ClientCursor renders it), and whether it is the short form,
    whose one column is a timestamptz in DateStyle ISO (queries.COMPLETE_SHORT)."""
    short = _SHORT_COMMIT.get(q.sql) if iso_dates(conn) else None
    text = literal_query((short or q.sql) + Q.AND_COMMIT, q.params, encoding,
                         conforming_strings(conn))
    return text, short is not None


def _commit_row(res: Any, short: bool, fetch: str, encoding: str) -> Any:
    """The row of a send of :func:`commit_text`: for the short form ``{"completed_at":
    datetime}``, which :func:`load_time` returns as it is."""
    if short:
        return {"completed_at": iso_time(res.get_value(0, 0))}
    return _text_row(res, fetch, encoding)


def _send_params(conn: Any, query: bytes, values: list[bytes | None], types: list[int],
                 formats: list[Format], result_format: Format) -> Any:
    """psycopg's cursor.execute() of one statement, as a generator for ``conn.wait``."""
    conn._check_connection_ok()
    yield from conn._start_query()
    pgconn = conn.pgconn
    pgconn.send_query_params(query, values, param_types=types, param_formats=formats,
                             result_format=result_format)
    return (yield from _generators.execute(pgconn))


def _send_simple(conn: Any, query: bytes) -> Any:
    """The same for a simple Query message (several statements, text results)."""
    conn._check_connection_ok()
    yield from conn._start_query()
    pgconn = conn.pgconn
    pgconn.send_query(query)
    return (yield from _generators.execute(pgconn))


def _first_result(results: list[Any], encoding: str) -> Any:
    """The first result of a send, after raising as psycopg's cursor raises for any failed
    one (the statement's error, or COMMIT's)."""
    if not results:
        raise psycopg.InternalError("got no result from the query")
    for res in results:
        status = res.status
        if status != _TUPLES_OK and status != _COMMAND_OK:
            if status == _FATAL_ERROR:
                raise _pgerrors.error_from_result(res, encoding=encoding)
            raise psycopg.InternalError(
                f"unexpected result status from query: {ExecStatus(status).name}")
    return results[0]


def codec(pgconn: Any) -> str:
    """The Python codec of the package's text on a connection: its client encoding's, except
    under SQL_ASCII (which psycopg names "ascii"). There the server converts nothing and psycopg
    sends text as UTF-8, so the package binds and reads its own text as UTF-8 too: a key that is
    not ASCII is sent as the same bytes as under UTF8, and read back as the same string."""
    encoding: str = pgconn._encoding
    return "utf-8" if encoding == "ascii" else encoding


# text, varchar, bpchar, name, unknown: the types psycopg's text loader reads
_TEXT_OIDS: Final = frozenset((25, 1043, 1042, 19, 705))


def _utf8_dict_row(cursor: Any) -> Callable[[Any], dict[str, Any]]:
    """dict_row under a SQL_ASCII client encoding, where psycopg's text loader returns bytes
    (it cannot know the bytes' encoding): the text columns decoded as UTF-8, what the package
    sent (see codec). Without it an outcome read b'completed', not 'completed', and a complete
    already committed raised in the caller's hands."""
    make = dict_row(cursor)
    texts = [i for i, column in enumerate(cursor.description or ())
             if column.type_code in _TEXT_OIDS]

    def row(values: Any) -> dict[str, Any]:
        values = list(values)
        for i in texts:
            if isinstance(values[i], (bytes, bytearray, memoryview)):
                values[i] = bytes(values[i]).decode("utf-8")
        return make(values)

    return row


def dict_rows(conn: Any) -> Any:
    """The row factory of every cursor the package opens on a psycopg connection: dict_row,
    with text decoded as UTF-8 under a SQL_ASCII client encoding (_utf8_dict_row)."""
    return _utf8_dict_row if conn.pgconn._encoding == "ascii" else dict_row


def _text_row(res: Any, fetch: str, encoding: str) -> Any:
    """A text result as the dict rows fetchone()/fetchall() would give with psycopg's default
    text loader, decoded here (no loader an application registered is involved): the
    package's statements return text columns only (queries.py)."""
    names = [res.fname(i).decode(encoding) for i in range(res.nfields)]
    rows = [{name: None if (v := res.get_value(r, i)) is None else bytes(v).decode(encoding)
             for i, name in enumerate(names)} for r in range(res.ntuples)]
    if fetch == "one":
        return rows[0] if rows else None
    return rows


# -- binary results ----------------------------------------------------------------------------

_INT8 = struct.Struct(">q").unpack
_INT4 = struct.Struct(">i").unpack
_INTERVAL = struct.Struct(">qii").unpack
#: PostgreSQL's epoch of binary timestamps, and the seconds from 1970's to it.
_EPOCH_2000 = datetime(2000, 1, 1, tzinfo=timezone.utc)
_UNIX_2000 = 946684800


def _binary_time(data: bytes | None) -> datetime | None:
    """A binary timestamptz (microseconds since 2000-01-01 UTC) as an aware datetime in UTC:
    the same instant, whatever the session's DateStyle and TimeZone."""
    if data is None:
        return None
    (us,) = _INT8(data)
    try:
        return _EPOCH_2000 + timedelta(microseconds=us)
    except OverflowError:
        # (+-infinity are the int8's ends)
        seconds = {2**63 - 1: "Infinity", -2**63: "-Infinity"}.get(
            us, f"{Decimal(us).scaleb(-6) + _UNIX_2000}")
        raise psycopg.DataError("timestamp out of the range of datetime (years 1 to 9999): "
                                f"{seconds} s since 1970") from None


def _binary_interval(data: bytes | None) -> timedelta | None:
    """A binary interval as a timedelta of the length extract(epoch FROM it) gives (a month
    is 30 days, a year 365.25), whatever the session's IntervalStyle."""
    if data is None:
        return None
    us, days, months = _INTERVAL(data)
    years = int(months / 12)  # C's division, toward zero, as PostgreSQL's
    us += (days * 86400 + (months - years * 12) * 30 * 86400) * 1_000_000 \
        + years * 31_557_600_000_000
    try:
        return timedelta(microseconds=us)
    except OverflowError:
        raise psycopg.DataError(f"interval out of the range of timedelta: "
                                f"{Decimal(us).scaleb(-6)} s") from None


_OID_AND_LENGTH = struct.Struct(">Ii").unpack_from


def _record_fields(data: bytes) -> list[bytes | None]:
    """The fields of a composite value in binary (PostgreSQL's record_send: their count, then
    each one's type OID, length, or -1 for NULL, and bytes)."""
    (count,) = _INT4(data[:4])
    fields: list[bytes | None] = []
    pos = 4
    for _ in range(count):
        _oid, length = _OID_AND_LENGTH(data, pos)
        pos += 8
        if length < 0:
            fields.append(None)
        else:
            fields.append(data[pos:pos + length])
            pos += length
    return fields


def claim_result_of(res: Any, encoding: str) -> ClaimResult:
    """The :class:`ClaimResult` of queries.CLAIM_BINARY or TAKEOVER_BINARY (claim_result's 13
    columns in their order), or of CLAIM_SHORT (claim_result as one composite value), run with
    binary results, read from the raw result ``res`` (a psycopg ``PGresult``) in the
    connection's client ``encoding``: no loader is involved, so none that an application
    registered, and no session setting, changes it."""
    if res.nfields == 1:
        record = res.get_value(0, 0)
        if record is None:
            raise psycopg.DataError("claim returned NULL")
        values = _record_fields(bytes(record))
    else:
        get = res.get_value
        values = [get(0, i) for i in range(13)]
    outcome = values[0]
    if outcome is None:
        raise psycopg.DataError("claim returned no outcome")
    result_outcome = Outcome(bytes(outcome).decode(encoding))
    token, expires, recovery_point, attempts = values[1:5]
    retry_after, created_at = values[10], values[11]
    response = None
    if result_outcome is Outcome.REPLAY or result_outcome is Outcome.ACCEPTED:
        (status, headers, body, body_bytes, content_type) = values[5:10]
        completed_at = values[12]
        if status is None:
            raise psycopg.DataError(f"claim returned {result_outcome.value} without a status")
        # jsonb in binary: a version byte (1), then the text
        stored = None if body is None else json.loads(bytes(body)[1:].decode(encoding))
        raw = None if body_bytes is None else bytes(body_bytes)
        ctype = None if content_type is None else bytes(content_type).decode(encoding)
        if stored is None and raw is not None:
            stored = json_of_bytes(ctype, raw)
        response = StoredResponse(
            status=_INT4(status)[0],
            headers=dict(json.loads(bytes(headers)[1:].decode(encoding)) or {})
            if headers is not None else {},
            body=stored, body_bytes=raw, content_type=ctype,
            completed_at=_binary_time(completed_at))
    return ClaimResult(
        result_outcome, None if token is None else _INT8(token)[0], _binary_time(expires),
        None if recovery_point is None else bytes(recovery_point).decode(encoding),
        None if attempts is None else _INT4(attempts)[0], _binary_interval(retry_after),
        _binary_time(created_at), response)


# -- the sends --------------------------------------------------------------------------------

def begin(conn: psycopg.Connection[Any]) -> bool:
    """BEGIN on an autocommit connection, as psycopg sends its own BEGIN and COMMIT (a command
    with no cursor, no parameters and no rows: cheaper for the client than
    ``conn.execute("BEGIN")``). False, having sent nothing, if a psycopg ever lacks that path:
    the caller sends it through ``conn.execute``."""
    command = getattr(conn, "_exec_command", None)
    if command is None:
        return False
    with conn.lock:
        conn.wait(command(_BEGIN))
    return True


async def abegin(conn: psycopg.AsyncConnection[Any]) -> bool:
    """:func:`begin` for an async connection."""
    command = getattr(conn, "_exec_command", None)
    if command is None:
        return False
    async with conn.lock:
        await conn.wait(command(_BEGIN))
    return True


_BEGIN = Q.BEGIN.encode()


def send_claim(conn: psycopg.Connection[Any], sql: str, params: Mapping[str, Any]
               ) -> ClaimResult | None:
    """Run ``sql`` (queries.CLAIM_BINARY or TAKEOVER_BINARY; CLAIM_SHORT in place of the first)
    with ``params`` bound here and binary results, and return its :func:`claim_result_of`; or
    None, having sent nothing, when psycopg lacks the internals or a value cannot be bound
    here (:func:`bind`)."""
    if not OWN_SEND:
        return None
    encoding = codec(conn.pgconn)
    bound = bind(_SHORT.get(sql, sql), params, encoding)
    if bound is None:
        return None
    with conn.lock:
        results = conn.wait(_send_params(conn, *bound, _BINARY))
    return claim_result_of(_first_result(results, encoding), encoding)


async def asend_claim(conn: psycopg.AsyncConnection[Any], sql: str, params: Mapping[str, Any]
                      ) -> ClaimResult | None:
    """:func:`send_claim` for an async connection."""
    if not OWN_SEND:
        return None
    encoding = codec(conn.pgconn)
    bound = bind(_SHORT.get(sql, sql), params, encoding)
    if bound is None:
        return None
    async with conn.lock:
        results = await conn.wait(_send_params(conn, *bound, _BINARY))
    return claim_result_of(_first_result(results, encoding), encoding)


def send_commit(conn: psycopg.Connection[Any], q: Statement) -> Any:
    """Run ``q`` and COMMIT in one simple Query message (:func:`commit_text`) and return its
    row(s) as ``q.fetch`` says; or :data:`UNSENT`, having sent nothing, when psycopg lacks the
    internals or a value cannot be written as a literal here. An error in the statement skips
    the COMMIT."""
    if not OWN_SEND:
        return UNSENT
    encoding = codec(conn.pgconn)
    text, short = commit_text(conn, q, encoding)
    if text is None:
        return UNSENT
    with conn.lock:
        results = conn.wait(_send_simple(conn, text))
    return _commit_row(_first_result(results, encoding), short, q.fetch, encoding)


async def asend_commit(conn: psycopg.AsyncConnection[Any], q: Statement) -> Any:
    """:func:`send_commit` for an async connection."""
    if not OWN_SEND:
        return UNSENT
    encoding = codec(conn.pgconn)
    text, short = commit_text(conn, q, encoding)
    if text is None:
        return UNSENT
    async with conn.lock:
        results = await conn.wait(_send_simple(conn, text))
    return _commit_row(_first_result(results, encoding), short, q.fetch, encoding)
