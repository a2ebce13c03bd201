"""ASGI middleware for Starlette and FastAPI, after the IETF Idempotency-Key header draft.

    pool = AsyncConnectionPool(dsn, open=False)
    app.add_middleware(IdempotencyMiddleware, pool=pool, scope=caller_id,
                       routes={"POST /payments": Policy.REQUIRED}, wait=5)

    @app.post("/payments")
    async def pay(request: Request):
        op = get_operation(request)              # None when no key was sent (optional route)
        await op.conn.execute("INSERT INTO ledger ...")
        return JSONResponse({...}, status_code=201)   # stored with the insert, in one commit

``pool`` may be an ``asyncpg.Pool`` too, or a callable that returns the pool on the first request
(an asyncpg pool made in the app's lifespan: ``pool=lambda: app.state.pool``; docs/python.md,
"On asyncpg"); ``op.conn`` is then asyncpg's (``await op.conn.execute("... $1", value)``).

For a request with an ``Idempotency-Key`` the middleware claims the key on a pooled connection
and gives it back, then calls the handler (``get_operation(request)`` gives the
:class:`pg_idempotency.aio.Operation`); ``op.conn`` takes a connection of the pool at the
handler's first statement and holds the transaction open on it, so a handler that awaits a
slow call before it writes holds no connection meanwhile. When the handler
answers, the response (status, exact body bytes, content type, and the headers named in
``replay_headers``) is stored with ``complete()`` in the same transaction as the handler's
writes, committed, and only then sent. Answers of its own:

- 400 ``application/problem+json``: the route requires a key and none was sent, or the key is
  not one (an RFC 8941 sf-string of printable ASCII, 1 to 255 characters), or the header came
  more than once (or with a list of values), or the body is shorter than its Content-Length,
  or the ``scope``
  callback's scope is not valid (over 255 characters, control characters), or the body cannot
  be fingerprinted (JSON nested deeper than 128);
- 413 when the body is over ``max_request_bytes`` (nothing past it is read, nothing claimed);
- 507 when the handler's answer is over ``max_response_bytes`` (not stored, nothing past the
  limit buffered; its writes roll back and the key is released);
- 401 when the ``scope`` callback cannot identify the caller (returns None);
- 409 with ``Retry-After`` (the lease left, at most ``retry_after_max`` seconds) while another
  attempt holds the key (after waiting up to ``wait`` seconds for it to finish, in which case
  the result is replayed instead);
- 503 with ``Retry-After`` when no connection of ``pool`` is free in time, and when the
  database cannot be reached or the connection is lost (before, during or after the handler;
  nothing is stored, the handler's writes roll back);
- 422 ``application/problem+json``: the key was used with a different request;
- a replay: the stored status, body and content type, the stored headers, and
  ``Idempotent-Replayed: true``.

Only the routes named in ``routes`` are keyed (unlisted ones are ``default_policy``, IGNORED).
The fingerprint covers the method, the path, the query string only with ``fingerprint_query``,
and the body (a JSON body by its canonical form, so re-serialising it does not matter; any
other body by its bytes). The scope (whose keys these are) comes from the ``scope`` callback,
from the authenticated caller, never from the client's say-so alone.

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

A handler that raises, or answers 5xx (unless ``store_server_errors``, which stores a 5xx
whether or not the handler asked for its operation), is rolled back; the key
is released for a fresh retry unless a side effect may have happened (a checkpoint was
committed or a downstream key derived: then the key stays in progress and the next retry after
the lease resumes). At most ``pool.max_size - pool_reserve`` handlers' transactions hold a
connection at a time, so a handler that takes one more from the same pool cannot deadlock
it. Responses are buffered whole before they are stored: do not use this on streaming
endpoints. Options and defaults: docs/python.md; the contract, the same behind every adapter
(:mod:`pg_idempotency.contract`): docs/http.md.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Awaitable, Callable, Iterable, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import anyio
from psycopg_pool import AsyncConnectionPool, PoolTimeout
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from . import _operation, aio
from . import contract as http
from ._asyncpg import is_asyncpg_pool
from ._calls import DEFAULT_LEASE
from ._pooled import AsyncHold
from ._results import ClaimResult
from .contract import DEFAULT_REPLAY_HEADERS, Answer, Handling, Policy
from .errors import (
    DEFAULT_UNAVAILABLE_RETRY_AFTER,
    AlreadyCompleted,
    ArgumentTooLarge,
    DatabaseUnavailable,
    KeyExpired,
    KeyInProgress,
    KeyMismatch,
    KeyNotFound,
    LeaseLost,
)

if TYPE_CHECKING:
    import asyncpg

__all__ = ["DEFAULT_REPLAY_HEADERS", "IdempotencyMiddleware", "Policy", "PoolExhausted",
           "add_cleanup", "get_operation"]

STATE_KEY = http.HANDLING_KEY


class _Rollback(Exception):
    """The handler's answer is not stored (a 5xx, or an error before it started): roll back
    and release the key, then send the answer."""


class _TooLarge(Exception):
    """The handler's answer is over max_response_bytes: roll back, release, answer 507."""


