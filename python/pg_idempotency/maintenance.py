"""Retention maintenance and status, from Python: the code behind ``pg-idempotency maintain``
and ``pg-idempotency status``.

Entry points (each takes an open psycopg 3 connection to the database with the schema):

:func:`run_maintenance`
    Run ``idempotency.maintain()``, each attempt in its own transaction, and retry (a few
    times, with a pause) while a step was skipped because a table lock was not granted within
    ``settings.maintenance_lock_timeout``. Returns every step of every attempt.
:func:`format_report`
    The steps as a readable text table.
:func:`fetch_status`
    ``idempotency.key_status()`` and ``idempotency.partition_status()``: keys by scope and
    state, expired leases, partitions with rows, sizes and when they will be dropped.
:func:`format_status`
    That status as readable text tables, with the next drop.

A CLI subcommand is a thin wrapper::

    with psycopg.connect(dsn, autocommit=True) as conn:
        print(format_report(run_maintenance(conn)))
        print(format_status(fetch_status(conn)))

Why no ``DETACH PARTITION ... CONCURRENTLY``: PostgreSQL refuses it on a table that has a
default partition, and ``idempotency.keys`` keeps one as the safety net that lets a claim
succeed when no partition exists for its time. The plain drop in ``maintain()`` waits at most
``settings.maintenance_lock_timeout`` for its lock and skips otherwise, so retrying a little
later (which :func:`run_maintenance` does) is the way around a busy moment.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import psycopg
from psycopg import pq

from . import _exec, _wire
from . import queries as Q
from ._results import load_time

__all__ = [
    "MaintenanceStep",
    "Status",
    "fetch_status",
    "format_report",
    "format_status",
    "run_maintenance",
]

#: The words maintain() uses when a lock was not granted in time (sql/functions/maintain.sql).
_LOCK_SKIPS = ("was not locked within", "could not lock")


@dataclass(frozen=True)
class MaintenanceStep:
    """One row of ``idempotency.maintain()``'s report, and the attempt that produced it."""

    action: str  #: created | moved | deleted | tombstoned | dropped | skipped
    parent_table: str | None  #: keys | inbox | tombstones; None when the whole run skipped
    partition_name: str | None
    lower_bound: datetime | None
    upper_bound: datetime | None
    row_count: int | None
    reason: str | None
    attempt: int = 1

    @property
    def skipped_for_a_lock(self) -> bool:
        """True when the step was skipped because a lock was not granted in time."""
        return self.action == "skipped" and any(w in (self.reason or "") for w in _LOCK_SKIPS)


def run_maintenance(
    conn: psycopg.Connection[Any],
    reference_time: datetime | None = None,
    *,
    attempts: int = 3,
    retry_delay: float = 2.0,
) -> list[MaintenanceStep]:
    """Run ``idempotency.maintain(reference_time)``; retry while it skipped a step for a lock.

    Each attempt runs and commits in its own transaction, so ``conn`` must not be inside a
    transaction (an autocommit connection, or one that is idle). ``reference_time`` defaults to
    the server's ``now()``. At most ``attempts`` runs, ``retry_delay`` seconds apart. Another
    run already in progress is not retried: it does the work. Returns the steps of all
    attempts, in order (``MaintenanceStep.attempt`` says which).
    """
    if attempts < 1:
        raise ValueError("attempts must be at least 1")
    if conn.info.transaction_status != pq.TransactionStatus.IDLE:
        raise ValueError("run_maintenance commits each run: call it outside a transaction")
    steps: list[MaintenanceStep] = []
    for attempt in range(1, attempts + 1):
        with conn.transaction(), conn.cursor(row_factory=_wire.dict_rows(conn)) as cur:
            rows = cur.execute(Q.MAINTAIN, {"reference_time": reference_time},
                               prepare=_exec.PREPARE).fetchall()
        this_run = [MaintenanceStep(**_times(row, "lower_bound", "upper_bound"), attempt=attempt)
                    for row in rows]
        steps.extend(this_run)
        if not any(s.skipped_for_a_lock for s in this_run) or attempt == attempts:
            break
        time.sleep(retry_delay)
    return steps


@dataclass(frozen=True)
class Status:
    """What :func:`fetch_status` read: one dict per row of each status function."""

    keys: list[dict[str, Any]] = field(default_factory=list)
    partitions: list[dict[str, Any]] = field(default_factory=list)

    @property
    def next_drop(self) -> dict[str, Any] | None:
        """The partition maintain() will drop first (smallest ``drop_after``), if any."""
        due = [p for p in self.partitions if p["drop_after"] is not None]
        return min(due, key=lambda p: p["drop_after"]) if due else None


def fetch_status(conn: psycopg.Connection[Any], reference_time: datetime | None = None
                 ) -> Status:
    """Read ``idempotency.key_status()`` and ``idempotency.partition_status()``.

    Both read every row (exact counts), so this is for an operator's look, not a scrape loop.
    Runs in the caller's transaction if there is one.
    """
    params = {"reference_time": reference_time}
    with conn.cursor(row_factory=_wire.dict_rows(conn)) as cur:
        keys = cur.execute(Q.KEY_STATUS, params, prepare=_exec.PREPARE).fetchall()
        partitions = cur.execute(Q.PARTITION_STATUS, params, prepare=_exec.PREPARE).fetchall()
    return Status(
        keys=[_times(k, "oldest_created_at", "oldest_expired_lease") for k in keys],
        partitions=[_times(p, "lower_bound", "upper_bound", "drop_after") for p in partitions])


