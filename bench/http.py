#!/usr/bin/env python3
"""Benchmark: one FastAPI endpoint over real HTTP, without idempotency, with the middleware,
and with the hand-written recipe a user would write instead.

The endpoint is ``POST /payments``: it parses the JSON body ``{"account": ..., "amount": ...}``,
sleeps 2 ms (standing in for the payment processor's call), inserts one row into
``ledger(ref, account, amount)`` (``ref`` is the Idempotency-Key) and answers 201 with a small
JSON body. Three variants of it, each served by uvicorn in a process of its own (asyncio loop,
httptools if installed else h11), each with the same AsyncConnectionPool size, all against one
PostgreSQL 15 server with the default durability (fsync, synchronous_commit, full_page_writes on):

  none        no idempotency: the handler inserts the ledger row in a transaction of its own
  middleware  pg_idempotency.asgi.IdempotencyMiddleware (Policy.REQUIRED, wait=0): the handler
              inserts on ``get_operation(request).conn``; the response is stored in the same
              commit
  recipe      the hand-written recipe, as a user writes it with psycopg's defaults (prepared after 5
              executions), on one pooled connection in autocommit for the whole request: a
              ``recipe_keys`` table; INSERT ... ON CONFLICT DO NOTHING RETURNING on its own
              (autocommit: one statement, one round trip); for a new key the work, then BEGIN,
              the ledger INSERT, the UPDATE with the answer, COMMIT: five statements a fresh
              request, as bench/operation.py's recipe. On a conflict it reads the stored row
              with one plain SELECT (no lock, autocommit) and answers from it: the stored answer
              with Idempotent-Replayed (completed, same hash), 422 (other hash) or 409 (in
              progress): two statements a replay. On an error the key row is deleted. It has no
              lease (a crash mid-request leaves the key in progress for good), no expiry, and
              hashes the body's bytes, not its JSON.

The load generator is a raw asyncio HTTP/1.1 client (hand-written requests with Content-Length,
keep-alive, one connection per simulated client), in a process of its own, so the numbers are
the server's cost, not an HTTP library's. Loads, for each --clients count:

  fresh       every request carries a new Idempotency-Key
  replay30    30% of the requests resend a key that was answered 2xx before, with the same body:
              replays for middleware and recipe; new payments for none (it has no key semantics,
              the header is sent all the same)

Each measurement truncates the tables, warms up for --warmup seconds, then counts the answers in
the next --seconds. The variants run interleaved, round by round (none, middleware, recipe,
none, ...), so machine noise hits them alike; per round we take middleware/none and
middleware/recipe, and report the medians of those ratios and of each variant's requests/s.
After every measurement the ledger is checked for duplicates (rows whose ref appears more than
once): for middleware and recipe there must be none (the exit status is 1 otherwise); for none
the replayed requests are duplicates by construction. Status counts, and the uvicorn process's
CPU time per answer (from /proc, Linux only), cover the warm-up too.
PostgreSQL's own cost per answer is taken over the measuring window only (the truncation and
the warm-up are outside it): the client prints a line when the window opens and when it closes,
and at each the driver snapshots, from a connection to another database, the top-level
statements' execution time and calls in the bench database (``pg_stat_statements``, preloaded,
``track = top``, BEGIN and COMMIT included), ``pg_current_wal_insert_lsn()``, and the CPU ticks
of every process of the server and the time they waited for a CPU while runnable (bench/common.py,
/proc/PID/schedstat). It prints, per variant and load, statement time, CPU, run-queue wait and
WAL bytes per request with ours (middleware) over recipe and over none per round and their
medians; bench/targets.py reads them from --json. On a machine whose cores are all busy (the
load client, uvicorn and PostgreSQL share them here) a statement's execution time includes its
backend's run-queue waits, and the wait column says how much of the server's time that is.
This is a benchmark, not a test: apart from the duplicate count it prints numbers only.

    .venv/bin/python bench/http.py [--seconds 5] [--rounds 3] [--clients 16,64]
                                   [--loads fresh,replay30] [--pool 16] [--json PATH]
                                   [--prepared]
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

# This file is called http.py: drop its directory from the import path before anything imports
# the standard library's ``http`` package (starlette and uvicorn do).
SELF = Path(__file__).resolve()
BENCH = SELF.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != BENCH]


def _bench_module(name: str) -> Any:
    """A module from bench/, whose directory is off the import path (see above)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


