"""Through a real pgbouncer (Debian's 1.18) in transaction mode, with psycopg's DEFAULT
``prepare_threshold`` (5): the package never prepares its own statements (issue 23, item 8).

Issue 13: when the package's statements were prepared (psycopg's default prepares a query after
5 executions), pooled server connections ran one client's prepared statement for another (a
``heartbeat()`` executed someone's ``release()``), and 507 of 1,600 claims failed. Here the
lifecycle walks cleanly, and 32 clients racing through 4 server connections for 50 keys (claim,
heartbeat, checkpoint, complete, and release of keys of their own) get exactly one owner per
key and lose none; the same race with preparing switched back on (``_exec.PREPARE = None``,
psycopg's default) fails, which shows that the race can tell.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

import pg_idempotency as idem
from pg_idempotency import _exec, api
from pg_idempotency.errors import KeyInProgress, KeyMismatch
from pgharness import WAIT_BOUND, PgBouncer, PgServer

# Needs (tests/README.md): Debian's pgbouncer.
pytestmark = pytest.mark.pgbouncer

APP_ROLE = "idem_bouncer_app"
CLIENTS = 32
# A live lease in these tests: it must not run out while a loaded machine serves 32 clients
# through 4 server connections (an owner's claim, heartbeat, checkpoint and complete).
LIVE = WAIT_BOUND
KEYS = 50


@pytest.fixture
def bouncer_db(server: PgServer, db: str) -> Iterator[tuple[PgBouncer, str]]:
    dbname = db.rsplit("/", 1)[1]
    with psycopg.connect(db, autocommit=True) as conn:
        if conn.execute("SELECT NOT EXISTS (SELECT FROM pg_roles WHERE rolname = %s)",
                        (APP_ROLE,)).fetchone()[0]:
            conn.execute(f"CREATE ROLE {APP_ROLE} LOGIN")
        # both kinds: the lifecycle below also takes over an abandoned key, as a worker does
        conn.execute("SELECT idempotency.grant_usage(%s, 'request')", (APP_ROLE,))
        conn.execute("SELECT idempotency.grant_usage(%s, 'completer')", (APP_ROLE,))
        conn.execute("SELECT idempotency._premake()")
        conn.execute("CREATE TABLE public.orders (key text, amount int)")
        conn.execute(f"GRANT INSERT, SELECT ON public.orders TO {APP_ROLE}")
    # A small pool, so the 32 clients share a few server connections.
    with PgBouncer(server, users=["postgres", APP_ROLE], pool_mode="transaction",
                   pool_size=4) as bouncer:
        yield bouncer, dbname


def connect(bouncer: PgBouncer, dbname: str) -> psycopg.Connection[Any]:
    """psycopg's defaults: nothing set for the pooler."""
    conn = psycopg.connect(bouncer.dsn(dbname, user=APP_ROLE), autocommit=True)
    assert conn.prepare_threshold == 5  # psycopg's default: it would prepare our statements
    return conn


def server_backends(conn: psycopg.Connection[Any]) -> int:
    return conn.execute("SELECT count(*) FROM pg_stat_activity WHERE usename = %s",
                        (APP_ROLE,)).fetchone()[0]


