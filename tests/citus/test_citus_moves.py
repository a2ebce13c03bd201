"""Shard moves and a shard split under load (issue 32's requirement, issue 33's "what each move
mode looks like to clients"), on a real Citus cluster (harness/citus_cluster.py), both versions.

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
completed payments since the last one and has run through the window its rates are counted
in, and the next once the moved tenants complete again: events, each bounded by WAIT_BOUND;
a logical catch-up that stops advancing fails within it too, citus.logical_replication_timeout):
1. ``citus_move_shard_placement(..., shard_transfer_mode => 'block_writes')`` (run);
2. the same shard group back with the default mode (``auto``: logical replication, which
   needs ``wal_level = logical`` and a replica identity on every co-located table: the ledger
   gets REPLICA IDENTITY FULL, docs/scale-out.md) (run);
3. ``citus_split_shard_by_split_points`` of another shard group in two (default mode), both
   halves onto the other worker (see PHASES for why not one on each);
4. the half that holds the first split tenant in two again, ``force_logical``, both halves
   back;
5. its half in two again with ``block_writes``, one half on each worker.
Then: every acknowledged payment has exactly one ledger row and its key is completed, no
payment has two ledger rows, and the load saw no error but the retry advice's. Completions per
second before, during and after each operation, for all tenants and for the tenants of the
shard group it moved or split, are printed: docs/scale-out.md quotes them. A split really
split: the tables have one shard more, and the split tenants' keys and ledger rows are on the
new shards, read there. The database runs with ``synchronous_commit = on`` on every node, as
production does: with the harness's ``off`` a logical move loses the commits of its last
moments, which the last test here shows on its own (docs/scale-out.md).
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
from helpers.citus import Cluster, installed, synchronous_commit
from psycopg import sql

import pg_idempotency as idem
from pgharness import WAIT_BOUND, wait_until

CLIENTS = 6
SHARDS = 8
LEASE = 5.0
# The package's retry_after (1 s) is meant for real clients; the test scales it down so that
# the run takes seconds, and keeps the full jitter.
BACKOFF_SCALE = 0.1
# Completions the load makes before an operation starts, and the moved tenants after it.
WARMUP = 60
RECOVERED = 20
# New payments per second, all clients together: about a third of what this cluster completes
# on two shared cores (the phases also pass unpaced, docs/scale-out.md; paced, the rates before,
# during and after each operation compare).
RATE = 100.0
# The operations, in order. The splits cut the split tenants' shard group in two at the middle
# of its hash range: first in the default mode (auto: logical replication, writes blocked only
# for the switch-over), both halves onto the other worker; then the half holding the first
# split tenant again with force_logical (the same, without auto's check for replica
# identities), both halves back; then its half again with block_writes (writes to it wait for
# the copy), one half on each worker.
# A logical split that leaves a half on the source worker does not end under this load, on
# either version (docs/scale-out.md, "Splitting a shard"): that half's subscription failed
# every 5 s with 'publisher did not send replica identity column expected by the logical
# replication target relation "idempotency.keys_p..."' on an UPDATE (a complete()) committed
# between the replication slot's creation and Citus creating that half's primary keys, and
# Citus waits for its LSN until citus.logical_replication_timeout. Halves on other nodes are
# decoded through dummy shards that get their replica identities before the slot exists.
PHASES = ("move block_writes", "move auto", "split auto", "split force_logical",
          "split block_writes")

@dataclass
class Phase:
    name: str
    tenants: list[str]
    start: float = 0.0
    end: float = 0.0
    rates: dict[str, tuple[float, float, float]] = field(default_factory=dict)

    @property
    def window(self) -> float:
        """The span the rates before and after are counted in."""
        return max(self.end - self.start, 2.0)

    @property
    def after_end(self) -> float:
        return self.end + self.window


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
        self.acked_at: dict[tuple[str, str], float] = {}  # when, to place a loss in a phase
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
                self.acked_at[(scope, key)] = self.ack_times[scope][-1]
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

    def wait_past(self, what: str, when: float) -> None:
        """Until the load has completed a payment at ``when`` or later: the window after the
        last operation is then covered by load (an event, bounded by WAIT_BOUND)."""
        with self.cond:
            ok = self.cond.wait_for(
                lambda: any(ts and ts[-1] >= when for ts in self.ack_times.values()),
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


def _shards(conn: psycopg.Connection[Any], table: str) -> set[int]:
    return {r[0] for r in conn.execute("SELECT shardid FROM pg_dist_shard WHERE logicalrelid"
                                       " = %s::regclass", (table,)).fetchall()}


def _split(conn: psycopg.Connection[Any], shard: int, mode: str,
           nodeids: dict[int, int]) -> set[int]:
    """Split ``shard``'s group in two at the middle of its hash range; returns the new shards
    of keys. A logical split (auto, force_logical) puts both halves on the other worker,
    block_writes one half on each (PHASES says why)."""
    lo, hi = conn.execute("SELECT shardminvalue::bigint, shardmaxvalue::bigint FROM"
                          " pg_dist_shard WHERE shardid = %s", (shard,)).fetchone()
    source = _node_of(conn, shard)
    (other,) = set(nodeids) - {source}
    placement = [source, other] if mode == "block_writes" else [other, other]
    before = _shards(conn, "idempotency.keys")
    conn.execute("SELECT citus_split_shard_by_split_points(%s, ARRAY[%s], ARRAY[%s, %s],"
                 " shard_transfer_mode => %s::citus.shard_transfer_mode)",
                 (shard, str((lo + hi) // 2), *(nodeids[p] for p in placement), mode))
    after = _shards(conn, "idempotency.keys")
    # One shard more: the split one gone, two new ones where they were asked for.
    assert len(after) == len(before) + 1 and shard not in after, (before, after)
    new = after - before
    assert len(new) == 2 and {_node_of(conn, n) for n in new} == set(placement), new
    return new


def _create_ledger(conn: psycopg.Connection[Any]) -> None:
    """The business table, co-located with the keys. No primary key: a duplicated payment must
    show as two rows, not as an error. A replica identity, as every co-located table needs for
    a logical move or split."""
    conn.execute("CREATE TABLE ledger (account text NOT NULL, payment text NOT NULL,"
                 " amount integer NOT NULL)")
    conn.execute("ALTER TABLE ledger REPLICA IDENTITY FULL")
    conn.execute("SELECT create_distributed_table('ledger', 'account',"
                 " colocate_with => 'idempotency.keys')")


def _move(conn: psycopg.Connection[Any], workers: set[int], shard: int, mode: str) -> int:
    """Move ``shard``'s group to the other worker (ports ``workers``) in ``mode``; returns the
    port it left."""
    source = _node_of(conn, shard)
    (target,) = workers - {source}
    conn.execute("SELECT citus_move_shard_placement(%s, '127.0.0.1', %s, '127.0.0.1', %s,"
                 " shard_transfer_mode => %s::citus.shard_transfer_mode)",
                 (shard, source, target, mode))
    assert _node_of(conn, shard) == target, (shard, mode)
    return source


def _old_placement(cluster: Any, port: int, shard: int) -> set[tuple[str, str]]:
    """The payments (keys rows and ledger rows) on the placement a move just left on the worker
    at ``port``, read there while Citus has not dropped it yet (empty once it has)."""
    worker = next(w for w in cluster.workers if w.port == port)
    with psycopg.connect(cluster.dsn, autocommit=True) as conn:
        keys, ledger = conn.execute(
            "SELECT shard_name('idempotency.keys'::regclass, %s), shard_name('ledger'::regclass,"
            " (SELECT s.shardid FROM pg_dist_shard AS s, pg_dist_shard AS k WHERE k.shardid = %s"
            " AND s.logicalrelid = 'ledger'::regclass AND s.shardminvalue = k.shardminvalue))",
            (shard, shard)).fetchone()
    rows: set[tuple[str, str]] = set()
    with psycopg.connect(worker.dsn(cluster.db), autocommit=True) as wconn:
        for table, cols in ((keys, "scope, key"), (ledger, "account, payment")):
            # Citus's deferred cleanup may drop the table at any moment, also between a
            # to_regclass() test and the read (seen once in a fresh-clone run): gone is empty.
            try:
                rows |= set(wconn.execute(
                    sql.SQL("SELECT {} FROM {}").format(sql.SQL(cols), sql.SQL(table))).fetchall())
            except psycopg.errors.UndefinedTable:
                continue
    return rows


@pytest.fixture(scope="module")
def moves_cluster(citus_cluster: Any) -> Any:
    cluster = installed(citus_cluster, "idem_moves", SHARDS)
    # The harness runs servers with synchronous_commit = off; a logical move or split then
    # loses what was committed in the last moments before its switch-over
    # (test_a_logical_move_loses_commits_made_with_synchronous_commit_off). Production keeps
    # PostgreSQL's default, on, and so does this database, on every node.
    synchronous_commit(cluster, "on")
    role = f"request_{uuid.uuid4().hex[:6]}"
    with psycopg.connect(cluster.dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
        conn.execute("SELECT idempotency.grant_usage(%s::regrole, kind => 'request')", (role,))
        _create_ledger(conn)
        conn.execute(sql.SQL("GRANT SELECT, INSERT ON ledger TO {}").format(
            sql.Identifier(role)))
        # A logical move or split fails once its target has not advanced for this long
        # (Citus's default: 2 hours): a stuck catch-up fails the test within WAIT_BOUND.
        bound = f"{int(WAIT_BOUND * 1000)}ms"
        conn.execute(f"ALTER SYSTEM SET citus.logical_replication_timeout = '{bound}'")
        conn.execute("SELECT pg_reload_conf()")

    def reloaded() -> bool:
        with psycopg.connect(cluster.dsn, autocommit=True) as conn:
            shown = conn.execute("SELECT current_setting('citus.logical_replication_timeout',"
                                 " true)::interval = %s::interval", (bound,)).fetchone()[0]
        return bool(shown)

    wait_until(reloaded, "citus.logical_replication_timeout reloaded")
    yield cluster, role
    with psycopg.connect(cluster.dsn, autocommit=True) as conn:
        conn.execute("ALTER SYSTEM RESET citus.logical_replication_timeout")
        conn.execute("SELECT pg_reload_conf()")


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
    new_shards: set[int] = set()
    # What each move left on its source (the old placement, dropped later by Citus's cleanup):
    # a loss found at the end is looked up here, to tell a write that reached the old placement
    # after the switch from one that never reached any.
    left_behind: dict[str, set[tuple[str, str]]] = {}
    started = time.monotonic()
    try:
        with psycopg.connect(cluster.dsn, autocommit=True) as conn:
            for name in PHASES:
                if name.startswith("move"):
                    affected = moving
                else:  # the split tenants still on the shard about to split
                    split_shard = _shard_of(conn, splitting[0])
                    affected = [s for s in splitting if _shard_of(conn, s) == split_shard]
                phase = Phase(name, affected)
                # Load through the window before this one: after the last one, or since the
                # start.
                load.wait_past(f"load before {name}",
                               phases[-1].after_end if phases else started + 2.0)
                load.wait_for(f"load before {name}", None, load.acks() + WARMUP)
                mode = name.split()[1]
                phase.start = time.monotonic()
                if name.startswith("move"):
                    source = _move(conn, ports, move_shard, mode)
                    left_behind[name] = _old_placement(cluster, source, move_shard)
                else:
                    made = _split(conn, split_shard, mode, nodeids)
                    assert {_shard_of(conn, s) for s in affected} <= made, name
                    new_shards |= made
                phase.end = time.monotonic()
                load.wait_for(f"the tenants of {name} completing again", affected,
                              load.acks(affected) + RECOVERED)
                if name.startswith("move"):  # and what reached it since
                    left_behind[name] |= _old_placement(cluster, source, move_shard)
                phases.append(phase)
            load.wait_for("load after the last operation", None, load.acks() + WARMUP)
            load.wait_past(f"load after {phases[-1].name}", phases[-1].after_end)
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
        # The splits split: two shards more for keys and the ledger (co-located), and each
        # split tenant's keys and ledger rows are in its new shards, on the worker holding them.
        assert len(_shards(conn, "idempotency.keys")) == SHARDS + sum(
            n.startswith("split") for n in PHASES)
        assert len(_shards(conn, "ledger")) == len(_shards(conn, "idempotency.keys"))
        placed = []
        for scope in splitting:
            shard = _shard_of(conn, scope)
            assert shard in new_shards, (scope, shard, new_shards)
            ledger_shard = conn.execute(
                "SELECT get_shard_id_for_distribution_column('ledger', %s::text)",
                (scope,)).fetchone()[0]
            names = conn.execute(
                "SELECT shard_name('idempotency.keys'::regclass, %s),"
                " shard_name('ledger'::regclass, %s)", (shard, ledger_shard)).fetchone()
            placed.append((scope, _node_of(conn, shard), _node_of(conn, ledger_shard), names))
    for scope, port, ledger_port, (keys_shard, ledger_table) in placed:
        assert port == ledger_port, scope
        worker = next(w for w in cluster.workers if w.port == port)
        with psycopg.connect(worker.dsn(cluster.db), autocommit=True) as wconn:
            on_shard = wconn.execute(
                sql.SQL("SELECT (SELECT count(*) FROM {} WHERE scope = %(s)s),"
                        " (SELECT count(*) FROM {} WHERE account = %(s)s)").format(
                    sql.SQL(keys_shard), sql.SQL(ledger_table)), {"s": scope}).fetchone()
        expected = sum(s == scope for s, _ in states)
        assert expected > 0 and on_shard == (expected, expected), (scope, on_shard, expected)
    lost = [p for p in load.acked if ledger[p] != 1 or states.get(p) != "completed"]
    duplicated = [p for p, n in ledger.items() if n > 1]
    print(f"\n{cluster.cluster.flavour}: acked {len(load.acked)}, lost {len(lost)}, duplicated"
          f" {len(duplicated)}; DatabaseUnavailable {len(load.unavailable)}, in progress"
          f" {load.in_progress}, other errors {len(load.other_errors)}")
    print("  rows read on the old placements:",
          {n: len(rows) for n, rows in left_behind.items()})
    for phase in phases:
        length, window = phase.end - phase.start, phase.window
        for label, who in (("all", tenants), ("its tenants", phase.tenants)):
            before = load.rate(who, phase.start - window, phase.start)
            during = load.rate(who, phase.start, phase.end)
            after = load.rate(who, phase.end, phase.end + window)
            print(f"  {phase.name}: {length:.2f} s; completions/s {label} before/during/after:"
                  f" {before:.0f} / {during:.0f} / {after:.0f}")
    for line in load.unavailable[:3] + load.other_errors[:10]:
        print("  ", line[:300])
    for p in lost[:10]:
        # where the acknowledgement fell: which operation was running, or how long after the
        # last one ended, and whether the payment's tenant was one it moved or split
        at = load.acked_at[p]
        where = [f"{ph.name} "
                 + ("during" if at <= ph.end else f"{at - ph.end:+.2f} s after")
                 + (" (its tenant)" if p[0] in ph.tenants else "")
                 for ph in phases if at >= ph.start]
        print("   lost:", p, ledger[p], states.get(p), where[-1:] or "before the first operation",
              "on the old placement of:", [n for n, rows in left_behind.items() if p in rows])
    assert lost == [] and duplicated == []
    assert load.other_errors == []
    assert len(load.acked) == len(set(load.acked))
    assert set(ledger) == set(load.acked), "every payment ended acknowledged, once"
    assert set(states.values()) == {"completed"}


def _move_under_inserts(cluster: Cluster, shard: int, scope: str) -> tuple[list[str], set[str]]:
    """Move ``shard``'s group to the other worker in the default mode (``auto``: logical
    replication) while a session inserts ledger rows of ``scope`` through the coordinator, one
    autocommit statement after the other. Returns the payments acknowledged (their INSERT
    returned), and those found on the old placement right after the move (before Citus's
    cleanup drops it)."""
    acked: list[str] = []
    stop = threading.Event()
    errors: list[str] = []

    def insert() -> None:
        with psycopg.connect(cluster.dsn, autocommit=True) as conn:
            n = 0
            while not stop.is_set():
                n += 1
                try:
                    conn.execute("INSERT INTO ledger VALUES (%s, %s, 1)", (scope, f"p{n}"))
                except psycopg.Error as exc:  # the switch-over may refuse one: not acked
                    errors.append(str(exc))
                    continue
                acked.append(f"p{n}")
                time.sleep(0.02)

    writer = threading.Thread(target=insert)
    writer.start()
    try:
        with psycopg.connect(cluster.dsn, autocommit=True) as conn:
            wait_until(lambda: len(acked) >= 50, "inserts before the move")
            source = _move(conn, {w.port for w in cluster.workers}, shard, "auto")
        left = {p for s, p in _old_placement(cluster, source, shard) if s == scope}
        done = len(acked)
        wait_until(lambda: len(acked) >= done + 50, "inserts after the move")
    finally:
        stop.set()
        writer.join(WAIT_BOUND)
    assert not writer.is_alive() and len(errors) < 5, errors[:5]
    return acked, left


def test_a_logical_move_loses_commits_made_with_synchronous_commit_off(
        citus_cluster: Any) -> None:
    """Citus (13.2.2 and 14.0.1) ends a logical move's catch-up at the source's
    ``pg_current_wal_lsn()``, the position WAL has been *written* to. With
    ``synchronous_commit = off`` a commit is visible, its locks released and the client
    answered before its WAL is written, so commits of the moments before the switch-over are
    not replicated, and the old placement that holds them is dropped. The source's WAL writer
    is slowed (``wal_writer_delay = 5s``, PostgreSQL's maximum is 10 s) to make that moment
    wide enough to hit every time (on 14.0.1 / PostgreSQL 18: see the note on 13.2.2 below).
    Then the same move back with ``synchronous_commit = on`` loses nothing. docs/scale-out.md
    quotes this; if Citus fixes it, the first half fails and the page must change."""
    cluster = installed(citus_cluster, "idem_async", 4)
    scope = f"tenant_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(cluster.dsn, autocommit=True) as conn:
        _create_ledger(conn)
        shard = _shard_of(conn, scope)
    workers = [w.dsn(cluster.db) for w in cluster.workers]

    def wal_writer_delay(value: str) -> None:
        for dsn in workers:
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(f"ALTER SYSTEM {value}")
                conn.execute("SELECT pg_reload_conf()")

    def present() -> set[str]:
        with psycopg.connect(cluster.dsn, autocommit=True) as conn:
            return {r[0] for r in conn.execute("SELECT payment FROM ledger WHERE account = %s",
                                               (scope,)).fetchall()}

    wal_writer_delay("SET wal_writer_delay = '5s'")
    try:
        synchronous_commit(cluster, "off")  # the harness's default, said here
        acked, left = _move_under_inserts(cluster, shard, scope)
        lost = set(acked) - present()
        print(f"\n{citus_cluster.flavour}, synchronous_commit = off: {len(acked)} acknowledged,"
              f" {len(lost)} lost, all of them left on the old placement: {lost <= left}")
        if citus_cluster.flavour == "pg18":
            assert lost, "no loss: has Citus fixed its catch-up? Then docs/scale-out.md changes"
        # 13.2.2 ends its catch-up at the same position, and PostgreSQL 15's write position
        # lags its commits the same way (read on these nodes: pg_current_wal_lsn() behind
        # pg_current_wal_insert_lsn() after an acknowledged INSERT), but this scheme has not
        # lost a row there (0 of 305 and of 4,198): what is lost, wherever, was left behind.
        assert lost <= left, "the lost rows are the ones committed on the old placement"

        synchronous_commit(cluster, "on")
        with psycopg.connect(cluster.dsn, autocommit=True) as conn:
            conn.execute("DELETE FROM ledger WHERE account = %s", (scope,))
        acked, left = _move_under_inserts(cluster, shard, scope)
        lost = set(acked) - present()
        print(f"{citus_cluster.flavour}, synchronous_commit = on: {len(acked)} acknowledged,"
              f" {len(lost)} lost")
        assert len(acked) > 100 and lost == set()
    finally:
        wal_writer_delay("RESET wal_writer_delay")
