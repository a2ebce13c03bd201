"""pg_idempotency.django through HTTP, on real PostgreSQL 15 and 18: the example app
(examples/django_payments) through Django's test client and through a real threaded WSGI
server on 127.0.0.1, with ATOMIC_REQUESTS off and on. Each test gets a brand-new database that
``manage.py migrate`` installs (the idempotency schema as Django migrations, then the app's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import unittest
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import httpx
import psycopg
import pytest
from django.conf import settings  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.core.servers.basehttp import ThreadedWSGIServer, WSGIRequestHandler  # noqa: E402
from django.core.wsgi import get_wsgi_application  # noqa: E402
from django.db import connections, transaction  # noqa: E402
from django.db.transaction import TransactionManagementError  # noqa: E402
from django.http import HttpResponse, JsonResponse  # noqa: E402
from django.test import Client, TestCase, override_settings  # noqa: E402
from helpers.django_example import BODY, EXAMPLE, MERCHANT, _migrated, post, use_database
from ledger import views  # noqa: E402
from ledger.models import Account, LedgerLine, Payment, Receipt  # noqa: E402
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

import pg_idempotency.django as pg_django  # noqa: E402
from pg_idempotency.django import idempotent  # noqa: E402
from pg_idempotency.django.testing import IdempotencyTestCaseMixin  # noqa: E402
from pg_idempotency.migrate import migrations as bundled  # noqa: E402
from pgharness import WAIT_BOUND  # noqa: E402


class SimulatedCrash(BaseException):
    """The worker dies (not an Exception: Django's handler does not turn it into a 500)."""


@pytest.fixture(params=[False, True], ids=["autocommit", "atomic_requests"])
def app_db(request: pytest.FixtureRequest, empty_db: str) -> Iterator[str]:
    """The example's database, with ATOMIC_REQUESTS off and on."""
    yield from _migrated(empty_db, request.param)


@pytest.fixture
def plain_db(empty_db: str) -> Iterator[str]:
    """The example's database (ATOMIC_REQUESTS off), for tests where it makes no difference."""
    yield from _migrated(empty_db, False)


def counts() -> tuple[int, int, int]:
    """(payments, ledger lines, receipts), read on a connection of this thread."""
    result = (Payment.objects.count(), LedgerLine.objects.count(), Receipt.objects.count())
    connections.close_all()
    return result


def closing(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` for a thread of its own: its Django connection is closed at the end."""
    def run() -> Any:
        try:
            return fn(*args)
        finally:
            connections.close_all()
    return run


# -- the contract ----------------------------------------------------------------------------

def test_replay_is_byte_identical_and_contract(app_db: str) -> None:
    client = Client()
    first = post(client, "k1")
    assert first.status_code == 201, first.content
    assert "Idempotent-Replayed" not in first.headers
    # the same request re-serialised, the key quoted (the draft's sf-string form)
    again = post(client, '"k1"', '{"amount": "12.50",   "account": "alice"}')
    assert again.status_code == 201
    assert again.content == first.content
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.headers["Location"] == first.headers["Location"]
    assert again.headers["Content-Type"] == first.headers["Content-Type"]
    assert counts() == (1, 2, 1)

    missing = post(client, None)
    assert missing.status_code == 400
    assert missing.headers["Content-Type"] == "application/problem+json"
    assert "Idempotency-Key" in missing.json()["title"]
    too_long = post(client, "k" * 256)
    assert too_long.status_code == 400 and "255" in too_long.json()["detail"]
    anonymous = client.post("/payments/", json.dumps(BODY), content_type="application/json",
                            HTTP_IDEMPOTENCY_KEY="k1")
    assert anonymous.status_code == 401
    reused = post(client, "k1", {"account": "alice", "amount": "99"})
    assert reused.status_code == 422 and "reused" in reused.json()["title"]
    # a key belongs to its scope: another merchant's k1 is a new payment
    other = post(client, "k1", HTTP_X_MERCHANT="m2")
    assert other.status_code == 201 and "Idempotent-Replayed" not in other.headers
    assert counts() == (2, 4, 2)


def test_chunked_body_is_411_and_nothing_is_claimed(app_db: str) -> None:
    """Django reads a body by its Content-Length only: a chunked one reaches the view empty, so
    two chunked requests with one key and different bodies would be one request (the second a
    replay of the first). Both are 411 before any claim; the same key then runs once."""
    client = Client()
    for _ in range(2):
        chunked = client.generic("POST", "/payments/", b"", HTTP_IDEMPOTENCY_KEY="ch1",
                                 HTTP_TRANSFER_ENCODING="chunked", **MERCHANT)
        assert chunked.status_code == 411, chunked.content
        assert chunked.headers["Content-Type"] == "application/problem+json"
        assert "Content-Length" in chunked.json()["detail"]
    assert counts() == (0, 0, 0)
    with psycopg.connect(app_db) as conn:
        assert conn.execute("SELECT count(*) FROM idempotency.keys").fetchone() == (0,)
    first = post(client, "ch1")
    assert first.status_code == 201 and "Idempotent-Replayed" not in first.headers
    assert counts() == (1, 2, 1)


def test_the_claim_commits_before_the_view_and_on_commit_waits(app_db: str,
                                                               monkeypatch: Any) -> None:
    """While the view runs, another connection already sees the claim (409) but not the
    view's writes; the receipt is written only after the commit."""
    seen: dict[str, Any] = {}
    original = views.record

    def record(account: Any, amount: Any) -> Any:
        payment = original(account, amount)
        with ThreadPoolExecutor(1) as pool:  # another thread: another connection
            seen["retry"] = pool.submit(closing(post, Client(), "k1")).result().status_code
        with psycopg.connect(app_db) as other:
            seen["payments"] = other.execute("SELECT count(*) FROM ledger_payment").fetchone()
        seen["receipts_in_view"] = Receipt.objects.count()
        return payment

    monkeypatch.setattr(views, "record", record)
    response = post(Client(), "k1")
    assert response.status_code == 201
    assert seen == {"retry": 409, "payments": (0,), "receipts_in_view": 0}
    assert counts() == (1, 2, 1)


def test_conflict_has_a_small_retry_after(app_db: str, monkeypatch: Any) -> None:
    started, go = threading.Event(), threading.Event()
    original = views.record

    def slow(account: Any, amount: Any) -> Any:
        started.set()
        assert go.wait(WAIT_BOUND)
        return original(account, amount)

    monkeypatch.setattr(views, "record", slow)
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(closing(post, Client(), "k1"))
        assert started.wait(WAIT_BOUND)
        busy = closing(post, Client(), "k1")()
        go.set()
        assert first.result().status_code == 201
    assert busy.status_code == 409
    assert busy.headers["Retry-After"] == "2"  # retry_after_max (2), not the 30 s lease
    assert counts() == (1, 2, 1)


def test_under_database_settings_psycopg_cannot_parse(plain_db: str, monkeypatch: Any) -> None:
    """A DBA set DateStyle, IntervalStyle and TimeZone for the database. Django binds on the
    client side, so the lease goes as text in sql_standard; the claim, a retry's 409 (its
    retry_after), complete() and the replay read times back
    (tests/server/test_session_settings.py)."""
    dbname = conninfo_to_dict(plain_db)["dbname"]
    with psycopg.connect(plain_db, autocommit=True) as conn:
        for name, value in (("datestyle", "SQL, DMY"), ("intervalstyle", "sql_standard"),
                            ("timezone", "Pacific/Chatham")):
            conn.execute(sql.SQL("ALTER DATABASE {} SET {} = {}").format(
                sql.Identifier(dbname), sql.Identifier(name), sql.Literal(value)))
    connections.close_all()
    seen: dict[str, Any] = {}
    original = views.record

    def record(account: Any, amount: Any) -> Any:
        payment = original(account, amount)
        with connections["default"].cursor() as cursor:
            cursor.execute("SHOW DateStyle")
            seen["datestyle"] = cursor.fetchone()
        with ThreadPoolExecutor(1) as pool:  # another thread: another connection
            seen["retry"] = pool.submit(closing(post, Client(), "k1")).result()
        with psycopg.connect(plain_db, options="-c DateStyle=ISO -c IntervalStyle=postgres"
                             ) as other:
            seen["lease"] = other.execute("SELECT lease_expires_at - created_at "
                                          "FROM idempotency.keys WHERE key = 'k1'").fetchone()
        return payment

    monkeypatch.setattr(views, "record", record)
    first = post(Client(), "k1")
    assert first.status_code == 201, first.content
    assert seen["datestyle"] == ("SQL, DMY",)
    assert seen["retry"].status_code == 409 and seen["retry"].headers["Retry-After"] == "2"
    assert seen["lease"] == (timedelta(seconds=30),)
    replay = post(Client(), "k1")
    assert replay.status_code == 201 and replay.headers["Idempotent-Replayed"] == "true"
    assert replay.content == first.content
    assert counts() == (1, 2, 1)


def test_exception_in_view_rolls_back_and_releases(app_db: str, monkeypatch: Any) -> None:
    original = views.record

    def failing(account: Any, amount: Any) -> Any:
        original(account, amount)
        raise RuntimeError("card network down")

    monkeypatch.setattr(views, "record", failing)
    with pytest.raises(RuntimeError):
        post(Client(), "k1")
    assert counts() == (0, 0, 0)  # rolled back, and no receipt
    assert Account.objects.count() == 0  # the get_or_create too
    monkeypatch.setattr(views, "record", original)
    retry = post(Client(), "k1")
    assert retry.status_code == 201 and "Idempotent-Replayed" not in retry.headers
    assert counts() == (1, 2, 1)


def test_crash_after_commit_then_retry_is_a_replay(app_db: str, monkeypatch: Any) -> None:
    """The worker dies after the commit (and the receipt) but before the response is sent."""
    original = views.send_receipt

    def send_then_die(payment_id: int) -> None:
        original(payment_id)
        raise SimulatedCrash

    monkeypatch.setattr(views, "send_receipt", send_then_die)
    with pytest.raises(SimulatedCrash):
        post(Client(), "k1")
    monkeypatch.setattr(views, "send_receipt", original)
    retry = post(Client(), "k1")
    assert retry.status_code == 201 and retry.headers["Idempotent-Replayed"] == "true"
    assert retry.json()["id"] == Payment.objects.get().pk
    assert counts() == (1, 2, 1)


def test_lease_takeover_fences_the_old_worker(app_db: str, monkeypatch: Any) -> None:
    """A's lease expires while its view runs; B takes the key over and completes; A's late
    complete() fails, its atomic block rolls back: one payment, one receipt."""
    a_wrote, b_claimed = threading.Event(), threading.Event()
    original_record, original_claim = views.record, pg_django._claim
    calls = {"record": 0, "claim": 0}

    def record(account: Any, amount: Any) -> Any:
        calls["record"] += 1
        payment = original_record(account, amount)
        if calls["record"] == 1:  # A: written, then stalls past its lease
            a_wrote.set()
            assert b_claimed.wait(WAIT_BOUND)
        return payment

    def claim(*args: Any) -> Any:
        result = original_claim(*args)
        calls["claim"] += 1
        if calls["claim"] == 2:
            assert result.outcome.value == "resumed"
            b_claimed.set()
        return result

    monkeypatch.setattr(views, "record", record)
    monkeypatch.setattr(pg_django, "_claim", claim)
    with override_settings(PG_IDEMPOTENCY=dict(settings.PG_IDEMPOTENCY, LEASE=1)):
        with ThreadPoolExecutor(1) as pool:
            a = pool.submit(closing(post, Client(), "k1"))
            assert a_wrote.wait(WAIT_BOUND)
            time.sleep(1.3)
            with ThreadPoolExecutor(1) as pool_b:
                b = pool_b.submit(closing(post, Client(), "k1"))
                a_response = a.result(timeout=WAIT_BOUND)
                b_response = b.result(timeout=WAIT_BOUND)
    assert a_response.status_code == 409 and a_response.headers["Retry-After"] == "1"
    assert b_response.status_code == 201
    assert counts() == (1, 2, 1)
    replay = post(Client(), "k1")
    assert replay.content == b_response.content
    assert Account.objects.get().balance == 12.5


def test_eight_concurrent_requests_over_http(app_db: str) -> None:
    """A real threaded WSGI server on 127.0.0.1 and 8 concurrent clients with one key."""
    server = ThreadedWSGIServer(("127.0.0.1", 0), WSGIRequestHandler, allow_reuse_address=True)
    server.set_app(get_wsgi_application())
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}/payments/"
    barrier = threading.Barrier(8)

    def send(_: int) -> httpx.Response:
        barrier.wait()
        return httpx.post(url, content=json.dumps(BODY), timeout=WAIT_BOUND,
                          headers={"Content-Type": "application/json", "X-Merchant": "m1",
                                   "Idempotency-Key": "k8"})

    try:
        with override_settings(PG_IDEMPOTENCY=dict(settings.PG_IDEMPOTENCY, WAIT=10)):
            with ThreadPoolExecutor(8) as pool:
                responses = list(pool.map(send, range(8)))
    finally:
        server.shutdown()
        server.server_close()
    assert [r.status_code for r in responses] == [201] * 8
    fresh = [r for r in responses if "idempotent-replayed" not in r.headers]
    assert len(fresh) == 1
    assert {r.content for r in responses} == {fresh[0].content}
    assert counts() == (1, 2, 1)


# -- the middleware (POST /refunds/ in PG_IDEMPOTENCY["ROUTES"]) ------------------------------

def test_middleware_route(app_db: str, monkeypatch: Any) -> None:
    client = Client(raise_request_exception=False)
    assert post(client, "p1").status_code == 201
    assert post(client, None, path="/refunds/").status_code == 400
    original = views.record

    def failing(account: Any, amount: Any) -> Any:
        original(account, amount)
        raise RuntimeError("boom")

    monkeypatch.setattr(views, "record", failing)
    assert post(client, "r1", path="/refunds/").status_code == 500  # rolled back, released
    assert counts() == (1, 2, 1)
    monkeypatch.setattr(views, "record", original)
    first = post(client, "r1", path="/refunds/")
    assert first.status_code == 201 and "Idempotent-Replayed" not in first.headers
    again = post(client, "r1", path="/refunds/")
    assert again.content == first.content and again.headers["Idempotent-Replayed"] == "true"
    assert post(client, "r1", {"account": "alice", "amount": "1"},
                path="/refunds/").status_code == 422
    assert counts() == (2, 4, 2)
    assert Account.objects.get().balance == 0


# -- transactions: refused inside an outer atomic block; TestCase through the helper ---------

def test_refuses_to_claim_inside_an_atomic_block(plain_db: str) -> None:
    @idempotent(scope=lambda r: "s")
    def view(request: Any) -> HttpResponse:
        return JsonResponse({}, status=201)

    from django.test import RequestFactory

    request = RequestFactory().post("/x", "{}", content_type="application/json",
                                    HTTP_IDEMPOTENCY_KEY="k")
    with pytest.raises(TransactionManagementError, match="inside an atomic block"):
        with transaction.atomic():
            view(request)
    assert view._non_atomic_requests == {"default"}  # ATOMIC_REQUESTS leaves it to us
    with psycopg.connect(plain_db) as conn:
        assert conn.execute("SELECT count(*) FROM idempotency.keys").fetchone() == (0,)


class PaymentsTestCase(IdempotencyTestCaseMixin, TestCase):
    __test__ = False  # run by test_testcase_helper, on a database made for it
    def test_replay_in_a_testcase(self) -> None:
        with self.captureOnCommitCallbacks(execute=True) as callbacks:
            first = post(self.client, "t1")
        self.assertEqual(first.status_code, 201)
        self.assertEqual(len(callbacks), 1)
        again = post(self.client, "t1")
        self.assertEqual(again.content, first.content)
        self.assertEqual(again.headers["Idempotent-Replayed"], "true")
        self.assertEqual(post(self.client, "t1", {"account": "a", "amount": 1}).status_code,
                         422)
        self.assertEqual((Payment.objects.count(), Receipt.objects.count()), (1, 1))


class PlainTestCase(TestCase):
    __test__ = False
    def test_without_the_helper_is_refused(self) -> None:
        with self.assertRaises(TransactionManagementError):
            post(self.client, "t1")


def test_testcase_helper(plain_db: str) -> None:
    suite = unittest.TestSuite()
    loader = unittest.defaultTestLoader
    suite.addTests(loader.loadTestsFromTestCase(PaymentsTestCase))
    suite.addTests(loader.loadTestsFromTestCase(PlainTestCase))
    result = unittest.TestResult()
    suite.run(result)
    assert result.testsRun == 2
    assert not result.errors and not result.failures, result.errors + result.failures
    assert counts() == (0, 0, 0)  # the TestCase rolled everything back


# -- the schema migration ---------------------------------------------------------------------

def test_schema_migrations(plain_db: str, db: str) -> None:
    """One Django migration per bundled SQL file; on a database where psql already applied
    them (``db``), Django's migrate records them without running them again."""
    from django.db.migrations.loader import MigrationLoader

    loader = MigrationLoader(None, ignore_no_migrations=True)
    names = sorted(name for app, name in loader.disk_migrations if app == "pg_idempotency")
    assert names == [m.name for m in bundled()]
    with psycopg.connect(plain_db) as conn:
        versions = [r[0] for r in conn.execute(
            "SELECT version FROM idempotency.migrations ORDER BY version")]
    assert versions == [m.version for m in bundled()]
    use_database(db, False)
    call_command("migrate", "pg_idempotency", verbosity=0)
    connections.close_all()
    with psycopg.connect(db) as conn:
        assert conn.execute("SELECT count(*) FROM idempotency.migrations").fetchone() == (
            len(bundled()),)
        assert conn.execute("SELECT count(*) FROM django_migrations WHERE app = "
                            "'pg_idempotency'").fetchone() == (len(bundled()),)


CRASHING_SERVER = """
import os, sys
sys.path.insert(0, sys.argv[1])
os.environ["DJANGO_SETTINGS_MODULE"] = "payments_site.settings"
import django
django.setup()
from django.core.servers.basehttp import ThreadedWSGIServer, WSGIRequestHandler
from django.core.wsgi import get_wsgi_application
from ledger import views

original = views.send_receipt

def send_then_die(payment_id):
    original(payment_id)
    os._exit(17)  # the worker dies: committed, receipt sent, no response

views.send_receipt = send_then_die
server = ThreadedWSGIServer(("127.0.0.1", 0), WSGIRequestHandler)
server.set_app(get_wsgi_application())
print(server.server_address[1], flush=True)
server.serve_forever()
"""


def test_worker_process_killed_after_commit(app_db: str) -> None:
    """A real worker process dies after the commit, before it answers; the retry (to another
    worker) is a replay: one payment, one receipt."""
    env = dict(os.environ, PAYMENTS_DSN=app_db,
               PAYMENTS_ATOMIC_REQUESTS="1" if connections.settings["default"][
                   "ATOMIC_REQUESTS"] else "0")
    proc = subprocess.Popen([sys.executable, "-c", CRASHING_SERVER, str(EXAMPLE)], env=env,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        with pytest.raises(httpx.TransportError):
            httpx.post(f"http://127.0.0.1:{port}/payments/", content=json.dumps(BODY),
                       timeout=WAIT_BOUND,
                       headers={"Content-Type": "application/json", "X-Merchant": "m1",
                                "Idempotency-Key": "kx"})
        assert proc.wait(timeout=WAIT_BOUND) == 17
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert counts() == (1, 2, 1)
    retry = post(Client(), "kx")
    assert retry.status_code == 201 and retry.headers["Idempotent-Replayed"] == "true"
    assert counts() == (1, 2, 1)


# -- on a Citus cluster (harness/citus_cluster.py): Django's migrations on the coordinator, then
# idempotency.distribute(); the example's own tables stay plain tables on the coordinator, so
# the view's write and the completion on a worker commit together by two-phase commit.

@pytest.fixture(params=[False, True], ids=["autocommit", "atomic_requests"])
def citus_app_db(request: pytest.FixtureRequest, citus_db: str) -> Iterator[str]:
    migrated = _migrated(citus_db, request.param)
    dsn = next(migrated)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT count(*) FROM idempotency.distribute(4)")
        assert conn.execute("SELECT count(*) FROM pg_dist_partition WHERE logicalrelid"
                            " = 'idempotency.keys'::regclass").fetchone() == (1,)
    yield dsn
    migrated.close()


def _keys_on_workers(dsn: str) -> int:
    """Keys of the distributed table as the coordinator sees them (they live on workers)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute("SELECT count(*) FROM idempotency.keys").fetchone()[0]


def test_citus_replay_and_contract(citus_app_db: str) -> None:
    test_replay_is_byte_identical_and_contract(citus_app_db)
    assert _keys_on_workers(citus_app_db) == 2


def test_citus_eight_concurrent_requests_over_http(citus_app_db: str) -> None:
    test_eight_concurrent_requests_over_http(citus_app_db)
    assert _keys_on_workers(citus_app_db) == 1


def test_citus_lease_takeover_fences_the_old_worker(citus_app_db: str, monkeypatch: Any) -> None:
    test_lease_takeover_fences_the_old_worker(citus_app_db, monkeypatch)


def test_prepared_statements_opt_in_follows_django_options(plain_db: str,
                                                           monkeypatch: Any) -> None:
    """allow_prepared_statements() under Django: Django's connections have
    prepare_threshold=None unless OPTIONS say otherwise, so the view's claims and completions
    stay unprepared; with OPTIONS server_side_binding and prepare_threshold 5 they are
    prepared, and replays still answer the same."""
    import pg_idempotency
    from pg_idempotency import _exec

    monkeypatch.setattr(_exec, "PREPARE", False)  # restored after the test
    pg_idempotency.allow_prepared_statements()
    prepared = "SELECT statement FROM pg_prepared_statements"
    client = Client()
    for i in range(8):
        assert post(client, f"plain-{i}").status_code == 201
    raw = connections["default"].connection
    assert raw.prepare_threshold is None
    assert raw.execute(prepared, prepare=False).fetchall() == []
    connections.close_all()
    options = connections["default"].settings_dict.setdefault("OPTIONS", {})
    monkeypatch.setitem(options, "server_side_binding", True)
    monkeypatch.setitem(options, "prepare_threshold", 5)
    try:
        first = [post(client, f"bound-{i}") for i in range(8)]
        assert [r.status_code for r in first] == [201] * 8
        raw = connections["default"].connection
        texts = " ".join(r[0] for r in raw.execute(prepared, prepare=False).fetchall())
        assert "idempotency.claim(" in texts and "idempotency.complete" in texts, texts
        again = post(client, "bound-3")
        assert again.status_code == 201 and again.content == first[3].content
        assert again.headers["Idempotent-Replayed"] == "true"
    finally:
        connections.close_all()
    assert counts() == (16, 32, 16)
