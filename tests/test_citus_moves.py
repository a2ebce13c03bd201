"""Shard moves and a shard split under load (issue 32's requirement, issue 33's "what each move
mode looks like to clients"), on a real Citus cluster (tests/citus_cluster.py), both versions.

Six client threads pay through the coordinator with the package's README pattern, as the
request role, RATE new payments a second in all: ``with idem.operation(conn, scope, key,
request) as op:`` + one ledger INSERT (a table co-located with the keys) +
``op.complete(201, ...)``, for eight tenants: three on the shard group that moves, three on
the one that splits, two elsewhere. They follow the
package's retry advice: on :class:`pg_idempotency.DatabaseUnavailable` wait ``retry_after``
(scaled down: the test's clock is short) with full jitter and put the payment back at the end
of the queue; on :class:`pg_idempotency.KeyInProgress` put it back after its ``retry_after``.
A payment is acknowledged when ``op.complete()`` returns (or a retry replays its answer).

While they run, the operations of PHASES, one after the other (each started once the load has
completed payments since the last one, and the next once the moved tenants complete again,
events not seconds):
1. ``citus_move_shard_placement(..., shard_transfer_mode => 'block_writes')`` (run);
2. the same shard group back with the default mode (``auto``: logical replication, which
   needs ``wal_level = logical`` and a replica identity on every co-located table: the ledger
   gets REPLICA IDENTITY FULL, docs/scale-out.md) (run);
3. ``citus_split_shard_by_split_points`` of another shard group in two (default mode), one
   half on each worker (written, not in PHASES yet: see there).
Then: every acknowledged payment has exactly one ledger row and its key is completed, no
payment has two ledger rows, and the load saw no error but the retry advice's. Completions per
second before, during and after each operation, for all tenants and for the tenants of the
shard group it moved or split, are printed: docs/scale-out.md quotes them.
"""

from __future__ import annotations

import collections
import random
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pytest
from psycopg import sql
from test_citus import Cluster, installed

import pg_idempotency as idem
from pgharness import WAIT_BOUND

CLIENTS = 6
LEASE = 5.0
# The package's retry_after (1 s) is meant for real clients; the test scales it down so that
# the run takes seconds, and keeps the full jitter.
BACKOFF_SCALE = 0.1
# Completions the load makes before an operation starts, and the moved tenants after it.
WARMUP = 60
RECOVERED = 20
# New payments per second, all clients together: about a third of what this cluster completes
# on two shared cores. Unpaced, the clients saturate the nodes, and the logical replication
# of the default-mode move and split never caught up (the split ran 15 minutes).
RATE = 100.0
# The operations run. Not yet the split (docs/scale-out.md): under unpaced load its logical
# catch-up did not end within pytest's 15-minute timeout, and it was not tried paced. (One
# unpaced run also saw a complete() answer IK001 during the auto move; paced runs did not.)
PHASES = ("move block_writes", "move auto")


@dataclass
class Phase:
    name: str
    tenants: list[str]
    start: float = 0.0
    end: float = 0.0
    rates: dict[str, tuple[float, float, float]] = field(default_factory=dict)


