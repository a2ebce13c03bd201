"""One behaviour everywhere, proven once: the same table of HTTP cases runs against every
adapter over real HTTP on real PostgreSQL.

- ``asgi``: a Starlette app behind :class:`pg_idempotency.asgi.IdempotencyMiddleware`, served by
  uvicorn;
- ``django``: views under :func:`pg_idempotency.django.idempotent`, served by Django's threaded
  WSGI server;
- ``flask``: Flask views under :meth:`pg_idempotency.flask.Idempotency.idempotent`, and
  ``wsgi``: the same Flask app behind :class:`pg_idempotency.flask.IdempotencyMiddleware`, both
  served by werkzeug's threaded WSGI server.

Each serves ``POST /pay`` (5xx not stored), ``POST /pay-store`` (``store_server_errors``) and
``POST /free`` (not a keyed route), with a 1 s lease and no wait. The handler's ``mode`` says
what it does: write a ledger row and answer 201 with the exact bytes ``{"zeta":1,"a":2,...}``,
raise before or after its write, or answer 500; a request with ``X-Gate: <name>`` is held after
its write until the test opens that gate (never a fixed delay: on a loaded machine a request
can take longer than any delay, and a race decided by the clock goes the other way). An outer
wrapper, asked by the
``X-Crash: after-commit`` header, loses the committed answer (502), as a worker that dies after
its commit would. Then a retry storm with such crashes runs through the four apps and through
the examples (docs/flask.md's app, the FastAPI and the Django payments examples): one ledger
row per intent, one answer per intent.
"""

from __future__ import annotations

import json
import random
import socket
import threading
import time
import types
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from django.core.wsgi import get_wsgi_application
from django.db import connections
from django.test import override_settings
from helpers.adapters import (
    ADAPTERS,
    crashing,
    fresh,
    gate,
    hold_lease,
    key_state,
    ledger,
    pay,
    problem,
    race_takeover,
    replayed,
    serve,
    until_claimed,
)
from helpers.django_example import _migrated, use_database  # sets Django up on the example
from helpers.http import payments, uvicorn_server, wsgi_server

import pg_idempotency as idem
from pg_idempotency.errors import UsageError
from pgharness import WAIT_BOUND

# -- what every handler does, by the request's "mode" ------------------------------------------


# -- the four apps --------------------------------------------------------------------------


@pytest.fixture(params=ADAPTERS)
def served(request: pytest.FixtureRequest, db: str) -> Iterator[tuple[str, str]]:
    with serve(request.param, db) as base:
        yield base, db


# -- the case table ---------------------------------------------------------------------------


def case_fresh_then_replay_byte_identical(base: str, dsn: str) -> None:
    first = pay(base, "k", "i")
    fresh(first)
    assert first.content == b'{"zeta":1,"a":2,"intent":"i"}'
    again = pay(base, '"k"', "i")  # the draft's quoted form is the same key
    replayed(again, first)
    assert "x-request-id" in first.headers and "x-request-id" not in again.headers
    assert ledger(dsn, "i") == 1


def case_missing_key_400_and_unlisted_route_not_keyed(base: str, dsn: str) -> None:
    problem(pay(base, None, "i"), 400)
    for _ in range(2):
        fresh(pay(base, "k", "free", path="/free"))  # not a keyed route: runs each time
    assert ledger(dsn, "free") == 2 and key_state(dsn, "k") is None


def case_in_progress_409_with_retry_after(base: str, dsn: str) -> None:
    held = uuid.uuid4().hex
    with ThreadPoolExecutor(1) as pool:
        try:
            slow = pool.submit(pay, base, "k", "i", gate=held)
            until_claimed(dsn, "k")
            hold_lease(dsn, "k")
            busy = pay(base, "k", "i")
        finally:
            gate(held).set()
        first = slow.result(WAIT_BOUND)
    problem(busy, 409)
    # the lease left (10 minutes), capped at the default retry_after_max of 2 s
    assert busy.headers["retry-after"] == "2"
    fresh(first)
    replayed(pay(base, "k", "i"), first)
    assert ledger(dsn, "i") == 1