common = _bench_module("common")  # which puts harness/ on the import path
common.use_tree_package()

import argparse  # noqa: E402
import asyncio  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402
from contextlib import asynccontextmanager  # noqa: E402

# at module level: FastAPI resolves the handlers' (string) annotations in this module's globals
from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse, Response  # noqa: E402
from psycopg_pool import AsyncConnectionPool  # noqa: E402

from pg_idempotency.asgi import IdempotencyMiddleware, Policy, get_operation  # noqa: E402

VARIANTS = ("none", "middleware", "recipe")
LOADS = ("fresh", "replay30")
REPLAY_SHARE = 0.30
# The handler's stand-in for the payment processor, in seconds (BENCH_PROCESSOR_DELAY: 0 shows
# what the variants cost without a transaction held open across it).
PROCESSOR_DELAY = float(os.environ.get("BENCH_PROCESSOR_DELAY", "0.002"))
# Server time per request: top-level statements only (what the application sends; a function's
# inner statements are inside its call's time), utility statements (BEGIN, COMMIT) included.
STATS_CONF = {"shared_preload_libraries": "pg_stat_statements",
              "pg_stat_statements.track": "top", "pg_stat_statements.track_utility": "on"}

SCHEMA_SQL = """
CREATE TABLE ledger (ref text, account text, amount int);
CREATE TABLE recipe_keys (
    account text, key text, request_hash bytea, status text,
    response_code int, response_body text,
    PRIMARY KEY (account, key)
);
"""
PG_COUNTERS = """
SELECT coalesce(sum(total_exec_time), 0)::float8, coalesce(sum(calls), 0)::bigint,
       pg_current_wal_insert_lsn()::text
FROM pg_stat_statements WHERE toplevel AND dbid = (SELECT oid FROM pg_database
                                                    WHERE datname = 'bench')
"""
TRUNCATE_SQL = "TRUNCATE ledger, recipe_keys, idempotency.keys, idempotency.key_directory"
DUPLICATES_SQL = """
SELECT coalesce(sum(n), 0)::int, (SELECT count(*) FROM ledger)::int
FROM (SELECT count(*) AS n FROM ledger GROUP BY ref HAVING count(*) > 1) AS d
"""


# -- the server (a subprocess: bench/http.py --serve VARIANT) -----------------------------------

def make_app(variant: str, dsn: str, pool_size: int) -> Any:
    # the recipe's connections are in autocommit: its claim is one statement on its own
    pool = AsyncConnectionPool(dsn, min_size=pool_size, max_size=pool_size, open=False,
                               kwargs={"autocommit": True} if variant == "recipe" else {})

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> Any:
        await pool.open(wait=True)
        yield
        await pool.close()

    app = FastAPI(lifespan=lifespan)
    insert = "INSERT INTO ledger (ref, account, amount) VALUES (%s, %s, %s)"

    if variant == "none":
        @app.post("/payments")
        async def pay_none(request: Request) -> Response:
            data = await request.json()
            ref = request.headers.get("idempotency-key")
            await asyncio.sleep(PROCESSOR_DELAY)
            async with pool.connection() as conn, conn.transaction():
                await conn.execute(insert, (ref, data["account"], data["amount"]))
            return JSONResponse({"ref": ref, "account": data["account"],
                                 "amount": data["amount"]}, status_code=201)

    elif variant == "middleware":
        app.add_middleware(IdempotencyMiddleware, pool=pool,
                           scope=lambda request: request.headers.get("x-account"),
                           routes={"POST /payments": Policy.REQUIRED})

        @app.post("/payments")
        async def pay_middleware(request: Request) -> Response:
            op = get_operation(request)
            assert op is not None  # the route requires the key
            data = await request.json()
            await asyncio.sleep(PROCESSOR_DELAY)
            await op.conn.execute(insert, (op.key, data["account"], data["amount"]))
            return JSONResponse({"ref": op.key, "account": data["account"],
                                 "amount": data["amount"]}, status_code=201)

    elif variant == "recipe":
        def problem(status: int, title: str) -> Response:
            return JSONResponse({"title": title, "status": status}, status_code=status,
                                media_type="application/problem+json")

        @app.post("/payments")
        async def pay_recipe(request: Request) -> Response:
            account = request.headers.get("x-account")
            key = request.headers.get("idempotency-key")
            if not account:
                return problem(401, "Unknown caller")
            if not key:
                return problem(400, "Idempotency-Key header required")
            body = await request.body()
            digest = hashlib.sha256(b"POST /payments\n" + body).digest()
            async with pool.connection() as conn:
                cur = await conn.execute(
                    "INSERT INTO recipe_keys (account, key, request_hash, status)"
                    " VALUES (%s, %s, %s, 'in_progress')"
                    " ON CONFLICT DO NOTHING RETURNING 1", (account, key, digest))
                if await cur.fetchone() is None:
                    # taken before: read what is stored (one statement, no lock) and answer
                    cur = await conn.execute(
                        "SELECT request_hash, status, response_code, response_body"
                        " FROM recipe_keys WHERE account = %s AND key = %s", (account, key))
                    row = await cur.fetchone()
                    if row is None or (row[0] == digest and row[1] != "completed"):
                        # in progress (or just released after an error): retry later
                        return problem(409, "Request in progress")
                    if row[0] != digest:
                        return problem(422, "Idempotency-Key reused")
                    return Response(row[3], status_code=row[2], media_type="application/json",
                                    headers={"Idempotent-Replayed": "true"})
                try:
                    data = json.loads(body)
                    await asyncio.sleep(PROCESSOR_DELAY)
                    response = JSONResponse({"ref": key, "account": data["account"],
                                             "amount": data["amount"]}, status_code=201)
                    async with conn.transaction():  # BEGIN ... COMMIT
                        await conn.execute(insert, (key, data["account"], data["amount"]))
                        cur = await conn.execute(
                            "UPDATE recipe_keys SET status = 'completed', response_code = %s,"
                            " response_body = %s WHERE account = %s AND key = %s"
                            " AND status = 'in_progress'",
                            (response.status_code, response.body.decode(), account, key))
                        if cur.rowcount != 1:
                            raise RuntimeError("key row gone while the request ran")
                    return response
                except BaseException:
                    if not conn.closed:
                        await conn.execute("DELETE FROM recipe_keys WHERE account = %s"
                                           " AND key = %s AND status = 'in_progress'",
                                           (account, key))
                    raise

    else:
        raise SystemExit(f"unknown variant {variant!r}")
    return app


