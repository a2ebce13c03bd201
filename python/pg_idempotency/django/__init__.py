"""Django integration: a view decorator and a middleware (Django 4.2+, the psycopg 3 backend).

    from pg_idempotency.django import idempotent

    @idempotent(scope=lambda request: request.headers.get("X-Account"))
    def create_payment(request):
        account, _ = Account.objects.get_or_create(name=...)
        LedgerEntry.objects.create(account=account, amount=...)
        transaction.on_commit(lambda: send_receipt(...))
        return JsonResponse({...}, status=201)

For a request with an ``Idempotency-Key`` header the key is claimed first, in autocommit on
Django's own connection (so concurrent retries see the claim at once). Then the view runs inside
``transaction.atomic()``, and the response (status, exact body bytes, content type and the
headers named in ``REPLAY_HEADERS``) is stored with ``complete()`` in that same atomic block: the
view's ORM writes and the stored response commit together, and ``on_commit`` callbacks run only
after that commit. Nothing here sends BEGIN or COMMIT itself: ``atomic()`` does.

Answers of its own, the contract every adapter shares (:mod:`pg_idempotency.contract`,
docs/http.md): 400 (no key on a route that requires one, an invalid key, a body cut short), 401
(the scope callback returned None), 409 with ``Retry-After`` (another attempt holds the key),
422 (the key was used with a different request, or it expired), 503 with ``Retry-After`` (the
database cannot be reached, or the connection was lost: nothing stored), and replays (the stored
status, body bytes, content type and headers, plus ``Idempotent-Replayed: true``). See
docs/django.md.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, connections, transaction
from django.db.transaction import TransactionManagementError
from django.http import HttpRequest, HttpResponse
from django.utils.module_loading import import_string

from .. import _log, api
from .. import contract as http
from .._calls import DEFAULT_LEASE
from .._results import ClaimResult, Outcome
from ..contract import DEFAULT_REPLAY_HEADERS, Answer
from ..errors import (
    DEFAULT_UNAVAILABLE_RETRY_AFTER,
    AlreadyCompleted,
    ArgumentTooLarge,
    KeyNotFound,
    LeaseLost,
)
from ..fingerprint import derive_key

__all__ = ["Idempotency", "IdempotencyMiddleware", "get_idempotency", "idempotent"]

log = logging.getLogger("pg_idempotency")

REQUEST_ATTR = "idempotency"
_OWNED_KEY_GONE = (LeaseLost, AlreadyCompleted, KeyNotFound)
_testcase_depth = 0  # > 0 while pg_idempotency.django.testing allows a TestCase's transaction


@dataclass
class _Config:
    scope: Callable[[HttpRequest], str | None]
    using: str
    settings: http.Settings


def _default_scope(request: HttpRequest) -> str | None:
    user = getattr(request, "user", None)
    if user is not None and user.is_authenticated:
        return f"user:{user.pk}"
    return None


def _config(**overrides: Any) -> _Config:
    """Arguments of the decorator/middleware, else ``settings.PG_IDEMPOTENCY``, else defaults.
    Read per request, so ``override_settings`` works."""
    conf: Mapping[str, Any] = getattr(settings, "PG_IDEMPOTENCY", {})

    def get(name: str, default: Any) -> Any:
        value = overrides.get(name.lower())
        return conf.get(name, default) if value is None else value

    scope = get("SCOPE", _default_scope)
    if isinstance(scope, str):
        scope = import_string(scope)
    return _Config(scope=scope, using=get("USING", DEFAULT_DB_ALIAS), settings=http.Settings(
        header_name=get("HEADER", "Idempotency-Key"), wait=float(get("WAIT", 0.0)),
        lease=get("LEASE", DEFAULT_LEASE),
        retry_after_max=float(get("RETRY_AFTER", http.DEFAULT_RETRY_AFTER_MAX)),
        replay_headers=frozenset(get("REPLAY_HEADERS", DEFAULT_REPLAY_HEADERS)),
        store_server_errors=bool(get("STORE_SERVER_ERRORS", False)),
        fingerprint_query=bool(get("INCLUDE_QUERY", False)),
        unavailable_retry_after=float(get("UNAVAILABLE_RETRY_AFTER",
                                          DEFAULT_UNAVAILABLE_RETRY_AFTER)),
        max_request_bytes=int(get("MAX_REQUEST_BYTES", http.DEFAULT_MAX_REQUEST_BYTES)),
        max_response_bytes=int(get("MAX_RESPONSE_BYTES", http.DEFAULT_MAX_RESPONSE_BYTES))))


class Idempotency:
    """What the view sees as ``request.idempotency`` (``get_idempotency(request)``)."""

    def __init__(self, scope: str, key: str, claim: ClaimResult) -> None:
        self.scope = scope
        self.key = key
        self.outcome: Outcome = claim.outcome
        self.lease_token: int | None = claim.lease_token
        #: The recovery point of an earlier attempt (outcome resumed), else None.
        self.recovery_point: str | None = claim.recovery_point
        self.attempts: int | None = claim.attempts
        # A resumed key's earlier attempt may have had effects outside the database.
        self.side_effects = claim.outcome is Outcome.RESUMED

    def derive_key(self, step: str) -> str:
        """The idempotency key for a downstream call made as ``step``. From here on an
        exception leaves the key in progress (the next retry after the lease resumes) instead
        of releasing it."""
        self.side_effects = True
        return derive_key(self.scope, self.key, step)

    def mark_side_effect(self) -> None:
        """Say that a side effect outside the database may have happened."""
        self.side_effects = True


def get_idempotency(request: HttpRequest) -> Idempotency | None:
    """The claimed key of this request (None when it carries no key)."""
    return getattr(request, REQUEST_ATTR, None)


class _Rollback(Exception):
    """Raised inside the atomic block to roll it back (an answer not stored, a streaming one)."""


class _Unavailable(_Rollback):
    """The view answered 5xx on a lost connection: an outage (503), not the view's answer."""