def case_changed_body_422(base: str, dsn: str) -> None:
    fresh(pay(base, "k", "i"))
    problem(pay(base, "k", "other"), 422)
    assert ledger(dsn, "other") == 0


def case_query_string_not_in_fingerprint(base: str, dsn: str) -> None:
    first = pay(base, "k", "i", query="?utm=a")
    fresh(first)
    replayed(pay(base, "k", "i", query="?utm=b&x=1"), first)


def case_5xx_not_stored_by_default(base: str, dsn: str) -> None:
    failed = pay(base, "k", "i", "fail500")
    assert failed.status_code == 500 and "idempotent-replayed" not in failed.headers
    assert ledger(dsn, "i") == 0 and key_state(dsn, "k") == "released"  # rolled back
    fresh(pay(base, "k", "i"))  # runs afresh
    assert key_state(dsn, "k") == "completed" and ledger(dsn, "i") == 1


def case_5xx_stored_when_asked(base: str, dsn: str) -> None:
    failed = pay(base, "k", "i", "fail500", path="/pay-store")
    fresh(failed, 500)
    replayed(pay(base, "k", "i", "fail500", path="/pay-store"), failed)
    assert ledger(dsn, "i") == 1  # the write commits with the stored 5xx


def case_5xx_stored_without_asking_for_the_operation(base: str, dsn: str) -> None:
    """store_server_errors needs no call of get_operation(): the handler does not run twice."""
    failed = pay(base, "k", "i", "bare500", path="/pay-store")
    assert failed.status_code == 500 and key_state(dsn, "k") == "completed"
    replayed(pay(base, "k", "i", "bare500", path="/pay-store"), failed)


def case_handler_raises_before_its_write(base: str, dsn: str) -> None:
    assert pay(base, "k", "i", "raise_before").status_code == 500
    assert key_state(dsn, "k") == "released" and ledger(dsn, "i") == 0
    fresh(pay(base, "k", "i"))  # runs afresh
    assert key_state(dsn, "k") == "completed" and ledger(dsn, "i") == 1


def case_handler_raises_after_its_write(base: str, dsn: str) -> None:
    assert pay(base, "k", "i", "raise_after").status_code == 500
    assert ledger(dsn, "i") == 0 and key_state(dsn, "k") == "released"  # write rolled back
    fresh(pay(base, "k2", "i"))
    assert ledger(dsn, "i") == 1


def case_aborted_upload_claims_nothing(base: str, dsn: str) -> None:
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /pay HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Idempotency-Key: k\r\nContent-Length: 200\r\n\r\n" + b'{"intent": "i"')
        sock.shutdown(socket.SHUT_WR)  # the client goes away mid-body
        sock.settimeout(WAIT_BOUND)
        while sock.recv(4096):
            pass
    assert key_state(dsn, "k") is None and ledger(dsn, "i") == 0
    fresh(pay(base, "k", "i"))  # the whole body: the first attempt


def case_crash_after_commit_then_replay(base: str, dsn: str) -> None:
    lost = pay(base, "k", "i", crash=True)
    assert lost.status_code == 502 and ledger(dsn, "i") == 1  # committed, answer lost
    retry = pay(base, "k", "i")
    assert retry.status_code == 201 and retry.headers["idempotent-replayed"] == "true"
    assert retry.content == b'{"zeta":1,"a":2,"intent":"i"}'
    assert ledger(dsn, "i") == 1


def case_takeover_refuses_the_stale_attempt(base: str, dsn: str) -> None:
    taker, late = race_takeover(base, dsn, "k", "i")
    fresh(taker)
    problem(late, 409)  # its complete() was fenced off; its write rolled back
    assert ledger(dsn, "i") == 1
    replayed(pay(base, "k", "i"), taker)


CASES = {name.removeprefix("case_"): fn for name, fn in list(globals().items())
         if name.startswith("case_")}


@pytest.mark.parametrize("case", sorted(CASES))
def test_case(served: tuple[str, str], case: str) -> None:
    base, dsn = served
    CASES[case](base, dsn)


# -- the APIs without HTTP: byte-identical replays, Django's connection refused -------------

