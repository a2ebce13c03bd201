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

Answers of its own, the contract of :mod:`pg_idempotency.asgi`: 400 (no key on a route that
requires one, or an invalid key), 401 (the scope callback returned None), 409 with
``Retry-After`` (another attempt holds the key), 422 (the key was used with a different
request, or it expired), and replays (the stored status, body bytes, content type and headers,
plus ``Idempotent-Replayed: true``). See docs/django.md.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, connections, transaction
from django.db.transaction import TransactionManagementError
from django.http import HttpRequest, HttpResponse
from django.utils.module_loading import import_string

from .. import api
from ..core import DEFAULT_LEASE, ClaimResult, Outcome, StoredResponse, _log
from ..errors import AlreadyCompleted, InvalidArgument, KeyNotFound, LeaseLost
from ..fingerprint import _check_name, derive_key, describe_request, fingerprint

__all__ = ["Idempotency", "IdempotencyMiddleware", "get_idempotency", "idempotent"]

log = logging.getLogger("pg_idempotency")

#: Headers stored and replayed by default (those that describe the result; the same list as
#: the ASGI middleware). Per-request headers (dates, cookies, trace ids) are not.
DEFAULT_REPLAY_HEADERS = ("location", "content-location", "etag", "last-modified")
REQUEST_ATTR = "idempotency"
_OWNED_KEY_GONE = (LeaseLost, AlreadyCompleted, KeyNotFound)
_testcase_depth = 0  # > 0 while pg_idempotency.django.testing allows a TestCase's transaction


@dataclass
class _Config:
    scope: Callable[[HttpRequest], str | None]
    lease: float
    wait: float
    retry_after: int
    replay_headers: frozenset[str]
    store_server_errors: bool
    include_query: bool
    using: str
    header_name: str


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
    lease = get("LEASE", DEFAULT_LEASE)
    if isinstance(lease, timedelta):
        lease = lease.total_seconds()
    return _Config(
        scope=scope, lease=float(lease), wait=float(get("WAIT", 0.0)),
        retry_after=int(get("RETRY_AFTER", 1)),
        replay_headers=frozenset(h.lower() for h in get("REPLAY_HEADERS",
                                                        DEFAULT_REPLAY_HEADERS)),
        store_server_errors=bool(get("STORE_SERVER_ERRORS", False)),
        include_query=bool(get("INCLUDE_QUERY", True)),
        using=get("USING", DEFAULT_DB_ALIAS),
        header_name=get("HEADER", "Idempotency-Key"),
    )


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
    """Raised inside the atomic block to roll it back (a 5xx answer, a streaming one)."""


def _problem(status: int, title: str, detail: str,
             headers: Mapping[str, str] | None = None) -> HttpResponse:
    """An RFC 9457 problem details answer (the ASGI middleware's)."""
    content = json.dumps({"type": "about:blank", "title": title, "status": status,
                          "detail": detail}).encode()
    response = HttpResponse(content, status=status, content_type="application/problem+json")
    for name, value in (headers or {}).items():
        response[name] = value
    return response


def _stored_response(stored: StoredResponse, replayed: bool) -> HttpResponse:
    content = stored.content
    response = HttpResponse(content, status=stored.status,
                            content_type=stored.content_type or "application/octet-stream")
    if stored.content_type is None:
        del response["Content-Type"]
    for name, value in stored.headers.items():
        response[name] = value
    response["Content-Length"] = str(len(content))
    if replayed:
        response["Idempotent-Replayed"] = "true"
    return response


def _describe(request: HttpRequest, body: bytes, include_query: bool) -> dict[str, Any]:
    """What the fingerprint covers: the ASGI middleware's description
    (:func:`~pg_idempotency.fingerprint.describe_request`)."""
    return describe_request(
        request.method, request.path,  # type: ignore[arg-type]  # always set by the handler
        request.META.get("QUERY_STRING", "") if include_query else None,
        request.META.get("CONTENT_TYPE", ""), body)


