"""A retrying HTTP client (httpx, sync and async) that sends one Idempotency-Key per intent.

    with httpx.Client(base_url="https://api.example") as http:
        client = RetryingClient(http, on_key=lambda key: save_intent(order_id, key))
        response = client.post("/payments", json={"amount": 50})

Each ``request()`` is one intent: it gets one key (yours, or a new UUID), which is handed to
``on_key`` *before* the first attempt, so that a caller that crashes can retry the same intent
with the same key later. Attempts are retried on transport errors (refused, reset, timed out),
409 (in progress), 429, 500, 502, 503 (the database unavailable) and 504, after a wait of
``Retry-After`` (when the server sends one: a floor) plus an exponential backoff with full
jitter, so that clients that failed together do not come back together. Any other answer is
returned at once: a 4xx is the client's mistake (400, 413, 422...), and a 501, 505 or 507
(the answer too large to store) says the same request will fail again. When the attempts or
the time run out, the last response is returned, or the last transport error raised.

The retry policy is tenacity's (:func:`retry_policy`); :class:`RetryingClient` and
:class:`AsyncRetryingClient` differ only in the tenacity runner and the httpx client they use.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime
from typing import Any

import httpx
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    Retrying,
    retry_if_exception_type,
    retry_if_result,
    stop_after_attempt,
    stop_after_delay,
    wait_random_exponential,
)

__all__ = ["AsyncRetryingClient", "RetryingClient", "retry_after_seconds", "retry_policy",
           "should_retry"]

#: 409 (the original is in progress), 429 (slow down), 500 (the handler failed, its key was
#: released), 502/504 (a proxy lost the server), 503 (the database unavailable, or no
#: connection free): another attempt may succeed. Every other 4xx is the request's own fault,
#: and 501, 505 and 507 (too large to store) fail again the same way.
RETRY_STATUSES = frozenset({409, 429, 500, 502, 503, 504})


def should_retry(response: httpx.Response) -> bool:
    """Whether the answer is worth another attempt with the same key (:data:`RETRY_STATUSES`)."""
    return response.status_code in RETRY_STATUSES


def retry_after_seconds(response: httpx.Response) -> float | None:
    """The ``Retry-After`` header in seconds (delta-seconds or an HTTP date), else None."""
    value = response.headers.get("retry-after")
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return max(0.0, (when - datetime.now(timezone.utc)).total_seconds())


def retry_policy(*, attempts: int = 6, initial: float = 0.1, max_delay: float = 10.0,
                 timeout: float = 60.0) -> dict[str, Any]:
    """tenacity arguments: up to ``attempts`` attempts within ``timeout`` seconds. Before
    attempt n+1 the wait is the server's Retry-After when it sent one (capped at
    ``max_delay``: a floor), plus a delay drawn uniformly from [0, min(max_delay,
    initial * 2**n)] ("full jitter"). So a 503 with ``Retry-After: 1`` sent to a hundred
    clients at once brings them back spread over the next seconds, not all one second later,
    and a refused connection (no answer, no Retry-After) backs off exponentially."""
    jitter = wait_random_exponential(multiplier=initial, max=max_delay)

    def wait(state: RetryCallState) -> float:
        delay = jitter(state)
        outcome = state.outcome
        if outcome is not None and not outcome.failed:
            hinted = retry_after_seconds(outcome.result())
            if hinted is not None:
                delay += min(hinted, max_delay)
        return delay

    def give_up(state: RetryCallState) -> Any:
        assert state.outcome is not None
        return state.outcome.result()  # the last response, or raise the last error

    return {
        "retry": retry_if_exception_type(httpx.TransportError) | retry_if_result(should_retry),
        "wait": wait,
        "stop": stop_after_attempt(attempts) | stop_after_delay(timeout),
        "retry_error_callback": give_up,
    }


class _Base:
    def __init__(self, http: Any, *, header: str = "Idempotency-Key",
                 on_key: Callable[[str], Any] | None = None, **policy: Any) -> None:
        self.http = http
        self.header = header
        self.on_key = on_key
        self.policy = retry_policy(**policy)

    def _prepare(self, key: str | None, on_key: Callable[[str], Any] | None,
                 kwargs: dict[str, Any]) -> tuple[str, Callable[[str], Any] | None]:
        key = key or str(uuid.uuid4())
        headers = httpx.Headers(kwargs.pop("headers", None))
        headers[self.header] = key
        kwargs["headers"] = headers
        return key, on_key or self.on_key


class RetryingClient(_Base):
    """Wraps an ``httpx.Client``; ``request()`` is one intent, retried safely."""

    def request(self, method: str, url: str, *, key: str | None = None,
                on_key: Callable[[str], Any] | None = None, **kwargs: Any) -> httpx.Response:
        key, hook = self._prepare(key, on_key, kwargs)
        if hook is not None:
            hook(key)  # persisted before anything is sent
        response: httpx.Response = Retrying(**self.policy)(self.http.request, method, url,
                                                           **kwargs)
        return response

    def post(self, url: str, **kwargs: Any) -> httpx.Response:
        return self.request("POST", url, **kwargs)

    def patch(self, url: str, **kwargs: Any) -> httpx.Response:
        return self.request("PATCH", url, **kwargs)


class AsyncRetryingClient(_Base):
    """Wraps an ``httpx.AsyncClient``; ``await request()`` is one intent, retried safely.
    ``on_key`` may be a coroutine function."""

    async def request(self, method: str, url: str, *, key: str | None = None,
                      on_key: Callable[[str], Any] | None = None,
                      **kwargs: Any) -> httpx.Response:
        key, hook = self._prepare(key, on_key, kwargs)
        if hook is not None:
            result = hook(key)
            if hasattr(result, "__await__"):
                await result
        return await AsyncRetrying(**self.policy)(self.http.request, method, url, **kwargs)

    async def post(self, url: str, **kwargs: Any) -> httpx.Response:
        return await self.request("POST", url, **kwargs)

    async def patch(self, url: str, **kwargs: Any) -> httpx.Response:
        return await self.request("PATCH", url, **kwargs)