def serve(variant: str, dsn: str, port: int, pool_size: int) -> None:
    common.serve_uvicorn(make_app(variant, dsn, pool_size), port)


# -- the load generator (a subprocess: bench/http.py --client JSON) -----------------------------

async def load_client(cfg: dict[str, Any]) -> dict[str, Any]:
    port, prefix = cfg["port"], cfg["prefix"]
    replay_share = REPLAY_SHARE if cfg["load"] == "replay30" else 0.0
    host = f"127.0.0.1:{port}".encode()
    answered: list[tuple[bytes, bytes, bytes]] = []  # (key, account, body) answered 2xx
    statuses: Counter[int] = Counter()
    latencies: list[float] = []
    state = {"measuring": False, "stop": False, "replayed": 0, "errors": 0}

    async def worker(i: int) -> None:
        rng = random.Random(f"{prefix}{i}")
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        n = 0
        try:
            while not state["stop"]:
                resend = bool(answered) and rng.random() < replay_share
                if resend:
                    key, account, body = rng.choice(answered)
                else:
                    n += 1
                    key = f"{prefix}-{i}-{n}".encode()
                    account = f"acct_{i % 10}".encode()
                    body = json.dumps({"account": account.decode(),
                                       "amount": rng.randint(1, 10_000)}).encode()
                request = (b"POST /payments HTTP/1.1\r\nHost: " + host
                           + b"\r\nContent-Type: application/json\r\nContent-Length: "
                           + str(len(body)).encode() + b"\r\nX-Account: " + account
                           + b"\r\nIdempotency-Key: " + key + b"\r\n\r\n" + body)
                started = time.perf_counter()
                writer.write(request)
                try:
                    status, headers, _content = await common.read_response(reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    state["errors"] += 1
                    writer.close()
                    reader, writer = await asyncio.open_connection("127.0.0.1", port)
                    continue
                if state["measuring"]:
                    latencies.append(time.perf_counter() - started)
                statuses[status] += 1
                if headers.get(b"idempotent-replayed") == b"true":
                    state["replayed"] += 1
                if 200 <= status < 300 and not resend:
                    answered.append((key, account, body))
                if headers.get(b"connection", b"").lower() == b"close":
                    writer.close()
                    reader, writer = await asyncio.open_connection("127.0.0.1", port)
        finally:
            writer.close()

    tasks = [asyncio.create_task(worker(i)) for i in range(cfg["clients"])]
    await asyncio.sleep(cfg["warmup"])
    # the driver snapshots the server's counters when it reads these lines
    print("window start", flush=True)
    state["measuring"] = True
    start = time.perf_counter()
    await asyncio.sleep(cfg["seconds"])
    state["measuring"], state["stop"] = False, True  # at once: the window is exact
    elapsed = time.perf_counter() - start
    print("window end", flush=True)
    await asyncio.gather(*tasks)  # each finishes its request in flight
    latencies.sort()

    def pct(q: float) -> float:
        if not latencies:
            return 0.0
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1000

    return {
        "rps": len(latencies) / elapsed, "measured": len(latencies),
        "p50_ms": pct(0.50), "p99_ms": pct(0.99),
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "non_2xx": sum(v for k, v in statuses.items() if not 200 <= k < 300),
        "replayed": state["replayed"], "connection_errors": state["errors"],
    }


# -- the driver ---------------------------------------------------------------------------------

def start_servers(dsn: str, pool_size: int, prepared: bool
                  ) -> dict[str, tuple[subprocess.Popen[bytes], int]]:
    servers = {}
    for variant in VARIANTS:
        port = common.free_port()
        opt_in = ["--prepared"] if prepared and variant == "middleware" else []
        proc = subprocess.Popen([sys.executable, str(SELF), "--serve", variant, "--dsn", dsn,
                                 "--port", str(port), "--pool", str(pool_size), *opt_in])
        servers[variant] = (proc, port)
    common.wait_listening(servers)
    return servers


def pg_snapshot(pg: Any, stats: Any) -> dict[str, Any]:
    """The server's counters now: top-level statements' execution time and calls in the bench
    database (``stats`` is a connection to another database, so its own queries are not
    counted), the WAL insert position, and the CPU ticks and run-queue waits of all its
    processes."""
    ms, calls, lsn = stats.execute(PG_COUNTERS).fetchone()
    return {"exec_ms": ms, "calls": calls, "lsn": lsn, "cpu": common.server_cpu(pg),
            "runqueue": common.server_runqueue(pg)}


def pg_window(before: dict[str, Any], after: dict[str, Any], stats: Any,
              requests: int) -> dict[str, float]:
    """Per request over the window between two snapshots."""
    n = max(requests, 1)
    wal = stats.execute("SELECT pg_wal_lsn_diff(%s::pg_lsn, %s::pg_lsn)::float8",
                        (after["lsn"], before["lsn"])).fetchone()[0]
    ticks = common.cpu_delta(before["cpu"], after["cpu"])
    waited = common.cpu_delta(before["runqueue"], after["runqueue"])
    return {"stmt_ms": (after["exec_ms"] - before["exec_ms"]) / n,
            "stmts": (after["calls"] - before["calls"]) / n,
            "pg_cpu_ms": ticks * 1000 / common.clock_ticks() / n,
            "pg_wait_ms": waited / 1e6 / n,
            "wal_bytes": wal / n}


def measure(conn: Any, stats: Any, pg: Any, variant: str, server: subprocess.Popen[bytes],
            port: int, clients: int, load: str, tag: str,
            args: argparse.Namespace) -> dict[str, Any]:
    # truncation and warm-up are outside the server window: it opens when the client says
    # that its measuring starts (after --warmup) and closes when it stops counting
    conn.execute(TRUNCATE_SQL)
    cpu_before = common.process_cpu_seconds(server.pid)
    cfg = {"port": port, "clients": clients, "load": load, "prefix": tag,
           "warmup": args.warmup, "seconds": args.seconds}
    client = subprocess.Popen([sys.executable, str(SELF), "--client", json.dumps(cfg)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert client.stdout is not None
    snaps = []
    for expected in ("window start", "window end"):
        line = client.stdout.readline().strip()
        if line != expected:
            client.kill()
            raise SystemExit(f"the load client said {line!r}:\n{client.communicate()}")
        snaps.append(pg_snapshot(pg, stats))
    stdout, stderr = client.communicate(timeout=args.warmup + args.seconds + 120)
    if client.returncode != 0:
        raise SystemExit(f"the load client failed:\n{stdout}\n{stderr}")
    result = json.loads(stdout)
    answers = sum(result["statuses"].values())
    # the uvicorn process's CPU per answer, warm-up included (the client's start-up is idle)
    result["server_cpu_ms"] = ((common.process_cpu_seconds(server.pid) - cpu_before) * 1000
                               / max(answers, 1))
    # PostgreSQL's cost per answer counted in the window (the requests in flight at its two
    # edges are the same in number, steady state, so they roughly cancel)
    result.update(pg_window(snaps[0], snaps[1], stats, result["measured"]))
    result["duplicates"], result["ledger_rows"] = conn.execute(DUPLICATES_SQL).fetchone()
    return result


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    import psycopg

    import pgharness

    with pgharness.PgServer(pgharness.flavour_bindir("pg15"),
                            extra_conf={**common.DURABLE, **STATS_CONF},
                            name="bench-http") as server:
        server.run_psql(server.dsn(), "CREATE EXTENSION pg_stat_statements")
        server.run_psql(server.dsn(), "CREATE DATABASE bench")
        dsn = server.dsn("bench")
        common.install_engine(server, dsn)
        server.run_psql(dsn, SCHEMA_SQL, args=common.PSQL_FILE)
        version = common.version(server)
        print(f"{version}, default durability; pool {args.pool} per server; "
              f"ours {'with' if args.prepared else 'without'} prepared statements; "
              f"{args.rounds} round(s) x {args.seconds}s after {args.warmup}s warm-up", flush=True)
        servers = start_servers(dsn, args.pool, args.prepared)
        results = []
        try:
            with psycopg.connect(dsn, autocommit=True) as conn, \
                    psycopg.connect(server.dsn(), autocommit=True) as stats:
                for clients in args.clients:
                    for load in args.loads:
                        rounds = []
                        for r in range(args.rounds):
                            per = {}
                            for variant in VARIANTS:
                                tag = f"{variant[0]}{clients}{load[0]}{r}"
                                proc, port = servers[variant]
                                res = measure(conn, stats, server, variant, proc, port,
                                              clients, load, tag, args)
                                per[variant] = res
                                print(f"  {load:8s} c={clients:<3d} round {r + 1}  "
                                      f"{variant:10s} {res['rps']:7.0f} req/s  "
                                      f"p50 {res['p50_ms']:5.1f} ms  p99 {res['p99_ms']:6.1f} ms"
                                      f"  uvicorn CPU {res['server_cpu_ms']:4.2f} ms/req"
                                      f"  PG: stmt {res['stmt_ms']:.3f} ms"
                                      f" ({res['stmts']:.1f} stmts)"
                                      f" CPU {res['pg_cpu_ms']:.3f} ms"
                                      f" run-queue {res['pg_wait_ms']:.3f} ms"
                                      f" WAL {res['wal_bytes']:4.0f} B /req"
                                      f"  replayed {res['replayed']:5d}  "
                                      f"non-2xx {res['non_2xx']}  "
                                      f"dup rows {res['duplicates']}  "
                                      f"statuses {res['statuses']}", flush=True)
                            rounds.append(per)
                        results.append(summarise(clients, load, rounds))
        finally:
            for proc, _port in servers.values():
                proc.terminate()
            for proc, _port in servers.values():
                proc.wait(30)
        return results


# server_cpu_ms is the uvicorn process's CPU per answer (the app CPU of bench/targets.toml)
PER_REQUEST = ("rps", "stmt_ms", "pg_cpu_ms", "pg_wait_ms", "wal_bytes", "server_cpu_ms")


def summarise(clients: int, load: str, rounds: list[dict[str, Any]]) -> dict[str, Any]:
    def total(variant: str, field: str) -> int:
        return sum(r[variant][field] for r in rounds)

    # per round, ours (middleware) over recipe and over none, for every per-request figure
    return {
        **common.ratio_summary(rounds, "middleware", ("recipe", "none"), PER_REQUEST),
        "clients": clients, "load": load, "rounds": rounds,
        **{f"{v}_rps": statistics.median(r[v]["rps"] for r in rounds) for v in VARIANTS},
        "middleware_over_none": statistics.median(
            r["middleware"]["rps"] / r["none"]["rps"] for r in rounds),
        "middleware_over_recipe": statistics.median(
            r["middleware"]["rps"] / r["recipe"]["rps"] for r in rounds),
        "duplicates": {v: total(v, "duplicates") for v in VARIANTS},
        "non_2xx": {v: total(v, "non_2xx") for v in VARIANTS},
        "server_cpu_ms": {v: statistics.median(r[v]["server_cpu_ms"] for r in rounds)
                          for v in VARIANTS},
    }


def print_server_cost(results: list[dict[str, Any]]) -> None:
    labels = {"rps": "requests/s", "stmt_ms": "statement ms/req", "pg_cpu_ms": "PG CPU ms/req",
              "pg_wait_ms": "PG run-queue wait ms/req", "wal_bytes": "WAL bytes/req",
              "server_cpu_ms": "app (uvicorn) CPU ms/req"}
    print("\nPostgreSQL's cost per request in the measuring window (medians of the rounds; "
          "statement time: pg_stat_statements, top level; CPU: every server process, /proc; "
          "run-queue wait: the time those processes were runnable but waited for a CPU, "
          "/proc/PID/schedstat; WAL: pg_current_wal_insert_lsn delta), the app's (uvicorn's) CPU "
          "per answer, and ours (middleware) over recipe and none, per round and median:\n")
    print("| load | figure | none | recipe | ours | ours/recipe per round (median) "
          "| ours/none per round (median) |")
    print("|---|---|---:|---:|---:|---|---|")
    for r in results:
        for field, label in labels.items():
            per, fmt = r["per_request"][field], ".3f" if field.endswith("_ms") else ".0f"
            cells = [common.rounds_cell(r["ratios"][f"{field}_over_{base}"])
                     for base in ("recipe", "none")]
            print(f"| {r['load']}, {r['clients']} clients | {label} | {per['none']:{fmt}} "
                  f"| {per['recipe']:{fmt}} | {per['middleware']:{fmt}} | {cells[0]} "
                  f"| {cells[1]} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", default="16,64")
    parser.add_argument("--loads", default=",".join(LOADS))
    parser.add_argument("--pool", type=int, default=16, help="pool size of every server")
    parser.add_argument("--json", metavar="PATH", help="write all results here")
    parser.add_argument("--prepared", action="store_true",
                        help="ours with pg_idempotency.allow_prepared_statements() (the opt-in "
                             "for processes with no transaction-mode pooler); the recipe's "
                             "statements are prepared by psycopg's default in every run")
    # internal: the server and client subprocesses
    parser.add_argument("--serve", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--dsn", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--client", metavar="CONFIG", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        if args.prepared:
            import pg_idempotency

            pg_idempotency.allow_prepared_statements()
        serve(args.serve, args.dsn, args.port, args.pool)
        return 0
    if args.client:
        print(json.dumps(asyncio.run(load_client(json.loads(args.client)))))
        return 0
    common.check_writable(parser, json=args.json)
    args.clients = [int(c) for c in args.clients.split(",")]
    args.loads = args.loads.split(",")
    for load in args.loads:
        if load not in LOADS:
            parser.error(f"unknown load {load!r} (choose from {', '.join(LOADS)})")

    started = time.monotonic()
    results = run(args)
    print(f"\nmedian of {args.rounds} round(s), {args.seconds:g}s each, requests/s "
          f"(non-2xx and duplicate ledger rows summed over the rounds):\n")
    print("| load | none rps | middleware rps | recipe rps | middleware/none "
          "| middleware/recipe | duplicates (mw, recipe) | non-2xx (none, mw, recipe) "
          "| server CPU ms/req (none, mw, recipe) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        dup, bad, cpu = r["duplicates"], r["non_2xx"], r["server_cpu_ms"]
        print(f"| {r['load']}, {r['clients']} clients | {r['none_rps']:.0f} "
              f"| {r['middleware_rps']:.0f} | {r['recipe_rps']:.0f} "
              f"| {r['middleware_over_none']:.2f} | {r['middleware_over_recipe']:.2f} "
              f"| {dup['middleware']}, {dup['recipe']} "
              f"| {bad['none']}, {bad['middleware']}, {bad['recipe']} "
              f"| {cpu['none']:.2f}, {cpu['middleware']:.2f}, {cpu['recipe']:.2f} |")
    print(f"\n(none's duplicates are its replayed requests, by construction; "
          f"took {time.monotonic() - started:.0f}s)")
    print_server_cost(results)
    if args.json:
        common.write_json(args.json, {"seconds": args.seconds, "warmup": args.warmup,
                                      "rounds": args.rounds, "pool": args.pool,
                                      "prepared": args.prepared, "results": results})
    bad_dups = sum(r["duplicates"]["middleware"] + r["duplicates"]["recipe"] for r in results)
    if bad_dups:
        print(f"DUPLICATES: {bad_dups} ledger rows with a repeated key (middleware/recipe)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