class _TooLarge(_Rollback):
    """The view's answer is over MAX_RESPONSE_BYTES: roll back, release, answer 507."""


def _response(answer: Answer) -> HttpResponse:
    response = HttpResponse(answer.body, status=answer.status)
    del response["Content-Type"]  # the answer says its own (a stored one may have none)
    for name, value in answer.headers:
        response[name] = value
    return response


def _claim(conn: Any, scope: str, key: str, digest: bytes, lease: float | timedelta
           ) -> ClaimResult:
    """One claim, committed on its own (the connection is in autocommit). A seam for tests."""
    return api.claim(conn, scope, key, None, fingerprint=digest, lease=lease)


def _raw_connection(using: str) -> tuple[Any, Any, bool]:
    """Django's connection, its psycopg connection, and whether to use test mode (the claim in
    a savepoint of a TestCase's transaction)."""
    connection = connections[using]
    if connection.vendor != "postgresql":
        raise TransactionManagementError(
            f"pg_idempotency.django needs a PostgreSQL database; {using!r} is "
            f"{connection.vendor}")
    connection.ensure_connection()
    test_mode = False
    if connection.in_atomic_block:
        if _testcase_depth and all(getattr(a, "_from_testcase", False)
                                   for a in connection.atomic_blocks):
            test_mode = True
        else:
            raise TransactionManagementError(
                "pg_idempotency.django: the view runs inside an atomic block, so the claim "
                "could not commit on its own and retries would not see it. Do not wrap "
                "idempotent views in atomic() (the decorator opens its own; with "
                "ATOMIC_REQUESTS it marks the view non_atomic_requests; a Django REST "
                "framework view whose method it decorates needs @method_decorator("
                "transaction.non_atomic_requests, name='dispatch') on its class). In Django's "
                "TestCase use pg_idempotency.django.testing (see docs/django.md).")
    elif not connection.get_autocommit():
        raise TransactionManagementError(
            "pg_idempotency.django needs AUTOCOMMIT = True on the database connection")
    return connection, connection.connection, test_mode


def _handle(request: HttpRequest, view: Callable[[], HttpResponse], conf: _Config,
            route: http.Route) -> HttpResponse:
    try:
        response = _keyed(request, view, conf, route)
    except _Unavailable:
        # A 5xx the view (or an inner middleware) answered on the lost connection.
        _forget_lost_connection(conf.using)
        return _response(http.unavailable(conf.settings))
    except Exception as exc:
        # The database went away (refused, lost, restarting), in the claim, the view's ORM
        # or the commit: 503 with Retry-After, nothing stored, never a 500.
        answer = http.outage(conf.settings, exc)
        if answer is None:
            raise
        _forget_lost_connection(conf.using)
        return _response(answer)
    return response


def _rendered(request: Any, response: HttpResponse) -> HttpResponse:
    """The response with its content: one rendered late (a TemplateResponse, Django REST
    framework's Response) is rendered now, so that its bytes and headers can be stored. A
    DRF Response returned by a view method (inside ``APIView.dispatch``) has not met its
    renderer yet: the view's ``finalize_response`` gives it one first (dispatch calls it again
    on the rendered response, which changes nothing)."""
    render = getattr(response, "render", None)
    if not callable(render) or getattr(response, "is_rendered", True):
        return response
    context = getattr(request, "parser_context", None)
    if not isinstance(context, Mapping):
        context = {}
    finalize = getattr(context.get("view"), "finalize_response", None)
    if callable(finalize) and getattr(response, "accepted_renderer", None) is None:
        response = finalize(request, response, *context.get("args", ()),
                            **context.get("kwargs", {}))
    rendered = response.render()
    return response if rendered is None else rendered


