"""A Citus worker killed under load: clients that follow the package's retry advice lose and
duplicate nothing, and the healthy worker's tenants keep completing while it is down.

Six client threads pay through the coordinator, each payment a claim (autocommit), then one
transaction with the ledger insert (a table co-located with the keys) and ``complete()``,
for eight tenants: four on each worker. They follow docs/scale-out.md's advice for an
outage: on :class:`pg_idempotency.DatabaseUnavailable` wait ``retry_after`` scaled down with
full jitter (the test's clock is short) and put the payment back at the end of the queue,
taking another tenant's payment next instead of retrying in place; an ``in_progress`` claim
(the lost attempt's lease, 2 s here) goes back the same way.

The worker's postmaster gets SIGKILL while they run, and is started again once the
clients have both seen it (DatabaseUnavailable for its tenants) and completed payments of
the other worker's tenants since the kill (the events the test waits for, with generous
timeouts, not fixed sleeps). Then: every acknowledged payment is completed with exactly one
ledger row, no payment has two, and the killed worker's tenants complete again.
"""

from __future__ import annotations

import collections
import os
import random
import re
import signal
import threading
import time
import uuid
from typing import Any

import psycopg
import pytest
from helpers.citus import Cluster, installed, synchronous_commit
from psycopg import sql

import pg_idempotency as idem
from pg_idempotency.errors import DEFAULT_UNAVAILABLE_RETRY_AFTER, is_unavailable
from pgharness import WAIT_BOUND, wait_until

CLIENTS = 6
TENANTS_PER_WORKER = 4
PAYMENTS_PER_TENANT = 60
LEASE = 2.0
# The package's retry_after (1 s) is meant for real clients; the test scales it down so that
# the run takes seconds, and keeps the full jitter.
BACKOFF_SCALE = 0.1
EVENT_TIMEOUT = WAIT_BOUND


def _worker_of(cluster: Cluster, scope: str) -> int:
    with psycopg.connect(cluster.dsn, autocommit=True) as conn:
        port = conn.execute(
            "SELECT nodeport FROM citus_shards WHERE table_name = 'idempotency.keys'::regclass"
            " AND shardid = get_shard_id_for_distribution_column('idempotency.keys', %s::text)",
            (scope,)).fetchone()[0]
    return next(i for i, w in enumerate(cluster.workers) if w.port == port)


