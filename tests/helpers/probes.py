"""Hostile session settings (migration 0004) and the timing oracle's keys and judge (issue 34):
what tests/probes/ measures, reused by tests/server/test_lease_outcomes.py."""

from __future__ import annotations

import statistics
from typing import Any

import psycopg

HOSTILE_SETTINGS = [
    {"DateStyle": "SQL, DMY", "TimeZone": "Europe/Dublin"},
    {"DateStyle": "German", "TimeZone": "Pacific/Chatham", "IntervalStyle": "sql_standard"},
    {"DateStyle": "Postgres, MDY", "TimeZone": "America/St_Johns",
     "IntervalStyle": "iso_8601", "extra_float_digits": "0"},
]


def apply(conn: psycopg.Connection[Any], settings: dict[str, str]) -> None:
    for name, value in settings.items():
        conn.execute("SELECT pg_catalog.set_config(%s, %s, false)", (name, value))

STATES = ("in_progress", "completed", "released")

KEYS_PER_CLASS = 300

WRONG_TOKEN = 4242


def make_keys(db: str, scopes: tuple[str, ...]) -> None:
    """KEYS_PER_CLASS keys per state in each scope, as the owner."""
    with psycopg.connect(db, autocommit=True) as conn:
        for scope in scopes:
            for state in STATES:
                for i in range(KEYS_PER_CLASS):
                    key = f"{state}{i}"
                    token = conn.execute("SELECT lease_token FROM idempotency.claim(%s, %s, '{}')",
                                         (scope, key)).fetchone()[0]
                    if state == "completed":
                        conn.execute("SELECT idempotency.complete(%s, %s, %s, 200, '{}')",
                                     (scope, key, token))
                    elif state == "released":
                        conn.execute("SELECT idempotency.release(%s, %s, %s)",
                                     (scope, key, token))
        conn.execute("VACUUM ANALYZE idempotency.keys, idempotency.key_directory")


def judge(measure: Any, classes: list[str], label: str) -> None:
    """Measure up to ROUNDS times until the bounds hold, keeping each class's least median over
    the rounds so far. Another process taking the core for a while can only make the calls of
    that while slower, and over 300 interleaved calls that is a few microseconds more on one
    class's median (CI saw 37-42 us between scopes that run the same statements); a class that
    is slower by design is slower in every round, so its least median keeps the gap and the
    test still fails."""
    best: dict[str, float] = {}
    for _ in range(ROUNDS):
        times = measure()
        for cls, values in times.items():
            best[cls] = min(best.get(cls, float("inf")), statistics.median(values))
        existing = [best[c] for c in classes if not c.endswith("/absent")]
        absent = [best[c] for c in classes if c.endswith("/absent")]
        call_time = statistics.median(existing + absent)
        report = ", ".join(f"{cls} {m:.1f}" for cls, m in sorted(best.items()))
        print(f"{label} server-side medians (us): {report}")
        # The existing states do the same statements, touching the same rows: indistinguishable
        # (the clock's resolution is 1 us).
        spread_ok = max(existing) - min(existing) <= max(1.0, 0.05 * call_time)
        # Existing against absent: what remains is the heap fetch of the key's rows
        # (docs/design.md) and must stay a small fraction of the call; before 0.11.0 it was a
        # third of it.
        gap = statistics.median(existing) - statistics.median(absent)
        gap_ok = abs(gap) <= 0.15 * call_time
        if spread_ok and gap_ok:
            return
    assert spread_ok, f"spread over the existing states: {report}"
    assert gap_ok, f"gap {gap:.1f} us of {call_time:.1f}: {report}"

# Eight: under make test's three workers on two cores, four rounds left a class's least
# median up to 3 us above its twins' now and then (the same statements, 34-42 us a call); a
# class slower by design is slower in every round, so more rounds only remove noise.
ROUNDS = 8
