"""The operation: the state and steps of one ``operation()`` block (:class:`OperationCore`,
as generators), the read-only fields every flavour of ``Operation`` shows
(:class:`OperationFields`), and the body of ``@idempotent``. :mod:`pg_idempotency.api`,
:mod:`pg_idempotency.aio` and :mod:`pg_idempotency.sqlalchemy` drive the same steps."""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus

from . import queries as Q
from ._calls import (
    DEFAULT_LEASE,
    accept_row,
    checkpoint_query,
    claim_query,
    claimed,
    complete_parts,
    fenced,
    release_key,
)
from ._exec import Call, Gen, Query, Tx
from ._log import log, logger
from ._results import ClaimResult, Outcome, StoredResponse, json_of_bytes, load_json, load_time
from .errors import (
    AlreadyCompleted,
    ArgumentTooLarge,
    DatabaseUnavailable,
    KeyExpired,
    KeyInProgress,
    KeyMismatch,
    KeyNotFound,
    LeaseLost,
    UsageError,
    argument_too_large,
)
from .fingerprint import canonical_json, derive_key

#: operation()'s default limits (bytes) on what ``op.complete()`` stores, the engine's defaults
#: (idempotency.settings.max_response_bytes and max_headers_bytes): a body or headers over
#: them raise ArgumentTooLarge (IK018) before anything is sent.
DEFAULT_MAX_RESPONSE_BYTES = 1048576
DEFAULT_MAX_HEADERS_BYTES = 16384


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
    def g_enter(self) -> Gen[None]:
        status, _autocommit = yield Tx.STATE
        if status == TransactionStatus.UNKNOWN:  # the connection was lost before this block
            raise DatabaseUnavailable("the database is unavailable: the connection is lost")
        if status != TransactionStatus.IDLE:
            raise UsageError(
                f"operation() needs an idle connection, this one is {status.name}: claim must "
                "commit on its own so that concurrent retries see it (commit or roll back first)")
        # alone: one statement in autocommit, whether or not the connection is in autocommit
        result = yield from claimed(
            claim_query(self.scope, self.key, self._request, self._lease, self._fingerprint,
                        False, self._reference_time, alone=True), "claim", self.scope, self.key)
        yield Tx.COMMIT  # a no-op unless a caller's autocommit connection opened a transaction
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
        yield Tx.BEGIN

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
                     ) -> Gen[datetime]:
        token = self._owner_token("checkpoint()")
        try:
            # The outcome form (no error on the server, no new worker connection on Citus):
            # on a lost lease the step's writes are rolled back here, as the raising form's
            # aborted transaction would have them, before LeaseLost reaches the block.
            row = yield from fenced(checkpoint_query(
                self.scope, self.key, token, recovery_point, extend, self._reference_time,
                Q.CHECKPOINT_OUTCOME), self.scope, self.key, "checkpoint")
        except LeaseLost:
            yield Tx.ROLLBACK
            raise
        expires: datetime = load_time(row["lease_expires_at"])
        yield Tx.COMMIT
        self._side_effects = True
        self.recovery_point = recovery_point
        yield Tx.BEGIN
        return expires

    def g_complete(self, status: int, body: Any = None, headers: Mapping[str, str] | None = None,
                   content_type: str | None = None) -> Gen[StoredResponse]:
        token = self._owner_token("complete()")
        q, value = complete_parts(self.scope, self.key, token, status, body, headers,
                                  content_type, self._reference_time, commit=True)
        too_large = self._too_large(q, headers)
        if too_large is not None:
            # Never half-stored: nothing is sent; the business transaction rolls back and the
            # key is released (kept in progress after a side effect), as when the block
            # raises, so that a caller catching the error cannot commit the writes without it.
            yield from self.g_exit(too_large)
            raise too_large
        # complete and COMMIT in one round trip: nothing runs between them anyway
        row = yield from fenced(q, self.scope, self.key, "complete", {"status": status})
        completed_at = load_time(row["completed_at"])
        self._done = True
        # The body as every replay will see it: the bytes sent, and for a JSON value its
        # value read back from them (a tuple is a list), made once by complete_parts.
        stored = q.params["body"]
        if isinstance(body, (bytes, bytearray, memoryview)):
            content_type = q.params["content_type"]
            value = json_of_bytes(content_type, stored)
        elif body is not None:
            content_type = "application/json"
        self.response = StoredResponse(status=status, headers=dict(headers or {}), body=value,
                                       body_bytes=stored, content_type=content_type,
                                       completed_at=completed_at)
        return self.response

    def _too_large(self, q: Query, headers: Mapping[str, str] | None
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
                 lease: timedelta | float | None = None) -> Gen[StoredResponse]:
        """Hand the operation over: store the interim response and commit it with the writes
        of this transaction (the enqueued job). The lease now belongs to the worker, who
        heartbeats it and completes with ``op.lease_token``; the block must end here."""
        token = self._owner_token("accept()")
        row = yield from accept_row(self.scope, self.key, token, status, body,
                                    headers=headers, lease=lease,
                                    reference_time=self._reference_time)
        yield Tx.COMMIT
        self._done = True
        # The body as stored (jsonb's key order and numbers), so that this answer and every
        # replay of it are the same bytes.
        self.response = StoredResponse(
            status=status, headers=dict(headers or {}), body=load_json(row["body"]),
            content_type="application/json" if body is not None else None)
        return self.response

    def g_release(self) -> Gen[None]:
        """A definite failure before any side effect: roll the business transaction back and
        release the key, so a retry runs afresh (even with another request). The caller says
        no side effect happened: a checkpoint or a derived key does not stop it."""
        token = self._owner_token("release()")
        yield Tx.ROLLBACK
        try:
            yield from release_key(self.scope, self.key, token, alone=True, reason="release()")
            yield Tx.COMMIT
        finally:
            self._done = True
        self.released = True

    def g_exit(self, exc: BaseException | None) -> Gen[None]:
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
            yield Tx.ROLLBACK
            if release_it:
                reason = "exception" if exc is not None else "no complete()"
                yield from release_key(self.scope, self.key, self._token, alone=True,
                                    reason=reason)
                yield Tx.COMMIT
                self.released = True
            elif not owned_key_is_gone and logger.isEnabledFor(logging.INFO):
                log(logging.INFO, "kept", self.scope, self.key,
                    reason="exception" if exc is not None else "no complete()")
        except (psycopg.Error, LeaseLost, AlreadyCompleted, KeyNotFound, DatabaseUnavailable):
            if exc is None:
                raise
            # Cleaning up after an error: the original error is the one to report. An
            # unreleased key only costs the caller a wait for the lease to expire.
        finally:
            self._done = True

    def g_run(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
              status: int) -> Gen[Any]:
        """The whole flow around one function call (for :func:`idempotent`)."""
        yield from self.g_enter()
        if self.replay is not None:
            return self.replay.json()
        try:
            value = yield Call(fn, args, kwargs)
            stored = yield from self.g_complete(status, value)
        except BaseException as exc:
            yield from self.g_exit(exc)
            raise
        # What every retry will get back: the stored JSON value (a tuple comes back as a list,
        # from the first call on), so the first answer and its replays are equal.
        return stored.json() if value is not None else None


