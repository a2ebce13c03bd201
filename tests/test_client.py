"""The retrying client: against the example app behind a transport that loses the first
responses after the server committed (ASGI in process, and a real uvicorn server), and its
retry rules against scripted answers (httpx.MockTransport, no database)."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from payments_helpers import ledger_rows, lifespan, payments, uvicorn_server
from pg_idempotency.client import AsyncRetryingClient, RetryingClient, retry_after_seconds

pytestmark = pytest.mark.anyio

ACCT = {"X-Account": "acct_42"}
FAST = {"initial": 0.01, "max_delay": 0.2}


class _Dropping:
    """Passes each request to the server, reads the whole response, then, for the first
    ``drop`` requests, throws it away and raises a transport error: the server committed,
    the client never heard."""

    def __init__(self, inner: Any, drop: int) -> None:
        self.inner = inner
        self.drop = drop
        self.seen: list[httpx.Request] = []
        self.lost: list[bytes] = []

    def _after(self, request: httpx.Request, response: httpx.Response) -> httpx.Response:
        self.seen.append(request)
        if len(self.seen) <= self.drop:
            self.lost.append(response.content)
            raise httpx.ReadError("connection reset by peer", request=request)
        return response


class DroppingTransport(_Dropping, httpx.BaseTransport):
    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self.inner.handle_request(request)
        response.read()
        return self._after(request, response)


class AsyncDroppingTransport(_Dropping, httpx.AsyncBaseTransport):
    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        await response.aread()
        return self._after(request, response)


def _check(db: str, transport: _Dropping, keys: list[str], response: httpx.Response) -> None:
    assert response.status_code == 201
    assert response.headers["idempotent-replayed"] == "true"
    assert len(transport.seen) == 3
    assert {r.headers["idempotency-key"] for r in transport.seen} == set(keys)
    assert transport.lost[0] == response.content  # the caller gets the original response
    assert len(ledger_rows(db)) == 1


async def test_async_client_through_lost_responses(db: str) -> None:
    app = payments.create_app(db)
    keys: list[str] = []

    async def remember(key: str) -> None:  # the persistence hook runs before any attempt
        assert transport.seen == []
        keys.append(key)

    transport = AsyncDroppingTransport(httpx.ASGITransport(app=app), drop=2)
    async with lifespan(app), httpx.AsyncClient(transport=transport,
                                                base_url="http://test") as http:
        client = AsyncRetryingClient(http, on_key=remember, **FAST)
        response = await client.post("/payments", json={"amount": 50}, headers=ACCT)
    assert len(keys) == 1
    _check(db, transport, keys, response)


def test_sync_client_through_lost_responses_uvicorn(db: str) -> None:
    app = payments.create_app(db)
    keys: list[str] = []
    transport = DroppingTransport(httpx.HTTPTransport(), drop=2)
    with uvicorn_server(app) as base, httpx.Client(transport=transport, base_url=base) as http:
        client = RetryingClient(http, on_key=keys.append, **FAST)
        response = client.post("/payments", json={"amount": 50}, headers=ACCT,
                               key="intent-1")
    assert keys == ["intent-1"]
    _check(db, transport, keys, response)


# -- the retry rules ------------------------------------------------------------------------

def scripted(*answers: Any) -> tuple[httpx.Client, list[httpx.Request]]:
    seen: list[httpx.Request] = []
    script = list(answers)

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        answer = script.pop(0) if len(script) > 1 else script[0]
        if isinstance(answer, Exception):
            raise answer
        return answer

    return httpx.Client(transport=httpx.MockTransport(handler), base_url="http://x"), seen


def test_retries_409_429_5xx_and_honours_retry_after() -> None:
    http, seen = scripted(httpx.Response(409, headers={"Retry-After": "1"}),
                          httpx.Response(429), httpx.Response(503),
                          httpx.ConnectError("refused"), httpx.Response(201, text="done"))
    started = time.monotonic()
    response = RetryingClient(http, **FAST).post("/p", json={})
    assert time.monotonic() - started >= 0.2  # Retry-After: 1, capped at max_delay 0.2
    assert (response.status_code, response.text, len(seen)) == (201, "done", 5)
    assert len({r.headers["idempotency-key"] for r in seen}) == 1


@pytest.mark.parametrize("status", [400, 401, 404, 422])
def test_never_retries_other_4xx(status: int) -> None:
    http, seen = scripted(httpx.Response(status))
    assert RetryingClient(http, **FAST).post("/p").status_code == status
    assert len(seen) == 1


def test_gives_up_with_the_last_answer_or_error() -> None:
    http, seen = scripted(httpx.Response(500))
    assert RetryingClient(http, attempts=3, **FAST).post("/p").status_code == 500
    assert len(seen) == 3
    http, seen = scripted(httpx.ConnectError("refused"))
    with pytest.raises(httpx.ConnectError):
        RetryingClient(http, attempts=2, **FAST).post("/p")
    assert len(seen) == 2


def test_retry_after_forms() -> None:
    def seconds(value: str) -> float | None:
        return retry_after_seconds(httpx.Response(409, headers={"Retry-After": value}))

    assert seconds("3") == 3.0
    assert seconds("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # in the past
    assert seconds("soon") is None
    assert retry_after_seconds(httpx.Response(409)) is None
