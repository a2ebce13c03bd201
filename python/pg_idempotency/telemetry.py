"""OpenTelemetry for the package (the ``otel`` extra: ``opentelemetry-api``), docs/python.md.

The generators of :mod:`pg_idempotency._calls` call :func:`start` and :func:`end` around each
call of the SQL API they send (claim, takeover, checkpoint, heartbeat, complete, accept, release,
inbox_accept), so every way in (the sync and async API, ``operation()``, ``@idempotent``, the
ASGI, Django, Flask/WSGI and SQLAlchemy adapters, the jobs worker) is traced and measured the
same way, with no code of its own:

- a span ``pg_idempotency <call>`` (kind CLIENT; the caller's current span is its parent)
  with the attributes ``pg_idempotency.call``, ``pg_idempotency.outcome``,
  ``pg_idempotency.key_hash`` (:func:`pg_idempotency.core.key_hash`: never the raw key, the
  scope, the request or a body), ``pg_idempotency.attempts`` for a claim, and
  ``db.system.name`` ``postgresql``; on an error also ``error.type`` and
  ``db.response.status_code`` (the SQLSTATE), and the span's status is ERROR (a claim's
  in_progress, mismatch, ... are answers, not errors); no exception event, as an error's
  message may quote the key;
- the counter ``pg_idempotency.calls`` and the histogram ``pg_idempotency.call.duration``
  (seconds, the call's round trip as the client sees it), both with the attributes
  ``pg_idempotency.call`` and ``pg_idempotency.outcome`` (and ``error.type`` on an error).

Without ``opentelemetry-api`` installed, :data:`ENABLED` is False and :func:`start` returns
None at the cost of one global lookup: nothing else runs. With the API and no SDK, the API's
no-op tracer and meter do nothing but still cost a little per call (bench/otel.py measures
it).
"""

from __future__ import annotations

import time
from typing import Any

from .fingerprint import key_hash

try:
    from opentelemetry import metrics as _metrics
    from opentelemetry import trace as _trace
except ImportError:  # the extra is not installed: every hook is a no-op
    _trace = None  # type: ignore[assignment]

ENABLED = _trace is not None

#: The instrumentation scope (the tracer's and the meter's name).
NAME = "pg_idempotency"
#: Outcomes other than a claim's.
OK = "ok"
LEASE_LOST = "lease_lost"
ERROR = "error"

if ENABLED:
    from importlib import metadata as _metadata

    try:
        _VERSION: str | None = _metadata.version("pg-idempotency")
    except _metadata.PackageNotFoundError:
        _VERSION = None
    # Proxies until the application sets its providers (before or after this import), then
    # the real ones: nothing here depends on the order.
    _tracer = _trace.get_tracer(NAME, _VERSION)
    _meter = _metrics.get_meter(NAME, _VERSION or "")  # (its default: no version)
    _calls = _meter.create_counter(
        "pg_idempotency.calls", unit="{call}",
        description="Calls of the idempotency SQL API, by call and outcome")
    _duration = _meter.create_histogram(
        "pg_idempotency.call.duration", unit="s",
        description="Round trip of one call of the idempotency SQL API, by call and outcome")
    _CLIENT = _trace.SpanKind.CLIENT
    _ERROR_STATUS = _trace.Status(_trace.StatusCode.ERROR)


class Observation:
    """One call being observed: its span and its start time."""

    __slots__ = ("call", "scope", "key", "span", "started")

    def __init__(self, call: str, scope: str, key: str) -> None:
        self.call = call
        self.scope = scope
        self.key = key
        self.span = _tracer.start_span(f"{NAME} {call}", kind=_CLIENT)
        self.started = time.perf_counter()


def start(call: str, scope: str, key: str) -> Observation | None:
    """Open the span of one call (None when the extra is not installed)."""
    if not ENABLED:
        return None
    return Observation(call, scope, key)


def end(obs: Observation | None, outcome: str, *, attempts: int | None = None,
        error: BaseException | None = None) -> None:
    """Close ``obs`` with ``outcome`` (a claim's :class:`~pg_idempotency.core.Outcome` value,
    ``ok``, ``lease_lost`` or ``error``), and count and time it."""
    if obs is None:
        return
    elapsed = time.perf_counter() - obs.started
    attributes: dict[str, Any] = {"pg_idempotency.call": obs.call,
                                  "pg_idempotency.outcome": outcome}
    if error is not None:
        attributes["error.type"] = type(error).__qualname__
    _calls.add(1, attributes)
    _duration.record(elapsed, attributes)
    span = obs.span
    if span.is_recording():
        span.set_attributes(attributes)
        span.set_attribute("pg_idempotency.key_hash", key_hash(obs.scope, obs.key))
        span.set_attribute("db.system.name", "postgresql")
        if attempts is not None:
            span.set_attribute("pg_idempotency.attempts", attempts)
        if error is not None:
            sqlstate = getattr(error, "sqlstate", None)
            if sqlstate:
                span.set_attribute("db.response.status_code", sqlstate)
            span.set_status(_ERROR_STATUS)  # no exception event: its message may name the key
    span.end()
