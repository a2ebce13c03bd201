"""The Python API, written once for psycopg's sync and async connections.

Every operation here is a generator that yields what it needs from the database (a query, a
commit, a rollback, a call of the caller's function) and receives the answer. A sync driver
(:func:`_run`) and an async one (:func:`_arun`) execute those requests on the caller's
connection; :mod:`pg_idempotency` and :mod:`pg_idempotency.aio` expose the two flavours. So the
logic (which statement, which transaction boundary, what to do on an error) exists once, and
the two APIs cannot drift apart.

Nothing here opens a connection: every call takes the caller's, so ``complete()`` joins the
caller's business transaction. Connections from ``psycopg_pool`` work as any other.
"""

from __future__ import annotations

import binascii
import functools
import inspect
import json
import logging
import re
import struct
from collections.abc import Awaitable, Callable, Generator, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from enum import Enum
from typing import Any, Concatenate, Final, ParamSpec, TypeVar, overload

import psycopg
from psycopg import errors as _pgerrors
from psycopg import generators as _generators
from psycopg.pq import ExecStatus, Format, PipelineStatus, TransactionStatus
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from . import queries as Q
from . import telemetry
from .errors import (
    AlreadyCompleted,
    ArgumentTooLarge,
    DatabaseUnavailable,
    IdempotencyError,
    KeyExpired,
    KeyInProgress,
    KeyMismatch,
    KeyNotFound,
    LeaseLost,
    LeaseLostCompleted,
    UsageError,
    argument_too_large,
    connection_lost,
    from_psycopg,
    invalid_argument,
)
from .fingerprint import MAX_DEPTH, canonical_json, derive_key, key_hash, request_fingerprint

P = ParamSpec("P")
T = TypeVar("T")

#: The engine's default lease (claim's ``lease DEFAULT '30 seconds'``).
DEFAULT_LEASE = timedelta(seconds=30)
#: operation()'s default limits (bytes) on what ``op.complete()`` stores, the engine's defaults
#: (idempotency.settings.max_response_bytes and max_headers_bytes): a body or headers over
#: them raise ArgumentTooLarge (IK018) before anything is sent.
DEFAULT_MAX_RESPONSE_BYTES = 1048576
DEFAULT_MAX_HEADERS_BYTES = 16384

#: The package's one logger (docs/python.md, "Logging"). Its lines carry :func:`key_hash`,
#: never the raw key, a request or a body; every call is behind ``isEnabledFor``, so a
#: disabled logger costs one cached level check per event.
logger = logging.getLogger("pg_idempotency")
# A library's logger: without it, an application that configures no logging would get the
# WARNING lines (a mismatch, a lost lease) on stderr through logging.lastResort.
logger.addHandler(logging.NullHandler())


def _log(level: int, event: str, scope: str, key: str, *, exc_info: bool = False,
         **fields: Any) -> None:
    """One line ``<event> key=<hash> k=v ...``; call it behind ``logger.isEnabledFor(level)``.
    The fields are also on the record (``record.idempotency``). The adapters log their own
    events (e.g. Django's ``kept``) through it too, so every line has one shape."""
    h = key_hash(scope, key)
    text = " ".join(f"{k}={v}" for k, v in fields.items() if v is not None)
    logger.log(level, "%s key=%s%s", event, h, f" {text}" if text else "", exc_info=exc_info,
               extra={"idempotency": {"event": event, "key_hash": h, **fields}})


# -- results ---------------------------------------------------------------------------------

class Outcome(str, Enum):
    """What :func:`claim` found (docs/sql-api.md, "Outcomes")."""

    CLAIMED = "claimed"  #: new key: you own it
    RESUMED = "resumed"  #: the previous lease expired: you own it, reconcile from recovery_point
    REPLAY = "replay"  #: completed before with the same request: return the stored response
    IN_PROGRESS = "in_progress"  #: someone holds a live lease: 409, retry after retry_after
    #: a long-running operation holds a live lease and stored an interim response with
    #: accept() (e.g. 202 and a status URL): answer it again
    ACCEPTED = "accepted"
    MISMATCH = "mismatch"  #: the key was used with another request: 422
    #: the key was dropped after its retention and only a tombstone remains
    #: (settings.tombstones): never execute, nothing to replay; answer 422
    EXPIRED = "expired"

    @property
    def owned(self) -> bool:
        """True when the caller now holds the lease (claimed or resumed)."""
        return self in (Outcome.CLAIMED, Outcome.RESUMED)


@dataclass(frozen=True)
class StoredResponse:
    """A completed key's response, as :func:`complete` stored it."""

    status: int
    headers: dict[str, str] = field(default_factory=dict)
    #: The JSON body (a Python value) when it was stored as JSON, else None.
    body: Any = None
    #: The exact bytes when it was stored with ``complete(..., body=b"...")``, else None.
    body_bytes: bytes | None = None
    content_type: str | None = None
    completed_at: datetime | None = None

    @property
    def content(self) -> bytes:
        """The body as bytes: the stored bytes, or the JSON body serialized (``b""`` if none)."""
        if self.body_bytes is not None:
            return self.body_bytes
        if self.body is None:
            return b""
        return json.dumps(self.body, separators=(",", ":"), ensure_ascii=False).encode()

    def json(self) -> Any:
        """The body as a JSON value (bytes bodies are parsed)."""
        if self.body_bytes is not None:
            return json.loads(self.body_bytes)
        return self.body


@dataclass(frozen=True)
class ClaimResult:
    """One row of ``idempotency.claim_result``; ``response`` is set for a replay (the final
    response) and for accepted (the interim response)."""

    outcome: Outcome
    lease_token: int | None
    lease_expires_at: datetime | None
    recovery_point: str | None
    attempts: int | None
    retry_after: timedelta | None
    created_at: datetime | None
    response: StoredResponse | None

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> ClaimResult:
        outcome = Outcome(row["outcome"])
        response = None
        if outcome in (Outcome.REPLAY, Outcome.ACCEPTED):
            body_bytes = row["response_body_bytes"]
            body = load_json(row["response_body"])
            if body is None and body_bytes is not None:
                body = _json_of_bytes(row["response_content_type"], bytes(body_bytes))
            response = StoredResponse(
                status=row["response_status"],
                headers=dict(load_json(row["response_headers"]) or {}),
                body=body,
                body_bytes=bytes(body_bytes) if body_bytes is not None else None,
                content_type=row["response_content_type"],
                completed_at=load_time(row["completed_at"]),
            )
        return cls(outcome, row["lease_token"], load_time(row["lease_expires_at"]),
                   row["recovery_point"], row["attempts"], load_interval(row["retry_after"]),
                   load_time(row["created_at"]), response)


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
    result_outcome = Outcome(bytes(values[0]).decode(encoding))
    token, expires, recovery_point, attempts = values[1:5]
    retry_after, created_at = values[10], values[11]
    response = None
    if result_outcome is Outcome.REPLAY or result_outcome is Outcome.ACCEPTED:
        (status, headers, body, body_bytes, content_type) = values[5:10]
        completed_at = values[12]
        # jsonb in binary: a version byte (1), then the text
        stored = None if body is None else json.loads(bytes(body)[1:].decode(encoding))
        raw = None if body_bytes is None else bytes(body_bytes)
        ctype = None if content_type is None else bytes(content_type).decode(encoding)
        if stored is None and raw is not None:
            stored = _json_of_bytes(ctype, raw)
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


