"""The functions of the SQL API, one generator each: ``claim``, ``takeover``, ``checkpoint``,
``heartbeat``, ``complete``, ``accept``, ``release``, ``list_abandoned``, ``inbox_accept``.
Each yields its :class:`~pg_idempotency._exec.Query` and turns the row into its result; the
drivers of :mod:`pg_idempotency._exec` run them on the caller's connection, in the caller's
transaction (:mod:`pg_idempotency.api` and :mod:`pg_idempotency.aio` are made from them)."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any, Final

from psycopg.types.json import Jsonb

from . import queries as Q
from . import telemetry
from ._exec import Gen, Query
from ._log import log, logger
from ._results import AbandonedKey, ClaimResult, Outcome, json_body, load_time
from .errors import LeaseLost, LeaseLostCompleted, UsageError
from .fingerprint import LegacyFingerprint, canonical_json, request_fingerprint

#: The engine's default lease (claim's ``lease DEFAULT '30 seconds'``).
DEFAULT_LEASE = timedelta(seconds=30)


def _interval(value: timedelta | float | None) -> timedelta | None:
    if value is None or isinstance(value, timedelta):
        return value
    return timedelta(seconds=value)


def jsonb(value: Any) -> Jsonb:
    # canonical_json keeps Decimal values exact and refuses what jsonb would refuse.
    return Jsonb(value, dumps=canonical_json)


def claim_query(scope: str, key: str, request: Any, lease: timedelta | float,
                fingerprint: bytes | None, strict: bool, reference_time: datetime | None,
                alone: bool = False) -> Query:
    if request is not None and fingerprint is None:
        # The request's fingerprint computed here, byte-identical to claim's own (the vectors
        # of tests/vectors prove it), so the database does not canonicalize it (issue 32).
        # With both given the server refuses the pair (IK016), as before.
        fingerprint, request = request_fingerprint(request), None
    if isinstance(fingerprint, LegacyFingerprint) and fingerprint.legacy is not None:
        # A key claimed before 0.12.0 may hold the request's old fingerprint: not strict here,
        # so that a mismatch comes back as an outcome and claimed() tries the old one (strict).
        strict = False
    return Query(Q.CLAIM, {
        "scope": scope, "key": key,
        "request": jsonb(request) if request is not None else None,
        "lease": _interval(lease), "fingerprint": fingerprint, "strict": strict,
        "reference_time": reference_time,
    }, alone=alone, binary_sql=Q.CLAIM_BINARY)


def _log_claim(event: str, scope: str, key: str, result: ClaimResult) -> None:
    outcome = result.outcome
    level = logging.WARNING if outcome in (Outcome.MISMATCH, Outcome.EXPIRED) else logging.INFO
    if logger.isEnabledFor(level):
        log(level, event, scope, key, outcome=outcome.value, attempts=result.attempts,
            recovery_point=None if result.recovery_point is None else "set")


def claimed(q: Query, call: str, scope: str, key: str,
            strict: bool = False) -> Gen[ClaimResult]:
    """Run a claim or a takeover: its result, logged and observed (telemetry)."""
    obs = telemetry.start(call, scope, key)
    try:
        row = yield q
        result = row if isinstance(row, ClaimResult) else ClaimResult.from_row(row)
        legacy = getattr(q.params.get("fingerprint"), "legacy", None)
        if result.outcome is Outcome.MISMATCH and legacy is not None:
            # Its request's fingerprint before 0.12.0 (LegacyFingerprint): the same claim with
            # it, strict as asked, matches a key claimed before the upgrade.
            row = yield Query(q.sql, {**q.params, "fingerprint": legacy, "strict": strict},
                              alone=q.alone, binary_sql=q.binary_sql)
            result = row if isinstance(row, ClaimResult) else ClaimResult.from_row(row)
    except BaseException as exc:
        telemetry.end(obs, telemetry.ERROR, error=exc)
        raise
    telemetry.end(obs, result.outcome.value, attempts=result.attempts)
    _log_claim(call, scope, key, result)
    return result


def claim(scope: str, key: str, request: Any = None, *,
          lease: timedelta | float = DEFAULT_LEASE, fingerprint: bytes | None = None,
          strict: bool = False, reference_time: datetime | None = None) -> Gen[ClaimResult]:
    """``idempotency.claim``. Pass the request as a JSON value, or ``request=None`` and your own
    32-byte ``fingerprint``. Run it in its own transaction (an autocommit connection, or commit
    right after): other retries must see the claim at once."""
    return (yield from claimed(
        claim_query(scope, key, request, lease, fingerprint, strict, reference_time),
        "claim", scope, key, strict))


def takeover(scope: str, key: str, *, lease: timedelta | float = DEFAULT_LEASE,
             reference_time: datetime | None = None) -> Gen[ClaimResult]:
    """``idempotency.takeover``: take over an abandoned key (for background completers)."""
    return (yield from claimed(
        Query(Q.TAKEOVER, {"scope": scope, "key": key, "lease": _interval(lease),
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


def fenced(q: Query, scope: str, key: str, call: str,
           done: Mapping[str, Any] | None = None) -> Gen[Any]:
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
            log(logging.WARNING, "lease_lost", scope, key, call=call, sqlstate=exc.sqlstate)
        raise
    except BaseException as exc:
        telemetry.end(obs, telemetry.ERROR, error=exc)
        raise
    telemetry.end(obs, telemetry.OK)
    if done is not None and logger.isEnabledFor(logging.INFO):
        log(logging.INFO, call, scope, key, **done)
    return row


def checkpoint_query(scope: str, key: str, lease_token: int, recovery_point: str,
                     extend: timedelta | float | None, reference_time: datetime | None,
                     sql: str) -> Query:
    return Query(sql, {
        "scope": scope, "key": key, "lease_token": lease_token,
        "recovery_point": recovery_point, "extend": _interval(extend),
        "reference_time": reference_time,
    }, fenced=True)


def checkpoint(scope: str, key: str, lease_token: int, recovery_point: str, *,
               extend: timedelta | float | None = None,
               reference_time: datetime | None = None) -> Gen[datetime]:
    """``idempotency.checkpoint`` in the caller's transaction; returns the lease expiry.
    The raising form: its IK001 aborts the caller's transaction, so the step's writes cannot
    commit without the recovery point (``op.checkpoint()``, which rolls back itself, uses
    ``checkpoint_outcome``)."""
    row = yield from fenced(checkpoint_query(scope, key, lease_token, recovery_point, extend,
                                               reference_time, Q.CHECKPOINT),
                             scope, key, "checkpoint")
    expires: datetime = load_time(row["lease_expires_at"])
    return expires


def heartbeat(scope: str, key: str, lease_token: int, *,
              lease: timedelta | float = DEFAULT_LEASE,
              reference_time: datetime | None = None) -> Gen[datetime]:
    """``idempotency.heartbeat_outcome``: extends the lease; returns the new lease expiry, or
    raises :class:`LeaseLost` (:class:`LeaseLostCompleted`) as ``idempotency.heartbeat``'s
    IK001 (IK004) would, without an error on the server: the transaction it ran in is left
    usable (heartbeat wrote nothing else), so roll back what it was part of yourself."""
    row = yield from fenced(Query(Q.HEARTBEAT_OUTCOME, {
        "scope": scope, "key": key, "lease_token": lease_token, "lease": _interval(lease),
        "reference_time": reference_time,
    }, fenced=True), scope, key, "heartbeat")
    expires: datetime = load_time(row["lease_expires_at"])
    return expires


def _complete_query(scope: str, key: str, lease_token: int, status: int, body: Any,
                    headers: Mapping[str, str] | None, content_type: str | None,
                    reference_time: datetime | None, commit: bool = False) -> Query:
    return complete_parts(scope, key, lease_token, status, body, headers, content_type,
                          reference_time, commit)[0]


def complete_parts(scope: str, key: str, lease_token: int, status: int, body: Any,
                   headers: Mapping[str, str] | None, content_type: str | None,
                   reference_time: datetime | None, commit: bool = False
                   ) -> tuple[Query, Any]:
    """complete()'s query, and the body's value as every replay will read it (None for bytes
    and for no body)."""
    params: dict[str, Any] = {
        "scope": scope, "key": key, "lease_token": lease_token, "status": status,
        "headers": jsonb(dict(headers or {})), "reference_time": reference_time,
    }
    if isinstance(body, (bytes, bytearray, memoryview)):
        params.update(body=bytes(body), content_type=content_type or "application/octet-stream")
        return Query(Q.COMPLETE_BYTES, params, fenced=True, commit=commit), None
    if content_type is not None:
        raise UsageError("content_type is for bytes bodies: a JSON body is stored as "
                         "application/json")
    if body is None:
        params["body"] = None
        return Query(Q.COMPLETE, params, fenced=True, commit=commit), None
    # A JSON value is stored as the bytes it serialises to (complete_bytes, application/json):
    # jsonb would reorder its keys, so {"zeta":1,"a":2} would replay as {"a":2,"zeta":1}.
    data, value = json_body(body)
    params.update(body=data, content_type="application/json")
    return Query(Q.COMPLETE_BYTES, params, fenced=True, commit=commit), value


def complete(scope: str, key: str, lease_token: int, status: int, body: Any = None, *,
             headers: Mapping[str, str] | None = None, content_type: str | None = None,
             reference_time: datetime | None = None) -> Gen[datetime]:
    """``idempotency.complete`` (a JSON body, or None) or, when ``body`` is bytes,
    ``idempotency.complete_bytes`` with ``content_type`` (default
    ``application/octet-stream``). Call it in the business transaction; returns completed_at.
    Raises :class:`~pg_idempotency.errors.LeaseLost` (IK001) when this attempt no longer owns
    the key, or its subclass :class:`~pg_idempotency.errors.LeaseLostCompleted` (IK004) when
    this very token completed it already: roll back."""
    q = _complete_query(scope, key, lease_token, status, body, headers, content_type,
                        reference_time)
    row = yield from fenced(q, scope, key, "complete", {"status": status})
    completed_at: datetime = load_time(row["completed_at"])
    return completed_at


def accept(scope: str, key: str, lease_token: int, status: int, body: Any = None, *,
           headers: Mapping[str, str] | None = None, lease: timedelta | float | None = None,
           reference_time: datetime | None = None) -> Gen[datetime]:
    """``idempotency.accept``: store an interim response (a JSON body, or None) on a key you
    hold, in the transaction that hands the work over (the one that enqueues the job);
    optionally extend the lease. Returns the lease expiry."""
    row = yield from accept_row(scope, key, lease_token, status, body, headers=headers,
                                lease=lease, reference_time=reference_time)
    expires: datetime = load_time(row["lease_expires_at"])
    return expires


def accept_row(scope: str, key: str, lease_token: int, status: int, body: Any = None, *,
               headers: Mapping[str, str] | None = None, lease: timedelta | float | None = None,
               reference_time: datetime | None = None) -> Gen[dict[str, Any]]:
    """:func:`accept`'s row: ``lease_expires_at`` and ``body`` as jsonb stored it."""
    row = yield from fenced(Query(Q.ACCEPT, {
        "scope": scope, "key": key, "lease_token": lease_token, "status": status,
        "body": jsonb(body) if body is not None else None,
        "headers": jsonb(dict(headers or {})), "lease": _interval(lease),
        "reference_time": reference_time,
    }, fenced=True), scope, key, "accept", {"status": status})
    return row  # type: ignore[no-any-return]


