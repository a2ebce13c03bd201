#!/usr/bin/env python3
"""Benchmark: a payment handler that awaits its provider, over real HTTP, with a small pool.

The endpoint is ``POST /payments``: it parses the JSON body, awaits the payment provider (an
``asyncio.sleep`` of ``--delays`` seconds: 0.2 stands for a provider's answer, 0.002 for the fast
path of bench/http.py), then inserts one ledger row and answers 201. Each variant is served by
one uvicorn worker (a process of its own, asyncio loop) with an ``AsyncConnectionPool`` of
``--pool`` connections (8), all against one PostgreSQL 15 server with the default durability:

  none      no idempotency: the handler takes a connection only around its INSERT
  recipe    the hand-written recipe as most apps write it: a pooled connection taken at the
            start of the request and held to its end (INSERT ... ON CONFLICT DO NOTHING into a
            key table, the provider call, then the ledger INSERT and the answer's UPDATE in one
            transaction), as in bench/http.py
  ours      pg_idempotency.asgi.IdempotencyMiddleware; the handler writes on ``op.conn`` after
            the provider call (the package's connection follows the SQL: the claim's connection
            goes back at once, the INSERT takes one, complete + COMMIT run on it)
  baseline  (with ``--baseline DIR``) ours from another checkout's python/, e.g. main's: the
            same handler, side by side

Anything that holds a connection across the provider call is capped at pool / delay requests a
second (8 / 0.2 s = 40), whatever the database could do; a variant that holds one only while its
SQL runs is capped by the clients instead (64 / 0.2 s = 320). The load generator is a raw
asyncio HTTP/1.1 client (keep-alive, one connection per simulated client, a fresh key on every
request) in a process of its own, so that its CPU is not an HTTP library's. Per round the
variants run one after the other on their servers (none, recipe, ours, [baseline]); per round
ours / recipe and ours / none of requests/s, and ours / none of the p50 latency, with the
medians of those ratios. After every measurement the ledger is checked for duplicate payments
(the exit status is 1 for any in recipe, ours or baseline). A benchmark, not a test: it prints
numbers.

    .venv/bin/python bench/provider.py [--delays 0.2,0.002] [--pool 8] [--clients 64]
                                       [--seconds 5] [--warmup 1] [--rounds 3]
                                       [--baseline DIR] [--json PATH]
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

SELF = Path(__file__).resolve()
BENCH = SELF.parent
# bench/http.py would shadow the standard library's ``http`` (starlette and uvicorn import it)
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
if "--tree" in sys.argv:  # a baseline server: the package of another checkout
    sys.path.insert(0, str(Path(sys.argv[sys.argv.index("--tree") + 1]) / "python"))
else:
    common.use_tree_package()

import argparse  # noqa: E402
import asyncio  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
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

VARIANTS = ("none", "recipe", "ours")
SCHEMA_SQL = """
CREATE TABLE ledger (ref text, account text, amount int);
CREATE TABLE recipe_keys (
    account text, key text, request_hash bytea, status text,
    response_code int, response_body text,
    PRIMARY KEY (account, key)
);
"""
TRUNCATE_SQL = "TRUNCATE ledger, recipe_keys, idempotency.keys, idempotency.key_directory"
DUPLICATES_SQL = """
SELECT coalesce(sum(n), 0)::int FROM (SELECT count(*) AS n FROM ledger GROUP BY ref
                                      HAVING count(*) > 1) AS d