class PoolExhausted(RuntimeError):
    """The handler waited in vain for a connection from the middleware's own pool."""


def _handling(request: Request) -> Handling | None:
    return http.handling_of(request.scope.get("state"))


def get_operation(request: Request) -> aio.Operation | None:
    """The operation the middleware opened for this request (None without a key). Its
    ``conn`` is the connection whose open transaction commits with the stored response.

    Calling it is what marks the handler as started: an error answer (4xx) sent before any
    call (a framework's request validation, a dependency that refuses) is not stored and the
    key is released, so call it in the handler's body, not in a dependency that runs before
    the request is validated."""
    return http.start(_handling(request))  # type: ignore[no-any-return]


def add_cleanup(request: Request, fn: Callable[[], Awaitable[None]]) -> None:
    """Run ``await fn()`` after the handler returned (or raised) and before the middleware
    stores the response and commits, e.g. to close a session bound to ``op.conn``
    (:func:`pg_idempotency.sqlalchemy.request_session` does the same). Cleanups run last
    first."""
    handling = _handling(request)
    if handling is None:
        raise RuntimeError("add_cleanup(): this request has no idempotency operation")
    handling.cleanups.append(fn)


class IdempotencyMiddleware:
    """Pure ASGI middleware; see the module documentation.

    - ``pool``: a psycopg ``AsyncConnectionPool`` or an ``asyncpg.Pool``, or a callable that
      returns one on the first request (an asyncpg pool is bound to the event loop it is
      made in: make it in the app's lifespan and pass ``lambda: app.state.pool``); a keyed
      request holds one of its connections only while its SQL runs (the claim; the handler's
      transaction from its first statement to the commit of the stored response).
    - ``scope``: ``callback(request) -> str | None`` (may be async), the caller's identity.
    - ``routes``: ``{"POST /payments": Policy.REQUIRED, "POST /orders/{id}/refunds": ...}``
      (``{name}`` matches one path segment; a value may be a
      :class:`~pg_idempotency.contract.Route` with the route's fingerprint fields and lease);
      unlisted routes are ``default_policy`` (IGNORED: name the keyed routes).
    - ``pool_reserve``: connections of ``pool`` that handlers' transactions never hold (default
      1): at most ``pool.max_size - pool_reserve`` of them hold one at a time, so a handler that
      takes up to ``pool_reserve`` more from the same pool cannot deadlock the pool.
    - ``refuse_foreign_commits``: while a handler runs, a commit on any SQLAlchemy connection
      other than the operation's raises
      :class:`pg_idempotency.sqlalchemy.ForeignCommitError` (default True; only when
      :mod:`pg_idempotency.sqlalchemy` is imported).
    - ``wait``, ``lease``, ``replay_headers``, ``header_name``, ``store_server_errors``,
      ``fingerprint_query``, ``retry_after_max``, ``unavailable_retry_after``,
      ``max_request_bytes``, ``max_response_bytes``: :class:`pg_idempotency.contract.Settings`.
    """

    def __init__(self, app: ASGIApp, *,
                 pool: AsyncConnectionPool | asyncpg.Pool | Callable[[], Any],
                 scope: Callable[[Request], str | None | Awaitable[str | None]],
                 routes: Mapping[str, http.Route | Policy | str | Mapping[str, Any]]
                 | None = None,
                 default_policy: Policy | str = Policy.IGNORED,
                 wait: float = 0.0, lease: timedelta | float = DEFAULT_LEASE,
                 replay_headers: Iterable[str] = DEFAULT_REPLAY_HEADERS,
                 header_name: str = "Idempotency-Key", store_server_errors: bool = False,
                 fingerprint_query: bool = False,
                 retry_after_max: float = http.DEFAULT_RETRY_AFTER_MAX, pool_reserve: int = 1,
                 refuse_foreign_commits: bool = True,
                 unavailable_retry_after: float = DEFAULT_UNAVAILABLE_RETRY_AFTER,
                 max_request_bytes: int = http.DEFAULT_MAX_REQUEST_BYTES,
                 max_response_bytes: int = http.DEFAULT_MAX_RESPONSE_BYTES) -> None:
        if pool_reserve < 0:
            raise ValueError("pool_reserve must be 0 or more")
        self.settings = http.Settings(
            header_name=header_name, wait=wait, lease=lease, retry_after_max=retry_after_max,
            replay_headers=frozenset(replay_headers), store_server_errors=store_server_errors,
            fingerprint_query=fingerprint_query, unavailable_retry_after=unavailable_retry_after,
            max_request_bytes=max_request_bytes, max_response_bytes=max_response_bytes)
        self.routes = http.Routes(routes, default_policy)
        self.app = app
        self._pool_source = pool
        self._pool: Any = None
        self._hold_class: Any = AsyncHold
        self._max_size = 0
        if not callable(pool):
            self._use(pool)
        self.scope_of = scope
        self.header = header_name.lower().encode("latin-1")
        self.pool_reserve = pool_reserve
        self.refuse_foreign_commits = refuse_foreign_commits
        self._holders: anyio.Semaphore | None = None

    @property
    def pool(self) -> Any:
        """The pool: the one given, or what the callable given returned on first use."""
        if self._pool is None:
            self._use(self._pool_source())  # type: ignore[operator]
        return self._pool

    def _use(self, pool: Any) -> None:
        if is_asyncpg_pool(pool):
            from ._asyncpg_pool import AsyncpgHold  # noqa: PLC0415 - only with asyncpg

            self._hold_class, self._max_size = AsyncpgHold, pool.get_max_size()
        else:
            self._hold_class, self._max_size = AsyncHold, pool.max_size
        self._pool = pool

    def _holder_slots(self) -> anyio.Semaphore:
        # Made on first use, in the server's event loop; sized from the pool when it is known.
        if self._holders is None:
            if self._pool is None:
                self._use(self._pool_source())  # type: ignore[operator]
            slots = max(1, self._max_size - self.pool_reserve)
            try:
                # anyio 4.5+: a free slot is taken without a trip through the event loop
                self._holders = anyio.Semaphore(slots, fast_acquire=True)
            except TypeError:
                self._holders = anyio.Semaphore(slots)
        return self._holders

    def policy(self, method: str, path: str) -> Policy:
        return self.routes.policy(method, path)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        method, path = scope["method"], scope["path"]
        headers = dict(scope["headers"])
        route = self.routes.route(method, path)
        # The header's bytes as they came: never decoded as Latin-1 (contract.parse_key); every
        # value when it came more than once (contract.read_key refuses that).
        raw: bytes | list[bytes] | None = headers.get(self.header)
        if raw is not None:
            values = [v for k, v in scope["headers"] if k == self.header]
            raw = values if len(values) > 1 else raw
        key = http.read_key(self.settings, route.policy, raw, method, path)
        if not isinstance(key, str):
            await (self.app(scope, receive, send) if key is None else _send(send, key))
            return
        # The body rule (contract.BodyReader): a bad or too large Content-Length is answered
        # before anything is read.
        reader = http.BodyReader(self.settings, _ascii(headers.get(b"content-length")) or None)
        if reader.answer is not None:
            await _send(send, reader.answer)
            return
        caller = self.scope_of(Request(scope))
        if inspect.isawaitable(caller):
            caller = await caller
        if not caller:
            await _send(send, http.unknown_caller())
            return
        body = await _read_body(receive, reader)
        if body is None:
            # The client went away before its body was complete: that is not a request.
            # Nothing is claimed, so its retry with the whole body is the first attempt.
            return
        if isinstance(body, Answer):
            await _send(send, body)
            return
        fingerprinting = functools.partial(
            http.keyed_request, self.settings, route, caller, method, path,
            _ascii(scope.get("query_string")), _ascii(headers.get(b"content-type")), body)
        # A large body is parsed and canonicalized in a worker thread, so that the event loop
        # goes on serving other requests meanwhile (up to a second or two of CPU for 1 MiB of
        # JSON numbers); a small one here, where a thread would cost more than it saves.
        keyed = (await anyio.to_thread.run_sync(fingerprinting)
                 if len(body) > _THREADED_BODY else fingerprinting())
        if isinstance(keyed, Answer):
            await _send(send, keyed)
            return
        digest = keyed.fingerprint
        slots = self._holder_slots()
        op: aio.Operation | None = None

        async def claim() -> ClaimResult:
            nonlocal op
            # A hold per attempt: the claim's connection goes back to the pool as soon as it
            # answered, the handler's transaction takes one at its first statement.
            op = aio.Operation(_operation.OperationCore(
                keyed.scope, key, None, fingerprint=digest, lease=keyed.lease,
                max_response_bytes=self.settings.max_response_bytes), None,
                self._hold_class(self.pool, slots))
            with contextlib.suppress(KeyMismatch, KeyExpired, KeyInProgress):
                await op.__aenter__()  # its claim_result says which
            assert op.claim_result is not None  # set before any of those is raised
            return op.claim_result

        started = False

        async def sending(message: Message) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            try:
                claimed = await http.aclaim_waiting(self.settings, claim, anyio.sleep)
                if isinstance(claimed, Answer):
                    await _send(sending, claimed)
                else:
                    assert op is not None
                    await self._execute(op, scope, receive, sending, body)
            finally:
                if op is not None:
                    await op._hold.close()
        except PoolTimeout:
            await _send(send, http.no_connection(self.settings))
        except Exception as exc:
            # The database went away (refused, lost, restarting), in the claim, the handler's
            # own queries or the complete: 503 with Retry-After, nothing stored, never a 500.
            answer = None if started else http.outage(self.settings, exc)
            if answer is None:
                raise
            await _send(send, answer)

    async def _execute(self, op: aio.Operation, scope: Scope, receive: Receive, send: Send,
                       body: bytes) -> None:
        handling = Handling(op)
        inner = dict(scope, state={**(scope.get("state") or {}), STATE_KEY: handling})
        sent_body = False

        async def receive_again() -> Message:
            nonlocal sent_body
            if not sent_body:
                sent_body = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        start: Message | None = None
        chunks: list[bytes] = []
        size = 0
        limit = self.settings.max_response_bytes

        async def capture(message: Message) -> None:
            nonlocal start, size
            if message["type"] == "http.response.start":
                start = message
            elif message["type"] == "http.response.body":
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    chunks.clear()  # over the limit: not stored, so nothing more is kept
                else:
                    chunks.append(chunk)

        try:
            try:
                with http.guarded(op.conn, self.refuse_foreign_commits):
                    await self.app(inner, receive_again, capture)
            finally:
                for cleanup in reversed(handling.cleanups):
                    await cleanup()
            if start is None:
                raise RuntimeError("the application sent no response")
            if size > limit:
                raise _TooLarge(size)
            if op.response is not None and op.response.completed_at is None:
                # The handler handed the work over with op.accept(): that committed the
                # interim answer with the job, and the key stays in progress for the worker.
                # Send what was stored, so that this answer and its replays are the same.
                await _send(send, http.stored_answer(op.response, replayed=False))
                return
            if not http.stores(self.settings, start["status"], started=handling.started):
                raise _Rollback(start["status"])
        except PoolTimeout as exc:
            if op._hold is not None and op._hold.timed_out:
                # The handler's first statement found no connection free in time: as a claim
                # that finds none, 503 (rolled back, the key released).
                await op.__aexit__(type(exc), exc, exc.__traceback__)
                raise
            error = PoolExhausted(
                f"the handler timed out waiting for a database connection ({exc}). If it "
                "asked the middleware's pool: each keyed request holds one of its "
                f"{self._max_size} connections until the response is stored, and "
                f"pool_reserve={self.pool_reserve} are kept free for handlers. Use op.conn "
                "(or pg_idempotency.sqlalchemy.request_session), take at most pool_reserve "
                "connections at once, or use another pool.")
            await op.__aexit__(PoolExhausted, error, None)
            raise error from exc
        except BaseException as exc:
            await op.__aexit__(type(exc), exc, exc.__traceback__)
            if isinstance(exc, _TooLarge):
                await _send(send, http.response_too_large(self.settings))
                return
            if isinstance(exc, _Rollback) and start is not None:
                # the framework answered 500 for a lost connection or an exhausted pool
                failed = http.failed_for_the_database(self.settings, op.conn)
                if failed is not None:
                    await _send(send, failed)
                    return
                await _send_raw(send, start["status"], start.get("headers", []), chunks)
                return
            raise
        raw_headers = [(bytes(k), bytes(v)) for k, v in start.get("headers", [])]
        stored, content_type = http.stored_parts(
            self.settings, [(k.decode("latin-1"), v.decode("latin-1")) for k, v in raw_headers])
        try:
            await op.complete(start["status"], b"".join(chunks), headers=stored,
                              content_type=content_type)
        except PoolTimeout as exc:
            # No connection free in time for complete (the handler wrote nothing): 503.
            await op.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        except (LeaseLost, AlreadyCompleted, KeyNotFound) as exc:
            # Taken over while we ran: our writes rolled back; the new holder's answer wins.
            await op.__aexit__(type(exc), exc, exc.__traceback__)
            await _send(send, http.taken_over())
            return
        except ArgumentTooLarge as exc:
            # The engine's own limit (settings.max_response_bytes) is lower than ours.
            await op.__aexit__(type(exc), exc, exc.__traceback__)
            await _send(send, http.response_too_large(self.settings))
            return
        except DatabaseUnavailable as exc:
            # Lost before or during the commit: whether it committed is unknown, so the key
            # is left as it is (a retry replays, or resumes once the lease expires).
            await op.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        await _send_raw(send, start["status"], raw_headers, chunks)