def release(scope: str, key: str, lease_token: int) -> Gen[None]:
    """``idempotency.release_outcome``: for a failure before any side effect. The key's row
    stays, in state released (no lease, no response), and the next claim starts it afresh
    under a greater lease token (engine 0.9.0). A lost lease raises :class:`LeaseLost` as
    ``idempotency.release``'s IK001 would, without an error on the server (the transaction is
    left usable)."""
    yield from release_key(scope, key, lease_token, alone=False, reason="release")


def release_key(scope: str, key: str, lease_token: int, *, alone: bool, reason: str
             ) -> Gen[None]:
    yield from fenced(Query(Q.RELEASE_OUTCOME, {"scope": scope, "key": key,
                                                  "lease_token": lease_token},
                              fenced=True, alone=alone), scope, key, "release")
    if logger.isEnabledFor(logging.INFO):
        log(logging.INFO, "release", scope, key, reason=reason)


def list_abandoned(max_keys: int = 100, *, scope: str | None = None,
                   reference_time: datetime | None = None) -> Gen[list[AbandonedKey]]:
    """``idempotency.list_abandoned``: the rows stay locked until the caller's transaction
    ends, so run it in a transaction together with the takeovers."""
    rows = yield Query(Q.LIST_ABANDONED, {"max_keys": max_keys, "scope": scope,
                                          "reference_time": reference_time}, fetch="all")
    return [AbandonedKey.from_row(row) for row in rows]


def inbox_accept(consumer: str, message_id: str, *,
                 reference_time: datetime | None = None) -> Gen[bool]:
    """``idempotency.inbox_accept``: True the first time, False for a redelivery. Call it in
    the transaction that applies the message's effects."""
    obs = telemetry.start("inbox_accept", consumer, message_id)
    try:
        row = yield Query(Q.INBOX_ACCEPT, {"consumer": consumer, "message_id": message_id,
                                           "reference_time": reference_time})
    except BaseException as exc:
        telemetry.end(obs, telemetry.ERROR, error=exc)
        raise
    accepted = bool(row["accepted"])
    telemetry.end(obs, "accepted" if accepted else "duplicate")
    return accepted
