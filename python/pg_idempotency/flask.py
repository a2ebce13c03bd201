"""Flask and plain WSGI: a view decorator and a WSGI middleware (extra ``flask``).

    pool = ConnectionPool(dsn, open=True)                   # psycopg_pool
    idem = Idempotency(pool, scope=lambda request: request.headers.get("X-Account"))

    @app.post("/payments")
    @idem.idempotent                                        # the key is required
    def pay():
        op = get_operation()
        op.conn.execute("INSERT INTO ledger ...")           # the business write, on op.conn
        return {"id": 7}, 201                               # stored with it, in one commit

or for a whole WSGI app, the keyed routes named (unlisted ones are not keyed)::

    app.wsgi_app = IdempotencyMiddleware(app.wsgi_app, pool=pool,
                                         scope=lambda environ: environ.get("HTTP_X_ACCOUNT"),
                                         routes={"POST /payments": "required"})

For a request with an ``Idempotency-Key`` the key is claimed on a connection of ``pool``
(committed on its own, so concurrent retries see it; the connection goes back at once), then
the view runs; ``get_operation().conn`` takes a connection of the pool at its first statement
and holds the transaction open on it. Its answer (status, exact body bytes, content
type and the headers named in ``replay_headers``) is stored with ``complete()`` in that same
transaction, committed, and only then sent: the business write and the stored answer commit
together or not at all. A view that raises, or answers 5xx (unless ``store_server_errors``), is
rolled back and the key released; a retry runs afresh. A database that cannot be reached (or a
connection lost while the view ran) is 503 with Retry-After, nothing stored. The answers of the
adapter's own (400, 401, 409 with Retry-After, 422, 503, replays with
``Idempotent-Replayed: true``) are the
contract every adapter shares (:mod:`pg_idempotency.contract`, docs/http.md). Guide:
docs/flask.md.
"""

from __future__ import annotations

import contextlib
import functools
import io
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from http import HTTPStatus
from typing import Any

import flask
from psycopg_pool import ConnectionPool, PoolTimeout
from werkzeug.exceptions import RequestEntityTooLarge

from . import _operation, api
from . import contract as http
from ._pooled import Hold
from ._results import ClaimResult
from .contract import DEFAULT_REPLAY_HEADERS, Answer, Handling, Policy
from .errors import (
    AlreadyCompleted,
    ArgumentTooLarge,
    DatabaseUnavailable,
    KeyExpired,
    KeyInProgress,
    KeyMismatch,
    KeyNotFound,
    LeaseLost,
)

__all__ = ["Idempotency", "IdempotencyMiddleware", "Policy", "get_operation"]

#: Where the request's :class:`~pg_idempotency.contract.Handling` is kept in the WSGI environ.
ENVIRON_KEY = "pg_idempotency." + http.HANDLING_KEY

StartResponse = Callable[..., Any]
WSGIApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]


def get_operation(environ: Mapping[str, Any] | None = None) -> api.Operation | None:
    """The operation of this request (None without a key): do the business writes on its
    ``conn``, in the transaction that will commit with the stored answer. Without ``environ``
    it is Flask's current request's. Calling it marks the view as started: behind the
    middleware, a 4xx answered before any call (a 404, a 405, a refusal before the view's
    work) is not the key's result and the key is released."""
    handling = http.handling_of(environ if environ is not None else flask.request.environ,
                                ENVIRON_KEY)
    return http.start(handling)  # type: ignore[no-any-return]


@dataclass
class _Out:
    """The handler's answer: what is stored, and the framework's own object to send."""

    status: int
    headers: list[tuple[str, str]]
    body: bytes
    original: Any
    #: The body was over max_response_bytes (and ``body`` holds none of it).
    too_large: bool = False


class _Rollback(Exception):
    """The handler's answer is not stored: roll back and release, then send it."""


class _TooLarge(Exception):
    """The handler's answer is over max_response_bytes: roll back, release, answer 507."""