def json_bytes(value: Any) -> bytes:
    """A JSON value as the bytes stored and replayed for it: compact, its keys in the order
    given (jsonb would sort them), a Decimal by its exact digits, a tuple as an array. Call
    :func:`~pg_idempotency.fingerprint.canonical_json` first to refuse what jsonb refuses."""
    return "".join(_json_parts(value)).encode()


def _json_parts(value: Any) -> Iterator[str]:
    if isinstance(value, Mapping):
        yield "{"
        for i, (name, item) in enumerate(value.items()):
            yield ("," if i else "") + json.dumps(name, ensure_ascii=False) + ":"
            yield from _json_parts(item)
        yield "}"
    elif isinstance(value, (list, tuple)):
        yield "["
        for i, item in enumerate(value):
            if i:
                yield ","
            yield from _json_parts(item)
        yield "]"
    elif isinstance(value, Decimal):
        yield str(value)
    else:
        yield json.dumps(value, ensure_ascii=False)


class _NotPlain(Exception):
    """:func:`_json_body`'s fast path cannot vouch for a value."""


def _not_plain(value: Any) -> Any:
    raise _NotPlain


#: The C encoder of the standard library, spelled as :func:`json_bytes` spells a value made of
#: dict, list, str, int, float, bool and None (compact, keys in the order given, floats by
#: repr); anything else raises (_not_plain), and so do NaN and the infinities.
_DUMPS = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"),
                          default=_not_plain).encode


def _json_body(value: Any) -> tuple[bytes, Any]:
    """What complete() stores for a JSON answer: ``json_bytes(value)``, refusing what
    ``canonical_json(value)`` refuses, and the value every replay reads back from those bytes
    (``json.loads``). One pass of the C encoder and one of the parser when that provably gives
    the same (issue 32: the answer was walked four times in Python): the text read back equals
    the value (so every key is a string and nothing is a tuple or a Decimal), holds no
    ``\\u0000``, encodes as UTF-8 (no unpaired surrogate) and has at most MAX_DEPTH brackets;
    anything else takes the slow path, which also says what is wrong."""
    try:
        text = _DUMPS(value)
        if "\\u0000" not in text and text.count("{") + text.count("[") <= MAX_DEPTH:
            back = json.loads(text)
            if back == value:
                return text.encode("utf-8"), back
    except (_NotPlain, TypeError, ValueError, RecursionError):
        pass  # (UnicodeEncodeError is a ValueError)
    canonical_json(value)  # refuses what jsonb would refuse (NaN, lone surrogates, ...)
    data = json_bytes(value)
    return data, json.loads(data)


def _json_of_bytes(content_type: str | None, body: bytes) -> Any:
    """The JSON value of a stored JSON body (None for any other body, or one that does not
    parse)."""
    if content_type is None or "json" not in content_type:
        return None
    try:
        return json.loads(body)
    except ValueError:
        return None


def load_json(text: str | None) -> Any:
    """A json/jsonb column that queries.py casts to text, parsed here: whatever loaders the
    connection has registered (Django registers a text loader for jsonb), the result is the
    same."""
    return None if text is None else json.loads(text)


_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def _microseconds(text: str) -> int:
    seconds = Decimal(text)  # exact: numeric text with 6 decimals
    if not seconds.is_finite():
        raise OverflowError(text)
    return int(seconds.scaleb(6))


def _delta(text: str) -> timedelta:
    """``timedelta(microseconds=_microseconds(text))``; what extract(epoch ...)::text gives from
    PostgreSQL 14 on, ``[-]digits.dddddd``, read with integer arithmetic (the same value; any
    other spelling takes the Decimal path). OverflowError when out of range."""
    whole, dot, frac = text.partition(".")
    digits = whole[1:] if whole[:1] == "-" else whole
    if (dot and len(frac) == 6 and frac.isdigit() and digits.isdigit()
            and frac.isascii() and digits.isascii()):
        delta = timedelta(0, int(digits), int(frac))
        return -delta if digits is not whole else delta
    return timedelta(microseconds=_microseconds(text))


@overload
def load_time(text: str | datetime) -> datetime: ...
@overload
def load_time(text: None) -> None: ...
def load_time(text: str | datetime | None) -> datetime | None:
    """A timestamptz column that queries.py sends as seconds since 1970-01-01 UTC (numeric
    text), as an aware datetime in UTC: the same instant, to the microsecond, under every
    DateStyle and TimeZone. A datetime (the own sends' short complete reads its time itself)
    is returned as it is."""
    if text is None:
        return None
    if type(text) is datetime:
        return text
    try:
        return _EPOCH + _delta(text)
    except OverflowError:
        raise psycopg.DataError("timestamp out of the range of datetime (years 1 to 9999): "
                                f"{text} s since 1970") from None


@overload
def load_interval(text: str) -> timedelta: ...
@overload
def load_interval(text: None) -> None: ...
def load_interval(text: str | None) -> timedelta | None:
    """An interval column that queries.py sends as its length in seconds (numeric text), as a
    timedelta: the same under every IntervalStyle."""
    if text is None:
        return None
    try:
        return _delta(text)
    except OverflowError:
        raise psycopg.DataError(f"interval out of the range of timedelta: {text} s") from None


@dataclass(frozen=True)
class AbandonedKey:
    """One row of ``idempotency.list_abandoned``."""

    scope: str
    key: str
    lease_expires_at: datetime
    recovery_point: str | None
    attempts: int
    created_at: datetime

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> AbandonedKey:
        return cls(row["scope"], row["key"], load_time(row["lease_expires_at"]),
                   row["recovery_point"], row["attempts"], load_time(row["created_at"]))


#: psycopg's ``prepare`` for every statement the package sends: never a named server-side
#: prepared statement, whatever the connection's ``prepare_threshold``. Behind a
#: transaction-mode pooler (pgbouncer) the server connection changes between transactions, so
#: a name prepared by one client can be executed by another: in issue 13 one client's
#: heartbeat() ran another's prepared release() and deleted its key. Unnamed statements (Parse
#: and Bind of "") live for one statement only. The cost is measured in docs/benchmarks.md
#: (bench/prepare.py). Tests set it to None (psycopg's default) to show what it prevents.
#: allow_prepared_statements() sets it, for processes with no such pooler in between.
_PREPARE: bool | None = False


def allow_prepared_statements(allowed: bool = True) -> None:
    """Let psycopg prepare the package's statements as each connection's ``prepare_threshold``
    says (``allowed=True``), or never (``False``: the default). For the whole process.

    Preparing saves the server the parse and plan of every call (claim and complete are
    function calls with a dozen casts and columns: about 75 µs of server CPU for a claim and
    140 µs for claim + complete on PostgreSQL 15, docs/benchmarks.md). Allow it only when no
    transaction-mode pooler (pgbouncer before 1.21 without ``max_prepared_statements``) sits
    between this process and the server: there a statement prepared by one client can run as
    another's (docs/install.md, "Connection poolers"). A connection with
    ``prepare_threshold=None`` still prepares nothing."""
    if not isinstance(allowed, bool):
        raise TypeError(f"allow_prepared_statements: allowed must be True or False, "
                        f"not {allowed!r}")
    global _PREPARE
    _PREPARE = None if allowed else False


# -- what the generators ask the drivers for -------------------------------------------------

