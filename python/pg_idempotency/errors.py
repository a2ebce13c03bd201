"""Exceptions: one class per SQLSTATE of docs/errors.md, under :class:`IdempotencyError`.

The engine raises errors of class ``IK``; :func:`from_psycopg` turns such a
:class:`psycopg.Error` into the matching class here (the original stays as ``__cause__`` and
``pgerror``), and an unreachable database into :class:`DatabaseUnavailable`. Other errors
PostgreSQL raises itself (42501, 40001, ...) are not translated: they reach the caller as
psycopg raised them.

    IdempotencyError
    ├── LeaseLost                 IK001: "you no longer own this key", and the family of:
    │   ├── LeaseLostCompleted    IK004 from a lease-token call (also an AlreadyCompleted)
    │   └── LeaseLostNotFound     IK003 from a lease-token call (servers before 0.9.0)
    ├── KeyMismatch               IK002 (also what operation() raises on outcome mismatch)
    ├── KeyNotFound               IK003
    ├── AlreadyCompleted          IK004
    ├── IsolationNotSupported     IK005
    ├── InvalidArgument           IK010..IK018, also a ValueError
    │   ├── ArgumentNull          IK010
    │   ├── ArgumentEmpty         IK011
    │   ├── ArgumentTooLong       IK012
    │   ├── ArgumentInvalidCharacters IK013
    │   ├── ArgumentOutOfRange    IK014
    │   ├── ArgumentWrongType     IK015
    │   ├── ArgumentConflict      IK016
    │   ├── ArgumentNotAllowed    IK017
    │   └── ArgumentTooLarge      IK018
    ├── KeyInProgress             outcome in_progress (no SQLSTATE: claim returns it)
    ├── KeyExpired                outcome expired (no SQLSTATE: claim returns it)
    ├── PgCronNotInstalled        IK020
    ├── CitusNotInstalled         IK021 (idempotency.distribute() without Citus)
    ├── CitusNotCoordinator       IK022 (a coordinator-only function on a Citus worker)
    ├── ScopeNotGranted           IK023 (takeover / list_abandoned by a completer limited to
    │                             other scopes)
    ├── DatabaseUnavailable       the database cannot be reached: SQLSTATE class 08, 57P01..57P03,
    │                             a lost / refused connection (no SQLSTATE), or Citus's XX000
    │                             for a worker lost mid-transaction or mid-COMMIT
    └── UsageError                the Python API was used wrongly (no SQLSTATE)
"""

from __future__ import annotations

import re
from datetime import timedelta

import psycopg

__all__ = [
    "AlreadyCompleted", "ArgumentConflict", "ArgumentEmpty", "ArgumentInvalidCharacters",
    "ArgumentTooLarge", "CitusNotCoordinator", "CitusNotInstalled", "DatabaseUnavailable",
    "ArgumentNull", "ArgumentOutOfRange", "ArgumentTooLong", "ArgumentWrongType",
    "IdempotencyError", "InvalidArgument", "IsolationNotSupported", "KeyExpired", "KeyInProgress",
    "KeyMismatch", "KeyNotFound", "LeaseLost", "LeaseLostCompleted", "LeaseLostNotFound",
    "PgCronNotInstalled", "ScopeNotGranted", "UsageError", "argument_too_large",
    "connection_lost", "from_psycopg", "from_sqlstate", "invalid_argument", "is_unavailable",
    "unavailable_state",
]


class IdempotencyError(Exception):
    """Base class. ``sqlstate`` is the documented code (None for the Python-only ones);
    ``detail`` and ``hint`` come from the server's error when there was one."""

    sqlstate: str | None = None

    def __init__(self, message: str, *, detail: str | None = None, hint: str | None = None,
                 pgerror: BaseException | None = None) -> None:
        super().__init__(message)
        self.detail = detail
        self.hint = hint
        self.pgerror = pgerror