class Load:
    """The clients, their queue of payments and what they saw."""

    def __init__(self, cluster: Cluster, role: str, tenants: list[str]) -> None:
        self.cluster = cluster
        self.role = role
        self.tenants = tenants
        self.retry: collections.deque[tuple[float, str, str]] = collections.deque()
        self.counter = 0
        self.next_at = time.monotonic()
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.acked: list[tuple[str, str]] = []
        self.ack_times: dict[str, list[float]] = {t: [] for t in tenants}
        self.unavailable: list[str] = []
        self.in_progress = 0
        self.other_errors: list[str] = []
        self.stop = threading.Event()

    def _next(self) -> tuple[str, str] | None:
        """A payment due for a retry, else a new one (none once stopping: then only the
        retries, so that every payment started ends)."""
        with self.lock:
            now = time.monotonic()
            for _ in range(len(self.retry)):
                due, scope, key = self.retry.popleft()
                if due <= now:
                    return scope, key
                self.retry.append((due, scope, key))
            if self.stop.is_set():
                return None if not self.retry else ("", "")
            if self.next_at > now:
                return "", ""
            self.next_at = max(self.next_at + 1 / RATE, now - 1.0)
            self.counter += 1
            return self.tenants[self.counter % len(self.tenants)], f"pay-{self.counter}"

    def _later(self, scope: str, key: str, delay: float) -> None:
        with self.lock:
            self.retry.append((time.monotonic() + delay, scope, key))

    def _pay(self, conn: psycopg.Connection[Any], scope: str, key: str) -> None:
        with idem.operation(conn, scope, key, {"amount": 1}, lease=LEASE) as op:
            if op.replay is None:
                conn.execute("INSERT INTO ledger VALUES (%s, %s, 1)", (scope, key))
                op.complete(201, {"paid": key})

    def client(self) -> None:
        conn: psycopg.Connection[Any] | None = None
        while True:
            item = self._next()
            if item is None:
                break
            if item == ("", ""):  # nothing due yet
                time.sleep(0.005)
                continue
            scope, key = item
            try:
                if conn is None or conn.closed:
                    conn = psycopg.connect(
                        self.cluster.coordinator.dsn(self.cluster.db, user=self.role))
                self._pay(conn, scope, key)
            except idem.DatabaseUnavailable as exc:
                with self.lock:
                    self.unavailable.append(f"{scope}/{key}: {exc}")
                if conn is not None and conn.broken:
                    conn.close()
                self._later(scope, key, random.uniform(0, exc.retry_after * BACKOFF_SCALE))
                continue
            except idem.KeyInProgress as exc:
                with self.lock:
                    self.in_progress += 1
                wait = exc.retry_after.total_seconds() if exc.retry_after else LEASE
                self._later(scope, key, random.uniform(0, wait))
                continue
            except Exception as exc:  # noqa: BLE001 - recorded, the test fails on it
                with self.lock:
                    self.other_errors.append(f"{scope}/{key}: {type(exc).__name__}: {exc}")
                if conn is not None:
                    conn.close()
                self._later(scope, key, 0.1)
                continue
            with self.cond:
                self.acked.append((scope, key))
                self.ack_times[scope].append(time.monotonic())
                self.cond.notify_all()
        if conn is not None:
            conn.close()

    def acks(self, tenants: list[str] | None = None) -> int:
        with self.lock:
            return sum(len(self.ack_times[t]) for t in tenants or self.tenants)

    def wait_for(self, what: str, tenants: list[str] | None, count: int) -> None:
        with self.cond:
            ok = self.cond.wait_for(
                lambda: sum(len(self.ack_times[t]) for t in tenants or self.tenants) >= count,
                WAIT_BOUND)
        assert ok, (what, self.other_errors[:5])

    def rate(self, tenants: list[str], start: float, end: float) -> float:
        with self.lock:
            n = sum(start <= t < end for s in tenants for t in self.ack_times[s])
        return n / max(end - start, 1e-9)


def _shard_of(conn: psycopg.Connection[Any], scope: str) -> int:
    return conn.execute("SELECT get_shard_id_for_distribution_column('idempotency.keys',"
                        " %s::text)", (scope,)).fetchone()[0]


def _node_of(conn: psycopg.Connection[Any], shard: int) -> int:
    return conn.execute("SELECT nodeport FROM citus_shards WHERE shardid = %s",
                        (shard,)).fetchone()[0]


