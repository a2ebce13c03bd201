"""Crash recovery probe (issue 13): a small load of sessions doing claim, then the business
insert and complete in one transaction, hit by ``pg_terminate_backend`` kills and an immediate
shutdown (``pg_ctl -m immediate``) in the middle; after crash recovery every in-progress key is
resumed and finished. Then the ledger and the completions match one to one: no business row
without its completion, no completion without its business row, no key with two business rows,
and no in-progress key that already has its business row (the two commit together).

Its own server with durable settings (the shared ones run with fsync off, which crash recovery
does not survive). ``PG_IDEM_PROBES=long`` runs more sessions, kills and crashes.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from helpers import MIGRATION_PSQL_ARGS, MIGRATIONS
from helpers.servers import FLAVOURS
from psycopg.types.json import Jsonb

from pgharness import WAIT_BOUND, PgServer, flavour_bindir, wait_until

LONG = os.environ.get("PG_IDEM_PROBES") == "long"
SESSIONS = 8
CRASHES = 3 if LONG else 1
KILL_ROUNDS = 20 if LONG else 4  # per crash round, a few backends each
# Load before the crash, per round, in keys the sessions start (a fixed time gives little
# load on a busy machine), spread over the kill rounds.
LOAD_KEYS = SESSIONS * (20 if LONG else 4)
LEASE = 1.0  # seconds: a crashed owner's key can be resumed this long after its claim
APP = "crash-load"
DURABLE = {"fsync": "on", "synchronous_commit": "on", "full_page_writes": "on"}


@pytest.fixture(params=FLAVOURS, ids=FLAVOURS)
def durable(request: pytest.FixtureRequest) -> Iterator[PgServer]:
    with PgServer(flavour_bindir(request.param), extra_conf=DURABLE,
                  name=f"crash-{request.param}") as srv:
        dsn = srv.dsn()
        for migration in sorted(MIGRATIONS.glob("*.sql")):
            srv.run_psql(dsn, migration, args=MIGRATION_PSQL_ARGS)
        with psycopg.connect(dsn, autocommit=True) as conn:
            assert conn.execute("SHOW fsync").fetchone()[0] == "on"
            conn.execute("CREATE TABLE public.business (scope text, key text, amount int, "
                         "at timestamptz DEFAULT clock_timestamp())")
        yield srv


class Load:
    """SESSIONS threads, each claiming fresh keys and doing business + complete in one
    transaction, until stopped; connection errors (kills, the crash) end a session's
    current key and it reconnects."""

    def __init__(self, dsn: str, round_no: int) -> None:
        self.dsn = dsn
        self.round_no = round_no
        self.stop = threading.Event()
        self.attempted: list[str] = []
        self.errors: list[str] = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(SESSIONS)]

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(WAIT_BOUND)
        assert not any(t.is_alive() for t in self.threads), "a session hung"

    def progress(self, keys: int) -> None:
        """Wait until the sessions have started ``keys`` more keys."""
        with self.lock:
            target = len(self.attempted) + keys
        wait_until(lambda: len(self.attempted) >= target or self.errors,
                   f"{keys} more keys from the sessions")

    def _run(self, worker: int) -> None:
        n = 0
        while not self.stop.is_set():
            try:
                conn = psycopg.connect(self.dsn, autocommit=True, application_name=APP,
                                       connect_timeout=2)
            except psycopg.OperationalError:
                time.sleep(0.05)
                continue
            try:
                while not self.stop.is_set():
                    n += 1
                    key = f"r{self.round_no}-w{worker}-{n}"
                    with self.lock:
                        self.attempted.append(key)
                    _do_key(conn, key)
            except psycopg.OperationalError:
                pass  # killed or crashed mid-key: the key is resumed after recovery
            except (psycopg.Error, AssertionError) as exc:
                with self.lock:
                    self.errors.append(f"{type(exc).__name__}: {exc}")
            finally:
                conn.close()


def _do_key(conn: psycopg.Connection[Any], key: str) -> str:
    """The application's work for one key; returns the claim's outcome."""
    outcome, token = conn.execute(
        "SELECT (r).outcome, (r).lease_token FROM idempotency.claim('crash', %s, %s, "
        "make_interval(secs => %s)) AS r", (key, Jsonb({"key": key}), LEASE)).fetchone()
    if outcome in ("claimed", "resumed"):
        with conn.transaction():
            if outcome == "resumed":
                # The business row commits with complete(): an unfinished key has none.
                done = conn.execute("SELECT count(*) FROM public.business "
                                    "WHERE scope = 'crash' AND key = %s", (key,)).fetchone()[0]
                assert done == 0, f"{key} is in progress but has its business row"
            conn.execute("INSERT INTO public.business (scope, key, amount) "
                         "VALUES ('crash', %s, 1)", (key,))
            conn.execute("SELECT idempotency.complete('crash', %s, %s, 201, %s)",
                         (key, token, Jsonb({"key": key})))
    return outcome


def _kill_some(dsn: str, rng: random.Random) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        pids = [r[0] for r in conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE application_name = %s", (APP,))]
        victims = rng.sample(pids, min(len(pids), 2))
        for pid in victims:
            conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
    return len(victims)


def test_kills_and_an_immediate_shutdown_leave_ledger_and_completions_one_to_one(
        durable: PgServer) -> None:
    dsn = durable.dsn()
    rng = random.Random(13)
    attempted: list[str] = []
    kills = 0
    for round_no in range(CRASHES):
        with Load(dsn, round_no) as load:
            for _ in range(KILL_ROUNDS):
                load.progress(LOAD_KEYS // (KILL_ROUNDS + 1))
                kills += _kill_some(dsn, rng)
            load.progress(LOAD_KEYS // (KILL_ROUNDS + 1))
            durable.crash()  # immediate shutdown while the sessions are mid-key
            load.stop.set()
        durable.restart()
        assert load.errors == [], load.errors[:5]
        attempted += load.attempted
    assert kills >= KILL_ROUNDS * CRASHES  # the kills did hit live sessions

    with psycopg.connect(dsn, autocommit=True) as conn:
        unfinished = conn.execute("SELECT count(*) FROM idempotency.keys "
                                  "WHERE scope = 'crash' AND state = 'in_progress'"
                                  ).fetchone()[0]
        assert unfinished > 0, "the crash should leave keys in progress"
        time.sleep(LEASE + 0.1)  # every lease of the crashed owners has expired
        outcomes: dict[str, int] = {}
        for key in attempted:
            out = _do_key(conn, key)
            outcomes[out] = outcomes.get(out, 0) + 1
        # a key whose claim never committed is claimed now; one left in progress is resumed
        assert set(outcomes) <= {"replay", "resumed", "claimed"}, outcomes
        assert outcomes.get("resumed", 0) >= unfinished
        assert [_do_key(conn, k) for k in attempted] == ["replay"] * len(attempted)

        ledger = conn.execute(
            """SELECT count(*) FILTER (WHERE k.state = 'completed'),
                      count(*) FILTER (WHERE k.state <> 'completed')
               FROM idempotency.keys AS k WHERE k.scope = 'crash'""").fetchone()
        assert ledger == (len(set(attempted)), 0)
        doubled = conn.execute("SELECT key FROM public.business GROUP BY scope, key "
                               "HAVING count(*) > 1").fetchall()
        assert doubled == []
        orphans = conn.execute(
            """SELECT b.key FROM public.business AS b
               WHERE NOT EXISTS (SELECT FROM idempotency.keys AS k WHERE k.scope = b.scope
                                 AND k.key = b.key AND k.state = 'completed')
               UNION ALL
               SELECT k.key FROM idempotency.keys AS k WHERE k.scope = 'crash'
                 AND NOT EXISTS (SELECT FROM public.business AS b
                                 WHERE b.scope = k.scope AND b.key = k.key)""").fetchall()
        assert orphans == []
        assert conn.execute("SELECT count(*) FROM public.business").fetchone()[0] == len(
            set(attempted))
    print(f"crash probe: {len(attempted)} keys, {kills} kills, {CRASHES} crashes, "
          f"{unfinished} left in progress, resume outcomes {outcomes}")