class LeaseLost(IdempotencyError):
    """IK001: the lease token is not the key's current one (taken over, released, gone, or
    never this key's). Roll back. Since engine 0.9.0 the answer is the same whatever the key's
    state, so a wrong token tells nothing about someone else's key.

    Also the family of every "you no longer own this key": a call that takes a lease token
    (complete, complete_bytes, accept, checkpoint, heartbeat, release) raises
    :class:`LeaseLostCompleted` (IK004) only to the attempt whose own token completed the key
    (a second complete, say). :class:`LeaseLostNotFound` (IK003) came from those calls before
    0.9.0 and is kept for code that catches it. ``except LeaseLost`` catches the three;
    ``sqlstate`` stays the engine's code."""

    sqlstate = "IK001"


class KeyMismatch(IdempotencyError):
    """IK002: the key was used with a different request. Never execute: answer 422."""

    sqlstate = "IK002"


class KeyNotFound(IdempotencyError):
    """IK003: no such (scope, key): never claimed, released, or past retention."""

    sqlstate = "IK003"


class AlreadyCompleted(IdempotencyError):
    """IK004: the key is completed; a retry replays the stored response."""

    sqlstate = "IK004"


class LeaseLostCompleted(LeaseLost, AlreadyCompleted):
    """IK004 from a call that takes a lease token: the key is completed, with this attempt's
    own token (it completed already). Roll back what this call was part of; a retry replays."""

    sqlstate = "IK004"


class LeaseLostNotFound(LeaseLost, KeyNotFound):
    """IK003 from a call that takes a lease token: raised before engine 0.9.0 when the key
    was released or dropped (now IK001, :class:`LeaseLost`). Kept so existing handlers still
    import and catch it."""

    sqlstate = "IK003"


class IsolationNotSupported(IdempotencyError):
    """IK005: claim() or inbox_accept() under REPEATABLE READ or SERIALIZABLE."""

    sqlstate = "IK005"


class InvalidArgument(IdempotencyError, ValueError):
    """IK010..IK017: an argument the engine refuses. ``argument`` names it (the error's COLUMN
    field), ``function`` is the SQL function. The pure-Python twins in
    :mod:`pg_idempotency.fingerprint` raise it too, with the SQLSTATE the SQL function would
    raise (which may be a PostgreSQL one such as 22P05 for input jsonb itself refuses)."""

    def __init__(self, function: str, argument: str | None, sqlstate: str, problem: str,
                 **kwargs: object) -> None:
        self.function = function
        self.argument = argument
        self.sqlstate = sqlstate
        if argument is None or problem.startswith(f"{function}:"):
            message = problem
        else:
            message = f'{function}: argument "{argument}" {problem}'
        super().__init__(message, **kwargs)  # type: ignore[arg-type]


class ArgumentNull(InvalidArgument):
    """IK010: a required argument is NULL."""


class ArgumentEmpty(InvalidArgument):
    """IK011: an empty scope, key, consumer, message id, step or recovery point."""


class ArgumentTooLong(InvalidArgument):
    """IK012: such a value is longer than 255 characters."""


class ArgumentInvalidCharacters(InvalidArgument):
    """IK013: such a value contains a control character."""


class ArgumentOutOfRange(InvalidArgument):
    """IK014: a lease, status, max_keys or fingerprint length out of range."""


class ArgumentWrongType(InvalidArgument):
    """IK015: JSON of the wrong shape (headers, fingerprint defaults or request)."""


class ArgumentConflict(InvalidArgument):
    """IK016: both request and fingerprint given to claim()."""


class ArgumentNotAllowed(InvalidArgument):
    """IK017: reference_time (the engine's test clock) passed by a role that does not own the
    schema."""


class ArgumentTooLarge(InvalidArgument):
    """IK018: a request, a response body or headers larger than the limit (the engine's
    ``settings.max_request_bytes``, ``max_response_bytes``, ``max_headers_bytes``, or the
    adapter's own). ``detail`` gives the size and the limit."""