class _Keyed:
    """What the decorator and the middleware share: claim on ``pool``, run, store."""

    def __init__(self, pool: ConnectionPool, settings: http.Settings,
                 refuse_foreign_commits: bool) -> None:
        self.pool = pool
        self.settings = settings
        self.refuse_foreign_commits = refuse_foreign_commits

    def run(self, environ: dict[str, Any], route: http.Route, caller: str | None, key: str,
            method: str, path: str, body: bytes | Answer, handler: Callable[[], _Out],
            started: bool) -> Answer | _Out:
        if not caller:
            return http.unknown_caller()
        if isinstance(body, Answer):  # the body rule (contract.BodyReader) refused it
            return body
        keyed = http.keyed_request(self.settings, route, caller, method, path,
                                   environ.get("QUERY_STRING", ""),
                                   environ.get("CONTENT_TYPE", ""), body)
        if isinstance(keyed, Answer):
            return keyed
        digest = keyed.fingerprint
        op: api.Operation | None = None

        def claim() -> ClaimResult:
            nonlocal op
            # A hold per attempt: the claim's connection goes back to the pool as soon as it
            # answered, the view's transaction takes one at its first statement.
            op = api.Operation(_operation.OperationCore(
                keyed.scope, key, None, fingerprint=digest, lease=keyed.lease,
                max_response_bytes=self.settings.max_response_bytes), None, Hold(self.pool))
            with contextlib.suppress(KeyMismatch, KeyExpired, KeyInProgress):
                op.__enter__()  # its claim_result says which
            assert op.claim_result is not None  # set before any of those is raised
            return op.claim_result

        try:
            try:
                claimed = http.claim_waiting(self.settings, claim)
                if isinstance(claimed, Answer):
                    return claimed
                assert op is not None
                return self._execute(op, environ, handler, started)
            finally:
                if op is not None:
                    op._hold.close()  # type: ignore[union-attr]
        except PoolTimeout:
            return http.no_connection(self.settings)
        except Exception as exc:
            # The database went away (refused, lost, restarting), in the claim, the view's own
            # queries or the complete: 503 with Retry-After, nothing stored, never a 500.
            answer = http.outage(self.settings, exc)
            if answer is None:
                raise
            return answer

    def _execute(self, op: api.Operation, environ: dict[str, Any], handler: Callable[[], _Out],
                 started: bool) -> Answer | _Out:
        handling = Handling(op, started=started)
        environ[ENVIRON_KEY] = handling
        try:
            try:
                with http.guarded(op.conn, self.refuse_foreign_commits):
                    out = handler()
            finally:
                for cleanup in reversed(handling.cleanups):
                    cleanup()
                environ.pop(ENVIRON_KEY, None)
            if op.response is not None and op.response.completed_at is None:
                # op.accept() handed the work to a worker and committed the interim answer:
                # send what was stored, so that this answer and its replays are the same.
                return http.stored_answer(op.response, replayed=False)
            if out.too_large or len(out.body) > self.settings.max_response_bytes:
                raise _TooLarge(out.status)
            if not http.stores(self.settings, out.status, started=handling.started):
                raise _Rollback(out.status)
        except BaseException as exc:
            op.__exit__(type(exc), exc, exc.__traceback__)
            if isinstance(exc, _TooLarge):
                return http.response_too_large(self.settings)
            if isinstance(exc, _Rollback):
                # a 500 made of a lost connection or an exhausted pool (Flask answered it
                # before we saw the error)
                return http.failed_for_the_database(self.settings, op.conn) or out
            raise
        stored, content_type = http.stored_parts(self.settings, out.headers)
        try:
            op.complete(out.status, out.body, headers=stored, content_type=content_type)
        except PoolTimeout as exc:
            # No connection free in time for complete (the view wrote nothing): 503.
            op.__exit__(type(exc), exc, exc.__traceback__)
            raise
        except (LeaseLost, AlreadyCompleted, KeyNotFound) as exc:
            # Taken over while the view ran: its writes rolled back; the new holder's counts.
            op.__exit__(type(exc), exc, exc.__traceback__)
            return http.taken_over()
        except ArgumentTooLarge as exc:
            # The engine's own limit (settings.max_response_bytes) is lower than ours.
            op.__exit__(type(exc), exc, exc.__traceback__)
            return http.response_too_large(self.settings)
        except DatabaseUnavailable as exc:
            # Lost before or during the commit: the key is left as it is (a retry replays, or
            # resumes once the lease expires); 503.
            op.__exit__(type(exc), exc, exc.__traceback__)
            raise
        return out