@pytest.fixture(scope="module")
def moves_cluster(citus_cluster: Any) -> Any:
    cluster = installed(citus_cluster, "idem_moves", 8)
    role = f"request_{uuid.uuid4().hex[:6]}"
    with psycopg.connect(cluster.dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
        conn.execute("SELECT idempotency.grant_usage(%s::regrole, kind => 'request')", (role,))
        # No primary key: a duplicated payment must show as two rows, not as an error. A
        # replica identity, as every co-located table needs for a logical move or split.
        conn.execute("CREATE TABLE ledger (account text NOT NULL, payment text NOT NULL,"
                     " amount integer NOT NULL)")
        conn.execute("ALTER TABLE ledger REPLICA IDENTITY FULL")
        conn.execute("SELECT create_distributed_table('ledger', 'account',"
                     " colocate_with => 'idempotency.keys')")
        conn.execute(sql.SQL("GRANT SELECT, INSERT ON ledger TO {}").format(
            sql.Identifier(role)))
    return cluster, role


def test_moves_and_a_split_under_load_lose_and_duplicate_nothing(moves_cluster: Any) -> None:
    cluster, role = moves_cluster
    with psycopg.connect(cluster.dsn, autocommit=True) as conn:
        by_shard: dict[int, list[str]] = collections.defaultdict(list)
        while True:
            scope = f"tenant_{uuid.uuid4().hex[:8]}"
            by_shard[_shard_of(conn, scope)].append(scope)
            full = [s for s, ts in by_shard.items() if len(ts) >= 3]
            if len(full) >= 2 and len(by_shard) >= 4:
                break
        move_shard, split_shard = full[:2]
        moving = by_shard[move_shard][:3]
        splitting = by_shard[split_shard][:3]
        others = [ts[0] for s, ts in by_shard.items() if s not in (move_shard, split_shard)][:2]
        ports = {w.port for w in cluster.workers}
        nodeids = dict(conn.execute("SELECT nodeport, nodeid FROM pg_dist_node"
                                    " WHERE noderole = 'primary' AND groupid <> 0").fetchall())
    tenants = moving + splitting + others
    load = Load(cluster, role, tenants)
    threads = [threading.Thread(target=load.client) for _ in range(CLIENTS)]
    for t in threads:
        t.start()
    phases: list[Phase] = []
    try:
        with psycopg.connect(cluster.dsn, autocommit=True) as conn:
            for name, affected in ((n, moving if n.startswith("move") else splitting)
                                   for n in PHASES):
                phase = Phase(name, affected)
                load.wait_for(f"load before {name}", None, load.acks() + WARMUP)
                phase.start = time.monotonic()
                if name.startswith("move"):
                    source = _node_of(conn, move_shard)
                    (target,) = ports - {source}
                    mode = "block_writes" if name.endswith("block_writes") else "auto"
                    conn.execute(
                        "SELECT citus_move_shard_placement(%s, '127.0.0.1', %s, '127.0.0.1',"
                        " %s, shard_transfer_mode => %s::citus.shard_transfer_mode)",
                        (move_shard, source, target, mode))
                    assert _node_of(conn, move_shard) == target, name
                else:
                    lo, hi = conn.execute(
                        "SELECT shardminvalue::bigint, shardmaxvalue::bigint FROM pg_dist_shard"
                        " WHERE shardid = %s", (split_shard,)).fetchone()
                    source = _node_of(conn, split_shard)
                    (other,) = ports - {source}
                    conn.execute("SELECT citus_split_shard_by_split_points(%s, ARRAY[%s],"
                                 " ARRAY[%s, %s])",
                                 (split_shard, str((lo + hi) // 2), nodeids[source],
                                  nodeids[other]))
                    halves = {_node_of(conn, _shard_of(conn, s)) for s in splitting}
                    assert conn.execute("SELECT count(*) FROM pg_dist_shard WHERE shardid = %s",
                                        (split_shard,)).fetchone() == (0,)
                    assert halves <= ports
                phase.end = time.monotonic()
                load.wait_for(f"the tenants of {name} completing again", affected,
                              load.acks(affected) + RECOVERED)
                phases.append(phase)
            load.wait_for("load after the last operation", None, load.acks() + WARMUP)
    finally:
        load.stop.set()
        for t in threads:
            t.join(WAIT_BOUND)
    assert not any(t.is_alive() for t in threads)
    assert not load.retry, f"{len(load.retry)} payments never done"

    with psycopg.connect(cluster.dsn, autocommit=True) as conn:
        ledger = collections.Counter(
            (a, p) for a, p in conn.execute("SELECT account, payment FROM ledger").fetchall())
        states = dict(((s, k), st) for s, k, st in conn.execute(
            "SELECT scope, key, state FROM idempotency.keys WHERE scope = ANY(%s)",
            (tenants,)).fetchall())
    lost = [p for p in load.acked if ledger[p] != 1 or states.get(p) != "completed"]
    duplicated = [p for p, n in ledger.items() if n > 1]
    print(f"\n{cluster.cluster.flavour}: acked {len(load.acked)}, lost {len(lost)}, duplicated"
          f" {len(duplicated)}; DatabaseUnavailable {len(load.unavailable)}, in progress"
          f" {load.in_progress}, other errors {len(load.other_errors)}")
    for phase in phases:
        length = phase.end - phase.start
        window = max(length, 2.0)
        for label, who in (("all", tenants), ("its tenants", phase.tenants)):
            before = load.rate(who, phase.start - window, phase.start)
            during = load.rate(who, phase.start, phase.end)
            after = load.rate(who, phase.end, phase.end + window)
            print(f"  {phase.name}: {length:.2f} s; completions/s {label} before/during/after:"
                  f" {before:.0f} / {during:.0f} / {after:.0f}")
    for line in load.unavailable[:3] + load.other_errors[:10]:
        print("  ", line[:300])
    for p in lost[:10]:
        print("   lost:", p, ledger[p], states.get(p))
    assert lost == [] and duplicated == []
    assert load.other_errors == []
    assert len(load.acked) == len(set(load.acked))
    assert set(ledger) == set(load.acked), "every payment ended acknowledged, once"
    assert set(states.values()) == {"completed"}