def _claim(conn: Any, scope: str, key: str, digest: bytes, lease: float) -> ClaimResult:
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
                "ATOMIC_REQUESTS it marks the view non_atomic_requests). In Django's "
                "TestCase use pg_idempotency.django.testing (see docs/django.md).")
    elif not connection.get_autocommit():
        raise TransactionManagementError(
            "pg_idempotency.django needs AUTOCOMMIT = True on the database connection")
    return connection, connection.connection, test_mode


def _handle(request: HttpRequest, view: Callable[[], HttpResponse], conf: _Config,
            required: bool) -> HttpResponse:
    raw_key = request.headers.get(conf.header_name)
    if raw_key is None:
        if required:
            return _problem(400, f"{conf.header_name} header required",
                            f"{request.method} {request.path} requires an "
                            f"{conf.header_name} header.")
        return view()
    key = raw_key.strip()
    if len(key) >= 2 and key[0] == key[-1] == '"':  # the draft's sf-string form
        key = key[1:-1]
    try:
        _check_name(conf.header_name, "key", key)
    except InvalidArgument as exc:
        return _problem(400, f"Invalid {conf.header_name}", str(exc))
    scope = conf.scope(request)
    if not scope:
        return _problem(401, "Unknown caller",
                        "Idempotency keys belong to an identified caller.")
    digest = fingerprint(_describe(request, request.body, conf.include_query))
    connection, conn, test_mode = _raw_connection(conf.using)
    deadline = time.monotonic() + conf.wait
    pause = 0.02
    while True:
        if test_mode:
            with transaction.atomic(using=conf.using):
                claim = _claim(conn, scope, key, digest, conf.lease)
        else:
            claim = _claim(conn, scope, key, digest, conf.lease)
        outcome = claim.outcome  # logged by the core's claim, as every event of the API
        if outcome is Outcome.MISMATCH:
            return _problem(422, f"{conf.header_name} reused",
                            f"This {conf.header_name} was used with a different request. "
                            "Use a new key for a new request.")
        if outcome is Outcome.EXPIRED:
            return _problem(422, f"{conf.header_name} expired",
                            f"This {conf.header_name} was used and has expired. Use a new "
                            "key for a new request.")
        if outcome in (Outcome.REPLAY, Outcome.ACCEPTED):
            assert claim.response is not None
            return _stored_response(claim.response, replayed=True)
        if outcome.owned:
            break
        left = deadline - time.monotonic()
        if left <= 0:
            remaining = claim.retry_after.total_seconds() if claim.retry_after else 1
            seconds = max(1, min(conf.retry_after, math.ceil(remaining)))
            return _problem(409, "Request in progress",
                            "A request with this key is being processed. Retry later.",
                            {"Retry-After": str(seconds)})
        time.sleep(min(pause, left))
        pause = min(pause * 2, 0.25)
    return _execute(request, view, conf, connection, conn, scope, key, claim)


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
            response = view()
            if getattr(response, "streaming", False):
                raise _Rollback("a streaming response cannot be stored: do not make "
                                "streaming views idempotent")
            if response.status_code >= 500 and not conf.store_server_errors:
                failed_response = response
                raise _Rollback(response.status_code)
            stored = {name: value for name, value in response.headers.items()
                      if name.lower() in conf.replay_headers}
            content_type = response.headers.get("Content-Type", "application/octet-stream")
            api.complete(conn, scope, key, token, response.status_code,
                         bytes(response.content), headers=stored, content_type=content_type)
            completed = True
    except _OWNED_KEY_GONE:
        # Taken over while we ran: the atomic block (our writes) rolled back; the new
        # holder's answer is the one that counts. (The core logged lease_lost.)
        return _problem(409, "Request in progress",
                        "The lease on this key expired and another attempt took it over.",
                        {"Retry-After": "1"})
    except BaseException as exc:
        if not completed:
            _release_after_failure(connection, conn, conf, state, token)
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
            _log(logging.INFO, "kept", state.scope, state.key, reason="exception")
        return
    try:
        if connection.in_atomic_block:  # test mode: a savepoint of the TestCase's transaction
            with transaction.atomic(using=conf.using):
                api.release(conn, state.scope, state.key, token)
        else:
            api.release(conn, state.scope, state.key, token)  # the core logs the release
    except Exception:  # noqa: BLE001 - the view's error is the one to report
        # An unreleased key only costs the client a wait for the lease to expire.
        if log.isEnabledFor(logging.WARNING):
            _log(logging.WARNING, "release_failed", state.scope, state.key, exc_info=True)