def _settings(**options: Any) -> http.Settings:
    replay_headers = options.pop("replay_headers", DEFAULT_REPLAY_HEADERS)
    return http.Settings(replay_headers=frozenset(replay_headers), **options)


class Idempotency:
    """The Flask view decorator's configuration: ``idem.idempotent`` (the key required) or
    ``idem.idempotent(required=False)``.

    - ``pool``: a ``psycopg_pool.ConnectionPool``; a keyed request holds one of its
      connections only while its SQL runs (no connection free in time: 503).
    - ``scope``: ``callback(flask.request) -> str | None``, the caller's identity (None: 401).
    - ``refuse_foreign_commits``: with :mod:`pg_idempotency.sqlalchemy` imported, a commit on
      another SQLAlchemy connection while the view runs raises (default True).
    - ``wait``, ``lease``, ``replay_headers``, ``header_name``, ``store_server_errors``,
      ``fingerprint_query``, ``retry_after_max``, ``unavailable_retry_after``,
      ``max_request_bytes``, ``max_response_bytes``: :class:`pg_idempotency.contract.Settings`.
    """

    def __init__(self, pool: ConnectionPool, *, scope: Callable[[flask.Request], str | None],
                 refuse_foreign_commits: bool = True, **options: Any) -> None:
        self.scope_of = scope
        self._keyed = _Keyed(pool, _settings(**options), refuse_foreign_commits)

    def idempotent(self, view: Callable[..., Any] | None = None, *, required: bool = True,
                   fingerprint_fields: Iterable[str] | None = None,
                   fingerprint_exclude: Iterable[str] = (),
                   lease: timedelta | float | None = None) -> Any:
        """Make a Flask view idempotent (``@idem.idempotent`` under ``@app.post(...)``).
        ``fingerprint_fields``, ``fingerprint_exclude`` and ``lease``: this route's
        (:class:`pg_idempotency.contract.Route`)."""
        route = http.Route(Policy.REQUIRED if required else Policy.OPTIONAL,
                           fingerprint_fields=fingerprint_fields,
                           fingerprint_exclude=fingerprint_exclude, lease=lease)

        def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(fn)
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                return self._handle(route, lambda: fn(*args, **kwargs))

            return wrapper

        return decorate(view) if view is not None else decorate

    def _handle(self, route: http.Route, view: Callable[[], Any]) -> Any:
        request = flask.request
        settings = self._keyed.settings
        environ = request.environ
        if http.handling_of(environ, ENVIRON_KEY) is not None:
            return view()  # the middleware claimed it already
        key = http.read_key(settings, route.policy, request.headers.get(settings.header_name),
                            request.method, request.path)
        if not isinstance(key, str):
            return view() if key is None else _flask_response(key)
        body = _flask_body(request, settings)

        def handler() -> _Out:
            response = flask.current_app.make_response(view())
            if response.is_streamed:
                raise TypeError("a streamed response cannot be stored: do not make streaming "
                                "views idempotent")
            return _Out(response.status_code, list(response.headers.items()),
                        response.get_data(), response)

        result = self._keyed.run(environ, route, self.scope_of(request), key, request.method,
                                 request.path, body, handler, started=True)
        return _flask_response(result) if isinstance(result, Answer) else result.original


def _flask_body(request: flask.Request, settings: http.Settings) -> bytes | Answer:
    """The request's body (cached for the view, which reads it with ``request.get_data()``),
    or the answer the body rule gives instead (contract.BodyReader), without reading past
    max_request_bytes (its Content-Length, or werkzeug counting a chunked body). Werkzeug
    reads the body the server hands it: under gunicorn a body cut short arrives short, with
    no error (the server says the stream ends there), so its length is checked here; under
    werkzeug's own server it raises; either way the body is incomplete (400)."""
    reader = http.BodyReader(settings, request.environ.get("CONTENT_LENGTH"))
    if reader.answer is not None:
        return reader.answer
    limit = settings.max_request_bytes
    if request.max_content_length is None or request.max_content_length > limit:
        # one byte more than the limit is read at most: werkzeug stops a chunked body there
        # without saying whether more followed, so a body that long is over the limit
        with contextlib.suppress(AttributeError):  # Flask before 3.1: Content-Length only
            request.max_content_length = limit + 1
    try:
        body = request.get_data(cache=True)
    except RequestEntityTooLarge:
        return http.too_large(settings)
    except Exception:  # noqa: BLE001 - the client went away, or the server could not read it
        return reader.finish(ended=False)
    reader.feed(body)
    return reader.finish()


