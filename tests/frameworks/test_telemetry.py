"""OpenTelemetry (issue 23, item 3) on real PostgreSQL 15 and 18, with the SDK's in-memory span
exporter and in-memory metric reader: a span per call of the SQL API with its outcome and the
key's hash (never the raw key, the scope, the request or a body), and the counter and histogram
of calls by call and outcome; through the plain API, the guided flow, the async API, Django, and
every HTTP adapter (ASGI, Django, Flask, WSGI) over real HTTP. Without opentelemetry installed,
the hooks are no-ops (a subprocess that cannot import it)."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import textwrap
from collections import Counter
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

import pg_idempotency as idem
from pg_idempotency import aio, telemetry
from pg_idempotency.core import key_hash
from pgharness import WAIT_BOUND

SCOPE = "acct-SECRET-SCOPE"
KEY = "key-SECRET-7f3a"
BODY = "card-4242-SECRET-BODY"

# Global providers can be set once per process: this module sets them on first use (the
# package's proxies bind to them whenever that happens) and every test reads what it added.
_EXPORTER = InMemorySpanExporter()
_READER = InMemoryMetricReader()
_INSTALLED: list[bool] = []


def install() -> None:
    if _INSTALLED:
        return
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(_EXPORTER))
    trace.set_tracer_provider(provider)
    metrics.set_meter_provider(MeterProvider(metric_readers=[_READER]))
    assert trace.get_tracer_provider() is provider, "another tracer provider was set first"
    _INSTALLED.append(True)


@pytest.fixture
def spans() -> Callable[[], list[ReadableSpan]]:
    """The package's finished spans since the test began (not the app's own)."""
    install()
    _EXPORTER.clear()
    return lambda: [s for s in _EXPORTER.get_finished_spans()
                    if s.instrumentation_scope.name == "pg_idempotency"]


def calls() -> Counter[tuple[str, str]]:
    """pg_idempotency.calls so far, by (call, outcome)."""
    out: Counter[tuple[str, str]] = Counter()
    data = _READER.get_metrics_data()
    for rm in data.resource_metrics if data else []:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                if m.name == "pg_idempotency.calls":
                    for p in m.data.data_points:
                        out[(p.attributes["pg_idempotency.call"],
                             p.attributes["pg_idempotency.outcome"])] += p.value
    return out


def durations() -> dict[tuple[str, str], tuple[int, float]]:
    """pg_idempotency.call.duration so far: (count, sum in seconds) by (call, outcome)."""
    out: dict[tuple[str, str], tuple[int, float]] = {}
    data = _READER.get_metrics_data()
    for rm in data.resource_metrics if data else []:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                if m.name == "pg_idempotency.call.duration":
                    assert m.unit == "s"
                    for p in m.data.data_points:
                        out[(p.attributes["pg_idempotency.call"],
                             p.attributes["pg_idempotency.outcome"])] = (p.count, p.sum)
    return out


def summary(got: list[ReadableSpan]) -> list[tuple[str, str]]:
    return [(s.name, s.attributes["pg_idempotency.outcome"]) for s in got]


def assert_nothing_secret(got: list[ReadableSpan]) -> None:
    text = repr([(s.name, dict(s.attributes or {}), [e.attributes for e in s.events],
                  s.status.description) for s in got])
    for secret in (SCOPE, KEY, BODY, "SECRET"):
        assert secret not in text, text


def test_spans_and_metrics_of_the_lifecycle(db: str, spans: Any) -> None:
    before, before_d = calls(), durations()
    h = key_hash(SCOPE, KEY)
    t0 = datetime.now(timezone.utc)
    tracer = trace.get_tracer("the-app")
    with psycopg.connect(db, autocommit=True) as conn:
        with tracer.start_as_current_span("POST /payments") as parent:
            with idem.operation(conn, SCOPE, KEY, {"card": BODY}) as op:
                op.checkpoint("charged")
                op.complete(201, {"echo": BODY})
        with idem.operation(conn, SCOPE, KEY, {"card": BODY}) as op:
            assert op.replay is not None
        with pytest.raises(idem.KeyMismatch), idem.operation(conn, SCOPE, KEY, {"card": "x"}):
            pass
        with idem.operation(conn, SCOPE, "r1", {}) as op:
            op.release()
        stale = idem.claim(conn, SCOPE, "l1", {}, lease=1, reference_time=t0)
        later = t0 + timedelta(seconds=2)
        with pytest.raises(idem.KeyInProgress):
            with idem.operation(conn, SCOPE, "l1", {}, reference_time=t0):
                pass
        idem.heartbeat(conn, SCOPE, "l1", stale.lease_token, lease=1, reference_time=t0)
        taken = idem.takeover(conn, SCOPE, "l1", reference_time=later)
        with pytest.raises(idem.LeaseLost):
            idem.complete(conn, SCOPE, "l1", stale.lease_token, 200, reference_time=later)
        with pytest.raises(idem.InvalidArgument):
            idem.claim(conn, SCOPE, "", {})
        assert idem.inbox_accept(conn, "consumer", "m1") is True
        assert idem.inbox_accept(conn, "consumer", "m1") is False
        # docs/python.md: an operator finds the key of a span's key_hash in SQL
        found = conn.execute(
            "SELECT scope, key FROM idempotency.keys WHERE left(encode(sha256("
            "convert_to(scope, 'UTF8') || '\\x00'::bytea || convert_to(key, 'UTF8')), 'hex'),"
            " 12) = %s", (h,)).fetchall()
        assert found == [(SCOPE, KEY)]
    got = spans()
    assert summary(got) == [
        ("pg_idempotency claim", "claimed"), ("pg_idempotency checkpoint", "ok"),
        ("pg_idempotency complete", "ok"), ("pg_idempotency claim", "replay"),
        ("pg_idempotency claim", "mismatch"), ("pg_idempotency claim", "claimed"),
        ("pg_idempotency release", "ok"), ("pg_idempotency claim", "claimed"),
        ("pg_idempotency claim", "in_progress"), ("pg_idempotency heartbeat", "ok"),
        ("pg_idempotency takeover", "resumed"), ("pg_idempotency complete", "lease_lost"),
        ("pg_idempotency claim", "error"), ("pg_idempotency inbox_accept", "accepted"),
        ("pg_idempotency inbox_accept", "duplicate"),
    ]
    first = got[0]
    assert first.kind == trace.SpanKind.CLIENT
    assert dict(first.attributes) == {
        "pg_idempotency.call": "claim", "pg_idempotency.outcome": "claimed",
        "pg_idempotency.key_hash": h, "pg_idempotency.attempts": 1,
        "db.system.name": "postgresql"}
    # the caller's span is the parent of the calls made inside it
    assert got[0].parent is not None and got[0].parent.span_id == parent.get_span_context().span_id
    assert got[2].parent.span_id == parent.get_span_context().span_id
    assert got[3].parent is None
    # expected answers are not errors; a lost lease and an invalid argument are
    assert {s.status.status_code for s in got[:11]} == {StatusCode.UNSET}
    lost, invalid = got[11], got[12]
    assert lost.status.status_code is StatusCode.ERROR
    assert lost.attributes["db.response.status_code"] == "IK001"
    assert lost.attributes["error.type"].startswith("LeaseLost")
    assert invalid.status.status_code is StatusCode.ERROR
    assert invalid.attributes["error.type"] == "ArgumentEmpty"  # an InvalidArgument
    assert taken.outcome is idem.Outcome.RESUMED
    assert_nothing_secret(got)

    after, after_d = calls(), durations()
    added = after - before
    assert added == Counter({("claim", "claimed"): 3, ("checkpoint", "ok"): 1,
                             ("complete", "ok"): 1, ("claim", "replay"): 1,
                             ("claim", "mismatch"): 1, ("release", "ok"): 1,
                             ("claim", "in_progress"): 1, ("heartbeat", "ok"): 1,
                             ("takeover", "resumed"): 1, ("complete", "lease_lost"): 1,
                             ("claim", "error"): 1, ("inbox_accept", "accepted"): 1,
                             ("inbox_accept", "duplicate"): 1}), added
    n0, s0 = before_d.get(("claim", "claimed"), (0, 0.0))
    n1, s1 = after_d[("claim", "claimed")]
    assert n1 - n0 == 3 and 0 < s1 - s0 < 30  # three round trips, in seconds


def test_async_api_gets_the_same_spans(db: str, spans: Any) -> None:
    async def flow() -> None:
        async with await psycopg.AsyncConnection.connect(db, autocommit=True) as conn:
            async with aio.operation(conn, SCOPE, "a1", {"x": 1}) as op:
                await op.complete(200, {"y": BODY})
            async with aio.operation(conn, SCOPE, "a1", {"x": 1}) as op:
                assert op.replay is not None

    asyncio.run(flow())
    got = spans()
    assert summary(got) == [("pg_idempotency claim", "claimed"),
                            ("pg_idempotency complete", "ok"),
                            ("pg_idempotency claim", "replay")]
    assert {s.attributes["pg_idempotency.key_hash"] for s in got} == {key_hash(SCOPE, "a1")}
    assert_nothing_secret(got)


def test_django_requests_get_spans_for_free(empty_db: str, spans: Any) -> None:
    from django.test import Client
    from helpers.django_example import _migrated, post  # sets up the example app

    for _ in _migrated(empty_db, False):
        client = Client()
        assert post(client, "k1").status_code == 201
        assert post(client, "k1").status_code == 201
    got = spans()
    assert summary(got) == [("pg_idempotency claim", "claimed"),
                            ("pg_idempotency complete", "ok"),
                            ("pg_idempotency claim", "replay")]
    assert got[0].attributes["pg_idempotency.key_hash"] == key_hash("merchant:m1", "k1")


@pytest.mark.parametrize("adapter", ["asgi", "django", "flask", "wsgi"])
def test_every_http_adapter_gets_the_same_spans_and_log_lines(
        db: str, spans: Any, adapter: str, caplog: pytest.LogCaptureFixture) -> None:
    """The adapters of pg_idempotency.contract call the core and nothing else: over real HTTP,
    each keyed request is a claim span (claimed, replay, mismatch) and then a complete or a
    release span, the same behind every adapter; a stale attempt's complete after a takeover
    is lease_lost with IK001 (engine 0.9.0), answered 409. The log has one line per event
    (test_logging.py's shape), the same behind every adapter: only the reason of a release
    after a 5xx that is not stored differs (Django calls release() itself: reason=release; the
    others leave operation()'s block with the error: reason=exception)."""
    from helpers.adapters import pay, race_takeover, serve

    caplog.set_level(logging.INFO, logger="pg_idempotency")
    with serve(adapter, db) as base:
        first = pay(base, KEY, BODY)
        assert first.status_code == 201
        assert pay(base, KEY, BODY).headers["idempotent-replayed"] == "true"
        assert pay(base, KEY, "other").status_code == 422
        assert pay(base, "k500", BODY, "fail500").status_code == 500  # not stored: released
        assert pay(base, None, BODY).status_code == 400  # no key: no claim, no span
        # held past its lease, taken over, let go first (fenced off), then the taker
        taker, late = race_takeover(base, db, "k-stale", BODY)
        assert taker.status_code == 201 and late.status_code == 409
    got = spans()
    assert summary(got[:6]) == [
        ("pg_idempotency claim", "claimed"), ("pg_idempotency complete", "ok"),
        ("pg_idempotency claim", "replay"), ("pg_idempotency claim", "mismatch"),
        ("pg_idempotency claim", "claimed"), ("pg_idempotency release", "ok")]
    assert {s.attributes["pg_idempotency.key_hash"] for s in got[:4]} == {key_hash("acct", KEY)}
    assert {s.attributes["pg_idempotency.key_hash"] for s in got[4:6]} == {
        key_hash("acct", "k500")}
    # the takeover: the stale claim, the taker's claim (resumed), the stale complete (fenced
    # off while the taker held the key), the taker's complete
    assert summary(got[6:]) == [
        ("pg_idempotency claim", "claimed"), ("pg_idempotency claim", "resumed"),
        ("pg_idempotency complete", "lease_lost"), ("pg_idempotency complete", "ok")]
    lost = got[8]
    assert lost.status.status_code is StatusCode.ERROR
    assert lost.attributes["db.response.status_code"] == "IK001"
    assert lost.attributes["error.type"] == "LeaseLost"
    assert got[7].attributes["pg_idempotency.attempts"] == 2
    assert {s.attributes["pg_idempotency.key_hash"] for s in got[6:]} == {
        key_hash("acct", "k-stale")}
    assert {s.kind for s in got} == {trace.SpanKind.CLIENT}
    assert_nothing_secret(got)

    h, h500, hs = (key_hash("acct", k) for k in (KEY, "k500", "k-stale"))
    reason = "release" if adapter == "django" else "exception"
    logged = [(r.levelname, r.getMessage()) for r in caplog.records
              if r.name == "pg_idempotency"]
    assert logged == [
        ("INFO", f"claim key={h} outcome=claimed attempts=1"),
        ("INFO", f"complete key={h} status=201"),
        ("INFO", f"claim key={h} outcome=replay attempts=1"),
        ("WARNING", f"claim key={h} outcome=mismatch"),
        ("INFO", f"claim key={h500} outcome=claimed attempts=1"),
        ("INFO", f"release key={h500} reason={reason}"),
        ("INFO", f"claim key={hs} outcome=claimed attempts=1"),
        ("INFO", f"claim key={hs} outcome=resumed attempts=2"),
        ("WARNING", f"lease_lost key={hs} call=complete sqlstate=IK001"),
        ("INFO", f"complete key={hs} status=201"),
    ], caplog.text
    assert KEY not in caplog.text and BODY not in caplog.text


NO_OTEL_APP = textwrap.dedent("""
    import os, sys
    sys.modules["opentelemetry"] = None  # as if the extra were not installed
    import psycopg
    import pg_idempotency as idem
    from pg_idempotency import telemetry
    assert telemetry.ENABLED is False
    with psycopg.connect(os.environ["IDEM_DSN"], autocommit=True) as conn:
        with idem.operation(conn, "s", "no-otel", {"a": 1}) as op:
            op.complete(200, {"b": 2})
        with idem.operation(conn, "s", "no-otel", {"a": 1}) as op:
            print(op.outcome.value, op.replay.json())
    print(sorted(m for m in sys.modules if m.startswith("opentelemetry")))
""")


def test_without_opentelemetry_the_hooks_are_no_ops(db: str) -> None:
    assert telemetry.ENABLED  # in this process the test extra installed it
    out = subprocess.run([sys.executable, "-c", NO_OTEL_APP], capture_output=True, text=True,
                         timeout=WAIT_BOUND, env=dict(os.environ, IDEM_DSN=db))
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["replay {'b': 2}", "['opentelemetry']"], out
    assert out.stderr == ""