def _forget_lost_connection(using: str) -> None:
    """Close Django's connection once it is lost, so that the next request connects again
    (Django closes an unusable one at the end of a request only when its own wrapper saw the
    error, and never under the test client)."""
    connection = connections[using]
    if connection.in_atomic_block:
        return  # a TestCase's transaction: its own rollback handles it
    with contextlib.suppress(Exception):
        connection.close()


def _keyed(request: HttpRequest, view: Callable[[], HttpResponse], conf: _Config,
           route: http.Route) -> HttpResponse:
    s = conf.settings
    method, path = request.method or "", request.path
    # META holds the header as WSGI gives it (Latin-1 text of the bytes): contract.read_key
    # refuses any character outside printable ASCII, so nothing is stored as mojibake.
    key = http.read_key(s, route.policy, request.headers.get(s.header_name), method, path)
    if not isinstance(key, str):
        return view() if key is None else _response(key)
    # The body rule (contract.BodyReader): a Content-Length that is not a number (400) or over
    # the limit (413) is answered before Django reads the body.
    reader = http.BodyReader(s, request.META.get("CONTENT_LENGTH"))
    if reader.answer is not None:
        return _response(reader.answer)
    if http.chunked_without_length(request.META.get("HTTP_TRANSFER_ENCODING"),
                                   request.META.get("CONTENT_LENGTH")):
        # Django reads a body by its Content-Length only: this one would be fingerprinted
        # (and seen by the view) as empty.
        return _response(http.length_required())
    caller = conf.scope(request)
    if not caller:
        return _response(http.unknown_caller())
    try:
        # Django reads up to the Content-Length: under gunicorn a body cut short arrives
        # short, with no error; a read that fails is UnreadablePostError (an OSError).
        reader.feed(request.body)
        body = reader.finish()
    except OSError:
        body = reader.finish(ended=False)
    if isinstance(body, Answer):
        return _response(body)
    keyed = http.keyed_request(s, route, caller, method, path,
                               request.META.get("QUERY_STRING", ""),
                               request.META.get("CONTENT_TYPE", ""), body)
    if isinstance(keyed, Answer):
        return _response(keyed)
    scope, digest = keyed.scope, keyed.fingerprint
    connection, conn, test_mode = _raw_connection(conf.using)

    def claim() -> ClaimResult:
        if test_mode:
            with transaction.atomic(using=conf.using):
                result = _claim(conn, scope, key, digest, keyed.lease)
        else:
            result = _claim(conn, scope, key, digest, keyed.lease)
        return result  # logged by the core's claim, as every event of the API

    claimed = http.claim_waiting(s, claim)
    if isinstance(claimed, Answer):
        return _response(claimed)
    return _execute(request, view, conf, connection, conn, scope, key, claimed)


def _execute(request: HttpRequest, view: Callable[[], HttpResponse], conf: _Config,
             connection: Any, conn: Any, scope: str, key: str, claim: ClaimResult
             ) -> HttpResponse:
    state = Idempotency(scope, key, claim)
    setattr(request, REQUEST_ATTR, state)
    token = claim.lease_token
    assert token is not None
    completed = False  # complete() ran: from here on never release (the commit may be done)
    failed_response: HttpResponse | None = None
    try:
        with transaction.atomic(using=conf.using):
            response = _rendered(request, view())
            if getattr(response, "streaming", False):
                raise _Rollback("a streaming response cannot be stored: do not make "
                                "streaming views idempotent")
            if response.status_code >= 500 and http.lost(conn):
                # The view's statement lost the connection and something between it and us
                # (Django's handler, an inner middleware) made that a 500: an outage.
                raise _Unavailable(response.status_code)
            if not http.stores(conf.settings, response.status_code) or \
                    transaction.get_rollback(using=conf.using):
                # Or the view marked the transaction for rollback (set_rollback(True)): the
                # stored response would roll back with it and leave the key in progress.
                failed_response = response
                raise _Rollback(response.status_code)
            if len(response.content) > conf.settings.max_response_bytes:
                raise _TooLarge(len(response.content))
            stored, content_type = http.stored_parts(conf.settings, response.headers.items())
            try:
                api.complete(conn, scope, key, token, response.status_code,
                             bytes(response.content), headers=stored, content_type=content_type)
            except ArgumentTooLarge as exc:  # the engine's own limit is lower than ours
                raise _TooLarge(str(exc)) from exc
            completed = True
    except _OWNED_KEY_GONE:
        # Taken over while we ran: the atomic block (our writes) rolled back; the new
        # holder's answer is the one that counts. (The core logged lease_lost.)
        return _response(http.taken_over())
    except BaseException as exc:
        if not completed:
            _release_after_failure(connection, conn, conf, state, token)
        if isinstance(exc, _Unavailable):
            raise
        if isinstance(exc, _TooLarge):
            return _response(http.response_too_large(conf.settings))
        if isinstance(exc, _Rollback) and failed_response is not None:
            return failed_response
        raise
    return response


