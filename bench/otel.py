#!/usr/bin/env python3
"""Benchmark: what the OpenTelemetry hooks cost per claim + complete.

Three configurations, each in a fresh Python process, interleaved round by round (the order
rotates) so machine noise hits them alike:

  absent  opentelemetry cannot be imported (``sys.modules["opentelemetry"] = None``): the
          hooks are one global lookup each
  api     opentelemetry-api without an SDK: the API's no-op tracer and meter
  sdk     the SDK: a TracerProvider with a BatchSpanProcessor (into an in-memory exporter)
          and a MeterProvider with an in-memory reader, so every span and data point is made

Each process reports three numbers:

  import  ms to ``import pg_idempotency`` in the fresh process (psycopg included)
  hooks   µs of the hooks alone per claim + complete (telemetry.start/end for both, in a
          loop without a database): the overhead itself, free of database noise; for "sdk"
          also the SDK's floor, two bare spans with no attributes and no metrics
  e2e     claim + complete per second through ``operation()`` on one connection to a local
          PostgreSQL 18 (fsync off), to put the overhead next to a real round trip

Reported: the median over the rounds of each, and of each round's e2e ratio to "absent". A
benchmark, not a test: it prints numbers and asserts nothing.

    .venv/bin/python bench/otel.py [--rounds 7] [--seconds 3] [--hooks 20000]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

import common  # noqa: F401 - puts harness/ on the import path
import psycopg

import pgharness
from pg_idempotency.migrate import migrate

CONFIGS = ("absent", "api", "sdk")

CHILD = r'''
import json, os, sys, time, uuid
config, seconds, hooks = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
if config == "absent":
    sys.modules["opentelemetry"] = None
t = time.perf_counter()
import pg_idempotency as idem
from pg_idempotency import telemetry
import_ms = (time.perf_counter() - t) * 1000
assert telemetry.ENABLED is (config != "absent")
if config == "sdk":
    from opentelemetry import metrics, trace
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    provider = TracerProvider()
    exporter = InMemorySpanExporter()
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    metrics.set_meter_provider(MeterProvider(metric_readers=[InMemoryMetricReader()]))

def hook_loop(n):
    start, end = telemetry.start, telemetry.end
    t = time.perf_counter()
    for _ in range(n):
        o = start("claim", "acct", "key-1")
        end(o, "claimed", attempts=1)
        o = start("complete", "acct", "key-1")
        end(o, "ok")
    return (time.perf_counter() - t) / n * 1e6

hook_loop(hooks // 10)
hooks_us = min(hook_loop(hooks) for _ in range(3))
bare_us = 0.0
if config == "sdk":  # the SDK's own floor: two bare spans, no attributes, no metrics
    tracer = trace.get_tracer("bench")
    t = time.perf_counter()
    for _ in range(hooks):
        tracer.start_span("a").end()
        tracer.start_span("b").end()
    bare_us = (time.perf_counter() - t) / hooks * 1e6

import psycopg
with psycopg.connect(os.environ["BENCH_DSN"], autocommit=True) as conn:
    def loop(secs):
        tag, n, t0 = uuid.uuid4().hex[:8], 0, time.perf_counter()
        while time.perf_counter() - t0 < secs:
            with idem.operation(conn, "bench", f"{tag}-{n}", {"n": n}) as op:
                op.complete(201, {"id": n})
            n += 1
        return n / (time.perf_counter() - t0)
    loop(0.5)
    rate = loop(seconds)
if config == "sdk":
    provider.force_flush()
    assert len(exporter.get_finished_spans()) > 2 * rate * seconds * 0.9
print(json.dumps({"import_ms": import_ms, "hooks_us": hooks_us, "bare_us": bare_us,
                  "rate": rate}))
'''


def child(config: str, dsn: str, args: argparse.Namespace) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, config, str(args.seconds),
                          str(args.hooks)], capture_output=True, text=True, check=False,
                         env=dict(os.environ, BENCH_DSN=dsn))
    if out.returncode != 0:
        raise SystemExit(f"{config} failed:\n{out.stderr}")
    return json.loads(out.stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--seconds", type=float, default=3)
    parser.add_argument("--hooks", type=int, default=20000)
    args = parser.parse_args()
    with pgharness.PgServer(pgharness.flavour_bindir("pg18"), name="bench-otel") as server:
        server.run_psql(server.dsn(), "CREATE DATABASE bench")
        dsn = server.dsn("bench")
        with psycopg.connect(dsn, autocommit=True) as conn:
            migrate(conn)
            conn.execute("SELECT idempotency._premake()")
        rounds = []
        for i in range(args.rounds):
            order = CONFIGS[i % 3:] + CONFIGS[:i % 3]
            r = {c: child(c, dsn, args) for c in order}
            rounds.append(r)
            print(f"  round {i + 1}: " + "  ".join(
                f"{c} {r[c]['import_ms']:.0f} ms / {r[c]['hooks_us']:.2f} µs / "
                f"{r[c]['rate']:.0f}/s" for c in CONFIGS), flush=True)
    print(f"\nmedians of {args.rounds} interleaved rounds (import ms, hooks µs per "
          "claim+complete, claim+complete per second and its ratio to absent):")
    for c in CONFIGS:
        med = {k: statistics.median(r[c][k] for r in rounds)
               for k in ("import_ms", "hooks_us", "rate")}
        ratio = statistics.median(r[c]["rate"] / r["absent"]["rate"] for r in rounds)
        print(f"  {c:7s} import {med['import_ms']:6.1f} ms   hooks {med['hooks_us']:6.2f} µs"
              f"   e2e {med['rate']:6.0f}/s ({ratio:.3f})")
    bare = statistics.median(r["sdk"]["bare_us"] for r in rounds)
    print(f"  (the SDK's floor on this machine: two bare spans started and ended {bare:.1f} µs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