class OperationFields:
    """The fields of an operation, read-only, as every ``Operation`` shows them (the sync and
    async ones, and the SQLAlchemy session's): properties over the shared
    :class:`OperationCore` in ``self._core``, so that IDEs and type checkers see them."""

    __slots__ = ()
    _core: OperationCore

    @property
    def scope(self) -> str:
        return self._core.scope

    @property
    def key(self) -> str:
        return self._core.key

    @property
    def claim_result(self) -> ClaimResult | None:
        """What claim returned on entry."""
        return self._core.claim_result

    @property
    def outcome(self) -> Outcome | None:
        """The claim's outcome (claimed, resumed, replay or accepted inside the block)."""
        return self._core.outcome

    @property
    def replay(self) -> StoredResponse | None:
        """The stored response when the key was completed before (outcome replay), else None."""
        return self._core.replay

    @property
    def accepted(self) -> StoredResponse | None:
        """The interim response when a long-running operation holds the key (outcome
        accepted), else None."""
        return self._core.accepted

    @property
    def response(self) -> StoredResponse | None:
        """The response this block stored with complete() or accept(), else None."""
        return self._core.response

    @property
    def recovery_point(self) -> str | None:
        """The last recovery point: the resumed key's on entry, then this block's checkpoints."""
        return self._core.recovery_point

    @property
    def attempts(self) -> int | None:
        return self._core.attempts

    @property
    def lease_token(self) -> int | None:
        """The lease token while this block owns the key (a worker completes with it after
        accept()), else None."""
        return self._core.lease_token

    @property
    def released(self) -> bool:
        """True once the block released the key (op.release(), or an early return before any
        side effect)."""
        return self._core.released

    @property
    def max_response_bytes(self) -> int:
        return self._core.max_response_bytes

    @property
    def max_headers_bytes(self) -> int:
        return self._core.max_headers_bytes

    def derive_key(self, step: str) -> str:
        """The idempotency key for a downstream call made as ``step`` of this operation (see
        :meth:`OperationCore.derive_key`)."""
        return self._core.derive_key(step)

    def mark_side_effect(self) -> None:
        """Say that a side effect may have happened (see
        :meth:`OperationCore.mark_side_effect`)."""
        self._core.mark_side_effect()


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
                       driver: Callable[[Any, Gen[Any]], Any],
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