def _flask_response(answer: Answer) -> flask.Response:
    response = flask.Response(answer.body, status=answer.status, headers=list(answer.headers))
    if not any(name.lower() == "content-type" for name, _ in answer.headers):
        del response.headers["Content-Type"]  # a stored answer without one stays without
    return response


class IdempotencyMiddleware:
    """WSGI middleware (``app.wsgi_app = IdempotencyMiddleware(app.wsgi_app, ...)``, or around
    any WSGI app). Options as :class:`Idempotency`, and:

    - ``scope``: ``callback(environ) -> str | None``;
    - ``routes``: ``{"POST /payments": "required", "POST /orders/{id}/refunds": "optional"}``
      (``{name}`` matches one path segment; a value may be a
      :class:`~pg_idempotency.contract.Route` with the route's fingerprint fields and lease);
      unlisted routes are ``default_policy`` (IGNORED: name the keyed routes).

    The view asks for its operation with :func:`get_operation`; a 4xx before it did is not
    stored (the key is released)."""

    def __init__(self, app: WSGIApp, *, pool: ConnectionPool,
                 scope: Callable[[dict[str, Any]], str | None],
                 routes: Mapping[str, http.Route | Policy | str | Mapping[str, Any]]
                 | None = None,
                 default_policy: Policy | str = Policy.IGNORED, **options: Any) -> None:
        self.app = app
        self.scope_of = scope
        self.routes = http.Routes(routes, default_policy)
        guard = options.pop("refuse_foreign_commits", True)
        self._keyed = _Keyed(pool, _settings(**options), guard)

    def __call__(self, environ: dict[str, Any], start_response: StartResponse
                 ) -> Iterable[bytes]:
        method, path = environ["REQUEST_METHOD"], environ.get("PATH_INFO", "")
        settings = self._keyed.settings
        raw = environ.get("HTTP_" + settings.header_name.upper().replace("-", "_"))
        route = self.routes.route(method, path)
        key = http.read_key(settings, route.policy, raw, method, path)
        if not isinstance(key, str):
            if key is None:
                return self.app(environ, start_response)
            return _start(start_response, key)
        # The body rule (contract.read_body): the whole body, or the answer to send instead.
        body = http.read_body(settings, environ.get("CONTENT_LENGTH"), environ["wsgi.input"].read,
                              terminated=bool(environ.get("wsgi.input_terminated")))
        whole = body if isinstance(body, bytes) else b""

        def handler() -> _Out:
            inner = dict(environ)  # with ENVIRON_KEY: the Handling is shared
            inner["wsgi.input"] = io.BytesIO(whole)
            inner["CONTENT_LENGTH"] = str(len(whole))
            inner.pop("HTTP_TRANSFER_ENCODING", None)
            captured: list[Any] = []

            def capture(status: str, headers: list[tuple[str, str]], exc_info: Any = None
                        ) -> Callable[[bytes], None]:
                captured[:] = [status, headers]
                return lambda data: None  # the legacy write(): unused by Flask and most apps

            chunks = self.app(inner, capture)
            kept: list[bytes] = []
            size = 0
            try:
                for chunk in chunks:
                    size += len(chunk)
                    if size > settings.max_response_bytes:
                        kept.clear()  # not stored: stop reading the answer here
                        break
                    kept.append(chunk)
            finally:
                close = getattr(chunks, "close", None)
                if close is not None:
                    close()
            status, headers = captured
            return _Out(int(status.split(" ", 1)[0]), list(headers), b"".join(kept), status,
                        too_large=size > settings.max_response_bytes)

        result = self._keyed.run(environ, route, self.scope_of(environ), key, method, path,
                                 body, handler, started=False)
        if isinstance(result, Answer):
            return _start(start_response, result)
        start_response(result.original, result.headers)
        return [result.body]


def _start(start_response: StartResponse, answer: Answer) -> Iterator[bytes]:
    try:
        phrase = HTTPStatus(answer.status).phrase
    except ValueError:
        phrase = ""
    start_response(f"{answer.status} {phrase}".rstrip(), list(answer.headers))
    return iter([answer.body])