def test_lifecycle_through_pgbouncer_transaction_mode(bouncer_db: tuple[PgBouncer, str]
                                                      ) -> None:
    bouncer, dbname = bouncer_db
    with connect(bouncer, dbname) as conn, connect(bouncer, dbname) as other:
        # claim, then the business insert and complete in one transaction
        with idem.operation(conn, "shop", "order-1", {"sku": "a", "qty": 2}) as op:
            assert op.outcome == "claimed"
            conn.execute("INSERT INTO public.orders VALUES ('order-1', 2)")
            op.complete(201, {"order": 1})
        # replay, from another client (another server connection, maybe)
        with idem.operation(other, "shop", "order-1", {"qty": 2, "sku": "a"}) as op:
            assert op.replay is not None and op.replay.status == 201
            assert op.replay.body == {"order": 1}
        # 422: same key, another request
        with pytest.raises(KeyMismatch), idem.operation(other, "shop", "order-1", {"qty": 3}):
            pass
        # checkpoint, heartbeat; 409 for a second attempt while the lease is live
        held = api.claim(conn, "shop", "order-2", {"sku": "b"}, lease=LIVE)
        assert held.outcome == "claimed"
        with conn.transaction():
            api.checkpoint(conn, "shop", "order-2", held.lease_token, "charged")
        api.heartbeat(conn, "shop", "order-2", held.lease_token, lease=LIVE)
        with pytest.raises(KeyInProgress) as busy, \
                idem.operation(other, "shop", "order-2", {"sku": "b"}):
            pass
        assert busy.value.recovery_point == "charged"
        # release: the key is gone, a retry claims it afresh
        api.release(conn, "shop", "order-2", held.lease_token)
        again = api.claim(other, "shop", "order-2", {"sku": "b"}, lease=0.2)
        assert again.outcome == "claimed" and again.lease_token > held.lease_token
        # takeover after expiry, then complete under the new token
        time.sleep(0.3)
        with conn.transaction():
            abandoned = api.list_abandoned(conn, 10, scope="shop")
            assert [k.key for k in abandoned] == ["order-2"]
            taken = api.takeover(conn, "shop", "order-2", lease=LIVE)
        assert taken.outcome == "resumed" and taken.lease_token > again.lease_token
        with conn.transaction():
            conn.execute("INSERT INTO public.orders VALUES ('order-2', 1)")
            api.complete(conn, "shop", "order-2", taken.lease_token, 201, {"order": 2})
        assert api.claim(other, "shop", "order-2", {"sku": "b"}).outcome == "replay"
        orders = conn.execute("SELECT key, count(*) FROM public.orders GROUP BY 1 ORDER BY 1"
                              ).fetchall()
        assert orders == [("order-1", 1), ("order-2", 1)]
        # The statements went through the pooler: pgbouncer's own view shows our database.
    with psycopg.connect(bouncer.dsn("pgbouncer"), autocommit=True) as admin:
        pools = [r for r in admin.execute("SHOW POOLS").fetchall() if r[0] == dbname]
        assert pools and pools[0][1] == APP_ROLE


