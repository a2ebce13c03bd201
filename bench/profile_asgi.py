#!/usr/bin/env python3
"""Profiling driver: the Python CPU per request of bench/http.py's three apps, without HTTP.

bench/http.py measures the uvicorn process's CPU per answer over real HTTP. This driver takes
the same FastAPI apps (``make_app`` of bench/http.py: ``none``, ``middleware``, ``recipe``),
calls them as ASGI applications directly (``await app(scope, receive, send)`` with hand-made
scopes, as uvicorn would after parsing a request), and reports the process's CPU time
(``time.process_time``) per request, so a change to the middleware's Python path shows up
without the noise of a load generator, sockets and HTTP parsing. One throwaway PostgreSQL 15
(harness/pgharness.py, default durability as in bench/http.py; ``--fast`` turns fsync,
synchronous_commit and full_page_writes off) with ``migrations/*.sql`` installed serves every
measurement.

Every measurement is a subprocess of its own (``--child``): it loads ``TREE/bench/http.py``
from its path with importlib (the file is named ``http.py``, and it puts ``TREE/python`` first
on the import path, so ``--tree`` selects which copy of the package is measured), builds the
app, runs its lifespan (the pool opens), warms up with ``--warmup`` requests, then sends
``--requests`` requests from ``--concurrency`` tasks (asyncio.gather), each with a new
Idempotency-Key, or with ``--replay-share`` of them resending a key answered before with the
same body. The tables are truncated before each measurement. The handlers' 2 ms
"processor" sleep is set to 0 unless ``--delay`` (it costs no CPU, but it makes runs slow).

Runs are interleaved (round by round: every tree, every variant), and the table shows the
median CPU µs per request over ``--rounds``, user + system, and in parentheses user time
alone (the rest is the kernel's: socket calls and wake-ups). On a shared 2-core machine one
measurement varies by 10-30% from run to run, for the same code: compare medians of several
rounds, and the variants of one tree with each other.

    .venv/bin/python bench/profile_asgi.py [--variants none,middleware,recipe]
        [--tree .] [--tree /path/to/baseline] [--requests 3000] [--concurrency 8]
        [--replay-share 0.3] [--rounds 5] [--delay] [--fast]
    .venv/bin/python bench/profile_asgi.py --profile [--variants recipe] [--sort tottime]
        [--top 40] [--pstats PATH]
        # cProfile of one variant (default middleware; the first --tree); --pstats keeps
        # the raw profile for pstats

``--components`` times the middleware's own steps for one request, without a database or a
server (each tree in a subprocess of its own, best of 5 loops, µs per call): the route and the
key (header parsing), the scope callback, reading the body, the scope check and the
fingerprint, building the claim, parsing a claim's row (fresh, and a replay with its stored
answer), building a replay's answer, the telemetry and log checks of two calls, and the
complete's preparation and result (the stored headers, the query, the StoredResponse). What a
request costs beyond their sum is psycopg, asyncio, the pool and the framework.

A baseline tree is any checkout with python/ and bench/http.py, for instance
``git archive <commit> python bench tests | tar -x -C /tmp/base``. Every answer must be a
201 (fresh or replayed): the driver exits non-zero otherwise. This is a profiling tool, not a
test.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# bench/ holds a file named http.py: off the import path before anything imports the standard
# library's http package (starlette does).
BENCH = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != BENCH]
ROOT = BENCH.parent
VARIANTS = ("none", "middleware", "recipe")
DURABLE = {"fsync": "on", "synchronous_commit": "on", "full_page_writes": "on"}
POOL = 16


# -- the child: one measurement ------------------------------------------------------------

def load_bench_http(tree: Path) -> Any:
    """``TREE/bench/http.py`` as a module (not as ``http``: that is the standard library's)."""
    spec = importlib.util.spec_from_file_location("bench_http", tree / "bench" / "http.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_scope(key: bytes, account: bytes, body: bytes) -> dict[str, Any]:
    return {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1", "method": "POST", "scheme": "http", "path": "/payments",
        "raw_path": b"/payments", "query_string": b"", "root_path": "",
        "headers": [(b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()), (b"x-account", account),
                    (b"idempotency-key", key)],
        "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000), "state": {},
    }


async def drive(app: Any, *, requests: int, concurrency: int, replay_share: float,
                prefix: str) -> dict[str, int]:
    """Send ``requests`` requests from ``concurrency`` tasks; count the statuses."""
    answered: list[tuple[bytes, bytes, bytes]] = []
    statuses: dict[str, int] = {}
    replayed = 0

    async def one(key: bytes, account: bytes, body: bytes) -> tuple[int, bool]:
        sent_body = False
        start: dict[str, Any] = {}

        async def receive() -> dict[str, Any]:
            nonlocal sent_body
            if not sent_body:
                sent_body = True
                return {"type": "http.request", "body": body, "more_body": False}
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                start.update(message)

        await app(make_scope(key, account, body), receive, send)
        return start["status"], (b"idempotent-replayed", b"true") in start.get("headers", [])

    async def worker(i: int, count: int) -> None:
        nonlocal replayed
        rng = random.Random(f"{prefix}{i}")
        for n in range(count):
            if answered and rng.random() < replay_share:
                key, account, body = rng.choice(answered)
                resend = True
            else:
                key = f"{prefix}-{i}-{n}".encode()
                account = f"acct_{i % 10}".encode()
                body = json.dumps({"account": account.decode(),
                                   "amount": rng.randint(1, 10_000)}).encode()
                resend = False
            status, was_replayed = await one(key, account, body)
            statuses[str(status)] = statuses.get(str(status), 0) + 1
            replayed += was_replayed
            if 200 <= status < 300 and not resend:
                answered.append((key, account, body))

    per, extra = divmod(requests, concurrency)
    await asyncio.gather(*(worker(i, per + (i < extra)) for i in range(concurrency)))
    return {"replayed": replayed, **{f"status_{k}": v for k, v in sorted(statuses.items())}}


async def child_main(cfg: dict[str, Any]) -> dict[str, Any]:
    module = load_bench_http(Path(cfg["tree"]))
    if not cfg["delay"]:
        module.PROCESSOR_DELAY = 0
    app = module.make_app(cfg["variant"], cfg["dsn"], POOL)
    profiler = None
    async with app.router.lifespan_context(app):
        await drive(app, requests=cfg["warmup"], concurrency=cfg["concurrency"],
                    replay_share=cfg["replay_share"], prefix=f"{cfg['tag']}w")
        if cfg["profile"]:
            import cProfile

            profiler = cProfile.Profile(time.process_time)  # CPU, not wall time
            profiler.enable()
        cpu, wall, times = time.process_time(), time.perf_counter(), os.times()
        counts = await drive(app, requests=cfg["requests"], concurrency=cfg["concurrency"],
                             replay_share=cfg["replay_share"], prefix=cfg["tag"])
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        user = os.times().user - times.user
        if profiler is not None:
            profiler.disable()
    if profiler is not None:
        import pstats

        if cfg.get("pstats"):
            profiler.dump_stats(cfg["pstats"])
        stats = pstats.Stats(profiler, stream=sys.stderr)
        stats.strip_dirs().sort_stats(cfg["sort"]).print_stats(cfg["top"])
        if cfg["sort"] != "cumulative":
            stats.sort_stats("cumulative").print_stats(cfg["top"])
    return {"cpu_us": cpu * 1e6 / cfg["requests"], "user_us": user * 1e6 / cfg["requests"],
            "wall_s": wall, **counts}


# -- the middleware's steps, without a database ---------------------------------------------

def components(tree: Path, loops: int = 5000) -> dict[str, float]:
    """µs per call of each step of a keyed request in ``TREE/python``'s middleware (best of 5
    runs of ``loops`` calls), fed what a request of bench/http.py brings."""
    sys.path.insert(0, str(tree / "python"))
    import logging

    from starlette.requests import Request
    from starlette.responses import JSONResponse

    from pg_idempotency import asgi, core, telemetry
    from pg_idempotency import contract as http
    from pg_idempotency.core import ClaimResult, OperationCore

    body = json.dumps({"account": "acct_3", "amount": 4242}).encode()
    key = b"c1600f-7-12345"
    scope = make_scope(key, b"acct_3", body)

    class Pool:  # the middleware only reads max_size before a request
        max_size = POOL

    mw = asgi.IdempotencyMiddleware(lambda *a: None, pool=Pool(),
                                    scope=lambda r: r.headers.get("x-account"),
                                    routes={"POST /payments": http.Policy.REQUIRED})
    settings = mw.settings
    route = mw.routes.route("POST", "/payments")
    epoch = "1733400000.123456"
    fresh = {"outcome": "claimed", "lease_token": 4294967297, "lease_expires_at": epoch,
             "recovery_point": None, "attempts": 1, "retry_after": None, "created_at": epoch,
             "response_status": None, "response_headers": None, "response_body": None,
             "response_body_bytes": None, "response_content_type": None, "completed_at": None}
    response = JSONResponse({"ref": key.decode(), "account": "acct_3", "amount": 4242},
                            status_code=201)
    replay = dict(fresh, outcome="replay", lease_token=None, response_status=201,
                  response_headers="{}", response_body_bytes=response.body,
                  response_content_type="application/json", completed_at=epoch)
    replayed = ClaimResult.from_row(replay)

    def route_and_key() -> None:
        headers = dict(scope["headers"])
        found = mw.routes.route("POST", "/payments")
        http.read_key(settings, found.policy, headers.get(mw.header), "POST", "/payments")
        http.content_too_long(settings, asgi._ascii(headers.get(b"content-length")))

    def read_body() -> None:
        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": body, "more_body": False}

        coro = asgi._read_body(receive, settings.max_request_bytes)
        try:
            coro.send(None)
        except StopIteration:
            pass

    def replay_answer() -> None:
        answer = http.claim_answer(settings, replayed)
        assert answer is not None
        [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in answer.headers]

    def telemetry_and_log() -> None:
        for call in ("claim", "complete"):
            obs = telemetry.start(call, "acct_3", "k")
            telemetry.end(obs, "ok")
            core.logger.isEnabledFor(logging.INFO)

    def complete() -> None:
        raw = [(bytes(k), bytes(v)) for k, v in response.raw_headers]
        stored, content_type = http.stored_parts(
            settings, [(k.decode("latin-1"), v.decode("latin-1")) for k, v in raw])
        op = OperationCore("acct_3", key.decode(), None, fingerprint=bytes(32))
        op._token = 4294967297
        steps = op.g_complete(201, response.body, stored, content_type)
        next(steps)
        try:
            steps.send({"completed_at": epoch})
        except StopIteration:
            pass

    steps: dict[str, Any] = {
        "route + key + length": route_and_key,
        "scope callback (Request)": lambda: mw.scope_of(Request(scope)),
        "read body": read_body,
        "scope check + fingerprint": lambda: http.keyed_request(
            settings, route, "acct_3", "POST", "/payments", "", "application/json", body),
        "claim query": lambda: core._claim_query("acct_3", key.decode(), None,
                                                 core.DEFAULT_LEASE, bytes(32), False, None,
                                                 alone=True),
        "claim row (fresh)": lambda: ClaimResult.from_row(fresh),
        "claim row (replay)": lambda: ClaimResult.from_row(replay),
        "replay answer": replay_answer,
        "telemetry + log (2 calls)": telemetry_and_log,
        "complete: prepare + result": complete,
    }
    out = {}
    for name, step in steps.items():
        best = float("inf")
        for _ in range(5):
            started = time.perf_counter()
            for _ in range(loops):
                step()
            best = min(best, time.perf_counter() - started)
        out[name] = best * 1e6 / loops
    return out


def print_components(trees: list[Path], rounds: int) -> int:
    # Interleaved rounds, every tree in each, and the least of them per step: on a shared
    # machine a step only ever takes longer than it costs, never shorter.
    results: list[dict[str, float]] = [{} for _ in trees]
    for _ in range(rounds):
        for best, tree in zip(results, trees, strict=True):
            out = subprocess.run([sys.executable, str(Path(__file__).resolve()),
                                  "--components-of", str(tree)],
                                 stdout=subprocess.PIPE, text=True, check=True)
            for name, us in json.loads(out.stdout.splitlines()[-1]).items():
                best[name] = min(best.get(name, us), us)
    print(f"µs per call, the least of {rounds} interleaved rounds of 5 loops (no database; "
          "psycopg, asyncio and the framework are not in these)\n")
    print("| step | " + " | ".join(str(t) for t in trees) + " |")
    print("|---|" + "---:|" * len(trees))
    for name in results[0]:
        print(f"| {name} | " + " | ".join(f"{r[name]:.1f}" for r in results) + " |")
    fresh = [n for n in results[0] if n not in ("claim row (replay)", "replay answer")]
    replay = [n for n in results[0] if n not in ("claim row (fresh)", "claim query",
                                                  "complete: prepare + result")]
    replay.remove("telemetry + log (2 calls)")  # a replay has one call: counted as half
    for label, names, half in (("fresh key, sum", fresh, 0.0), ("replay, sum", replay, 0.5)):
        sums = [sum(r[n] for n in names) + half * r["telemetry + log (2 calls)"]
                for r in results]
        print(f"| {label} | " + " | ".join(f"**{x:.1f}**" for x in sums) + " |")
    return 0


# -- the parent: a server, interleaved children, the table ---------------------------------

def measure(cfg: dict[str, Any], conn: Any) -> dict[str, Any]:
    conn.execute("TRUNCATE ledger, recipe_keys, idempotency.keys, idempotency.key_directory")
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child",
                          json.dumps(cfg)], stdout=subprocess.PIPE, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"the {cfg['variant']} measurement failed (exit {out.returncode})")
    result: dict[str, Any] = json.loads(out.stdout.splitlines()[-1])
    bad = {k: v for k, v in result.items() if k.startswith("status_") and k != "status_201"}
    if bad:
        raise SystemExit(f"{cfg['variant']} ({cfg['tree']}): answers other than 201: {bad}")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", help=f"default: {','.join(VARIANTS)} "
                        "(with --profile: the first one, default middleware)")
    parser.add_argument("--tree", action="append", type=Path,
                        help="a checkout whose python/ and bench/http.py are measured "
                             "(repeatable; default: this one)")
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--replay-share", type=float, default=0.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--delay", action="store_true",
                        help="keep the handlers' 2 ms processor sleep")
    parser.add_argument("--fast", action="store_true",
                        help="fsync, synchronous_commit and full_page_writes off")
    parser.add_argument("--profile", action="store_true",
                        help="one cProfile run of one variant (first --tree)")
    parser.add_argument("--sort", default="tottime", help="pstats sort key (--profile)")
    parser.add_argument("--top", type=int, default=40, help="functions printed (--profile)")
    parser.add_argument("--pstats", metavar="PATH",
                        help="also write the raw profile here (--profile; for pstats)")
    parser.add_argument("--components", action="store_true",
                        help="time the middleware's steps without a database (every --tree)")
    parser.add_argument("--child", metavar="CONFIG", help=argparse.SUPPRESS)
    parser.add_argument("--components-of", metavar="TREE", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(asyncio.run(child_main(json.loads(args.child)))))
        return 0
    if args.components_of:
        print(json.dumps(components(Path(args.components_of))))
        return 0
    if args.components:
        return print_components([t.resolve() for t in (args.tree or [ROOT])], args.rounds)

    sys.path.insert(0, str(ROOT / "harness"))
    import psycopg

    import pgharness

    trees = [t.resolve() for t in (args.tree or [ROOT])]
    variants = (args.variants or ("middleware" if args.profile else ",".join(VARIANTS))
                ).split(",")
    if args.profile:
        variants = variants[:1]
    for v in variants:
        if v not in VARIANTS:
            parser.error(f"unknown variant {v!r}")
    with pgharness.PgServer(pgharness.flavour_bindir("pg15"),
                            extra_conf=None if args.fast else DURABLE,
                            name="profile-asgi") as server:
        server.run_psql(server.dsn(), "CREATE DATABASE bench")
        dsn = server.dsn("bench")
        for migration in sorted((ROOT / "migrations").glob("*.sql")):
            server.run_psql(dsn, migration, args=("-X", "-q", "-1", "-v", "ON_ERROR_STOP=1"))
        bench_http = load_bench_http(ROOT)  # only for its schema
        server.run_psql(dsn, bench_http.SCHEMA_SQL, args=("-X", "-q", "-v", "ON_ERROR_STOP=1"))
        base = {"dsn": dsn, "requests": args.requests, "warmup": args.warmup,
                "concurrency": args.concurrency, "replay_share": args.replay_share,
                "delay": args.delay, "profile": args.profile, "sort": args.sort,
                "top": args.top, "pstats": args.pstats}
        with psycopg.connect(dsn, autocommit=True) as conn:
            if args.profile:
                cfg = dict(base, tree=str(trees[0]), variant=variants[0], tag="p")
                result = measure(cfg, conn)
                print(f"{variants[0]} ({trees[0]}), under cProfile: {result['cpu_us']:.0f} µs "
                      "CPU per request")
                return 0
            cpu: dict[tuple[str, str], list[float]] = {}
            user: dict[tuple[str, str], list[float]] = {}
            for r in range(args.rounds):
                for t, tree in enumerate(trees):
                    for variant in variants:
                        cfg = dict(base, tree=str(tree), variant=variant, tag=f"{r}{t}{variant}")
                        result = measure(cfg, conn)
                        cpu.setdefault((str(tree), variant), []).append(result["cpu_us"])
                        user.setdefault((str(tree), variant), []).append(result["user_us"])
                        print(f"  round {r + 1} {variant:10s} {result['cpu_us']:7.0f} µs/req "
                              f"(user {result['user_us']:5.0f}) "
                              f"{args.requests / result['wall_s']:6.0f} req/s  "
                              f"replayed {result['replayed']:4d}  {tree}", flush=True)
    print(f"\nCPU µs per request, median of {args.rounds} round(s); {args.requests} requests, "
          f"concurrency {args.concurrency}, replay share {args.replay_share:g}, "
          f"processor delay {'2 ms' if args.delay else 'off'}\n")
    print("| tree | " + " | ".join(f"{v} (user)" for v in variants) + " |")
    print("|---|" + "---:|" * len(variants))
    for tree in trees:
        row = [f"{statistics.median(cpu[(str(tree), v)]):.0f} "
               f"({statistics.median(user[(str(tree), v)]):.0f})" for v in variants]
        print(f"| {tree} | " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