def _times(row: dict[str, Any], *columns: str) -> dict[str, Any]:
    """The row with its timestamptz columns (epoch text, queries._seconds) as datetimes."""
    return {**row, **{c: load_time(row[c]) for c in columns}}


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, datetime):
        return value.isoformat(sep=" ", timespec="seconds")
    return str(value)


def _size(n: int | None) -> str:
    if n is None:
        return ""
    size = float(n)
    for unit in ("B", "kB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def text_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain text table: a header, a rule, one line per row; numbers right-aligned."""
    cells = [[_cell(v) for v in row] for row in rows]
    numeric = [all(isinstance(row[i], int) or row[i] is None for row in rows) and bool(rows)
               for i in range(len(headers))]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w)
                         for v, w, num in zip(values, widths, numeric, strict=True)).rstrip()

    out = [line(list(headers)), line(["-" * w for w in widths])]
    out += [line(r) for r in cells]
    return "\n".join(out)


def format_report(steps: Sequence[MaintenanceStep]) -> str:
    """The steps of :func:`run_maintenance` as a text table (or a line saying there were none)."""
    if not steps:
        return "maintenance: nothing to do"
    show_attempt = any(s.attempt > 1 for s in steps)
    headers = ["action", "table", "partition", "from", "to", "rows", "reason"]
    if show_attempt:
        headers.insert(0, "attempt")
    rows = []
    for s in steps:
        row: list[Any] = [s.action, s.parent_table, s.partition_name, s.lower_bound,
                          s.upper_bound, s.row_count, s.reason]
        if show_attempt:
            row.insert(0, s.attempt)
        rows.append(row)
    return text_table(headers, rows)


#: The states key_status() reports, in the order the summary shows them.
# Every state key_status() reports, so that a scope's "keys" is the sum of its columns
# (a released key stays a row, in state released, from 0.9.0 on).
STATES = ("in_progress", "completed", "released", "tombstone")


def scope_summary(status: Status) -> list[dict[str, Any]]:
    """One dict per scope (the busiest first): ``keys`` in all, a count per state, the oldest
    key still in progress (its ``created_at`` and key), and the expired leases waiting for a
    takeover (``expired_leases``, ``oldest_expired_lease``)."""
    scopes: dict[str, dict[str, Any]] = {}
    for k in status.keys:
        row = scopes.setdefault(k["scope"], {
            "scope": k["scope"], "keys": 0, **dict.fromkeys(STATES, 0),
            "oldest_in_progress": None, "oldest_in_progress_key": None,
            "expired_leases": 0, "oldest_expired_lease": None})
        row["keys"] += k["keys"]
        row[k["state"]] = row.get(k["state"], 0) + k["keys"]
        if k["state"] == "in_progress":
            row["oldest_in_progress"] = k["oldest_created_at"]
            row["oldest_in_progress_key"] = k["oldest_key"]
            row["expired_leases"] = k["expired_leases"] or 0
            row["oldest_expired_lease"] = k["oldest_expired_lease"]
    return sorted(scopes.values(), key=lambda r: (-r["keys"], r["scope"]))


def format_status(status: Status, limit: int | None = None) -> str:
    """:func:`fetch_status`'s result as text: one line per scope with its keys by state (the
    ``limit`` busiest scopes, and a line saying how many more), then the partitions, then the
    next drop."""
    scopes = scope_summary(status)
    shown = scopes if limit is None else scopes[:limit]
    keys = text_table(
        ["scope", "keys", *STATES, "oldest in progress", "key", "expired leases",
         "oldest expired lease"],
        [[r["scope"], r["keys"], *(r[st] for st in STATES), r["oldest_in_progress"],
          r["oldest_in_progress_key"], r["expired_leases"], r["oldest_expired_lease"]]
         for r in shown],
    ) if scopes else "keys: none"
    if len(shown) < len(scopes):
        rest = scopes[len(shown):]
        keys += (f"\n... and {len(rest)} more scopes with {sum(r['keys'] for r in rest)} keys "
                 "(--limit)")
    partitions = text_table(
        ["table", "partition", "from", "to", "rows", "size", "drop after", "note"],
        [[p["parent_table"], p["partition_name"], p["lower_bound"], p["upper_bound"],
          p["row_count"], _size(p["total_bytes"]), p["drop_after"], p["note"]]
         for p in status.partitions],
    )
    nxt = status.next_drop
    next_line = (f"next drop: {nxt['parent_table']}.{nxt['partition_name']} "
                 f"at {_cell(nxt['drop_after'])}" if nxt else "next drop: none scheduled")
    return f"{keys}\n\n{partitions}\n\n{next_line}"


def status_json(status: Status, limit: int | None = None) -> dict[str, Any]:
    """:func:`fetch_status`'s result for ``status --json``: ``scopes`` (as
    :func:`scope_summary`, at most ``limit``), ``scopes_total``, ``partitions`` and
    ``next_drop``; timestamps as ISO 8601 strings."""
    def plain(row: dict[str, Any]) -> dict[str, Any]:
        return {k: v.isoformat() if isinstance(v, datetime) else v for k, v in row.items()}

    scopes = scope_summary(status)
    nxt = status.next_drop
    return {"scopes": [plain(r) for r in (scopes if limit is None else scopes[:limit])],
            "scopes_total": len(scopes),
            "partitions": [plain(p) for p in status.partitions],
            "next_drop": plain(nxt) if nxt else None}