class Load:
    """The clients, their queue of payments and what they saw."""

    def __init__(self, cluster: Cluster, role: str, tenants: dict[str, int]) -> None:
        self.cluster = cluster
        self.role = role
        self.tenants = tenants  # scope -> index of its worker
        self.queue: collections.deque[tuple[str, str, float]] = collections.deque(
            (scope, f"pay-{i}", 0.0) for i in range(PAYMENTS_PER_TENANT) for scope in tenants)
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.acked: list[tuple[str, str]] = []
        self.acked_by_worker = [0] * len(cluster.workers)
        self.ack_times: list[list[float]] = [[] for _ in cluster.workers]
        self.unavailable_by_worker = [0] * len(cluster.workers)
        self.other_errors: list[str] = []
        self.stop = threading.Event()

    def _next(self) -> tuple[str, str] | None:
        with self.lock:
            for _ in range(len(self.queue)):
                scope, key, not_before = self.queue.popleft()
                if not_before <= time.monotonic():
                    return scope, key
                self.queue.append((scope, key, not_before))
            return None if not self.queue else ("", "")

    def _later(self, scope: str, key: str, delay: float) -> None:
        with self.lock:
            self.queue.append((scope, key, time.monotonic() + delay))

    def _pay(self, conn: psycopg.Connection[Any], scope: str, key: str) -> str:
        conn.autocommit = True
        result = idem.claim(conn, scope, key, {"amount": 1}, lease=LEASE)
        if result.outcome == "replay":
            return "replay"
        if result.outcome == "in_progress":
            return "in_progress"
        assert result.outcome in ("claimed", "resumed"), result.outcome
        conn.autocommit = False
        with conn.transaction():
            conn.execute("INSERT INTO ledger VALUES (%s, %s, 1)", (scope, key))
            idem.complete(conn, scope, key, result.lease_token, 201, {"paid": key})
        return "acked"

    def _other(self, scope: str, key: str, exc: BaseException,
               conn: psycopg.Connection[Any] | None) -> None:
        """Anything but an outage: recorded (the test fails on it), the payment retried."""
        with self.lock:
            self.other_errors.append(f"{scope}/{key}: {type(exc).__name__}: {exc}")
        if conn is not None:
            conn.close()
        self._later(scope, key, 0.1)

    def client(self) -> None:
        conn: psycopg.Connection[Any] | None = None
        while not self.stop.is_set():
            item = self._next()
            if item is None:
                return
            if item == ("", ""):
                time.sleep(0.01)
                continue
            scope, key = item
            worker = self.tenants[scope]
            try:
                if conn is None or conn.closed:
                    conn = psycopg.connect(
                        self.cluster.coordinator.dsn(self.cluster.db, user=self.role))
                outcome = self._pay(conn, scope, key)
            except (idem.DatabaseUnavailable, psycopg.Error) as exc:
                # The package raises DatabaseUnavailable from its own calls; the ledger insert
                # and the COMMIT are ours, so is_unavailable() classifies psycopg's error (also
                # Citus's XX000 for a worker lost during the COMMIT it relays, whose outcome is
                # unknown: the payment is retried, and its claim replays or resumes).
                if not is_unavailable(exc):
                    self._other(scope, key, exc, conn)
                    continue
                with self.cond:
                    self.unavailable_by_worker[worker] += 1
                    self.cond.notify_all()
                if conn is not None and not conn.closed and conn.info.transaction_status:
                    try:
                        conn.rollback()
                    except psycopg.Error:
                        conn.close()
                # The package's advice: back off with full jitter, then another tenant's work.
                retry_after = getattr(exc, "retry_after", DEFAULT_UNAVAILABLE_RETRY_AFTER)
                self._later(scope, key, random.uniform(0, retry_after * BACKOFF_SCALE))
                continue
            except (idem.IdempotencyError, AssertionError) as exc:
                self._other(scope, key, exc, conn)
                continue
            if outcome == "in_progress":
                self._later(scope, key, random.uniform(0, LEASE))
            elif outcome == "acked":
                with self.cond:
                    self.acked.append((scope, key))
                    self.ack_times[worker].append(time.monotonic())
                    self.acked_by_worker[worker] += 1
                    self.cond.notify_all()
        if conn is not None:
            conn.close()

    def wait_for(self, what: str, predicate: Any) -> None:
        with self.cond:
            if not self.cond.wait_for(predicate, EVENT_TIMEOUT):
                raise AssertionError(f"timed out waiting for {what}: acked by worker "
                                     f"{self.acked_by_worker}, unavailable by worker "
                                     f"{self.unavailable_by_worker}, other errors "
                                     f"{self.other_errors[:5]}")