def race(bouncer: PgBouncer, dbname: str) -> tuple[Counter[str], Counter[str], list[str]]:
    """CLIENTS clients through the pooler, each walking all KEYS shared keys (claim; the owner
    heartbeats, checkpoints and completes with a business row) and releasing a key of its own
    after a heartbeat (which must stay released: nobody else's statement may delete or
    resurrect it). Returns (claim outcomes, owners per key, errors)."""
    outcomes: Counter[str] = Counter()
    owners: Counter[str] = Counter()
    errors: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(CLIENTS)

    def client(i: int) -> None:
        try:
            with connect(bouncer, dbname) as conn:
                start.wait(WAIT_BOUND)
                for k in range(KEYS):
                    key = f"race-{(k + i) % KEYS}"  # clients start on different keys
                    r = api.claim(conn, "race", key, {"k": key}, lease=LIVE)
                    with lock:
                        outcomes[r.outcome.value] += 1
                    if r.outcome == "claimed":
                        with lock:
                            owners[key] += 1
                        api.heartbeat(conn, "race", key, r.lease_token, lease=LIVE)
                        with conn.transaction():
                            api.checkpoint(conn, "race", key, r.lease_token, "charged")
                        with conn.transaction():
                            # The app's own statement: the package cannot keep psycopg from
                            # preparing it after 5 runs, so it says so itself (install.md).
                            conn.execute("INSERT INTO public.orders VALUES (%s, 1)", (key,),
                                         prepare=False)
                            api.complete(conn, "race", key, r.lease_token, 200, {"k": key})
                    if k % 10 == 0:  # a key of this client's own, released after a heartbeat
                        own = f"own-{i}-{k}"
                        mine = api.claim(conn, "own", own, {"k": own}, lease=LIVE)
                        assert mine.outcome == "claimed", (own, mine.outcome)
                        api.heartbeat(conn, "own", own, mine.lease_token, lease=LIVE)
                        api.release(conn, "own", own, mine.lease_token)
        except Exception as exc:  # noqa: BLE001 - every failure is reported below
            with lock:
                errors.append(f"client {i}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_BOUND)
    assert not any(t.is_alive() for t in threads), "a client hung"
    return outcomes, owners, errors


def test_32_clients_50_keys_one_owner_each_through_pgbouncer(
        bouncer_db: tuple[PgBouncer, str], server: PgServer) -> None:
    bouncer, dbname = bouncer_db
    t0 = time.monotonic()
    outcomes, owners, errors = race(bouncer, dbname)
    elapsed = time.monotonic() - t0
    assert errors == [], errors[:5]
    assert sum(outcomes.values()) == CLIENTS * KEYS
    assert set(outcomes) <= {"claimed", "in_progress", "replay"}, outcomes
    assert outcomes["claimed"] == KEYS and set(owners.values()) == {1} and len(owners) == KEYS
    with psycopg.connect(server.dsn(dbname), autocommit=True) as conn:
        assert conn.execute("SELECT count(*), count(DISTINCT key) FROM public.orders"
                            ).fetchone() == (KEYS, KEYS)
        # every shared key completed by its one owner, with the owner's checkpoint; no key lost
        assert conn.execute("SELECT count(*) FROM idempotency.keys WHERE scope = 'race' "
                            "AND state = 'completed' AND recovery_point = 'charged'"
                            ).fetchone()[0] == KEYS
        # every released key stays released (engine 0.9.0 keeps the row for the next claim):
        # no lease, no response, no recovery point, its directory row kept; nobody else's
        # statement deleted or resurrected one, and nothing else is left in its scope
        released = CLIENTS * len(range(0, KEYS, 10))
        assert conn.execute(
            "SELECT count(*), count(*) FILTER (WHERE k.state = 'released'"
            " AND k.lease_expires_at IS NULL AND k.response_status IS NULL"
            " AND k.recovery_point IS NULL AND d.created_at = k.created_at)"
            " FROM idempotency.keys AS k LEFT JOIN idempotency.key_directory AS d"
            "   ON d.scope = k.scope AND d.key_hash = sha256(convert_to(k.key, 'UTF8'))"
            " WHERE k.scope = 'own'").fetchone() == (released, released)
        # 32 clients shared at most the pool's 4 server connections
        assert 0 < server_backends(conn) <= 4
    print(f"pgbouncer race: {CLIENTS} clients x {KEYS} keys in {elapsed:.2f}s, {dict(outcomes)}")


def test_the_race_fails_when_preparing_is_switched_back_on(
        bouncer_db: tuple[PgBouncer, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: psycopg's default preparing on the package's statements (what 0.8.0 did)
    breaks the same race, so the test above would catch a statement that prepares again."""
    bouncer, dbname = bouncer_db
    monkeypatch.setattr(_exec, "PREPARE", None)
    outcomes, owners, errors = race(bouncer, dbname)
    wrong = sorted(k for k, n in owners.items() if n != 1)
    print(f"preparing on: {len(errors)} of {CLIENTS} clients failed, e.g. {errors[:2]}; "
          f"keys with more than one owner: {wrong}")
    assert errors or wrong, "the race passed with prepared statements: it cannot tell"


def test_the_package_prepares_nothing_on_a_direct_connection(
        db: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a pooler, where prepared statements could be seen: after 3 x psycopg's
    threshold of each call (and BEGIN/COMMIT), the session has no prepared statement; with
    _exec.PREPARE = None it has them (so this count can tell)."""
    def lifecycle(conn: psycopg.Connection[Any], n: int, tag: str) -> None:
        for i in range(n):
            with idem.operation(conn, "prep", f"{tag}-{i}", {"i": i}) as op:
                op.checkpoint("half")
                op.complete(200, {"i": i})
            held = api.claim(conn, "prep", f"{tag}-h{i}", None, fingerprint=bytes(32))
            api.heartbeat(conn, "prep", f"{tag}-h{i}", held.lease_token)
            api.release(conn, "prep", f"{tag}-h{i}", held.lease_token)
            if not conn.autocommit:
                conn.commit()

    prepared = "SELECT count(*) FROM pg_prepared_statements"
    with psycopg.connect(db, autocommit=True) as conn:
        assert conn.prepare_threshold == 5
        lifecycle(conn, 15, "off")
        assert conn.execute(prepared, prepare=False).fetchone()[0] == 0
    with psycopg.connect(db) as conn:  # not autocommit: BEGIN/COMMIT of its own
        lifecycle(conn, 15, "tx")
        conn.rollback()
        assert conn.execute(prepared, prepare=False).fetchone()[0] == 0
    monkeypatch.setattr(_exec, "PREPARE", None)
    with psycopg.connect(db, autocommit=True) as conn:
        lifecycle(conn, 15, "on")
        assert conn.execute(prepared, prepare=False).fetchone()[0] >= 4


def test_allow_prepared_statements_follows_each_connection(
        db: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The opt-in for processes with no transaction-mode pooler: allowed, the package's
    statements are prepared as the connection's prepare_threshold says (psycopg's default 5:
    prepared; None: never); switched off again, nothing more is prepared. Anything but a bool
    is refused and changes nothing."""
    monkeypatch.setattr(_exec, "PREPARE", False)  # restored after the test
    lifecycle_sql = "SELECT name, statement FROM pg_prepared_statements ORDER BY name"

    def lifecycle(conn: psycopg.Connection[Any], n: int, tag: str) -> None:
        for i in range(n):
            with idem.operation(conn, "allow", f"{tag}-{i}", {"i": i}) as op:
                conn.execute("SELECT 1", prepare=False)  # a business statement, unprepared
                op.complete(200, {"i": i})
            assert idem.claim(conn, "allow", f"{tag}-{i}", {"i": i}).outcome == "replay"

    with pytest.raises(TypeError, match="allowed must be True or False"):
        idem.allow_prepared_statements("yes")  # type: ignore[arg-type]
    assert _exec.PREPARE is False
    idem.allow_prepared_statements()
    with psycopg.connect(db, autocommit=True) as conn:
        lifecycle(conn, 8, "on")
        statements = conn.execute(lifecycle_sql, prepare=False).fetchall()
        texts = " ".join(s for _, s in statements)
        assert "idempotency.claim(" in texts and "idempotency.complete" in texts, statements
        # and they were used: the replays of the last rounds ran through them
        assert conn.execute("SELECT outcome FROM idempotency.claim('allow', 'on-0', "
                            "'{\"i\": 0}')", prepare=False).fetchone()[0] == "replay"
    with psycopg.connect(db, autocommit=True, prepare_threshold=None) as conn:
        lifecycle(conn, 8, "none")
        assert conn.execute(lifecycle_sql, prepare=False).fetchall() == []
    idem.allow_prepared_statements(False)
    assert _exec.PREPARE is False
    with psycopg.connect(db, autocommit=True) as conn:
        lifecycle(conn, 8, "off")
        assert conn.execute(lifecycle_sql, prepare=False).fetchall() == []


def test_prepared_statements_outlive_an_upgrade_of_the_functions(
        db: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the opt-in, a long-lived connection keeps using its prepared claim and complete
    while a migration replaces the functions (CREATE OR REPLACE) and widens claim_result (ALTER
    TYPE ... ADD ATTRIBUTE): the server re-plans them; no error, no second preparation, the
    same answers."""
    monkeypatch.setattr(_exec, "PREPARE", False)
    idem.allow_prepared_statements()
    with psycopg.connect(db, autocommit=True) as app, \
            psycopg.connect(db, autocommit=True) as owner:
        def walk(i: int) -> None:
            with idem.operation(app, "upgrade", f"k{i}", {"i": i}) as op:
                assert op.outcome == "claimed"
                op.complete(201, {"i": i})
            replay = idem.claim(app, "upgrade", f"k{i}", {"i": i})
            assert replay.outcome == "replay" and replay.response.json() == {"i": i}

        for i in range(6):
            walk(i)
        prepared = app.execute("SELECT count(*) FROM pg_prepared_statements",
                               prepare=False).fetchone()[0]
        assert prepared >= 3
        for fn in ("claim", "complete_bytes"):
            owner.execute(owner.execute("SELECT pg_get_functiondef(%s::regproc)",
                                        (f"idempotency.{fn}",)).fetchone()[0])
        owner.execute("ALTER TYPE idempotency.claim_result ADD ATTRIBUTE spare integer")
        for i in range(6, 12):
            walk(i)
        assert app.execute("SELECT count(*) FROM pg_prepared_statements",
                           prepare=False).fetchone()[0] == prepared
        assert app.execute("SELECT count(*) FROM idempotency.keys WHERE scope = 'upgrade' "
                           "AND state = 'completed'", prepare=False).fetchone()[0] == 12