def idempotent(view: Callable[..., HttpResponse] | None = None, *,
               scope: Callable[[HttpRequest], str | None] | str | None = None,
               required: bool = True, lease: float | timedelta | None = None,
               wait: float | None = None, retry_after: int | None = None,
               replay_headers: Iterable[str] | None = None,
               store_server_errors: bool | None = None, include_query: bool | None = None,
               using: str | None = None) -> Any:
    """Make a view idempotent (``@idempotent`` or ``@idempotent(scope=..., ...)``). Each
    argument left None comes from ``settings.PG_IDEMPOTENCY`` (docs/django.md). The view is
    marked ``non_atomic_requests`` for its database: with ``ATOMIC_REQUESTS`` the decorator
    still runs it in an atomic block, opened after the claim."""
    overrides = {"scope": scope, "lease": lease, "wait": wait, "retry_after": retry_after,
                 "replay_headers": replay_headers, "store_server_errors": store_server_errors,
                 "include_query": include_query, "using": using}

    def decorate(fn: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
        @functools.wraps(fn)
        def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            if get_idempotency(request) is not None:  # the middleware claimed it already
                return fn(request, *args, **kwargs)
            return _handle(request, lambda: fn(request, *args, **kwargs), _config(**overrides),
                           required)

        alias = using or getattr(settings, "PG_IDEMPOTENCY", {}).get("USING", DEFAULT_DB_ALIAS)
        return transaction.non_atomic_requests(using=alias)(wrapper)

    return decorate(view) if view is not None else decorate


def _route_regex(pattern: str) -> re.Pattern[str]:
    method, _, path = pattern.strip().partition(" ")
    parts = re.split(r"(\{[^/{}]+\})", path.strip())
    body = "".join("[^/]+" if p.startswith("{") else re.escape(p) for p in parts)
    return re.compile(f"{re.escape(method.upper())} {body}")


class IdempotencyMiddleware:
    """``"pg_idempotency.django.IdempotencyMiddleware"`` in ``MIDDLEWARE``, routes in
    ``PG_IDEMPOTENCY["ROUTES"]``: ``{"POST /payments/": "required", "POST /orders/{id}/":
    "optional"}``. Unlisted routes get ``DEFAULT_POLICY`` ("ignored"). The claim is made
    before the rest of the chain runs, and the rest of the chain (inner middleware and the view,
    wrapped by ATOMIC_REQUESTS or not) runs in the atomic block that stores the response."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response
        conf: Mapping[str, Any] = getattr(settings, "PG_IDEMPOTENCY", {})
        self.default_policy = conf.get("DEFAULT_POLICY", "ignored")
        self.routes = [(_route_regex(p), policy) for p, policy in conf.get("ROUTES", {}).items()]
        for _, policy in [*self.routes, (None, self.default_policy)]:
            if policy not in ("required", "optional", "ignored"):
                raise ValueError(f"PG_IDEMPOTENCY: policy {policy!r} is not one of "
                                 "'required', 'optional', 'ignored'")

    def policy(self, method: str, path: str) -> str:
        for regex, policy in self.routes:
            if regex.fullmatch(f"{method} {path}"):
                return str(policy)
        return str(self.default_policy)

    def __call__(self, request: HttpRequest) -> HttpResponse:
        policy = self.policy(request.method or "", request.path)
        if policy == "ignored":
            return self.get_response(request)
        return _handle(request, lambda: self.get_response(request), _config(),
                       required=policy == "required")
