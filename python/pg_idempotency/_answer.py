"""The answers and settings of the HTTP contract (:mod:`pg_idempotency.contract`, which
re-exports them): an HTTP answer in no framework's types, what an adapter's user may
choose, and the RFC 9457 problem answer every refusal is made of."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import timedelta

from ._calls import DEFAULT_LEASE
from .errors import DEFAULT_UNAVAILABLE_RETRY_AFTER

#: Headers that describe the operation's result, stored and replayed by default. Per-request
#: headers (dates, trace ids, rate-limit counters, cookies) are not.
# Allow and Vary too: frameworks set them on every answer (Django REST framework: the view's
# methods, and Vary: Accept), and a replay without them is not the answer the client missed.
DEFAULT_REPLAY_HEADERS = ("location", "content-location", "etag", "last-modified", "allow",
                          "vary")
#: Retry-After never says more than this by default (seconds), whatever the lease.
DEFAULT_RETRY_AFTER_MAX = 2.0
#: The default limits (bytes), the engine's defaults (idempotency.settings.max_request_bytes and
#: max_response_bytes): a request body over the first is 413, an answer over the second 507.
DEFAULT_MAX_REQUEST_BYTES = 1048576
DEFAULT_MAX_RESPONSE_BYTES = 1048576
#: The header every replay carries.
REPLAYED_HEADER = ("Idempotent-Replayed", "true")


@dataclass(frozen=True)
class Answer:
    """An HTTP answer in no framework's types: the adapter sends it as it is."""

    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes
    #: True when this is a replay of a stored answer (it carries Idempotent-Replayed).
    replayed: bool = False


@dataclass(frozen=True)
class Settings:
    """What every adapter lets its user choose, with the defaults a payments service wants.

    - ``header_name``: the request header carrying the key.
    - ``wait``: seconds to wait for an attempt in progress to finish (then replay) before
      answering 409; 0 answers at once.
    - ``lease``: how long a handler may run before a retry may take the key over.
    - ``retry_after_max``: the largest ``Retry-After`` of a 409 (the lease left, capped).
    - ``replay_headers``: response headers stored and replayed (case-insensitive).
    - ``store_server_errors``: store 5xx answers as the key's result (default False: a 5xx is
      rolled back and the key released, so the retry runs afresh).
    - ``fingerprint_query``: whether the query string is part of the fingerprint (default
      False: a tracking parameter added by a retrying client does not make another request).
    - ``unavailable_retry_after``: the ``Retry-After`` (seconds, rounded up, at least 1) of a
      503 answered because the database cannot be reached (:func:`unavailable`).
    - ``max_request_bytes``: the largest request body of a keyed request (413 above it, before
      any claim; nothing past it is read).
    - ``max_response_bytes``: the largest answer body stored (above it: 507, not stored, the
      handler's writes rolled back and the key released; nothing past it is buffered).
    """

    header_name: str = "Idempotency-Key"
    wait: float = 0.0
    lease: timedelta | float = DEFAULT_LEASE
    retry_after_max: float = DEFAULT_RETRY_AFTER_MAX
    replay_headers: frozenset[str] = field(
        default_factory=lambda: frozenset(DEFAULT_REPLAY_HEADERS))
    store_server_errors: bool = False
    fingerprint_query: bool = False
    unavailable_retry_after: float = DEFAULT_UNAVAILABLE_RETRY_AFTER
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES

    def __post_init__(self) -> None:
        for name in ("max_request_bytes", "max_response_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a whole number of bytes, at least 1")
        if not self.unavailable_retry_after > 0:
            raise ValueError("unavailable_retry_after must be more than 0 (seconds)")
        if self.retry_after_max < 1:
            raise ValueError("retry_after_max must be at least 1 (second)")
        if self.wait < 0:
            raise ValueError("wait must be 0 or more (seconds)")
        object.__setattr__(self, "replay_headers",
                           frozenset(h.lower() for h in self.replay_headers))

    @property
    def lease_seconds(self) -> float:
        lease = self.lease
        return lease.total_seconds() if isinstance(lease, timedelta) else float(lease)


# -- answers of the adapter's own --------------------------------------------------------------

def problem(status: int, title: str, detail: str,
            headers: Iterable[tuple[str, str]] = ()) -> Answer:
    """An RFC 9457 problem details answer."""
    content = json.dumps({"type": "about:blank", "title": title, "status": status,
                          "detail": detail}).encode()
    return Answer(status, (("Content-Type", "application/problem+json"),
                           ("Content-Length", str(len(content))), *headers), content)