@pytest.fixture(scope="module")
def outage_cluster(citus_cluster: Any) -> Any:
    cluster = installed(citus_cluster, "idem_outage", 8)
    # The harness runs servers with synchronous_commit = off (fast, and a process kill loses
    # nothing else): a commit is then acknowledged before its WAL leaves the server's
    # buffers, and SIGKILL loses it. A killed worker must keep what it acknowledged, as a
    # production server does.
    synchronous_commit(cluster, "on")
    role = f"request_{uuid.uuid4().hex[:6]}"
    with psycopg.connect(cluster.dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
        conn.execute("SELECT idempotency.grant_usage(%s::regrole, kind => 'request')", (role,))
        # No primary key: a duplicated payment must show as two rows, not as an error.
        conn.execute("CREATE TABLE ledger (account text NOT NULL, payment text NOT NULL,"
                     " amount integer NOT NULL)")
        conn.execute("SELECT create_distributed_table('ledger', 'account',"
                     " colocate_with => 'idempotency.keys')")
        conn.execute(sql.SQL("GRANT SELECT, INSERT ON ledger TO {}").format(
            sql.Identifier(role)))
    return cluster, role


def test_a_killed_worker_loses_nothing_and_stalls_only_its_tenants(outage_cluster: Any) -> None:
    cluster, role = outage_cluster
    tenants: dict[str, int] = {}
    per_worker = [0, 0]
    while min(per_worker) < TENANTS_PER_WORKER:
        scope = f"tenant_{uuid.uuid4().hex[:8]}"
        w = _worker_of(cluster, scope)
        if per_worker[w] < TENANTS_PER_WORKER:
            tenants[scope] = w
            per_worker[w] += 1
    load = Load(cluster, role, tenants)
    victim, healthy = 0, 1
    server = cluster.workers[victim]
    threads = [threading.Thread(target=load.client) for _ in range(CLIENTS)]
    for t in threads:
        t.start()
    try:
        load.wait_for("completions on both workers before the kill",
                      lambda: min(load.acked_by_worker) >= 10)
        postmaster = server._pg.child_process  # noqa: SLF001 (the harness's process)
        t_kill = time.monotonic()
        os.kill(postmaster.pid, signal.SIGKILL)
        postmaster.wait(WAIT_BOUND)
        server._pg.child_process = None  # noqa: SLF001
        killed_at = (list(load.acked_by_worker), list(load.unavailable_by_worker))
        # While it is down: its tenants' calls fail as outages, the other worker's complete.
        load.wait_for("DatabaseUnavailable for the killed worker's tenants",
                      lambda: load.unavailable_by_worker[victim] >= 20)
        load.wait_for("completions on the healthy worker during the outage",
                      lambda: load.acked_by_worker[healthy] >= killed_at[0][healthy] + 60)
        during = (list(load.acked_by_worker), list(load.unavailable_by_worker))
        t_restart = time.monotonic()
        # Orphaned backends of the killed postmaster must be gone before it can start again.
        deadline = time.monotonic() + WAIT_BOUND
        while True:
            try:
                server._pg.start()  # noqa: SLF001
                break
            except RuntimeError:
                assert time.monotonic() < deadline, "the killed worker never started again"
                time.sleep(0.2)
        load.wait_for("completions on the restarted worker",
                      lambda: load.acked_by_worker[victim] >= during[0][victim] + 10)
        for t in threads:
            t.join(WAIT_BOUND)
    finally:
        load.stop.set()
        for t in threads:
            t.join(WAIT_BOUND)
    assert not any(t.is_alive() for t in threads)
    assert not load.queue, f"{len(load.queue)} payments never done"
    # The outage: its tenants stalled (no completion for them between the kill and the
    # first DatabaseUnavailable count reached), the healthy worker's did not.
    assert during[0][healthy] - killed_at[0][healthy] >= 60
    assert during[1][victim] - killed_at[1][victim] >= 20
    with psycopg.connect(cluster.dsn, autocommit=True) as conn:
        ledger = collections.Counter(
            (a, p) for a, p in conn.execute("SELECT account, payment FROM ledger").fetchall())
        states = dict(((s, k), st) for s, k, st in conn.execute(
            "SELECT scope, key, state FROM idempotency.keys WHERE scope = ANY(%s)",
            (list(tenants),)).fetchall())
    lost = [p for p in load.acked if ledger[p] != 1 or states.get(p) != "completed"]
    duplicated = [p for p, n in ledger.items() if n > 1]
    assert lost == [] and duplicated == []
    assert load.other_errors == []
    # Every payment ended completed with one ledger row (acknowledged, or replayed after an
    # acknowledgement the outage cut off).
    assert len(ledger) == len(tenants) * PAYMENTS_PER_TENANT
    assert set(states.values()) == {"completed"}
    def rate(worker: int, start: float, end: float) -> float:
        return sum(start <= t < end for t in load.ack_times[worker]) / max(end - start, 1e-9)

    down = t_restart - t_kill
    print(f"\ndown {down:.2f} s; completions/s before (same length) / during, healthy worker:"
          f" {rate(healthy, t_kill - down, t_kill):.0f} / {rate(healthy, t_kill, t_restart):.0f},"
          f" killed worker: {rate(victim, t_kill - down, t_kill):.0f} /"
          f" {rate(victim, t_kill, t_restart):.0f}")
    print(f"acked {len(load.acked)} (by worker {load.acked_by_worker}); DatabaseUnavailable"
          f" by worker {load.unavailable_by_worker}; other errors {len(load.other_errors)}:"
          f" {load.other_errors[:3]}")


#: The advisory lock the worker's deferred trigger waits on, so that a COMMIT is in flight on
#: the worker (its deferred triggers run inside it) when the test kills that backend.
HOLD_LOCK = 0x1D3A_C0DE


def test_a_worker_lost_during_the_commit_it_relays_is_an_outage(outage_cluster: Any) -> None:
    """The worker's backend dies in the middle of the COMMIT the coordinator relays to it
    (SIGKILL while a deferred trigger on the ledger's shard, which runs inside that COMMIT,
    waits on an advisory lock the test holds). Citus answers the client's COMMIT (here the one
    ``op.complete()`` sends with complete()) with XX000 "could not commit transaction for
    shard ..."; the package raises DatabaseUnavailable for it (an HTTP adapter: 503 +
    Retry-After). The outcome of such a COMMIT is unknown to the client, so it retries with the
    same key, as docs/scale-out.md says, until the engine answers: one ledger row, the key
    completed, the retry's 201."""
    cluster, role = outage_cluster
    victim = 0
    scope = next(s for s in (f"tenant_{uuid.uuid4().hex[:8]}" for _ in range(1000))
                 if _worker_of(cluster, s) == victim)
    server = cluster.workers[victim]
    with psycopg.connect(cluster.dsn, autocommit=True) as conn:
        shard = conn.execute("SELECT get_shard_id_for_distribution_column('ledger', %s::text)",
                             (scope,)).fetchone()[0]
    wdsn = server.dsn(cluster.db)
    with psycopg.connect(wdsn, autocommit=True) as conn:
        conn.execute("SET citus.enable_ddl_propagation = off")
        conn.execute("CREATE OR REPLACE FUNCTION public.hold_commit() RETURNS trigger"
                     " LANGUAGE plpgsql AS $$BEGIN PERFORM pg_advisory_xact_lock("
                     f"{HOLD_LOCK}); RETURN NULL; END$$")
        conn.execute(sql.SQL(
            "CREATE CONSTRAINT TRIGGER hold_commit AFTER INSERT ON public.{}"
            " DEFERRABLE INITIALLY DEFERRED FOR EACH ROW"
            " WHEN (NEW.payment LIKE 'cut-%') EXECUTE FUNCTION public.hold_commit()"
        ).format(sql.Identifier(f"ledger_{shard}")))
    holder = psycopg.connect(wdsn, autocommit=True)
    holder.execute("SELECT pg_advisory_lock(%s)", (HOLD_LOCK,))
    seen: list[BaseException] = []

    def pay() -> None:
        with psycopg.connect(cluster.coordinator.dsn(cluster.db, user=role)) as conn:
            try:
                with idem.operation(conn, scope, "cut-1", {"amount": 1}, lease=LEASE) as op:
                    conn.execute("INSERT INTO ledger VALUES (%s, 'cut-1', 1)", (scope,))
                    op.complete(201, {"paid": "cut-1"})
            except BaseException as exc:  # noqa: BLE001 - what the client saw, asserted below
                seen.append(exc)

    client = threading.Thread(target=pay)
    client.start()
    try:
        def waiting() -> int | None:
            row = holder.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
                " AND wait_event_type = 'Lock' AND wait_event = 'advisory'").fetchone()
            return row[0] if row else None

        os.kill(wait_until(waiting, "the COMMIT waiting in the worker's deferred trigger"),
                signal.SIGKILL)
        client.join(WAIT_BOUND)
        assert not client.is_alive()
    finally:
        holder.close()  # the worker's crash restart has ended its session already
    assert len(seen) == 1, seen
    exc = seen[0]
    assert isinstance(exc, idem.DatabaseUnavailable), repr(exc)
    cause = exc.pgerror
    assert isinstance(cause, psycopg.Error) and cause.sqlstate == "XX000", repr(cause)
    # The shard it names is one of the co-located group's (the keys' or the ledger's).
    assert re.fullmatch(r"could not commit transaction for shard \d+ on at least one active"
                        r" node", cause.diag.message_primary or ""), cause.diag.message_primary
    print(f"\nthe client saw {type(exc).__name__}: {cause.sqlstate} {cause.diag.message_primary}")

    # The worker restarts by itself (crash recovery). The client retries the same key.
    wait_until(lambda: _accepts(wdsn), "the worker accepting connections after its crash")
    answers: list[str] = []

    def retry() -> Any:
        with psycopg.connect(cluster.coordinator.dsn(cluster.db, user=role)) as conn:
            try:
                with idem.operation(conn, scope, "cut-1", {"amount": 1}, lease=LEASE) as op:
                    if op.replay is not None:
                        answers.append("replay")
                        return op.replay
                    conn.execute("INSERT INTO ledger VALUES (%s, 'cut-1', 1)", (scope,))
                    answers.append(str(op.outcome))
                    return op.complete(201, {"paid": "cut-1"})
            except (idem.KeyInProgress, idem.DatabaseUnavailable) as exc:
                answers.append(type(exc).__name__)  # the lost attempt's lease, or recovery
                time.sleep(0.2)
                return None

    stored = wait_until(retry, "the retry's answer")
    assert stored.status == 201, stored
    with psycopg.connect(cluster.dsn, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM ledger WHERE account = %s AND payment ="
                            " 'cut-1'", (scope,)).fetchone() == (1,)
        assert conn.execute("SELECT state FROM idempotency.keys WHERE scope = %s AND key ="
                            " 'cut-1'", (scope,)).fetchone() == ("completed",)
    print(f"the retries saw: {answers}")


def _accepts(dsn: str) -> bool:
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("SELECT 1")
    except psycopg.OperationalError:
        return False
    return True
