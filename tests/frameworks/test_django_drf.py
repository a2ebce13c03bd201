"""pg_idempotency.django with Django REST framework, on real PostgreSQL: ``@idempotent`` on an
APIView method, a ViewSet action, an ``@api_view`` function view and around ``as_view()``, and
the middleware in front of a DRF view. DRF's Response is rendered late (after the view
returns): the adapter renders it before storing its bytes and headers. Then a lost connection
during a view's statement (its backend terminated): 503 with Retry-After, never a 500."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from django.db import connection, connections, transaction
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.test import Client, override_settings
from django.urls import path
from django.utils.decorators import method_decorator
from helpers.django_example import MERCHANT, _migrated
from ledger.models import Account, Payment
from rest_framework import viewsets
from rest_framework.decorators import api_view
from rest_framework.renderers import JSONRenderer
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from pg_idempotency.django import idempotent

SETTINGS = {"SCOPE": "ledger.views.merchant_of", "LEASE": 30, "WAIT": 0,
            "ROUTES": {"POST /mw/": "required", "POST /mw-sleep/": "required",
                       "POST /django-mw/": "required"}}
DRF = {"DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
       "DEFAULT_AUTHENTICATION_CLASSES": [], "UNAUTHENTICATED_USER": None}


def _pay(request: Request) -> Response:
    """The view's work: a payment row, or a statement the test kills, or an error after a
    write."""
    data = request.data
    if data.get("sleep"):
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_sleep(5)")
    account, _ = Account.objects.get_or_create(name=data["account"])
    payment = Payment.objects.create(account=account, amount=data["amount"])
    if data.get("fail"):
        raise RuntimeError("the handler failed after its write")
    return Response({"id": payment.pk, "amount": str(payment.amount)}, status=201,
                    headers={"Location": f"/payments/{payment.pk}"})


# With ATOMIC_REQUESTS Django wraps the URL's view (as_view()) in atomic() unless that view is
# marked: a decorated method cannot mark it, the class (or the function view) says it.
@method_decorator(transaction.non_atomic_requests, name="dispatch")
class PayView(APIView):
    renderer_classes = [JSONRenderer]

    @method_decorator(idempotent)
    def post(self, request: Request) -> Response:
        return _pay(request)


class PlainView(APIView):  # wrapped around as_view() below, and behind the middleware
    renderer_classes = [JSONRenderer]

    def post(self, request: Request) -> Response:
        return _pay(request)


@method_decorator(transaction.non_atomic_requests, name="dispatch")
class PaymentViewSet(viewsets.ViewSet):
    renderer_classes = [JSONRenderer]

    @method_decorator(idempotent)
    def create(self, request: Request) -> Response:
        return _pay(request)


@transaction.non_atomic_requests
@api_view(["POST"])
@idempotent
def pay_function(request: Request) -> Response:
    return _pay(request)


def plain_django(request: HttpRequest) -> HttpResponse:
    """A plain Django view (no DRF) that runs a statement the test kills."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_sleep(5)" if json.loads(request.body).get("sleep")
                       else "SELECT 1")
    account, _ = Account.objects.get_or_create(name="alice")
    payment = Payment.objects.create(account=account, amount="12.50")
    return JsonResponse({"id": payment.pk}, status=201)


@idempotent(scope=lambda request: "s")
def marks_rollback(request: HttpRequest) -> HttpResponse:
    """Writes, then marks its transaction for rollback (as DRF does for a handled exception
    under ATOMIC_REQUESTS) and still answers 201."""
    Payment.objects.create(account=Account.objects.create(name="bob"), amount="1")
    transaction.set_rollback(True)
    return JsonResponse({"rolled": "back"}, status=201)


urlpatterns = [
    path("rollback/", marks_rollback),
    path("django/", idempotent(plain_django)),
    path("django-mw/", plain_django),
    path("apiview/", PayView.as_view()),
    path("viewset/", PaymentViewSet.as_view({"post": "create"})),
    path("function/", pay_function),
    path("wrapped/", idempotent(PlainView.as_view())),
    path("mw/", PlainView.as_view()),
    path("mw-sleep/", PlainView.as_view()),
]
ROUTES = ["apiview/", "viewset/", "function/", "wrapped/", "mw/"]
BODY = {"account": "alice", "amount": "12.50"}


@pytest.fixture(params=[False, True], ids=["autocommit", "atomic_requests"])
def drf_db(request: pytest.FixtureRequest, empty_db: str) -> Iterator[str]:
    middleware = ["pg_idempotency.django.IdempotencyMiddleware"]
    with override_settings(ROOT_URLCONF=__name__, MIDDLEWARE=middleware,
                           PG_IDEMPOTENCY=SETTINGS, REST_FRAMEWORK=DRF, DEBUG=False):
        yield from _migrated(empty_db, request.param)