"""
INSERT = "INSERT INTO ledger (ref, account, amount) VALUES (%s, %s, %s)"


# -- the server (a subprocess: bench/provider.py --serve VARIANT) -------------------------------

def make_app(variant: str, dsn: str, pool_size: int) -> Any:
    # the recipe's connections are in autocommit: its claim is one statement on its own
    pool = AsyncConnectionPool(dsn, min_size=pool_size, max_size=pool_size, open=False,
                               timeout=60,
                               kwargs={"autocommit": True} if variant == "recipe" else {})

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> Any:
        await pool.open(wait=True)
        yield
        await pool.close()

    app = FastAPI(lifespan=lifespan)

    def delay(request: Request) -> float:
        return float(request.headers.get("x-delay", "0"))

    def answer(ref: str | None, data: dict[str, Any]) -> JSONResponse:
        return JSONResponse({"ref": ref, "account": data["account"], "amount": data["amount"]},
                            status_code=201)

    if variant == "none":
        @app.post("/payments")
        async def pay_none(request: Request) -> Response:
            data = await request.json()
            ref = request.headers.get("idempotency-key")
            await asyncio.sleep(delay(request))  # the provider
            async with pool.connection() as conn, conn.transaction():
                await conn.execute(INSERT, (ref, data["account"], data["amount"]))
            return answer(ref, data)

    elif variant in ("ours", "baseline"):
        app.add_middleware(IdempotencyMiddleware, pool=pool,
                           scope=lambda request: request.headers.get("x-account"),
                           routes={"POST /payments": Policy.REQUIRED})

        @app.post("/payments")
        async def pay_ours(request: Request) -> Response:
            op = get_operation(request)
            assert op is not None  # the route requires the key
            data = await request.json()
            await asyncio.sleep(delay(request))  # the provider
            await op.conn.execute(INSERT, (op.key, data["account"], data["amount"]))
            return answer(op.key, data)

    elif variant == "recipe":
        @app.post("/payments")
        async def pay_recipe(request: Request) -> Response:
            account = request.headers.get("x-account")
            key = request.headers.get("idempotency-key")
            body = await request.body()
            digest = hashlib.sha256(b"POST /payments\n" + body).digest()
            async with pool.connection() as conn:  # held across the provider call
                cur = await conn.execute(
                    "INSERT INTO recipe_keys (account, key, request_hash, status)"
                    " VALUES (%s, %s, %s, 'in_progress')"
                    " ON CONFLICT DO NOTHING RETURNING 1", (account, key, digest))
                if await cur.fetchone() is None:
                    return JSONResponse({"title": "Request in progress"}, status_code=409)
                try:
                    data = json.loads(body)
                    await asyncio.sleep(delay(request))  # the provider
                    response = answer(key, data)
                    async with conn.transaction():
                        await conn.execute(INSERT, (key, data["account"], data["amount"]))
                        await conn.execute(
                            "UPDATE recipe_keys SET status = 'completed', response_code = %s,"
                            " response_body = %s WHERE account = %s AND key = %s",
                            (response.status_code, response.body.decode(), account, key))
                    return response
                except BaseException:
                    if not conn.closed:
                        await conn.execute("DELETE FROM recipe_keys WHERE account = %s"
                                           " AND key = %s", (account, key))
                    raise

    else:
        raise SystemExit(f"unknown variant {variant!r}")
    return app


def serve(variant: str, dsn: str, port: int, pool_size: int) -> None:
    common.serve_uvicorn(make_app(variant, dsn, pool_size), port)


# -- the load generator (a subprocess: bench/provider.py --client JSON) -------------------------

async def load_client(cfg: dict[str, Any]) -> dict[str, Any]:
    port, prefix = cfg["port"], cfg["prefix"]
    host = f"127.0.0.1:{port}".encode()
    delay = str(cfg["delay"]).encode()
    statuses: Counter[int] = Counter()
    latencies: list[float] = []
    state = {"measuring": False, "stop": False}

    async def worker(i: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        account = f"acct_{i % 10}".encode()
        n = 0
        try:
            while not state["stop"]:
                n += 1
                key = f"{prefix}-{i}-{n}".encode()
                body = b'{"account": "%s", "amount": %d}' % (account, n)
                request = (b"POST /payments HTTP/1.1\r\nHost: " + host
                           + b"\r\nContent-Type: application/json\r\nContent-Length: "
                           + str(len(body)).encode() + b"\r\nX-Account: " + account
                           + b"\r\nX-Delay: " + delay
                           + b"\r\nIdempotency-Key: " + key + b"\r\n\r\n" + body)
                started = time.perf_counter()
                writer.write(request)
                status, _headers, _body = await common.read_response(reader)
                if state["measuring"]:
                    latencies.append(time.perf_counter() - started)
                    statuses[status] += 1
        finally:
            writer.close()

    tasks = [asyncio.create_task(worker(i)) for i in range(cfg["clients"])]
    await asyncio.sleep(cfg["warmup"])
    state["measuring"] = True
    start = time.perf_counter()
    await asyncio.sleep(cfg["seconds"])
    state["measuring"], state["stop"] = False, True
    elapsed = time.perf_counter() - start
    await asyncio.gather(*tasks)
    latencies.sort()

    def pct(q: float) -> float:
        if not latencies:
            return 0.0
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))]

    ok = sum(v for k, v in statuses.items() if 200 <= k < 300)
    return {"rps": ok / elapsed, "p50": pct(0.50), "p99": pct(0.99),
            "statuses": {str(k): v for k, v in sorted(statuses.items())},
            "non_2xx": len(latencies) - ok}


# -- the driver ---------------------------------------------------------------------------------

def start_servers(dsn: str, args: argparse.Namespace
                  ) -> dict[str, tuple[subprocess.Popen[bytes], int]]:
    servers = {}
    for variant in args.variants:
        port = common.free_port()
        tree = ["--tree", str(args.baseline)] if variant == "baseline" else []
        proc = subprocess.Popen([sys.executable, str(SELF), "--serve", variant, "--dsn", dsn,
                                 "--port", str(port), "--pool", str(args.pool), *tree])
        servers[variant] = (proc, port)
    common.wait_listening(servers)
    return servers


def measure(conn: Any, port: int, delay: float, tag: str, args: argparse.Namespace
            ) -> dict[str, Any]:
    conn.execute(TRUNCATE_SQL)
    cfg = {"port": port, "clients": args.clients, "delay": delay, "prefix": tag,
           "warmup": args.warmup, "seconds": args.seconds}
    out = subprocess.run([sys.executable, str(SELF), "--client", json.dumps(cfg)],
                         capture_output=True, text=True, check=False,
                         timeout=args.warmup + args.seconds + 120)
    if out.returncode != 0:
        raise SystemExit(f"the load client failed:\n{out.stdout}\n{out.stderr}")
    result: dict[str, Any] = json.loads(out.stdout)
    result["duplicates"] = conn.execute(DUPLICATES_SQL).fetchone()[0]
    return result


def summarise(delay: float, rounds: list[dict[str, Any]], variants: list[str]
              ) -> dict[str, Any]:
    def per_round(field: str, ours: str, base: str) -> list[float]:
        return [r[ours][field] / r[base][field] if r[base][field] else float("nan")
                for r in rounds]

    ratios = {"rps_over_recipe": per_round("rps", "ours", "recipe"),
              "rps_over_none": per_round("rps", "ours", "none"),
              "p50_over_none": per_round("p50", "ours", "none")}
    if "baseline" in variants:
        ratios["rps_over_baseline"] = per_round("rps", "ours", "baseline")
        ratios["p50_over_baseline"] = per_round("p50", "ours", "baseline")
    return {"delay": delay, "rounds": rounds, "ratios": ratios,
            "ratio_medians": {k: statistics.median(v) for k, v in ratios.items()},
            "rps": {v: statistics.median(r[v]["rps"] for r in rounds) for v in variants},
            "p50": {v: statistics.median(r[v]["p50"] for r in rounds) for v in variants},
            "p99": {v: statistics.median(r[v]["p99"] for r in rounds) for v in variants},
            "duplicates": {v: sum(r[v]["duplicates"] for r in rounds) for v in variants},
            "non_2xx": {v: sum(r[v]["non_2xx"] for r in rounds) for v in variants}}


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    import psycopg

    import pgharness

    with pgharness.PgServer(pgharness.flavour_bindir("pg15"), extra_conf=common.DURABLE,
                            name="bench-provider") as server:
        server.run_psql(server.dsn(), "CREATE DATABASE bench")
        dsn = server.dsn("bench")
        common.install_engine(server, dsn)
        server.run_psql(dsn, SCHEMA_SQL, args=common.PSQL_FILE)
        print(f"{common.version(server)}, default durability; one uvicorn worker per variant, "
              f"pool {args.pool}, {args.clients} clients, fresh keys; {args.rounds} round(s) x "
              f"{args.seconds:g}s after {args.warmup:g}s warm-up"
              + (f"; baseline: {args.baseline}" if args.baseline else ""), flush=True)
        servers = start_servers(dsn, args)
        results = []
        try:
            with psycopg.connect(dsn, autocommit=True) as conn:
                for delay in args.delays:
                    rounds = []
                    for r in range(args.rounds):
                        per = {}
                        for variant in args.variants:
                            res = measure(conn, servers[variant][1], delay,
                                          f"{variant[0]}{delay}{r}", args)
                            per[variant] = res
                            print(f"  provider {delay * 1000:5.0f} ms  round {r + 1}  "
                                  f"{variant:8s} {res['rps']:6.0f} req/s  "
                                  f"p50 {res['p50'] * 1000:6.0f} ms  "
                                  f"p99 {res['p99'] * 1000:6.0f} ms  "
                                  f"non-2xx {res['non_2xx']}  dup rows {res['duplicates']}",
                                  flush=True)
                        rounds.append(per)
                    results.append(summarise(delay, rounds, args.variants))
        finally:
            for proc, _port in servers.values():
                proc.terminate()
            for proc, _port in servers.values():
                proc.wait(30)
        return results


def print_tables(results: list[dict[str, Any]], variants: list[str]) -> None:
    print("\nrequests/s and p50 latency (medians of the rounds), and ours over the others per "
          "round (median in bold):\n")
    head = " | ".join(f"{v} rps, p50" for v in variants)
    extra = " | ours/baseline rps" if "baseline" in variants else ""
    print(f"| provider call | {head} | ours/recipe rps | ours/none rps | ours/none p50{extra} |")
    print("|---|" + "---:|" * len(variants) + "---|---|---|" + ("---|" if extra else ""))
    for r in results:
        cells = " | ".join(f"{r['rps'][v]:.0f}, {r['p50'][v] * 1000:.0f} ms" for v in variants)
        ratios = [common.rounds_cell(r["ratios"][k])
                  for k in ("rps_over_recipe", "rps_over_none", "p50_over_none")]
        if extra:
            ratios.append(common.rounds_cell(r["ratios"]["rps_over_baseline"]))
        print(f"| {r['delay'] * 1000:.0f} ms | {cells} | " + " | ".join(ratios) + " |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delays", default="0.2,0.002",
                        help="the provider call's seconds, one set of rounds each")
    parser.add_argument("--pool", type=int, default=8, help="pool size of every server")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", type=Path, metavar="DIR",
                        help="also serve ours from DIR/python (another checkout, e.g. main's)")
    parser.add_argument("--json", metavar="PATH", help="write all results here")
    # internal: the server and client subprocesses
    parser.add_argument("--serve", choices=(*VARIANTS, "baseline"), help=argparse.SUPPRESS)
    parser.add_argument("--tree", help=argparse.SUPPRESS)
    parser.add_argument("--dsn", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--client", metavar="CONFIG", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.dsn, args.port, args.pool)
        return 0
    if args.client:
        print(json.dumps(asyncio.run(load_client(json.loads(args.client)))))
        return 0
    common.check_writable(parser, json=args.json)
    if args.baseline is not None and not (args.baseline / "python" / "pg_idempotency").is_dir():
        parser.error(f"--baseline {args.baseline}: no python/pg_idempotency there")
    args.delays = [float(d) for d in args.delays.split(",")]
    args.variants = [*VARIANTS, *(["baseline"] if args.baseline else [])]

    started = time.monotonic()
    results = run(args)
    print_tables(results, args.variants)
    print(f"\n(took {time.monotonic() - started:.0f}s)")
    if args.json:
        common.write_json(args.json, {"seconds": args.seconds, "warmup": args.warmup,
                                      "rounds": args.rounds, "pool": args.pool,
                                      "clients": args.clients,
                                      "baseline": str(args.baseline or ""),
                                      "results": results})
    dups = sum(r["duplicates"][v] for r in results for v in args.variants if v != "none")
    if dups:
        print(f"DUPLICATES: {dups} ledger rows with a repeated key")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