class KeyInProgress(IdempotencyError):
    """Another attempt holds a live lease on the key: answer 409 and retry after
    ``retry_after``. Raised by :func:`pg_idempotency.operation`, not by the engine."""

    def __init__(self, message: str, *, retry_after: timedelta | None,
                 recovery_point: str | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.recovery_point = recovery_point


class KeyExpired(IdempotencyError):
    """The key was used, then dropped after its retention; a tombstone remains
    (settings.tombstones). Never execute, nothing to replay: answer 422 and ask for a new key.
    Raised by :func:`pg_idempotency.operation`, not by the engine."""


class PgCronNotInstalled(IdempotencyError):
    """IK020: schedule_maintenance / unschedule_maintenance without pg_cron here."""

    sqlstate = "IK020"


class CitusNotInstalled(IdempotencyError):
    """IK021: idempotency.distribute() in a database without the citus extension."""

    sqlstate = "IK021"


class CitusNotCoordinator(IdempotencyError):
    """IK022: a coordinator-only function (distribute, maintain, schedule_maintenance,
    unschedule_maintenance, metrics, metrics_by_scope, key_status, partition_status,
    grant_usage) called on a Citus worker instead of the coordinator (docs/errors.md)."""

    sqlstate = "IK022"


class ScopeNotGranted(IdempotencyError):
    """IK023: the calling role is a completer limited to some scopes (``grant_usage(...,
    kind => 'completer', scopes => ...)``) and ``takeover`` or ``list_abandoned`` was called
    for another scope (or, for list_abandoned, for every scope), or the role reaches no
    completer grant at all. Nothing was read or changed: call it for a scope of the role's
    grant, or have the schema owner grant the scope."""

    sqlstate = "IK023"


#: Seconds a client should wait before retrying after :class:`DatabaseUnavailable` (the HTTP
#: adapters' ``Retry-After``, see ``contract.Settings.unavailable_retry_after``).
DEFAULT_UNAVAILABLE_RETRY_AFTER = 1.0

#: Server states that mean "not reachable now" rather than "your statement failed":
#: admin_shutdown, crash_shutdown, cannot_connect_now (starting up, shutting down, recovery).
_UNAVAILABLE_SQLSTATES = frozenset({"57P01", "57P02", "57P03"})

#: What a Citus coordinator says, with SQLSTATE XX000 (internal_error) and nothing else to tell
#: them by, when its connection to a worker failed inside the transaction: at the COMMIT it
#: relays (the worker died or was cut off before answering, so whether the worker committed is
#: unknown; Citus's placement_connection.c) or on a connection the transaction had already
#: written through (remote_transaction.c). Citus's messages are not translated (it has no
#: message catalogs), so their text is stable across lc_messages.
_CITUS_UNAVAILABLE_PREFIXES = (
    "could not commit transaction for shard ",
    "failure on connection marked as essential: ",
)


class DatabaseUnavailable(IdempotencyError):
    """The database cannot be reached now: the connection was refused or lost (psycopg's
    OperationalError without a SQLSTATE), SQLSTATE class 08 (connection exception, also what a
    Citus coordinator raises when a worker is down), or 57P01..57P03 (the server is shutting
    down, crashed, or starting up). Nothing the call was part of is known to have committed,
    except what the caller committed before; a key claimed by a lost claim stays in progress
    until its lease expires. Retry after ``retry_after`` seconds (plus jitter, so that retries
    spread); the HTTP adapters answer 503 with Retry-After and store nothing.

    On Citus it is also the coordinator's XX000 "could not commit transaction for shard ..."
    (a worker lost during the COMMIT it relayed: the worker may or may not have committed) and
    "failure on connection marked as essential: ..." (a worker lost mid-transaction). After a
    COMMIT, yours or the one ``complete()`` sends, the outcome is unknown: retry the whole
    request with the same key, and the engine makes that safe (it replays the stored answer if
    the commit happened, and runs the request again once the lease expires if it did not).
    ``pgerror`` is the driver's error."""

    sqlstate = None

    def __init__(self, message: str, *, retry_after: float = DEFAULT_UNAVAILABLE_RETRY_AFTER,
                 **kwargs: object) -> None:
        super().__init__(message, **kwargs)  # type: ignore[arg-type]
        self.retry_after = float(retry_after)


class UsageError(IdempotencyError):
    """The Python API was used in a way that cannot be right (e.g. an operation started
    inside an open transaction, or a block that ended without complete())."""


_BY_SQLSTATE: dict[str, type[IdempotencyError]] = {
    "IK001": LeaseLost,
    "IK002": KeyMismatch,
    "IK003": KeyNotFound,
    "IK004": AlreadyCompleted,
    "IK005": IsolationNotSupported,
    "IK020": PgCronNotInstalled,
    "IK021": CitusNotInstalled,
    "IK022": CitusNotCoordinator,
    "IK023": ScopeNotGranted,
}
#: A lease-token call's IK003/IK004: the same condition seen by an attempt that held the key.
_LEASE_LOST_BY_SQLSTATE: dict[str, type[LeaseLost]] = {
    "IK001": LeaseLost,
    "IK003": LeaseLostNotFound,
    "IK004": LeaseLostCompleted,
}
_INVALID_BY_SQLSTATE: dict[str, type[InvalidArgument]] = {
    "IK010": ArgumentNull,
    "IK011": ArgumentEmpty,
    "IK012": ArgumentTooLong,
    "IK013": ArgumentInvalidCharacters,
    "IK014": ArgumentOutOfRange,
    "IK015": ArgumentWrongType,
    "IK016": ArgumentConflict,
    "IK017": ArgumentNotAllowed,
    "IK018": ArgumentTooLarge,
}


#: 'idempotency.claim: argument "scope" must not be NULL' (sql/functions/_invalid_argument.sql).
_ARGUMENT_RE = re.compile(r': argument "([a-z_]+)" ')


def invalid_argument(function: str, argument: str | None, sqlstate: str,
                     problem: str) -> InvalidArgument:
    """The :class:`InvalidArgument` subclass for ``sqlstate`` (the base class for a code that
    is not one of IK010..IK017)."""
    cls = _INVALID_BY_SQLSTATE.get(sqlstate, InvalidArgument)
    return cls(function, argument, sqlstate, problem)


def argument_too_large(function: str, argument: str, size: int, limit: int, setting: str,
                       hint: str) -> ArgumentTooLarge:
    """IK018 in the engine's words (idempotency._check_size) for a value the package refuses
    before sending it: ``size`` bytes against ``limit``, the one named ``setting``."""
    error = invalid_argument(function, argument, "IK018", "is too large")
    assert isinstance(error, ArgumentTooLarge)
    error.detail = f"It is {size} bytes; the limit ({setting}) is {limit} bytes."
    error.hint = hint
    return error


def is_unavailable(exc: BaseException) -> bool:
    """Whether ``exc`` itself says the database cannot be reached: a
    :class:`DatabaseUnavailable`, or a psycopg or asyncpg error of SQLSTATE class 08 or
    57P01..57P03, or psycopg's OperationalError without a SQLSTATE (refused, lost, closed) or
    asyncpg's InterfaceError of a closed connection, or a Citus coordinator's
    XX000 for a worker lost mid-transaction or mid-COMMIT (whose outcome is then unknown; see
    :class:`DatabaseUnavailable`). A query canceled (57014)
    or a deadlock is not: those are the statement's; nor is psycopg_pool's PoolTimeout (no
    connection of a pool free in time: the adapters answer it on their own, and a handler
    that starves its own pool is a bug to see, not an outage)."""
    if isinstance(exc, DatabaseUnavailable):
        return True
    if not isinstance(exc, psycopg.Error):
        return type(exc).__module__.startswith("asyncpg.") and _asyncpg_unavailable(exc)
    if type(exc).__module__.startswith("psycopg_pool"):
        return False
    state = exc.sqlstate
    if state is None:
        return isinstance(exc, psycopg.OperationalError)
    return unavailable_state(state, exc.diag.message_primary)


def unavailable_state(state: str, message: str | None) -> bool:
    """Whether a server error's SQLSTATE (and, for XX000, its primary message) says the
    database cannot be reached: class 08, 57P01..57P03, or a Citus coordinator's XX000 for a
    lost worker. One rule for every driver's error (psycopg's, asyncpg's, those under
    SQLAlchemy)."""
    if state == "XX000":
        return (message or "").startswith(_CITUS_UNAVAILABLE_PREFIXES)
    return state.startswith("08") or state in _UNAVAILABLE_SQLSTATES


#: What asyncpg's InterfaceError says when the connection was closed (by a lost server, or
#: by asyncpg after an error it could not recover from): an error without a SQLSTATE, like
#: psycopg's OperationalError of a lost connection. Its other InterfaceErrors (another
#: operation in progress, a transaction misused) are the caller's mistakes.
_ASYNCPG_CLOSED = ("connection is closed", "cannot perform operation: connection is closed")


def _asyncpg_unavailable(exc: BaseException) -> bool:
    """:func:`is_unavailable` for an asyncpg error: SQLSTATE class 08 (asyncpg's
    ConnectionDoesNotExistError, 08003, for a connection lost mid-statement; its
    ConnectionFailureError, 08006), 57P01..57P03 (AdminShutdownError for a terminated backend,
    CannotConnectNowError), Citus's XX000 for a lost worker, or the InterfaceError of a closed
    connection, or its InternalClientError (a connection whose protocol state broke)."""
    state = getattr(exc, "sqlstate", None)
    if isinstance(state, str):
        return unavailable_state(state, str(getattr(exc, "message", "") or ""))
    if type(exc).__name__ == "InternalClientError":
        # asyncpg's protocol state broken on that connection ("another operation is in
        # progress" after a backend was terminated mid-statement): the connection is unusable,
        # the next one works
        return True
    return type(exc).__name__ == "InterfaceError" and str(exc) in _ASYNCPG_CLOSED


def connection_lost(exc: BaseException | None) -> bool:
    """Whether ``exc`` or an error it was raised from (``__cause__``/``__context__``: Django's
    and SQLAlchemy's wrappers keep psycopg's error there) says the database cannot be reached.
    The adapters use it on what a handler raised: its own query on a lost connection is an
    outage (503), not a bug (500)."""
    seen = 0
    while exc is not None and seen < 16:
        if is_unavailable(exc):
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


def from_psycopg(exc: psycopg.Error, *, lease_token: bool = False) -> Exception:
    """The :class:`IdempotencyError` for an engine error (:class:`DatabaseUnavailable` for an
    unreachable database), or ``exc`` itself for any other. ``lease_token=True`` says the
    failed call took a lease token: its IK003 and IK004 become the :class:`LeaseLost`
    subclasses."""
    if is_unavailable(exc):
        reason = str(exc).strip() or type(exc).__name__
        return DatabaseUnavailable(f"the database is unavailable: {reason}", pgerror=exc)
    diag = exc.diag
    return from_sqlstate(exc, exc.sqlstate, diag.message_primary or str(exc),
                         detail=diag.message_detail, hint=diag.message_hint,
                         column=diag.column_name, lease_token=lease_token)


def from_sqlstate(exc: Exception, sqlstate: str | None, message: str, *,
                  detail: str | None = None, hint: str | None = None,
                  column: str | None = None, lease_token: bool = False) -> Exception:
    """:func:`from_psycopg` for an error of any driver, given its fields: the
    :class:`IdempotencyError` for an engine SQLSTATE (``exc`` kept as its ``pgerror``), or
    ``exc`` itself for any other. ``column`` is the error's COLUMN field (the argument's
    name). Whether the database was reachable is the caller's to decide first."""
    state = sqlstate
    if lease_token and state in _LEASE_LOST_BY_SQLSTATE:
        return _LEASE_LOST_BY_SQLSTATE[state](message, detail=detail, hint=hint, pgerror=exc)
    if state in _BY_SQLSTATE:
        return _BY_SQLSTATE[state](message, detail=detail, hint=hint, pgerror=exc)
    if state in _INVALID_BY_SQLSTATE:
        function = message.split(":", 1)[0] if ":" in message else ""
        # The COLUMN field names the argument; Citus passes an error raised on a worker on
        # without it (docs/scale-out.md), and the message names it too.
        argument = column
        if argument is None:
            found = _ARGUMENT_RE.search(message)
            argument = found.group(1) if found else None
        return _INVALID_BY_SQLSTATE[state](function, argument, state, message, detail=detail,
                                           hint=hint, pgerror=exc)
    return exc
