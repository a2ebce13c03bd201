"""The retrying client against the example app when the first responses are lost after the
server committed: async through an in-process transport that drops them, sync through a TCP
proxy in front of a real uvicorn server that cuts the connection. Its retry rules against
scripted answers (httpx.MockTransport, no database)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Any

import httpx
import pytest
from helpers.http import ledger_rows, lifespan, payments, uvicorn_server

from pg_idempotency.client import AsyncRetryingClient, RetryingClient, retry_after_seconds

pytestmark = pytest.mark.anyio

ACCT = {"X-Account": "acct_42"}
FAST = {"initial": 0.01, "max_delay": 0.2}


class AsyncDroppingTransport(httpx.AsyncBaseTransport):
    """Passes each request to the server and reads the whole response; for the first
    ``drop`` requests it then throws the response away and raises a transport error: the
    server committed, the client never heard."""

    def __init__(self, inner: httpx.AsyncBaseTransport, drop: int) -> None:
        self.inner = inner
        self.drop = drop
        self.seen: list[httpx.Request] = []
        self.lost: list[bytes] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        await response.aread()
        self.seen.append(request)
        if len(self.seen) <= self.drop:
            self.lost.append(response.content)
            raise httpx.ReadError("connection reset by peer", request=request)
        return response


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
    assert response.status_code == 201
    assert response.headers["idempotent-replayed"] == "true"
    assert len(keys) == 1 and len(transport.seen) == 3
    assert {r.headers["idempotency-key"] for r in transport.seen} == set(keys)
    assert transport.lost[0] == response.content  # the caller gets the original response
    assert len(ledger_rows(db)) == 1


class DroppingProxy:
    """A TCP proxy on 127.0.0.1 in front of a server: on its first ``drop`` connections it
    passes the request on, reads what the server answers (so the server has committed:
    the middleware sends only after the commit) and closes the client's connection without
    a byte. The client sees the server disconnect, as after a crash or a network cut."""

    def __init__(self, upstream: str, drop: int) -> None:
        host, port = upstream.removeprefix("http://").split(":")
        self.upstream = (host, int(port))
        self.drop = drop
        self.lost: list[bytes] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        connections = 0
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            connections += 1
            threading.Thread(target=self._serve, args=(client, connections <= self.drop),
                             daemon=True).start()

    def _serve(self, client: socket.socket, drop: bool) -> None:
        with client, socket.create_connection(self.upstream, timeout=30) as server:
            threading.Thread(target=_pump, args=(client, server), daemon=True).start()
            if not drop:
                _pump(server, client)
                return
            answer = server.recv(65536)
            server.settimeout(0.3)
            with contextlib.suppress(OSError):
                while chunk := server.recv(65536):
                    answer += chunk
            self.lost.append(answer)
            client.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.listener.close()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := src.recv(65536):
            dst.sendall(data)
        dst.shutdown(socket.SHUT_WR)


def test_sync_client_through_a_proxy_that_drops_responses(db: str) -> None:
    app = payments.create_app(db)
    keys: list[str] = []
    with uvicorn_server(app) as base:
        proxy = DroppingProxy(base, drop=2)
        try:
            with httpx.Client(base_url=proxy.url, timeout=30) as http:
                client = RetryingClient(http, on_key=keys.append, **FAST)
                response = client.post("/payments", json={"amount": 50}, headers=ACCT)
        finally:
            proxy.close()
    assert response.status_code == 201
    assert response.headers["idempotent-replayed"] == "true"
    assert len(keys) == 1 and len(proxy.lost) == 2
    assert proxy.lost[0].startswith(b"HTTP/1.1 201")
    assert proxy.lost[0].endswith(response.content)  # the caller gets the original response
    assert len(ledger_rows(db)) == 1


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


@pytest.mark.parametrize("status", [400, 401, 404, 413, 422, 501, 507])
def test_never_retries_other_4xx_nor_a_5xx_that_fails_again(status: int) -> None:
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
