"""The five HTTP adapters serving one small payments app under tight size limits, and the
client-side checks their tests share (tests/frameworks/test_http_bounds.py,
test_http_growth.py)."""

from __future__ import annotations

import json
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import flask
import httpx
import psycopg
from django.db import connections
from django.http import HttpRequest, HttpResponse
from django.urls import path as django_path
from psycopg_pool import AsyncConnectionPool, ConnectionPool
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route as StarletteRoute

import pg_idempotency.django as pg_django
from helpers.django_example import django_on
from helpers.http import uvicorn_server, with_pool_lifespan, wsgi_server
from pg_idempotency import asgi as pg_asgi
from pg_idempotency import flask as pg_flask
from pg_idempotency.contract import Route
from pgharness import WAIT_BOUND

ADAPTERS = ["asgi", "django", "django-mw", "flask", "wsgi"]
MAX_REQUEST = 4000
MAX_RESPONSE = 3000
LEDGER = "CREATE TABLE IF NOT EXISTS ledger (intent text NOT NULL)"
#: /pay: a client timestamp and a trace id do not count; /only: only the amount counts.
ROUTES = {"POST /pay": Route("required", fingerprint_exclude=["sent_at", "trace.id"], lease=7),
          "POST /only": Route("required", fingerprint_fields=["amount"])}
LIMITS = {"max_request_bytes": MAX_REQUEST, "max_response_bytes": MAX_RESPONSE}


def answer_of(body: bytes) -> tuple[str, bytes]:
    """What every handler does: the intent's ledger row, and an answer of ``size`` bytes."""
    data = json.loads(body)
    size = int(data.get("size", 0))
    content = json.dumps({"intent": data["intent"], "pad": "x" * size}).encode()
    return data["intent"], content


def _asgi_app(dsn: str) -> Any:
    pool = AsyncConnectionPool(dsn, min_size=1, max_size=6, open=False)

    async def pay(request: Request) -> Response:
        intent, content = answer_of(await request.body())
        op = pg_asgi.get_operation(request)
        assert op is not None
        await op.conn.execute("INSERT INTO ledger VALUES (%s)", (intent,))
        return Response(content, status_code=201, media_type="application/json")

    inner = Starlette(routes=[StarletteRoute(p, pay, methods=["POST"]) for p in ("/pay", "/only")])
    keyed = pg_asgi.IdempotencyMiddleware(
        inner, pool=pool, scope=lambda r: r.headers.get("x-account"), routes=ROUTES, **LIMITS)
    return with_pool_lifespan(pool, keyed)


def _django_view(request: HttpRequest) -> HttpResponse:
    intent, content = answer_of(request.body)
    with connections["default"].cursor() as cursor:
        cursor.execute("INSERT INTO ledger VALUES (%s)", [intent])
    return HttpResponse(content, status=201, content_type="application/json")


def _account(request: HttpRequest) -> str | None:
    return request.headers.get("X-Account")


urlpatterns = [  # the decorator, one per route
    django_path("pay", pg_django.idempotent(scope=_account, lease=7,
                                            fingerprint_exclude=["sent_at", "trace.id"])(
        _django_view)),
    django_path("only", pg_django.idempotent(scope=_account, fingerprint_fields=["amount"])(
        _django_view)),
]
mw_urlpatterns = [django_path("pay", _django_view), django_path("only", _django_view)]


def _flask_app(pool: ConnectionPool, middleware: bool) -> flask.Flask:
    app = flask.Flask(__name__)

    def pay() -> Any:
        intent, content = answer_of(flask.request.get_data())
        op = pg_flask.get_operation()
        assert op is not None
        op.conn.execute("INSERT INTO ledger VALUES (%s)", (intent,))
        return flask.Response(content, status=201, content_type="application/json")

    if middleware:
        app.add_url_rule("/pay", "pay", pay, methods=["POST"])
        app.add_url_rule("/only", "only", pay, methods=["POST"])
        app.wsgi_app = pg_flask.IdempotencyMiddleware(  # type: ignore[method-assign]
            app.wsgi_app, pool=pool, scope=lambda environ: environ.get("HTTP_X_ACCOUNT"),
            routes=ROUTES, **LIMITS)
        return app
    idem = pg_flask.Idempotency(pool, scope=lambda r: r.headers.get("X-Account"), **LIMITS)
    app.add_url_rule("/pay", "pay", idem.idempotent(
        pay, fingerprint_exclude=["sent_at", "trace.id"], lease=7), methods=["POST"])
    app.add_url_rule("/only", "only", idem.idempotent(pay, fingerprint_fields=["amount"]),
                     methods=["POST"])
    return app


_MIDDLEWARE_URLS = types.ModuleType(f"{__name__}_mw")
_MIDDLEWARE_URLS.urlpatterns = mw_urlpatterns  # type: ignore[attr-defined]
sys.modules[_MIDDLEWARE_URLS.__name__] = _MIDDLEWARE_URLS


@contextmanager
def serve(adapter: str, dsn: str) -> Iterator[str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(LEDGER)
    if adapter == "asgi":
        with uvicorn_server(_asgi_app(dsn)) as base:
            yield base
    elif adapter.startswith("django"):
        from django.test import override_settings
        middleware = adapter == "django-mw"
        conf = {"MAX_REQUEST_BYTES": MAX_REQUEST, "MAX_RESPONSE_BYTES": MAX_RESPONSE,
                "SCOPE": _account,
                "ROUTES": {"POST /pay": {"policy": "required", "lease": 7,
                                         "fingerprint_exclude": ["sent_at", "trace.id"]},
                           "POST /only": {"fingerprint_fields": ["amount"]}}}
        urlconf = _MIDDLEWARE_URLS.__name__ if middleware else __name__
        with override_settings(PG_IDEMPOTENCY=conf), django_on(dsn, urlconf) as app:
            if middleware:
                with override_settings(MIDDLEWARE=["pg_idempotency.django.IdempotencyMiddleware"]):
                    app.load_middleware()
            with wsgi_server(app, django=True) as base:
                yield base
    else:
        with ConnectionPool(dsn, min_size=1, max_size=6, open=True) as pool:
            with wsgi_server(_flask_app(pool, adapter == "wsgi").wsgi_app) as base:
                yield base


def post(base: str, path: str, key: bytes | str | None, body: Any, account: str = "acct",
         raw: Any = None) -> httpx.Response:
    headers: dict[str, Any] = {"Content-Type": "application/json", "X-Account": account}
    if key is not None:
        headers["Idempotency-Key"] = key
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(base + path, headers=headers, content=content, timeout=WAIT_BOUND)


def problem(r: httpx.Response, status: int, *words: str) -> str:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/problem+json"
    detail: str = r.json()["detail"]
    for word in words:
        assert word in detail, detail
    return detail


def keys_of(dsn: str) -> list[tuple[str, str, str]]:
    with psycopg.connect(dsn) as conn:
        return [tuple(r) for r in conn.execute(  # type: ignore[misc]
            "SELECT scope, key, state::text FROM idempotency.keys ORDER BY key").fetchall()]


def ledger(dsn: str, intent: str) -> int:
    with psycopg.connect(dsn) as conn:
        return conn.execute("SELECT count(*) FROM ledger WHERE intent = %s",  # type: ignore[index]
                            (intent,)).fetchone()[0]