#: Bodies longer than this (bytes) are fingerprinted in a worker thread.
_THREADED_BODY = 65536


def _ascii(value: bytes | None) -> str:
    """A header or query string's bytes as text for the fingerprint: ASCII as it is, any
    other byte escaped (never Latin-1 mojibake)."""
    return "" if value is None else value.decode("ascii", "backslashreplace")


async def _read_body(receive: Receive, reader: http.BodyReader) -> bytes | Answer | None:
    """The body rule over ASGI messages: the whole body; None when the client disconnected
    before its last chunk (no one to answer); else the answer ``reader`` gives instead (413 as
    soon as the body is over the limit: the rest is not read; 400 for a body shorter than its
    Content-Length)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        if not reader.feed(message.get("body", b"")):
            return reader.finish()
        if not message.get("more_body", False):
            return reader.finish()


async def _send_raw(send: Send, status: int, headers: Iterable[tuple[bytes, bytes]],
                    chunks: list[bytes]) -> None:
    await send({"type": "http.response.start", "status": status, "headers": list(headers)})
    await send({"type": "http.response.body", "body": b"".join(chunks), "more_body": False})


async def _send(send: Send, answer: Answer) -> None:
    await _send_raw(send, answer.status,
                    [(k.lower().encode("latin-1"), v.encode("latin-1"))
                     for k, v in answer.headers], [answer.body])
