"""ASGI middleware for Starlette and FastAPI, after the IETF Idempotency-Key header draft.

    pool = AsyncConnectionPool(dsn, open=False)
    app.add_middleware(IdempotencyMiddleware, pool=pool, scope=caller_id,
                       routes={"POST /payments": Policy.REQUIRED}, wait=5)

    @app.post("/payments")
    async def pay(request: Request):
        op = get_operation(request)              # None when no key was sent (optional route)
        await op.conn.execute("INSERT INTO ledger ...")
        return JSONResponse({...}, status_code=201)   # stored with the insert, in one commit

For a request with an ``Idempotency-Key`` the middleware claims the key on a pooled connection,
then calls the handler with that connection in an open transaction (``get_operation(request)``
gives the :class:`pg_idempotency.aio.Operation`, ``op.conn`` the connection). When the handler
answers, the response (status, exact body bytes, content type, and the headers named in
``replay_headers``) is stored with ``complete()`` in the same transaction as the handler's
writes, committed, and only then sent. Answers of its own:

- 400 ``application/problem+json``: the route requires a key and none was sent, or the key is
  not a valid name (empty, over 255 characters, control characters);
- 401 when the ``scope`` callback cannot identify the caller (returns None);
- 409 with ``Retry-After`` (the lease left, at most ``retry_after_max`` seconds) while another
  attempt holds the key (after waiting up to ``wait`` seconds for it to finish, in which case
  the result is replayed instead);
- 503 with ``Retry-After`` when no connection of ``pool`` is free in time;
- 422 ``application/problem+json``: the key was used with a different request;
- a replay: the stored status, body and content type, the stored headers, and
  ``Idempotent-Replayed: true``.

The fingerprint covers the method, the path, the query string (``fingerprint_query``) and the
body (a JSON body by its canonical form, so re-serialising it does not matter; any other body
by its bytes). The scope (whose keys these are) comes from the ``scope`` callback, from the
authenticated caller, never from the client's say-so alone.

Only the handler's writes on ``op.conn`` are covered by the key (with SQLAlchemy: the session
of :func:`pg_idempotency.sqlalchemy.request_session`); while the handler runs, a commit on
another SQLAlchemy connection raises ``ForeignCommitError``.

A request whose client disconnects before the end of its body is not claimed. An error answer
sent before the handler started (called :func:`get_operation`, or used ``request_session``),
such as a framework's request validation error, is not stored and the key is released.

A handler may hand the work to a worker instead (a long-running operation): it enqueues the job
on ``op.conn`` (:func:`pg_idempotency.jobs.aenqueue`) and calls ``await op.accept(202, body,
headers={"Location": ...})``, which commits the interim answer with the job. The middleware then
does not complete the key (the worker will) and sends the stored interim answer (status, the
headers given to accept, the body as stored) in place of the handler's own response, so the
first client and every retry while the worker runs get the same bytes; retries carry
``Idempotent-Replayed: true``. After the worker's ``complete`` they get its final answer.

A handler that raises, or answers 5xx (unless ``store_server_errors``), is rolled back; the key
is released for a fresh retry unless a side effect may have happened (a checkpoint was
committed or a downstream key derived: then the key stays in progress and the next retry after
the lease resumes). At most ``pool.max_size - pool_reserve`` keyed requests hold a connection
at a time, so a handler that takes one more from the same pool cannot deadlock it. Responses
are buffered whole before they are stored: do not use this on streaming endpoints. Options and
defaults: docs/python.md.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import re
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from enum import Enum
from typing import Any

import anyio
from psycopg_pool import AsyncConnectionPool, PoolTimeout
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from . import aio
from .core import DEFAULT_LEASE, StoredResponse
from .errors import (
    AlreadyCompleted,
    InvalidArgument,
    KeyExpired,
    KeyInProgress,
    KeyMismatch,
    KeyNotFound,
    LeaseLost,
)
from .fingerprint import _check_name, describe_request, fingerprint

__all__ = ["IdempotencyMiddleware", "Policy", "PoolExhausted", "add_cleanup", "get_operation"]

#: Headers that describe the operation's result, stored and replayed by default. Per-request
#: headers (dates, trace ids, rate-limit counters, cookies) are not.
DEFAULT_REPLAY_HEADERS = ("location", "content-location", "etag", "last-modified")
STATE_KEY = "idempotency"
#: Retry-After never says more than this by default (seconds), whatever the lease.
DEFAULT_RETRY_AFTER_MAX = 2.0


class Policy(str, Enum):
    """Per-route use of the Idempotency-Key header."""

    REQUIRED = "required"  #: 400 without the header
    OPTIONAL = "optional"  #: idempotent when the header is sent, passed through otherwise
    IGNORED = "ignored"  #: never looked at


class _HandlerFailed(Exception):
    """The handler answered 5xx: treated like an exception (rolled back)."""


class _NotStarted(Exception):
    """An error answer came before the handler asked for its operation (a framework's
    validation error, an auth dependency's 403): nothing is stored and the key is released."""


class PoolExhausted(RuntimeError):
    """The handler waited in vain for a connection from the middleware's own pool."""


@dataclass
class _Handling:
    """Per request: the operation, whether the handler started (asked for it), and what to
    run once the handler has returned, before the response is stored."""

    op: aio.Operation
    started: bool = False
    cleanups: list[Callable[[], Awaitable[None]]] = field(default_factory=list)


def _handling(request: Request) -> _Handling | None:
    state = request.scope.get("state") or {}
    return state.get(STATE_KEY)  # type: ignore[no-any-return]


def get_operation(request: Request) -> aio.Operation | None:
    """The operation the middleware opened for this request (None without a key). Its
    ``conn`` is the connection whose open transaction commits with the stored response.

    Calling it is what marks the handler as started: an error answer (4xx, 5xx) sent before
    any call (a framework's request validation, a dependency that refuses) is not stored and
    the key is released, so call it in the handler's body, not in a dependency that runs
    before the request is validated."""
    handling = _handling(request)
    if handling is None:
        return None
    handling.started = True
    return handling.op


def add_cleanup(request: Request, fn: Callable[[], Awaitable[None]]) -> None:
    """Run ``await fn()`` after the handler returned (or raised) and before the middleware
    stores the response and commits, e.g. to close a session bound to ``op.conn``
    (:func:`pg_idempotency.sqlalchemy.request_session` uses it). Cleanups run last first."""
    handling = _handling(request)
    if handling is None:
        raise RuntimeError("add_cleanup(): this request has no idempotency operation")
    handling.cleanups.append(fn)


class IdempotencyMiddleware:
    """Pure ASGI middleware; see the module documentation.

    - ``pool``: an ``AsyncConnectionPool``; each keyed request holds one connection until its
      response is committed.
    - ``scope``: ``callback(request) -> str | None`` (may be async), the caller's identity.
    - ``routes``: ``{"POST /payments": Policy.REQUIRED, "POST /orders/{id}/refunds": ...}``
      (``{name}`` matches one path segment); unlisted POST and PATCH routes are
      ``default_policy`` (OPTIONAL), other methods are ignored.
    - ``wait``: seconds to wait for an attempt in progress to finish (then replay) before
      answering 409; 0 answers at once.
    - ``lease``: how long a handler may run before a retry may take the key over.
    - ``store_server_errors``: store 5xx answers as the key's result (as Stripe does) instead
      of rolling back and releasing the key (default False: a 5xx is retried afresh).
    - ``fingerprint_query``: whether the query string is part of the request's fingerprint
      (default True).
    - ``retry_after_max``: the largest ``Retry-After`` of a 409 (seconds, default 2): the hint
      is the lease left, capped by this, and at least 1.
    - ``pool_reserve``: connections of ``pool`` that keyed requests never hold (default 1):
      at most ``pool.max_size - pool_reserve`` requests hold one at a time, so a handler that
      takes up to ``pool_reserve`` more from the same pool cannot deadlock the pool.
    - ``refuse_foreign_commits``: while a handler runs, a commit on any SQLAlchemy connection
      other than the operation's raises
      :class:`pg_idempotency.sqlalchemy.ForeignCommitError` (default True; only when
      SQLAlchemy is imported).
    """

    def __init__(self, app: ASGIApp, *, pool: AsyncConnectionPool,
                 scope: Callable[[Request], str | None | Awaitable[str | None]],
                 routes: Mapping[str, Policy] | None = None,
                 default_policy: Policy = Policy.OPTIONAL,
                 wait: float = 0.0, lease: timedelta | float = DEFAULT_LEASE,
                 replay_headers: Iterable[str] = DEFAULT_REPLAY_HEADERS,
                 header_name: str = "Idempotency-Key", store_server_errors: bool = False,
                 fingerprint_query: bool = True,
                 retry_after_max: float = DEFAULT_RETRY_AFTER_MAX, pool_reserve: int = 1,
                 refuse_foreign_commits: bool = True) -> None:
        if retry_after_max < 1:
            raise ValueError("retry_after_max must be at least 1 (second)")
        if pool_reserve < 0:
            raise ValueError("pool_reserve must be 0 or more")
        self.app = app
        self.pool = pool
        self.scope_of = scope
        self.default_policy = default_policy
        self.wait = wait
        self.lease = lease
        self.replay_headers = {h.lower() for h in replay_headers}
        self.header = header_name.lower().encode("latin-1")
        self.header_name = header_name
        self._routes = [(_route_regex(pattern), policy)
                        for pattern, policy in (routes or {}).items()]
        self.store_server_errors = store_server_errors
        self.fingerprint_query = fingerprint_query
        self.retry_after_max = retry_after_max
        self.pool_reserve = pool_reserve
        self.refuse_foreign_commits = refuse_foreign_commits
        self._holders: anyio.Semaphore | None = None

    def _holder_slots(self) -> anyio.Semaphore:
        # Made on first use, in the server's event loop; sized from the pool when it is known.
        if self._holders is None:
            slots = max(1, self.pool.max_size - self.pool_reserve)
            try:
                # anyio 4.5+: a free slot is taken without a trip through the event loop
                self._holders = anyio.Semaphore(slots, fast_acquire=True)
            except TypeError:
                self._holders = anyio.Semaphore(slots)
        return self._holders

    def _retry_after(self, left: timedelta | None) -> bytes:
        seconds = left.total_seconds() if left is not None else 1.0
        return str(max(1, math.ceil(min(seconds, self.retry_after_max)))).encode()

    def policy(self, method: str, path: str) -> Policy:
        for regex, policy in self._routes:
            if regex.fullmatch(f"{method} {path}"):
                return policy
        return self.default_policy if method in ("POST", "PATCH") else Policy.IGNORED

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        policy = self.policy(scope["method"], scope["path"])
        raw_key = dict(scope["headers"]).get(self.header) if policy != Policy.IGNORED else None
        if raw_key is None:
            if policy == Policy.REQUIRED:
                await _problem(send, 400, f"{self.header_name} header required",
                               f"{scope['method']} {scope['path']} requires an "
                               f"{self.header_name} header.")
                return
            await self.app(scope, receive, send)
            return
        key = raw_key.decode("latin-1").strip()
        if len(key) >= 2 and key[0] == key[-1] == '"':  # the draft's sf-string form
            key = key[1:-1]
        try:
            _check_name(self.header_name, "key", key)
        except InvalidArgument as exc:
            await _problem(send, 400, f"Invalid {self.header_name}", str(exc))
            return
        caller = self.scope_of(Request(scope))
        if inspect.isawaitable(caller):
            caller = await caller
        if not caller:
            await _problem(send, 401, "Unknown caller",
                           "Idempotency keys belong to an identified caller.")
            return

        body = await _read_body(receive)
        if body is None:
            # The client went away before its body was complete: that is not a request.
            # Nothing is claimed, so its retry with the whole body is the first attempt.
            return
        digest = fingerprint(_describe(scope, body, query=self.fingerprint_query))
        deadline = time.monotonic() + self.wait
        pause = 0.02
        while True:
            try:
                async with self._holder_slots(), self.pool.connection() as conn:
                    answered, retry_after = await self._attempt(conn, caller, key, digest,
                                                                scope, receive, send, body)
                if answered:
                    return
            except PoolTimeout:
                await _problem(send, 503, "No database connection",
                               "No connection to the idempotency store was free in time. "
                               "Retry later.", [(b"retry-after", self._retry_after(None))])
                return
            left = deadline - time.monotonic()
            if left <= 0:
                await _problem(send, 409, "Request in progress",
                               "A request with this key is being processed. Retry later.",
                               [(b"retry-after", self._retry_after(retry_after))])
                return
            await anyio.sleep(min(pause, left))
            pause = min(pause * 2, 0.25)

    async def _attempt(self, conn: Any, caller: str, key: str, digest: bytes, scope: Scope,
                       receive: Receive, send: Send, body: bytes
                       ) -> tuple[bool, timedelta | None]:
        """One claim: (True, None) once the request is answered, (False, the lease left) while
        another attempt holds the key."""
        op = aio.operation(conn, caller, key, None, fingerprint=digest, lease=self.lease)
        try:
            await op.__aenter__()
        except KeyMismatch:
            await _problem(send, 422, f"{self.header_name} reused",
                           f"This {self.header_name} was used with a different request. Use a "
                           "new key for a new request.")
        except KeyExpired:
            await _problem(send, 422, f"{self.header_name} expired",
                           f"This {self.header_name} was used and has expired. Use a new key "
                           "for a new request.")
        except KeyInProgress as exc:
            return False, exc.retry_after
        else:
            stored = op.replay if op.replay is not None else op.accepted
            if stored is not None:
                # replay, or a worker's interim answer (outcome accepted): the same response
                # again, never a second execution.
                await _send_replay(send, stored)
            else:
                await self._execute(op, scope, receive, send, body)
        return True, None

    async def _execute(self, op: aio.Operation, scope: Scope, receive: Receive, send: Send,
                       body: bytes) -> None:
        handling = _Handling(op)
        state = dict(scope.get("state") or {})
        state[STATE_KEY] = handling
        inner = dict(scope, state=state)
        sent_body = False

        async def receive_again() -> Message:
            nonlocal sent_body
            if not sent_body:
                sent_body = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        start: Message | None = None
        chunks: list[bytes] = []

        async def capture(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                start = message
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        try:
            try:
                with self._guard(op):
                    await self.app(inner, receive_again, capture)
            finally:
                for cleanup in reversed(handling.cleanups):
                    await cleanup()
            if start is None:
                raise RuntimeError("the application sent no response")
            if op.response is not None and op.response.completed_at is None:
                # The handler handed the work over with op.accept(): that committed the
                # interim answer with the job, and the key stays in progress for the worker.
                # Send what was stored, so that this answer and its replays are the same.
                await _send_stored(send, op.response)
                return
            if not handling.started and start["status"] >= 400:
                # An error before the handler asked for its operation: a framework's request
                # validation, an auth dependency. Not the endpoint's result (Stripe stores
                # results only once the endpoint started): release the key.
                raise _NotStarted(start["status"])
            if start["status"] >= 500 and not self.store_server_errors:
                raise _HandlerFailed(start["status"])
        except PoolTimeout as exc:
            error = PoolExhausted(
                f"the handler timed out waiting for a database connection ({exc}). If it "
                "asked the middleware's pool: each keyed request holds one of its "
                f"{self.pool.max_size} connections until the response is stored, and "
                f"pool_reserve={self.pool_reserve} are kept free for handlers. Use op.conn "
                "(or pg_idempotency.sqlalchemy.request_session), take at most pool_reserve "
                "connections at once, or use another pool.")
            await op.__aexit__(PoolExhausted, error, None)
            raise error from exc
        except BaseException as exc:
            await op.__aexit__(type(exc), exc, exc.__traceback__)
            if isinstance(exc, (_HandlerFailed, _NotStarted)) and start is not None:
                await _send(send, start["status"], start.get("headers", []), b"".join(chunks))
                return
            raise
        content = b"".join(chunks)
        headers = [(bytes(k), bytes(v)) for k, v in start.get("headers", [])]
        stored: dict[str, str] = {}
        content_type = "application/octet-stream"
        for name, value in headers:
            lname = name.decode("latin-1").lower()
            if lname == "content-type":
                content_type = value.decode("latin-1")
            elif lname in self.replay_headers:
                stored[name.decode("latin-1")] = value.decode("latin-1")
        try:
            await op.complete(start["status"], content, headers=stored,
                              content_type=content_type)
        except (LeaseLost, AlreadyCompleted, KeyNotFound) as exc:
            # Taken over while we ran: our writes rolled back; the new holder's answer wins.
            await op.__aexit__(type(exc), exc, exc.__traceback__)
            await _problem(send, 409, "Request in progress",
                           "The lease on this key expired and another attempt took it over.",
                           [(b"retry-after", b"1")])
            return
        await _send(send, start["status"], headers, content)

    def _guard(self, op: aio.Operation) -> contextlib.AbstractContextManager[Any]:
        """While the handler runs, refuse commits on other SQLAlchemy connections: their writes
        would not be fenced by the key (see pg_idempotency.sqlalchemy). Only when the app has
        imported SQLAlchemy; the adapter module is loaded then, never otherwise."""
        if self.refuse_foreign_commits and "sqlalchemy" in sys.modules:
            from . import sqlalchemy as sa_adapter

            return sa_adapter.refuse_foreign_commits(op.conn)
        return contextlib.nullcontext()


def _route_regex(pattern: str) -> re.Pattern[str]:
    method, _, path = pattern.strip().partition(" ")
    parts = re.split(r"(\{[^/{}]+\})", path.strip())
    body = "".join("[^/]+" if p.startswith("{") else re.escape(p) for p in parts)
    return re.compile(f"{re.escape(method.upper())} {body}")


async def _read_body(receive: Receive) -> bytes | None:
    """The whole body, or None when the client disconnected before its last chunk."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _describe(scope: Scope, body: bytes, *, query: bool = True) -> dict[str, Any]:
    """What the fingerprint covers (:func:`~pg_idempotency.fingerprint.describe_request`)."""
    return describe_request(
        scope["method"], scope["path"],
        scope.get("query_string", b"").decode("latin-1") if query else None,
        dict(scope["headers"]).get(b"content-type", b"").decode("latin-1"), body)


async def _send(send: Send, status: int, headers: Iterable[tuple[bytes, bytes]],
                content: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": list(headers)})
    await send({"type": "http.response.body", "body": content, "more_body": False})


async def _send_stored(send: Send, stored: StoredResponse,
                       extra: Iterable[tuple[bytes, bytes]] = ()) -> None:
    content = stored.content
    headers = [(k.lower().encode("latin-1"), v.encode("latin-1"))
               for k, v in stored.headers.items()]
    if stored.content_type:
        headers.append((b"content-type", stored.content_type.encode("latin-1")))
    headers += [(b"content-length", str(len(content)).encode()), *extra]
    await _send(send, stored.status, headers, content)


async def _send_replay(send: Send, stored: StoredResponse) -> None:
    await _send_stored(send, stored, [(b"idempotent-replayed", b"true")])


async def _problem(send: Send, status: int, title: str, detail: str,
                   extra: list[tuple[bytes, bytes]] | None = None) -> None:
    """An RFC 9457 problem details answer."""
    content = json.dumps({"type": "about:blank", "title": title, "status": status,
                          "detail": detail}).encode()
    headers = [(b"content-type", b"application/problem+json"),
               (b"content-length", str(len(content)).encode()), *(extra or [])]
    await _send(send, status, headers, content)
