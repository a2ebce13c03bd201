"""The growth shapes over HTTP (issue 49, item 1), through every adapter, on real PostgreSQL.

Before 0.12.0 the fingerprint behind every adapter wrote a number in plain decimal: a 27 KB body
of ``1e131071`` took one uvicorn app 21 s and 0.8-1.0 GB, and an ordinary request sent meanwhile
waited 19.2 s. Here each shape (huge and tiny exponents, deep arrays of big numbers, many keys,
long strings with escapes) is sent under the adapters' limit: executed once (201), replayed for
its retry, a different body under the same key 422, and a body over the limit 413, never
claimed. Under the default 1 MiB limit, uvicorn (the ASGI middleware) and gunicorn (the Flask
decorator and the WSGI middleware, gthread and sync workers, in a process of their own) answer
the largest such body and an ordinary request sent meanwhile within a fraction of the old times,
and the app's (the gunicorn worker's) peak memory grows by a small multiple of the limit at most.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from itertools import count, repeat
from pathlib import Path

import httpx
import psycopg
import pytest
from helpers.bounds_apps import ADAPTERS, MAX_REQUEST, keys_of, ledger, post, problem, serve
from helpers.http import uvicorn_server, with_pool_lifespan
from helpers.served import TABLES, gunicorn, vm_hwm_kb, worker_pids
from psycopg_pool import AsyncConnectionPool
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route as StarletteRoute

from pg_idempotency import asgi as pg_asgi
from pg_idempotency.contract import Route
from pgharness import WAIT_BOUND

#: Seconds a request may take here: 0.11.0 took 21 s for 27 KB; on an idle machine these take
#: a fraction of a second, this leaves room for a loaded 2-core one.
REQUEST_BOUND = 10.0
#: Seconds an ordinary request may wait behind the largest growth body (0.11.0: 19.2 s).
ORDINARY_BOUND = 3.0
MIB = 1024 * 1024


def shapes(limit: int) -> dict[str, str]:
    """JSON bodies of each growth shape, each just under ``limit`` bytes (an "intent" member
    first, for the handler's ledger row: "%s" in them)."""
    def fill(head: str, items: Iterator[str], tail: str, sep: str = ",") -> str:
        parts: list[str] = []
        size = len(head) + len(tail) + 10
        for item in items:
            if size + len(item) + len(sep) > limit:
                break
            parts.append(item)
            size += len(item) + len(sep)
        return head + sep.join(parts) + tail

    return {
        "huge exponents": fill('{"intent": "%s", "x": [', repeat("1e131071"), "]}"),
        "tiny exponents": fill('{"intent": "%s", "x": [', repeat("-9.87654321e-16375"), "]}"),
        "deep arrays of big numbers": fill('{"intent": "%s", "x": ' + "[" * 100,
                                           repeat("1.5e131000"), "]" * 100 + "}"),
        "many keys": fill('{"intent": "%s", "x": {', (f'"k{i}": 1e-16383' for i in count()),
                          "}}"),
        "long strings with escapes": fill('{"intent": "%s", "x": "', repeat("\\u0001\\n"),
                                          '"}', ""),
    }


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_growth_shapes_are_executed_once_and_replayed(adapter: str, db: str) -> None:
    with serve(adapter, db) as base:
        for i, (shape, template) in enumerate(shapes(MAX_REQUEST).items()):
            body = (template % f"g{i}").encode()
            assert len(body) <= MAX_REQUEST, (shape, len(body))
            started = time.monotonic()
            first = post(base, "/pay", f"g{i}", None, raw=body)
            elapsed = time.monotonic() - started
            assert first.status_code == 201, (shape, first.text)
            assert elapsed < REQUEST_BOUND, (shape, elapsed)
            again = post(base, "/pay", f"g{i}", None, raw=body)
            assert again.headers.get("idempotent-replayed") == "true", (shape, again.text)
            # the same shape, another value: not this request
            other = body.replace(b"1e131071", b"1e131070").replace(b"-16375", b"-16374") \
                .replace(b"1e-16383", b"1e-16382").replace(b"1.5e131000", b"1.5e131001") \
                .replace(b"\\u0001", b"\\u0002")
            problem(post(base, "/pay", f"g{i}", None, raw=other), 422)
            assert ledger(db, f"g{i}") == 1, shape
            # over the limit: 413, nothing claimed
            over = (shapes(MAX_REQUEST + 400)[shape] % f"o{i}").encode()
            assert len(over) > MAX_REQUEST
            problem(post(base, "/pay", f"o{i}", None, raw=over), 413)
        assert {k for _, k, _ in keys_of(db)} == {f"g{i}" for i in range(5)}


def _vm_hwm_kb() -> int:
    return int(re.search(r"^VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text(),
                         re.M).group(1))  # type: ignore[union-attr]


def test_uvicorn_answers_the_largest_growth_body_and_others_meanwhile(db: str) -> None:
    """The default limits (1 MiB): the issue's 27 KB body, then the largest one, each with an
    ordinary request sent while it is handled."""
    with psycopg.connect(db, autocommit=True) as conn:
        conn.execute("CREATE TABLE ledger (intent text NOT NULL)")
    pool = AsyncConnectionPool(db, min_size=2, max_size=6, open=False)

    async def pay(request: Request) -> Response:
        data = json.loads(await request.body())
        op = pg_asgi.get_operation(request)
        assert op is not None
        await op.conn.execute("INSERT INTO ledger VALUES (%s)", (data["intent"],))
        return Response(b'{"ok": true}', status_code=201, media_type="application/json")

    app = with_pool_lifespan(pool, pg_asgi.IdempotencyMiddleware(
        Starlette(routes=[StarletteRoute("/pay", pay, methods=["POST"])]), pool=pool,
        scope=lambda r: r.headers.get("x-account"), routes={"POST /pay": Route("required")}))
    headers = {"Content-Type": "application/json", "X-Account": "acct"}
    with uvicorn_server(app) as base:
        for name, size in [("27KB", 27_000), ("1MiB", MIB - 100)]:
            body = (shapes(size)["huge exponents"] % name).encode()
            ordinary: dict[str, float] = {}

            def send_ordinary(name: str = name, ordinary: dict[str, float] = ordinary) -> None:
                time.sleep(0.05)  # while the large one is being read and fingerprinted
                started = time.monotonic()
                r = httpx.post(base + "/pay", headers={**headers, "Idempotency-Key": "o" + name},
                               content=json.dumps({"intent": "o" + name, "amount": 5}),
                               timeout=WAIT_BOUND)
                ordinary["seconds"] = time.monotonic() - started
                ordinary["status"] = r.status_code

            before = _vm_hwm_kb()
            thread = threading.Thread(target=send_ordinary)
            thread.start()
            started = time.monotonic()
            big = httpx.post(base + "/pay", headers={**headers, "Idempotency-Key": "b" + name},
                             content=body, timeout=WAIT_BOUND)
            elapsed = time.monotonic() - started
            thread.join(WAIT_BOUND)
            grown = _vm_hwm_kb() - before
            print(f"{name} of 1e131071: {big.status_code} in {elapsed:.3f} s, ordinary "
                  f"request meanwhile {ordinary}, the process's VmHWM +{grown} kB")
            assert big.status_code == 201, big.text
            assert elapsed < REQUEST_BOUND
            assert ordinary["status"] == 201 and ordinary["seconds"] < ORDINARY_BOUND, ordinary
            # the test process holds the client, the server and the app: the body (1 MiB),
            # its parsed values and their canonical text, a few times over at most
            assert grown < 128 * 1024, grown
            replay = httpx.post(base + "/pay",
                                headers={**headers, "Idempotency-Key": "b" + name},
                                content=body, timeout=WAIT_BOUND)
            assert replay.headers.get("idempotent-replayed") == "true"


@pytest.mark.parametrize("worker", ["gthread", "sync"])
def test_gunicorn_answers_the_largest_growth_body_and_others_meanwhile(db: str,
                                                                      worker: str) -> None:
    """The Flask decorator and the WSGI middleware under gunicorn, the default limits (1 MiB):
    one worker with 4 threads (gthread), or 2 sync workers (a sync worker serves one request
    at a time: the ordinary one goes to the other). The worker's peak resident memory (VmHWM,
    read from /proc) is measured before and after."""
    with psycopg.connect(db, autocommit=True) as conn:
        conn.execute(TABLES)
    options = ["--workers", "2"] if worker == "sync" else []
    headers = {"Content-Type": "application/json"}
    with gunicorn(db, worker, "helpers.served:wsgi_app()", *options) as (base, master):
        for adapter in ("flask", "wsgi"):  # warm every worker and route up
            for i in range(4):
                r = httpx.post(f"{base}/{adapter}/pay", content=json.dumps({"intent": "w"}),
                               headers={**headers, "Idempotency-Key": f"w{adapter}{i}"},
                               timeout=WAIT_BOUND)
                assert r.status_code == 201, r.text
        workers = worker_pids(master.pid)
        assert len(workers) == (2 if worker == "sync" else 1)
        before = {pid: vm_hwm_kb(pid) for pid in workers}
        for adapter in ("flask", "wsgi"):
            for name, size in [("27KB", 27_000), ("1MiB", MIB - 100)]:
                body = (shapes(size)["huge exponents"] % f"{adapter}{name}").encode()
                ordinary: dict[str, float] = {}

                def send_ordinary(name: str = f"o{adapter}{name}",
                                  url: str = f"{base}/{adapter}/pay",
                                  ordinary: dict[str, float] = ordinary) -> None:
                    time.sleep(0.05)  # while the large one is being read and fingerprinted
                    started = time.monotonic()
                    r = httpx.post(url,
                                   headers={**headers, "Idempotency-Key": name},
                                   content=json.dumps({"intent": name, "amount": 5}),
                                   timeout=WAIT_BOUND)
                    ordinary["seconds"] = time.monotonic() - started
                    ordinary["status"] = r.status_code

                thread = threading.Thread(target=send_ordinary)
                thread.start()
                started = time.monotonic()
                big = httpx.post(f"{base}/{adapter}/pay",
                                 headers={**headers, "Idempotency-Key": f"b{adapter}{name}"},
                                 content=body, timeout=WAIT_BOUND)
                elapsed = time.monotonic() - started
                thread.join(WAIT_BOUND)
                print(f"gunicorn {worker}, {adapter}: {name} of 1e131071: {big.status_code} in "
                      f"{elapsed:.3f} s, ordinary request meanwhile {ordinary}")
                assert big.status_code == 201, big.text
                assert elapsed < REQUEST_BOUND
                assert ordinary["status"] == 201 and ordinary["seconds"] < ORDINARY_BOUND, \
                    ordinary
                replay = httpx.post(f"{base}/{adapter}/pay",
                                    headers={**headers, "Idempotency-Key": f"b{adapter}{name}"},
                                    content=body, timeout=WAIT_BOUND)
                assert replay.headers.get("idempotent-replayed") == "true", replay.text
        grown = {pid: vm_hwm_kb(pid) - before[pid] for pid in workers}
        print(f"gunicorn {worker}: workers' VmHWM before {before} kB, grown by {grown} kB")
        # one worker held a 1 MiB body at a time: the body, werkzeug's cached copy, the parsed
        # values (a Decimal for each of ~116,000 numbers) and their canonical text
        assert max(grown.values()) < 32 * 1024, grown
    assert ledger(db, "flask1MiB") == 1 and ledger(db, "wsgi1MiB") == 1