def post(route: str, key: str, body: Any = BODY) -> Any:
    client = Client(raise_request_exception=False)
    return client.post(f"/{route}", json.dumps(body), content_type="application/json",
                       HTTP_IDEMPOTENCY_KEY=key, **MERCHANT)


def rows(dsn: str, sql: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(sql).fetchall()


def sent_headers(response: Any) -> dict[str, str]:
    """The headers a client compares (Content-Length: the test client sends none of its own
    for the first answer; a replay states it)."""
    return {k.lower(): v for k, v in response.headers.items()
            if k.lower() not in ("idempotent-replayed", "content-length")}


@pytest.mark.parametrize("route", ROUTES)
def test_drf_view_is_stored_and_replayed_with_its_headers(route: str, drf_db: str) -> None:
    first = post(route, "k1")
    assert first.status_code == 201, first.content
    assert "Idempotent-Replayed" not in first.headers
    assert "POST" in first.headers["Allow"]
    assert rows(drf_db, "SELECT count(*) FROM ledger_payment") == [(1,)]
    again = post(route, "k1")
    assert again.status_code == 201
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.content == first.content
    assert sent_headers(again) == sent_headers(first)
    assert rows(drf_db, "SELECT count(*) FROM ledger_payment") == [(1,)]
    (stored,) = rows(drf_db, "SELECT response_body_bytes FROM idempotency.keys")
    assert bytes(stored[0]) == first.content

    reused = post(route, "k1", {"account": "alice", "amount": "99"})
    assert reused.status_code == 422
    assert reused.headers["Content-Type"] == "application/problem+json"
    assert rows(drf_db, "SELECT count(*) FROM ledger_payment") == [(1,)]


@pytest.mark.parametrize("route", ROUTES)
def test_drf_handler_error_writes_nothing_and_releases(route: str, drf_db: str) -> None:
    failed = post(route, "k2", dict(BODY, fail=True))
    assert failed.status_code == 500
    assert rows(drf_db, "SELECT count(*) FROM ledger_payment") == [(0,)]
    assert rows(drf_db, "SELECT state FROM idempotency.keys") == [("released",)]
    retried = post(route, "k2")  # released: the retry runs afresh
    assert retried.status_code == 201 and "Idempotent-Replayed" not in retried.headers
    assert rows(drf_db, "SELECT count(*) FROM ledger_payment") == [(1,)]


def _kill_sleeping(dsn: str) -> int:
    """Terminate the backend running the view's pg_sleep, from another session."""
    deadline = time.monotonic() + 10
    with psycopg.connect(dsn, autocommit=True) as conn:
        while time.monotonic() < deadline:
            (killed,) = conn.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE query = 'SELECT pg_sleep(5)' AND state = 'active' "
                "AND pid <> pg_backend_pid()").fetchone()
            if killed:
                return int(killed)
            time.sleep(0.02)
    return 0


@pytest.mark.parametrize("route", ["apiview/", "viewset/", "function/", "wrapped/", "mw-sleep/",
                                   "django/", "django-mw/"])
def test_lost_connection_in_view_is_503_and_releases(route: str, drf_db: str) -> None:
    answer: dict[str, Any] = {}

    def request() -> None:
        try:
            answer["response"] = post(route, "k3", dict(BODY, sleep=True))
        finally:
            connections.close_all()

    thread = threading.Thread(target=request)
    thread.start()
    started = time.monotonic()
    assert _kill_sleeping(drf_db) == 1
    thread.join(30)
    lost = answer["response"]
    assert time.monotonic() - started < 5  # the kill ended it, not pg_sleep
    assert lost.status_code == 503, lost.content
    assert lost.headers["Content-Type"] == "application/problem+json"
    assert int(lost.headers["Retry-After"]) >= 1
    assert rows(drf_db, "SELECT count(*) FROM ledger_payment") == [(0,)]
    assert rows(drf_db, "SELECT state FROM idempotency.keys") == [("released",)]
    retried = post(route, "k3")
    assert retried.status_code == 201 and "Idempotent-Replayed" not in retried.headers
    assert post(route, "k3").headers["Idempotent-Replayed"] == "true"
    assert rows(drf_db, "SELECT count(*) FROM ledger_payment") == [(1,)]
    connections.close_all()


def test_an_answer_whose_transaction_is_marked_for_rollback_is_not_stored(drf_db: str) -> None:
    """Stored, complete() would be rolled back with the view's writes and the key left in
    progress: it is passed on unstored instead, the key released."""
    for _ in range(2):
        answer = post("rollback/", "k4")
        assert answer.status_code == 201 and "Idempotent-Replayed" not in answer.headers
        assert rows(drf_db, "SELECT count(*) FROM ledger_payment") == [(0,)]
        assert rows(drf_db, "SELECT state FROM idempotency.keys") == [("released",)]