#: The calls Citus delegates by their first argument (docs/scale-out.md), with its name. A NULL
#: there crashes a Citus 14.0.1 node's backend before the function can refuse it, so the
#: package refuses it first, with the engine's own error (IK010), and sends nothing.
_DELEGATED_BY: Final = {
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


class _Query:
    """One statement for a driver to run (a plain class with slots: one is made per call)."""

    __slots__ = ("sql", "params", "fetch", "fenced", "alone", "commit", "binary_sql")

    def __init__(self, sql: str, params: Mapping[str, Any], fetch: str = "one", *,
                 fenced: bool = False, alone: bool = False, commit: bool = False,
                 binary_sql: str | None = None) -> None:
        delegated = _DELEGATED_BY.get(sql)
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
        #: (queries.CLAIM_BINARY): core's own drivers run it and return its
        #: :func:`claim_result_of`; a driver that reads rows (the SQLAlchemy session's) runs
        #: ``sql`` and hands over a dict row.
        self.binary_sql = binary_sql


@dataclass(frozen=True)
class _Call:
    """Call the user's function; the async driver awaits what it returns if awaitable."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]


class _Tx(Enum):
    STATE = "state"  # -> (TransactionStatus, autocommit)
    BEGIN = "begin"  # open a transaction now (explicit BEGIN on an autocommit connection)
    COMMIT = "commit"
    ROLLBACK = "rollback"


_Request = _Query | _Call | _Tx
_Gen = Generator[_Request, Any, T]


def _run(conn: psycopg.Connection[Any], gen: _Gen[T]) -> T:
    """Drive ``gen`` on a sync connection. Engine errors are thrown into the generator (so it
    can clean up) as the classes of :mod:`pg_idempotency.errors`."""
    send: Callable[[Any], _Request] = gen.send
    value: Any = None
    while True:
        try:
            request = send(value)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        try:
            if isinstance(request, _Query):
                value = _execute(conn, request)
            elif isinstance(request, _Call):
                value = request.fn(*request.args, **request.kwargs)
            elif request is _Tx.STATE:
                # (libpq's status as conn.info gives it, without a ConnectionInfo per call)
                value = (TransactionStatus(conn.pgconn.transaction_status), conn.autocommit)
            elif request is _Tx.BEGIN:
                if conn.autocommit and conn.pgconn.transaction_status == TransactionStatus.IDLE:
                    _begin(conn)
                value = None
            elif request is _Tx.COMMIT:
                value = conn.commit()
            else:
                value = conn.rollback()
            send = gen.send
        except Exception as exc:  # noqa: BLE001 - handed to the generator, which re-raises
            value, send = _translate(exc, request), gen.throw


def _begin(conn: psycopg.Connection[Any]) -> None:
    """BEGIN on an autocommit connection, as psycopg sends its own BEGIN and COMMIT (a command
    with no cursor, no parameters and no rows: about half the client CPU of
    ``conn.execute("BEGIN")``); through ``conn.execute`` if a psycopg ever lacks that path."""
    command = getattr(conn, "_exec_command", None)
    if command is None:
        conn.execute(Q.BEGIN, prepare=_PREPARE)
        return
    with conn.lock:
        conn.wait(command(_BEGIN))


async def _abegin(conn: psycopg.AsyncConnection[Any]) -> None:
    """:func:`_begin` for an async connection."""
    command = getattr(conn, "_exec_command", None)
    if command is None:
        await conn.execute(Q.BEGIN, prepare=_PREPARE)
        return
    async with conn.lock:
        await conn.wait(command(_BEGIN))


_BEGIN = Q.BEGIN.encode()


# -- the package's own sends ------------------------------------------------------------------
#
# claim (in binary) and complete + COMMIT (one simple Query) are the statements of every
# payment. Through a psycopg cursor each costs the application a cursor, a Transformer, the
# query's conversion, a dumper per parameter and a loader per result column, about as much
# CPU as the round trip itself (issue 32). Their parameters are few and of known types, so
# the package binds them itself and sends them with psycopg's own generators on the caller's
# connection, as psycopg's cursor does: under the connection's lock, its state checked, a
# transaction begun first where psycopg would begin one, errors raised as psycopg raises them
# (psycopg.errors.error_from_result: the same classes, SQLSTATEs and diagnostics). Values of
# any other type, a text psycopg would refuse (NUL) or the client encoding cannot hold, the
# opt-in to prepared statements and a pipeline take the cursor as before. Nothing is prepared:
# claim goes as an unnamed extended-protocol statement (the same Parse, Bind and Execute a
# cursor sends, with the same parameter types and formats), complete + COMMIT as a simple
# Query with its values as literals (what psycopg's ClientCursor renders).

#: The psycopg internals the own sends rely on; with a psycopg that lacks one, every statement
#: takes a cursor.
_OWN_SEND: Final = (
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


def _bound(sql: str, params: Mapping[str, Any], encoding: str
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


def _conforming(conn: Any) -> bool:
    """standard_conforming_strings is on for ``conn`` (as libpq last heard from the server)."""
    return conn.pgconn.parameter_status(b"standard_conforming_strings") == b"on"


def _literal_query(sql: str, params: Mapping[str, Any], encoding: str, conforming: bool
                   ) -> bytes | None:
    """``sql`` with its values as literals (text, int, bytea, Jsonb, NULL) in the client
    ``encoding``, or None when a value is of another type, holds a NUL, or the encoding
    cannot hold it: psycopg's ClientCursor renders it then. Built as bytes, a body's hex in
    one piece, so that a large body is copied once into the statement (the HTTP adapters'
    memory bounds, tests/test_http_bounds.py)."""
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


def _iso_dates(conn: Any) -> bool:
    """The server prints dates in DateStyle ISO to ``conn`` (as libpq last heard from it: the
    server reports every change of DateStyle, SET LOCAL included, before it is ready for the
    next query)."""
    style = conn.pgconn.parameter_status(b"DateStyle")
    return style is not None and style.startswith(b"ISO")


def _iso_time(text: bytes | None) -> datetime | None:
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


def _commit_text(conn: Any, q: _Query, encoding: str) -> tuple[bytes | None, bool]:
    """A complete + COMMIT (any statement + COMMIT) as one simple Query's text with its values
    as literals (None: psycopg's ClientCursor renders it), and whether it is the short form,
    whose one column is a timestamptz in DateStyle ISO (queries.COMPLETE_SHORT)."""
    short = _SHORT_COMMIT.get(q.sql) if _iso_dates(conn) else None
    text = _literal_query((short or q.sql) + Q.AND_COMMIT, q.params, encoding,
                          _conforming(conn))
    return text, short is not None


def _commit_row(res: Any, short: bool, fetch: str, encoding: str) -> Any:
    """The row of a send of :func:`_commit_text`: for the short form ``{"completed_at":
    datetime}``, which :func:`load_time` returns as it is."""
    if short:
        return {"completed_at": _iso_time(res.get_value(0, 0))}
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


def _codec(pgconn: Any) -> str:
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
    sent (see _codec). Without it an outcome read b'completed', not 'completed', and a complete
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


def _execute(conn: psycopg.Connection[Any], q: _Query) -> Any:
    if q.alone and not conn.autocommit and conn.info.transaction_status == TransactionStatus.IDLE:
        conn.autocommit = True
        try:
            return _execute(conn, q)
        finally:
            if not conn.broken:  # a lost connection cannot switch (its status is UNKNOWN)
                conn.autocommit = False
    if q.binary_sql is not None and conn.pgconn.pipeline_status == PipelineStatus.OFF:
        encoding = _codec(conn.pgconn)
        if _OWN_SEND and _PREPARE is False:
            bound = _bound(_SHORT.get(q.binary_sql, q.binary_sql), q.params, encoding)
            if bound is not None:
                with conn.lock:
                    results = conn.wait(_send_params(conn, *bound, _BINARY))
                return claim_result_of(_first_result(results, encoding), encoding)
        # psycopg's own cursor class, not the connection's cursor_factory (a ClientCursor
        # cannot ask for binary results)
        with psycopg.Cursor(conn) as bcur:
            bcur.execute(q.binary_sql, q.params, prepare=_PREPARE, binary=True)
            return claim_result_of(bcur.pgresult, _codec(conn.pgconn))
    if q.commit and _PREPARE is False and conn.pgconn.pipeline_status == PipelineStatus.OFF:
        # The statement and COMMIT in one simple Query message: one round trip, with the
        # values bound here (psycopg quotes them for the connection's settings) and none of
        # a pipeline's machinery, which costs the app more CPU than the round trip it saves
        # (docs/benchmarks.md). An error in the statement skips the COMMIT.
        if _OWN_SEND:
            encoding = _codec(conn.pgconn)
            text, short = _commit_text(conn, q, encoding)
            if text is not None:
                with conn.lock:
                    results = conn.wait(_send_simple(conn, text))
                return _commit_row(_first_result(results, encoding), short, q.fetch, encoding)
        with psycopg.ClientCursor(conn, row_factory=dict_rows(conn)) as ccur:
            ccur.execute(q.sql + Q.AND_COMMIT, q.params, prepare=False)
            return ccur.fetchone() if q.fetch == "one" else ccur.fetchall()
    with conn.cursor(row_factory=dict_rows(conn)) as cur:
        if q.commit and conn.pgconn.pipeline_status != PipelineStatus.OFF:
            # the caller's pipeline (opt-in): their writes, complete and COMMIT go together
            cur.execute(q.sql, q.params, prepare=_PREPARE)  # type: ignore[arg-type]
            conn.execute(Q.COMMIT, prepare=_PREPARE)
        elif q.commit and _PIPELINE:
            # one Sync for both: conn.commit() in a pipeline would send a second one
            with conn.pipeline():
                cur.execute(q.sql, q.params, prepare=_PREPARE)  # type: ignore[arg-type]
                conn.execute(Q.COMMIT, prepare=_PREPARE)
        else:
            cur.execute(q.sql, q.params, prepare=_PREPARE)  # type: ignore[arg-type]
            if q.commit:
                conn.commit()
        return cur.fetchone() if q.fetch == "one" else cur.fetchall()


async def _aexecute(conn: psycopg.AsyncConnection[Any], q: _Query) -> Any:
    if q.alone and not conn.autocommit and conn.info.transaction_status == TransactionStatus.IDLE:
        await conn.set_autocommit(True)
        try:
            return await _aexecute(conn, q)
        finally:
            if not conn.broken:  # a lost connection cannot switch (its status is UNKNOWN)
                await conn.set_autocommit(False)
    if q.binary_sql is not None and conn.pgconn.pipeline_status == PipelineStatus.OFF:
        encoding = _codec(conn.pgconn)
        if _OWN_SEND and _PREPARE is False:
            bound = _bound(_SHORT.get(q.binary_sql, q.binary_sql), q.params, encoding)
            if bound is not None:
                async with conn.lock:
                    results = await conn.wait(_send_params(conn, *bound, _BINARY))
                return claim_result_of(_first_result(results, encoding), encoding)
        async with psycopg.AsyncCursor(conn) as bcur:
            await bcur.execute(q.binary_sql, q.params, prepare=_PREPARE, binary=True)
            return claim_result_of(bcur.pgresult, _codec(conn.pgconn))
    if q.commit and _PREPARE is False and conn.pgconn.pipeline_status == PipelineStatus.OFF:
        if _OWN_SEND:
            encoding = _codec(conn.pgconn)
            text, short = _commit_text(conn, q, encoding)
            if text is not None:
                async with conn.lock:
                    results = await conn.wait(_send_simple(conn, text))
                return _commit_row(_first_result(results, encoding), short, q.fetch, encoding)
        async with psycopg.AsyncClientCursor(conn, row_factory=dict_rows(conn)) as ccur:
            await ccur.execute(q.sql + Q.AND_COMMIT, q.params, prepare=False)
            return await (ccur.fetchone() if q.fetch == "one" else ccur.fetchall())
    async with conn.cursor(row_factory=dict_rows(conn)) as cur:
        if q.commit and conn.pgconn.pipeline_status != PipelineStatus.OFF:
            await cur.execute(q.sql, q.params, prepare=_PREPARE)  # type: ignore[arg-type]
            await conn.execute(Q.COMMIT, prepare=_PREPARE)
        elif q.commit and _PIPELINE:
            async with conn.pipeline():
                await cur.execute(q.sql, q.params, prepare=_PREPARE)  # type: ignore[arg-type]
                await conn.execute(Q.COMMIT, prepare=_PREPARE)
        else:
            await cur.execute(q.sql, q.params, prepare=_PREPARE)  # type: ignore[arg-type]
            if q.commit:
                await conn.commit()
        return await (cur.fetchone() if q.fetch == "one" else cur.fetchall())


async def _arun(conn: psycopg.AsyncConnection[Any], gen: _Gen[T]) -> T:
    """:func:`_run` for an async connection."""
    send: Callable[[Any], _Request] = gen.send
    value: Any = None
    while True:
        try:
            request = send(value)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        try:
            if isinstance(request, _Query):
                value = await _aexecute(conn, request)
            elif isinstance(request, _Call):
                value = request.fn(*request.args, **request.kwargs)
                if inspect.isawaitable(value):
                    value = await value
            elif request is _Tx.STATE:
                value = (TransactionStatus(conn.pgconn.transaction_status), conn.autocommit)
            elif request is _Tx.BEGIN:
                if conn.autocommit and conn.pgconn.transaction_status == TransactionStatus.IDLE:
                    await _abegin(conn)
                value = None
            elif request is _Tx.COMMIT:
                value = await conn.commit()
            else:
                value = await conn.rollback()
            send = gen.send
        except Exception as exc:  # noqa: BLE001
            value, send = _translate(exc, request), gen.throw


#: libpq 14 or later: complete() and its COMMIT go in one round trip.
_PIPELINE = psycopg.Pipeline.is_supported()


def _translate(exc: Exception, request: _Request) -> Exception:
    if isinstance(exc, psycopg.Error):
        mapped = from_psycopg(exc, lease_token=isinstance(request, _Query) and request.fenced)
        if mapped is not exc:
            mapped.__cause__ = exc
        return mapped
    if not isinstance(exc, DatabaseUnavailable) and not isinstance(request, _Call) \
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
    while cause is not None and not isinstance(cause, psycopg.Error):
        cause = cause.__cause__ or cause.__context__
    mapped = DatabaseUnavailable(f"the database is unavailable: {exc}",
                                 pgerror=cause if isinstance(cause, psycopg.Error) else None)
    mapped.__cause__ = exc
    return mapped


def _sync(op: Callable[P, _Gen[T]]) -> Callable[Concatenate[psycopg.Connection[Any], P], T]:
    @functools.wraps(op)
    def call(conn: psycopg.Connection[Any], /, *args: P.args, **kwargs: P.kwargs) -> T:
        return _run(conn, op(*args, **kwargs))

    return call


def _async(op: Callable[P, _Gen[T]]
           ) -> Callable[Concatenate[psycopg.AsyncConnection[Any], P], Awaitable[T]]:
    @functools.wraps(op)
    async def call(conn: psycopg.AsyncConnection[Any], /, *args: P.args,
                   **kwargs: P.kwargs) -> T:
        return await _arun(conn, op(*args, **kwargs))

    return call


# -- the functions of the SQL API, one generator each ----------------------------------------

def _interval(value: timedelta | float | None) -> timedelta | None:
    if value is None or isinstance(value, timedelta):
        return value
    return timedelta(seconds=value)


def _jsonb(value: Any) -> Jsonb:
    # canonical_json keeps Decimal values exact and refuses what jsonb would refuse.
    return Jsonb(value, dumps=canonical_json)


def _claim_query(scope: str, key: str, request: Any, lease: timedelta | float,
                 fingerprint: bytes | None, strict: bool, reference_time: datetime | None,
                 alone: bool = False) -> _Query:
    if request is not None and fingerprint is None:
        # The request's fingerprint computed here, byte-identical to claim's own (the vectors
        # of tests/vectors prove it), so the database does not canonicalize it (issue 32).
        # With both given the server refuses the pair (IK016), as before.
        fingerprint, request = request_fingerprint(request), None
    return _Query(Q.CLAIM, {
        "scope": scope, "key": key,
        "request": _jsonb(request) if request is not None else None,
        "lease": _interval(lease), "fingerprint": fingerprint, "strict": strict,
        "reference_time": reference_time,
    }, alone=alone, binary_sql=Q.CLAIM_BINARY)


def _log_claim(event: str, scope: str, key: str, result: ClaimResult) -> None:
    outcome = result.outcome
    level = logging.WARNING if outcome in (Outcome.MISMATCH, Outcome.EXPIRED) else logging.INFO
    if logger.isEnabledFor(level):
        _log(level, event, scope, key, outcome=outcome.value, attempts=result.attempts,
             recovery_point=None if result.recovery_point is None else "set")


def _claimed(q: _Query, call: str, scope: str, key: str) -> _Gen[ClaimResult]:
    """Run a claim or a takeover: its result, logged and observed (telemetry)."""
    obs = telemetry.start(call, scope, key)
    try:
        row = yield q
        result = row if isinstance(row, ClaimResult) else ClaimResult.from_row(row)
    except BaseException as exc:
        telemetry.end(obs, telemetry.ERROR, error=exc)
        raise
    telemetry.end(obs, result.outcome.value, attempts=result.attempts)
    _log_claim(call, scope, key, result)
    return result


def claim(scope: str, key: str, request: Any = None, *,
          lease: timedelta | float = DEFAULT_LEASE, fingerprint: bytes | None = None,
          strict: bool = False, reference_time: datetime | None = None) -> _Gen[ClaimResult]:
    """``idempotency.claim``. Pass the request as a JSON value, or ``request=None`` and your own
    32-byte ``fingerprint``. Run it in its own transaction (an autocommit connection, or commit
    right after): other retries must see the claim at once."""
    return (yield from _claimed(
        _claim_query(scope, key, request, lease, fingerprint, strict, reference_time),
        "claim", scope, key))


def takeover(scope: str, key: str, *, lease: timedelta | float = DEFAULT_LEASE,
             reference_time: datetime | None = None) -> _Gen[ClaimResult]:
    """``idempotency.takeover``: take over an abandoned key (for background completers)."""
    return (yield from _claimed(
        _Query(Q.TAKEOVER, {"scope": scope, "key": key, "lease": _interval(lease),
                            "reference_time": reference_time}, binary_sql=Q.TAKEOVER_BINARY),
        "takeover", scope, key))


#: The calls that answer a lost lease as an outcome (idempotency.*_outcome), with the name of
#: the raising form whose error the package raises from it.
_ANSWERS_OUTCOME: Final = {
    Q.HEARTBEAT_OUTCOME: "idempotency.heartbeat", Q.CHECKPOINT_OUTCOME: "idempotency.checkpoint",
    Q.RELEASE_OUTCOME: "idempotency.release",
}


def _lease_lost(fn: str, scope: str, key: str, lease_token: int, outcome: str) -> LeaseLost:
    """The exception, message, DETAIL and HINT the raising form's IK001 (outcome lease_lost) or
    IK004 (outcome completed) would have brought (sql/functions/_lease_error.sql)."""
    where = f"key {json.dumps(key, ensure_ascii=False)} in scope " \
            f"{json.dumps(scope, ensure_ascii=False)}"
    if outcome == "completed":
        return LeaseLostCompleted(f"{fn}: {where} is already completed",
                                  detail="It was completed with this lease token.",
                                  hint="Roll back; a retry will replay the stored response.")
    if outcome != "lease_lost":
        raise UsageError(f"{fn}: unknown outcome {outcome!r} (is the engine newer than "
                         "the package?)")
    return LeaseLost(
        f"{fn}: lease token {lease_token} is not the current one for {where}",
        detail="The lease was lost (taken over after it expired, or released), or the key or "
               "the token is not one this caller was given.",
        hint="Roll back: whoever holds the current token owns the key.")


def _fenced(q: _Query, scope: str, key: str, call: str,
            done: Mapping[str, Any] | None = None) -> _Gen[Any]:
    """Run a call that takes a lease token; log a lost lease (any :class:`LeaseLost`) and, when
    ``done`` is given, the call's success as an INFO line with those fields; observe it
    (telemetry: ok, lease_lost or error). A call of :data:`_ANSWERS_OUTCOME` answers a lost
    lease as its outcome, not as an error: raised here as the same :class:`LeaseLost` (or
    :class:`LeaseLostCompleted`) the raising form's IK001 (IK004) becomes, with no error on the
    server (on Citus an error costs the session a new worker connection)."""
    obs = telemetry.start(call, scope, key)
    try:
        row = yield q
        fn = _ANSWERS_OUTCOME.get(q.sql)
        if fn is not None and row["outcome"] != "ok":
            raise _lease_lost(fn, scope, key, q.params["lease_token"], row["outcome"])
    except LeaseLost as exc:
        telemetry.end(obs, telemetry.LEASE_LOST, error=exc)
        if logger.isEnabledFor(logging.WARNING):
            _log(logging.WARNING, "lease_lost", scope, key, call=call, sqlstate=exc.sqlstate)
        raise
    except BaseException as exc:
        telemetry.end(obs, telemetry.ERROR, error=exc)
        raise
    telemetry.end(obs, telemetry.OK)
    if done is not None and logger.isEnabledFor(logging.INFO):
        _log(logging.INFO, call, scope, key, **done)
    return row


def _checkpoint_query(scope: str, key: str, lease_token: int, recovery_point: str,
                      extend: timedelta | float | None, reference_time: datetime | None,
                      sql: str) -> _Query:
    return _Query(sql, {
        "scope": scope, "key": key, "lease_token": lease_token,
        "recovery_point": recovery_point, "extend": _interval(extend),
        "reference_time": reference_time,
    }, fenced=True)


def checkpoint(scope: str, key: str, lease_token: int, recovery_point: str, *,
               extend: timedelta | float | None = None,
               reference_time: datetime | None = None) -> _Gen[datetime]:
    """``idempotency.checkpoint`` in the caller's transaction; returns the lease expiry.
    The raising form: its IK001 aborts the caller's transaction, so the step's writes cannot
    commit without the recovery point (``op.checkpoint()``, which rolls back itself, uses
    ``checkpoint_outcome``)."""
    row = yield from _fenced(_checkpoint_query(scope, key, lease_token, recovery_point, extend,
                                               reference_time, Q.CHECKPOINT),
                             scope, key, "checkpoint")
    return load_time(row["lease_expires_at"])


def heartbeat(scope: str, key: str, lease_token: int, *,
              lease: timedelta | float = DEFAULT_LEASE,
              reference_time: datetime | None = None) -> _Gen[datetime]:
    """``idempotency.heartbeat_outcome``: extends the lease; returns the new lease expiry, or
    raises :class:`LeaseLost` (:class:`LeaseLostCompleted`) as ``idempotency.heartbeat``'s
    IK001 (IK004) would, without an error on the server: the transaction it ran in is left
    usable (heartbeat wrote nothing else), so roll back what it was part of yourself."""
    row = yield from _fenced(_Query(Q.HEARTBEAT_OUTCOME, {
        "scope": scope, "key": key, "lease_token": lease_token, "lease": _interval(lease),
        "reference_time": reference_time,
    }, fenced=True), scope, key, "heartbeat")
    return load_time(row["lease_expires_at"])


def _complete_query(scope: str, key: str, lease_token: int, status: int, body: Any,
                    headers: Mapping[str, str] | None, content_type: str | None,
                    reference_time: datetime | None, commit: bool = False) -> _Query:
    return _complete_parts(scope, key, lease_token, status, body, headers, content_type,
                           reference_time, commit)[0]


def _complete_parts(scope: str, key: str, lease_token: int, status: int, body: Any,
                    headers: Mapping[str, str] | None, content_type: str | None,
                    reference_time: datetime | None, commit: bool = False
                    ) -> tuple[_Query, Any]:
    """complete()'s query, and the body's value as every replay will read it (None for bytes
    and for no body)."""
    params: dict[str, Any] = {
        "scope": scope, "key": key, "lease_token": lease_token, "status": status,
        "headers": _jsonb(dict(headers or {})), "reference_time": reference_time,
    }
    if isinstance(body, (bytes, bytearray, memoryview)):
        params.update(body=bytes(body), content_type=content_type or "application/octet-stream")
        return _Query(Q.COMPLETE_BYTES, params, fenced=True, commit=commit), None
    if content_type is not None:
        raise UsageError("content_type is for bytes bodies: a JSON body is stored as "
                         "application/json")
    if body is None:
        params["body"] = None
        return _Query(Q.COMPLETE, params, fenced=True, commit=commit), None
    # A JSON value is stored as the bytes it serialises to (complete_bytes, application/json):
    # jsonb would reorder its keys, so {"zeta":1,"a":2} would replay as {"a":2,"zeta":1}.
    data, value = _json_body(body)
    params.update(body=data, content_type="application/json")
    return _Query(Q.COMPLETE_BYTES, params, fenced=True, commit=commit), value


def complete(scope: str, key: str, lease_token: int, status: int, body: Any = None, *,
             headers: Mapping[str, str] | None = None, content_type: str | None = None,
             reference_time: datetime | None = None) -> _Gen[datetime]:
    """``idempotency.complete`` (a JSON body, or None) or, when ``body`` is bytes,
    ``idempotency.complete_bytes`` with ``content_type`` (default
    ``application/octet-stream``). Call it in the business transaction; returns completed_at.
    Raises :class:`~pg_idempotency.errors.LeaseLost` (IK001) when this attempt no longer owns
    the key, or its subclass :class:`~pg_idempotency.errors.LeaseLostCompleted` (IK004) when
    this very token completed it already: roll back."""
    q = _complete_query(scope, key, lease_token, status, body, headers, content_type,
                        reference_time)
    row = yield from _fenced(q, scope, key, "complete", {"status": status})
    return load_time(row["completed_at"])


def accept(scope: str, key: str, lease_token: int, status: int, body: Any = None, *,
           headers: Mapping[str, str] | None = None, lease: timedelta | float | None = None,
           reference_time: datetime | None = None) -> _Gen[datetime]:
    """``idempotency.accept``: store an interim response (a JSON body, or None) on a key you
    hold, in the transaction that hands the work over (the one that enqueues the job);
    optionally extend the lease. Returns the lease expiry."""
    row = yield from _accept_row(scope, key, lease_token, status, body, headers=headers,
                                 lease=lease, reference_time=reference_time)
    return load_time(row["lease_expires_at"])


def _accept_row(scope: str, key: str, lease_token: int, status: int, body: Any = None, *,
                headers: Mapping[str, str] | None = None, lease: timedelta | float | None = None,
                reference_time: datetime | None = None) -> _Gen[dict[str, Any]]:
    """:func:`accept`'s row: ``lease_expires_at`` and ``body`` as jsonb stored it."""
    row = yield from _fenced(_Query(Q.ACCEPT, {
        "scope": scope, "key": key, "lease_token": lease_token, "status": status,
        "body": _jsonb(body) if body is not None else None,
        "headers": _jsonb(dict(headers or {})), "lease": _interval(lease),
        "reference_time": reference_time,
    }, fenced=True), scope, key, "accept", {"status": status})
    return row  # type: ignore[no-any-return]


def release(scope: str, key: str, lease_token: int) -> _Gen[None]:
    """``idempotency.release_outcome``: for a failure before any side effect. The key's row
    stays, in state released (no lease, no response), and the next claim starts it afresh
    under a greater lease token (engine 0.9.0). A lost lease raises :class:`LeaseLost` as
    ``idempotency.release``'s IK001 would, without an error on the server (the transaction is
    left usable)."""
    yield from _release(scope, key, lease_token, alone=False, reason="release")


def _release(scope: str, key: str, lease_token: int, *, alone: bool, reason: str
             ) -> _Gen[None]:
    yield from _fenced(_Query(Q.RELEASE_OUTCOME, {"scope": scope, "key": key,
                                                  "lease_token": lease_token},
                              fenced=True, alone=alone), scope, key, "release")
    if logger.isEnabledFor(logging.INFO):
        _log(logging.INFO, "release", scope, key, reason=reason)


def list_abandoned(max_keys: int = 100, *, scope: str | None = None,
                   reference_time: datetime | None = None) -> _Gen[list[AbandonedKey]]:
    """``idempotency.list_abandoned``: the rows stay locked until the caller's transaction
    ends, so run it in a transaction together with the takeovers."""
    rows = yield _Query(Q.LIST_ABANDONED, {"max_keys": max_keys, "scope": scope,
                                           "reference_time": reference_time}, fetch="all")
    return [AbandonedKey.from_row(row) for row in rows]


def inbox_accept(consumer: str, message_id: str, *,
                 reference_time: datetime | None = None) -> _Gen[bool]:
    """``idempotency.inbox_accept``: True the first time, False for a redelivery. Call it in
    the transaction that applies the message's effects."""
    obs = telemetry.start("inbox_accept", consumer, message_id)
    try:
        row = yield _Query(Q.INBOX_ACCEPT, {"consumer": consumer, "message_id": message_id,
                                            "reference_time": reference_time})
    except BaseException as exc:
        telemetry.end(obs, telemetry.ERROR, error=exc)
        raise
    accepted = bool(row["accepted"])
    telemetry.end(obs, "accepted" if accepted else "duplicate")
    return accepted


# -- the guided flow -------------------------------------------------------------------------

class OperationCore:
    """The state and logic of one ``operation()`` block, shared by the sync
    :class:`pg_idempotency.Operation` and the async :class:`pg_idempotency.aio.Operation`.

    Transactions: ``claim`` commits on its own; then a business transaction is open on the
    connection until ``complete()`` commits it (with the response) or the block ends.
    ``checkpoint()`` commits the writes made so far together with the recovery point and opens
    the next transaction.

    When the block raises: the open transaction rolls back. If no side effect can have
    happened (the key was freshly claimed, no checkpoint was committed, no downstream key was
    derived) the key is released so that a retry runs afresh; otherwise it stays in progress,
    its lease expires, and the next retry gets ``resumed`` with the last recovery point.
    """

    def __init__(self, scope: str, key: str, request: Any = None, *,
                 lease: timedelta | float = DEFAULT_LEASE, fingerprint: bytes | None = None,
                 reference_time: datetime | None = None,
                 max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
                 max_headers_bytes: int = DEFAULT_MAX_HEADERS_BYTES) -> None:
        for name, value in (("max_response_bytes", max_response_bytes),
                            ("max_headers_bytes", max_headers_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"operation(): {name} must be a whole number of bytes, at "
                                 f"least 1, not {value!r}")
        self.max_response_bytes = max_response_bytes
        self.max_headers_bytes = max_headers_bytes
        self.scope = scope
        self.key = key
        self._request = request
        self._lease = lease
        self._fingerprint = fingerprint
        self._reference_time = reference_time
        self.claim_result: ClaimResult | None = None
        #: The stored response when the key was completed before (outcome replay), else None.
        self.replay: StoredResponse | None = None
        #: The interim response when a long-running operation holds the key (outcome accepted).
        self.accepted: StoredResponse | None = None
        #: The response this block stored with complete() or accept(), else None.
        self.response: StoredResponse | None = None
        self.recovery_point: str | None = None
        #: True once the block released the key (op.release(), or an early return before any
        #: side effect).
        self.released = False
        self._token: int | None = None
        self._done = False
        self._side_effects = False

    # -- read-only views
    @property
    def outcome(self) -> Outcome | None:
        return self.claim_result.outcome if self.claim_result else None

    @property
    def lease_token(self) -> int | None:
        return self._token

    @property
    def attempts(self) -> int | None:
        return self.claim_result.attempts if self.claim_result else None

    def derive_key(self, step: str) -> str:
        """The idempotency key for a downstream call made as ``step`` of this operation
        (``idempotency.derive_key``). From here on a failure counts as ambiguous: the key is
        no longer released on an exception, so the next retry resumes instead."""
        self._side_effects = True
        return derive_key(self.scope, self.key, step)

    def mark_side_effect(self) -> None:
        """Say that a side effect may have happened (e.g. a downstream call without a derived
        key): from here on an exception leaves the key in progress instead of releasing it."""
        self._side_effects = True

    # -- the steps, as generators
    def g_enter(self) -> _Gen[None]:
        status, _autocommit = yield _Tx.STATE
        if status == TransactionStatus.UNKNOWN:  # the connection was lost before this block
            raise DatabaseUnavailable("the database is unavailable: the connection is lost")
        if status != TransactionStatus.IDLE:
            raise UsageError(
                f"operation() needs an idle connection, this one is {status.name}: claim must "
                "commit on its own so that concurrent retries see it (commit or roll back first)")
        # alone: one statement in autocommit, whether or not the connection is in autocommit
        result = yield from _claimed(
            _claim_query(self.scope, self.key, self._request, self._lease, self._fingerprint,
                         False, self._reference_time, alone=True), "claim", self.scope, self.key)
        yield _Tx.COMMIT  # a no-op unless a caller's autocommit connection opened a transaction
        self.claim_result = result
        self.recovery_point = result.recovery_point
        if result.outcome is Outcome.MISMATCH:
            raise KeyMismatch(f"key {self.key!r} in scope {self.scope!r} was used with a "
                              "different request")
        if result.outcome is Outcome.EXPIRED:
            raise KeyExpired(f"key {self.key!r} in scope {self.scope!r} expired: it was used "
                             "and dropped after its retention")
        if result.outcome is Outcome.IN_PROGRESS:
            raise KeyInProgress(f"key {self.key!r} in scope {self.scope!r} is in progress",
                                retry_after=result.retry_after,
                                recovery_point=result.recovery_point)
        if result.outcome is Outcome.REPLAY:
            self.replay = result.response
            return
        if result.outcome is Outcome.ACCEPTED:
            self.accepted = result.response
            return
        self._token = result.lease_token
        # A resumed key's earlier attempt may have called downstream: never release it.
        self._side_effects = result.outcome is Outcome.RESUMED
        yield _Tx.BEGIN

    def _owner_token(self, what: str) -> int:
        if self.replay is not None:
            raise UsageError(f"{what}: the key was completed before (outcome replay); return "
                             "op.replay instead of executing again")
        if self.accepted is not None:
            raise UsageError(f"{what}: a worker holds the key (outcome accepted); return "
                             "op.accepted instead of executing again")
        if self.released:
            raise UsageError(f"{what}: the key was released")
        if self._done:
            raise UsageError(f"{what}: the operation is already completed")
        if self._token is None:
            raise UsageError(f"{what}: the operation was not entered")
        return self._token

    def g_checkpoint(self, recovery_point: str, extend: timedelta | float | None = None
                     ) -> _Gen[datetime]:
        token = self._owner_token("checkpoint()")
        try:
            # The outcome form (no error on the server, no new worker connection on Citus):
            # on a lost lease the step's writes are rolled back here, as the raising form's
            # aborted transaction would have them, before LeaseLost reaches the block.
            row = yield from _fenced(_checkpoint_query(
                self.scope, self.key, token, recovery_point, extend, self._reference_time,
                Q.CHECKPOINT_OUTCOME), self.scope, self.key, "checkpoint")
        except LeaseLost:
            yield _Tx.ROLLBACK
            raise
        expires = load_time(row["lease_expires_at"])
        yield _Tx.COMMIT
        self._side_effects = True
        self.recovery_point = recovery_point
        yield _Tx.BEGIN
        return expires

    def g_complete(self, status: int, body: Any = None, headers: Mapping[str, str] | None = None,
                   content_type: str | None = None) -> _Gen[StoredResponse]:
        token = self._owner_token("complete()")
        q, value = _complete_parts(self.scope, self.key, token, status, body, headers,
                                   content_type, self._reference_time, commit=True)
        too_large = self._too_large(q, headers)
        if too_large is not None:
            # Never half-stored: nothing is sent; the business transaction rolls back and the
            # key is released (kept in progress after a side effect), as when the block
            # raises, so that a caller catching the error cannot commit the writes without it.
            yield from self.g_exit(too_large)
            raise too_large
        # complete and COMMIT in one round trip: nothing runs between them anyway
        row = yield from _fenced(q, self.scope, self.key, "complete", {"status": status})
        completed_at = load_time(row["completed_at"])
        self._done = True
        # The body as every replay will see it: the bytes sent, and for a JSON value its
        # value read back from them (a tuple is a list), made once by _complete_parts.
        stored = q.params["body"]
        if isinstance(body, (bytes, bytearray, memoryview)):
            content_type = q.params["content_type"]
            value = _json_of_bytes(content_type, stored)
        elif body is not None:
            content_type = "application/json"
        self.response = StoredResponse(status=status, headers=dict(headers or {}), body=value,
                                       body_bytes=stored, content_type=content_type,
                                       completed_at=completed_at)
        return self.response

    def _too_large(self, q: _Query, headers: Mapping[str, str] | None
                   ) -> ArgumentTooLarge | None:
        """IK018 for complete's body (the bytes stored: a JSON value as it serializes) over
        ``max_response_bytes`` or its headers (their canonical JSON text) over
        ``max_headers_bytes``, else None."""
        fn = "idempotency.complete_bytes" if q.sql == Q.COMPLETE_BYTES else "idempotency.complete"
        hint = ("Nothing was sent: the business transaction was rolled back and the key "
                "released (kept in progress after a checkpoint or a derived key). Store a "
                "smaller answer, or raise the limit given to operation() together with the "
                "server's settings (docs/python.md, \"Limits\").")
        body = q.params.get("body")
        if isinstance(body, bytes) and len(body) > self.max_response_bytes:
            return argument_too_large(fn, "body", len(body), self.max_response_bytes,
                                      "max_response_bytes of operation()", hint)
        if headers:
            # A cheap bound first (a character is at most 6 bytes of JSON text: \u00XX), so
            # ordinary headers are not serialized twice.
            bound = 2 + sum(6 * (len(str(k)) + len(str(v))) + 6
                            for k, v in headers.items())
            if bound > self.max_headers_bytes:
                size = len(canonical_json(dict(headers)).encode())
                if size > self.max_headers_bytes:
                    return argument_too_large(fn, "headers", size, self.max_headers_bytes,
                                              "max_headers_bytes of operation()", hint)
        return None

    def g_accept(self, status: int, body: Any = None, headers: Mapping[str, str] | None = None,
                 lease: timedelta | float | None = None) -> _Gen[StoredResponse]:
        """Hand the operation over: store the interim response and commit it with the writes
        of this transaction (the enqueued job). The lease now belongs to the worker, who
        heartbeats it and completes with ``op.lease_token``; the block must end here."""
        token = self._owner_token("accept()")
        row = yield from _accept_row(self.scope, self.key, token, status, body,
                                     headers=headers, lease=lease,
                                     reference_time=self._reference_time)
        yield _Tx.COMMIT
        self._done = True
        # The body as stored (jsonb's key order and numbers), so that this answer and every
        # replay of it are the same bytes.
        self.response = StoredResponse(
            status=status, headers=dict(headers or {}), body=load_json(row["body"]),
            content_type="application/json" if body is not None else None)
        return self.response

    def g_release(self) -> _Gen[None]:
        """A definite failure before any side effect: roll the business transaction back and
        release the key, so a retry runs afresh (even with another request). The caller says
        no side effect happened: a checkpoint or a derived key does not stop it."""
        token = self._owner_token("release()")
        yield _Tx.ROLLBACK
        try:
            yield from _release(self.scope, self.key, token, alone=True, reason="release()")
            yield _Tx.COMMIT
        finally:
            self._done = True
        self.released = True

    def g_exit(self, exc: BaseException | None) -> _Gen[None]:
        """The end of the block. complete(), accept() or release() ended the operation
        already: nothing to do. Otherwise the open transaction rolls back, and the key is
        released when no side effect can have happened, else kept in progress (its lease
        expires; a retry resumes). That holds for an exception and for a block that returns
        without complete() (an early return, e.g. a 402 not worth storing): neither raises
        UsageError; a block that means to keep nothing can say so with op.release()."""
        if self._token is None or self._done:
            return  # replay, or never entered, or completed, accepted or released
        owned_key_is_gone = isinstance(exc, (LeaseLost, AlreadyCompleted, KeyNotFound))
        release_it = not self._side_effects and not owned_key_is_gone
        try:
            yield _Tx.ROLLBACK
            if release_it:
                reason = "exception" if exc is not None else "no complete()"
                yield from _release(self.scope, self.key, self._token, alone=True,
                                    reason=reason)
                yield _Tx.COMMIT
                self.released = True
            elif not owned_key_is_gone and logger.isEnabledFor(logging.INFO):
                _log(logging.INFO, "kept", self.scope, self.key,
                     reason="exception" if exc is not None else "no complete()")
        except (psycopg.Error, LeaseLost, AlreadyCompleted, KeyNotFound, DatabaseUnavailable):
            if exc is None:
                raise
            # Cleaning up after an error: the original error is the one to report. An
            # unreleased key only costs the caller a wait for the lease to expire.
        finally:
            self._done = True

    def g_run(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
              status: int) -> _Gen[Any]:
        """The whole flow around one function call (for :func:`idempotent`)."""
        yield from self.g_enter()
        if self.replay is not None:
            return self.replay.json()
        try:
            value = yield _Call(fn, args, kwargs)
            stored = yield from self.g_complete(status, value)
        except BaseException as exc:
            yield from self.g_exit(exc)
            raise
        # What every retry will get back: the stored JSON value (a tuple comes back as a list,
        # from the first call on), so the first answer and its replays are equal.
        return stored.json() if value is not None else None


def refuse_managed(conn: Any) -> None:
    """:func:`~pg_idempotency.operation` and ``@idempotent`` commit on ``conn`` themselves (the
    claim alone, then the business transaction with the response). A framework's connection
    whose transactions the framework manages breaks under that (Django: ``atomic()``,
    ``get_or_create`` and ``bulk_create`` fail with "can't change 'autocommit' now", and
    ``on_commit`` fires for a write that rolled back): refuse it and name the adapter to use.
    Recognised by the connection's cursor class (no framework is imported)."""
    factory = getattr(conn, "cursor_factory", None)
    if getattr(factory, "__module__", "").startswith("django."):
        raise UsageError(
            "operation() and @idempotent commit on the connection themselves, and this is "
            "Django's connection, whose transactions Django manages (atomic(), on_commit): use "
            "pg_idempotency.django instead (@idempotent on the view, or IdempotencyMiddleware; "
            "docs/django.md), or a connection of your own")


def idempotent_wrapper(fn: Callable[..., Any], *, lease: timedelta | float, status: int,
                       driver: Callable[[Any, _Gen[Any]], Any],
                       make_op: Callable[[OperationCore, Any], Any]) -> Callable[..., Any]:
    """The body of ``@idempotent``: ``fn(conn, *args, **kwargs)`` becomes
    ``wrapper(conn, scope, key, *args, **kwargs)``. The request fingerprinted is the
    function's qualified name with its arguments (which must be JSON values). If ``fn`` takes
    a parameter named ``op`` it receives the operation (for checkpoint() and derive_key())."""
    wants_op = "op" in inspect.signature(fn).parameters
    name = f"{fn.__module__}.{fn.__qualname__}"

    @functools.wraps(fn)
    def wrapper(conn: Any, scope: str, key: str, *args: Any, **kwargs: Any) -> Any:
        refuse_managed(conn)
        request = {"function": name, "args": list(args), "kwargs": kwargs}
        core = OperationCore(scope, key, request, lease=lease)
        call_kwargs = dict(kwargs, op=make_op(core, conn)) if wants_op else kwargs
        return driver(conn, core.g_run(fn, (conn, *args), call_kwargs, status))

    return wrapper