def test_operation_and_idempotent_replay_the_stored_bytes(db: str) -> None:
    with psycopg.connect(db, autocommit=True) as conn:
        with idem.operation(conn, "acct", "op1", {"n": 1}) as op:
            stored = op.complete(201, {"zeta": 1, "a": 2})
        assert stored.content == b'{"zeta":1,"a":2}'
        with idem.operation(conn, "acct", "op1", {"n": 1}) as op:
            assert op.replay is not None
            assert op.replay.content == b'{"zeta":1,"a":2}'
            assert op.replay.content_type == "application/json"
            assert list(op.replay.json()) == ["zeta", "a"] and op.replay.body == {"zeta": 1,
                                                                                 "a": 2}

        @idem.idempotent()
        def pair(conn: Any, n: int) -> Any:
            return (n, {"zeta": 1, "a": 2})

        first = pair(conn, "acct", "f1", 5)
        again = pair(conn, "acct", "f1", 5)
    # the first call returns what every retry gets: the stored JSON value (a tuple is a list)
    assert first == again == [5, {"zeta": 1, "a": 2}]
    assert list(again[1]) == ["zeta", "a"]


def test_operation_refuses_djangos_connection(db: str) -> None:
    use_database(db, False)
    try:
        connection = connections["default"]
        connection.ensure_connection()
        with pytest.raises(UsageError, match="pg_idempotency.django"):
            idem.operation(connection.connection, "acct", "d1", {"n": 1})

        @idem.idempotent()
        def fn(conn: Any) -> int:
            return 1

        with pytest.raises(UsageError, match="pg_idempotency.django"):
            fn(connection.connection, "acct", "d2")
        with psycopg.connect(db) as conn:
            assert conn.execute("SELECT count(*) FROM idempotency.keys").fetchone() == (0,)
    finally:
        connections.close_all()


# -- the retry storm --------------------------------------------------------------------------

def storm(url: str, intents: list[str], body_of: Callable[[str], bytes],
          headers: dict[str, str], clients_per_intent: int = 3, crash_rate: float = 0.3,
          seed: int = 7) -> dict[str, set[bytes]]:
    """Every intent sent by ``clients_per_intent`` concurrent clients, each retrying (409,
    502, 5xx, a dropped connection) until it gets its answer; ``crash_rate`` of the attempts
    lose their committed answer. Returns the distinct 201 bodies per intent."""
    answers: dict[str, set[bytes]] = {i: set() for i in intents}
    lost = [0]
    lock = threading.Lock()

    def client(intent: str, n: int) -> None:
        rng = random.Random(f"{seed}-{intent}-{n}")
        with httpx.Client(timeout=WAIT_BOUND) as http:
            for _ in range(200):
                extra = {"X-Crash": "after-commit"} if rng.random() < crash_rate else {}
                try:
                    r = http.post(url, content=body_of(intent), headers={
                        **headers, **extra, "Idempotency-Key": f"key-{intent}"})
                except httpx.TransportError:
                    continue
                if r.status_code == 201:
                    with lock:
                        answers[intent].add(r.content)
                    return
                assert r.status_code in (409, 502, 503), (r.status_code, r.text)
                if r.status_code == 502:
                    with lock:
                        lost[0] += 1
                time.sleep(rng.uniform(0.01, 0.05))
            raise AssertionError(f"{intent}: no answer after 200 attempts")

    jobs = [(i, n) for i in intents for n in range(clients_per_intent)]
    random.Random(seed).shuffle(jobs)
    with ThreadPoolExecutor(12) as pool:
        for future in [pool.submit(client, i, n) for i, n in jobs]:
            future.result()
    assert lost[0] >= len(intents) // 4, lost  # answers were lost after commit
    return answers


INTENTS = [f"intent-{n:02}" for n in range(12)]