def _release_after_failure(connection: Any, conn: Any, conf: _Config, state: Idempotency,
                           token: int) -> None:
    """The view failed before complete(): its writes are rolled back. Release the key for a
    fresh retry unless a side effect may have happened (then it stays in progress and the next
    retry after the lease resumes)."""
    if state.side_effects:
        if log.isEnabledFor(logging.INFO):
            _log.log(logging.INFO, "kept", state.scope, state.key, reason="exception")
        return
    try:
        if connection.in_atomic_block:  # test mode: a savepoint of the TestCase's transaction
            with transaction.atomic(using=conf.using):
                api.release(conn, state.scope, state.key, token)
        else:
            if http.lost(conn):
                # The view lost the connection (a backend killed, a failover): release on a
                # new one, so that a retry runs at once instead of after the lease.
                connection.close()
                connection.ensure_connection()
                conn = connection.connection
            api.release(conn, state.scope, state.key, token)  # the core logs the release
    except Exception:  # noqa: BLE001 - the view's error is the one to report
        # An unreleased key only costs the client a wait for the lease to expire.
        if log.isEnabledFor(logging.WARNING):
            _log.log(logging.WARNING, "release_failed", state.scope, state.key, exc_info=True)


def idempotent(view: Callable[..., HttpResponse] | None = None, *,
               scope: Callable[[HttpRequest], str | None] | str | None = None,
               required: bool = True, lease: float | timedelta | None = None,
               wait: float | None = None, retry_after: int | None = None,
               replay_headers: Iterable[str] | None = None,
               store_server_errors: bool | None = None, include_query: bool | None = None,
               using: str | None = None, fingerprint_fields: Iterable[str] | None = None,
               fingerprint_exclude: Iterable[str] = ()) -> Any:
    """Make a view idempotent (``@idempotent`` or ``@idempotent(scope=..., ...)``). Each
    argument left None comes from ``settings.PG_IDEMPOTENCY`` (docs/django.md). The view is
    marked ``non_atomic_requests`` for its database: with ``ATOMIC_REQUESTS`` the decorator
    still runs it in an atomic block, opened after the claim. ``fingerprint_fields`` and
    ``fingerprint_exclude``: the body fields this route's fingerprint covers, or leaves out
    (:class:`pg_idempotency.contract.Route`)."""
    overrides = {"scope": scope, "lease": lease, "wait": wait, "retry_after": retry_after,
                 "replay_headers": replay_headers, "store_server_errors": store_server_errors,
                 "include_query": include_query, "using": using}
    route = http.Route(http.Policy.REQUIRED if required else http.Policy.OPTIONAL,
                       fingerprint_fields=fingerprint_fields,
                       fingerprint_exclude=fingerprint_exclude)

    def decorate(fn: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
        @functools.wraps(fn)
        def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            if get_idempotency(request) is not None:  # the middleware claimed it already
                return fn(request, *args, **kwargs)
            return _handle(request, lambda: fn(request, *args, **kwargs), _config(**overrides),
                           route)

        alias = using or getattr(settings, "PG_IDEMPOTENCY", {}).get("USING", DEFAULT_DB_ALIAS)
        view_fn: Callable[..., Any] = transaction.non_atomic_requests(using=alias)(wrapper)
        return view_fn

    return decorate(view) if view is not None else decorate


class IdempotencyMiddleware:
    """``"pg_idempotency.django.IdempotencyMiddleware"`` in ``MIDDLEWARE``, routes in
    ``PG_IDEMPOTENCY["ROUTES"]``: ``{"POST /payments/": "required", "POST /orders/{id}/":
    "optional", "POST /transfers/": {"policy": "required", "fingerprint_exclude":
    ["sent_at"], "lease": 120}}`` (a policy, a :class:`pg_idempotency.contract.Route` or a
    mapping of its arguments). Unlisted routes get ``DEFAULT_POLICY`` ("ignored"). The claim is made
    before the rest of the chain runs, and the rest of the chain (inner middleware and the view,
    wrapped by ATOMIC_REQUESTS or not) runs in the atomic block that stores the response."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response
        conf: Mapping[str, Any] = getattr(settings, "PG_IDEMPOTENCY", {})
        self.routes = http.Routes(conf.get("ROUTES", {}), conf.get("DEFAULT_POLICY", "ignored"))

    def policy(self, method: str, path: str) -> str:
        return self.routes.policy(method, path).value

    def __call__(self, request: HttpRequest) -> HttpResponse:
        route = self.routes.route(request.method or "", request.path)
        if route.policy is http.Policy.IGNORED:
            return self.get_response(request)
        return _handle(request, lambda: self.get_response(request), _config(), route)