def one_answer_each(answers: dict[str, set[bytes]]) -> None:
    assert all(len(bodies) == 1 for bodies in answers.values()), answers


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_retry_storm_with_crashes_after_commit(adapter: str, db: str) -> None:
    with serve(adapter, db) as base:
        answers = storm(f"{base}/pay", INTENTS,
                        lambda i: json.dumps({"intent": i}).encode(),
                        {"Content-Type": "application/json"})
    one_answer_each(answers)
    with psycopg.connect(db) as conn:
        rows = conn.execute("SELECT intent, count(*) FROM ledger GROUP BY intent").fetchall()
    assert dict(rows) == dict.fromkeys(INTENTS, 1)


ROOT = Path(__file__).resolve().parents[2]


def flask_doc_app() -> str:
    """The code of docs/flask.md's "The app" section (its first python block)."""
    text = (ROOT / "docs" / "flask.md").read_text()
    start = text.index("```python\n", text.index("## The app")) + len("```python\n")
    return text[start:text.index("\n```", start) + 1]


def test_the_flask_example_is_the_doc() -> None:
    example = (ROOT / "examples" / "flask_payments" / "app.py").read_text()
    assert example.endswith(flask_doc_app().split("from __future__ import annotations\n")[1])


def _load_flask_example() -> Any:
    """A module made from docs/flask.md alone."""
    module = types.ModuleType("flask_doc_app")
    exec(compile(flask_doc_app(), "docs/flask.md", "exec"), module.__dict__)  # noqa: S102
    return module


PAYMENT = {"Content-Type": "application/json", "X-Account": "acct_42"}


def amount_of(intent: str) -> int:
    return int(intent.rsplit("-", 1)[1]) + 1


def test_storm_through_the_flask_example(db: str) -> None:
    """docs/flask.md's app (its code, read from the page) under a threaded WSGI
    server and concurrent retrying clients, crashes after commit: one ledger row per intent."""
    example = _load_flask_example()
    app = example.create_app(db, wait=5)
    try:
        with wsgi_server(crashing(app.wsgi_app)) as base:
            answers = storm(f"{base}/payments", INTENTS,
                            lambda i: json.dumps({"amount": amount_of(i)}).encode(), PAYMENT)
    finally:
        app.extensions["pool"].close()
    one_answer_each(answers)
    with psycopg.connect(db) as conn:
        rows = conn.execute("SELECT amount, count(*) FROM ledger GROUP BY amount").fetchall()
    assert dict(rows) == {amount_of(i): 1 for i in INTENTS}


def test_storm_through_the_fastapi_example(db: str) -> None:
    app = payments.create_app(db, payments.FakeProcessor(), wait=5)

    async def crashing_asgi(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or (b"x-crash", b"after-commit") not in scope["headers"]:
            await app(scope, receive, send)
            return

        async def lose(message: Any) -> None:
            pass

        await app(scope, receive, lose)
        await send({"type": "http.response.start", "status": 502, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    with uvicorn_server(crashing_asgi) as base:
        answers = storm(f"{base}/payments", INTENTS,
                        lambda i: json.dumps({"amount": amount_of(i),
                                              "currency": "EUR"}).encode(), PAYMENT)
    one_answer_each(answers)
    with psycopg.connect(db) as conn:
        rows = conn.execute("SELECT amount, count(*) FROM ledger GROUP BY amount").fetchall()
    assert dict(rows) == {amount_of(i): 1 for i in INTENTS}


def test_storm_through_the_django_example(empty_db: str) -> None:
    for _ in _migrated(empty_db, False):
        with override_settings(PG_IDEMPOTENCY={
                "SCOPE": "ledger.views.merchant_of", "LEASE": 30, "WAIT": 5}):
            with wsgi_server(crashing(get_wsgi_application()), django=True) as base:
                answers = storm(
                    f"{base}/payments/", INTENTS,
                    lambda i: json.dumps({"account": i, "amount": amount_of(i)}).encode(),
                    {"Content-Type": "application/json", "X-Merchant": "m1"})
        connections.close_all()
    one_answer_each(answers)
    with psycopg.connect(empty_db) as conn:
        rows = conn.execute("SELECT a.name, count(*) FROM ledger_payment p "
                            "JOIN ledger_account a ON a.id = p.account_id "
                            "GROUP BY a.name").fetchall()
    assert dict(rows) == dict.fromkeys(INTENTS, 1)
