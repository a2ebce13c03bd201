"""What an error raised on a worker costs a client of the coordinator (docs/scale-out.md,
"What an error costs"): Citus drops the session's connection to that worker after the error,
so the next call opens a new one (a new backend on the worker). Counted, not timed: the
test asserts the new worker backends per call for each answer of the hot path of a retry
storm, and prints the median call time of each for the page (``pytest -s``). The lost lease
is measured in both forms: the raising heartbeat / checkpoint / release (IK001) and the
*_outcome functions answering lease_lost (tests/citus/test_citus_outcomes.py has the rest).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from helpers import sqlstate
from helpers.citus import _measure, installed


def _scope() -> str:
    return f"cost_{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="module")
def cost_cluster(citus_cluster: Any) -> Any:
    return installed(citus_cluster, "idem_cost", 4)


def _outcome(conn: psycopg.Connection[Any], query: str, params: Any) -> str | None:
    """The first column of the answer (an outcome), or the SQLSTATE of an error."""
    try:
        return str(conn.execute(query, params).fetchone()[0])
    except psycopg.Error as exc:
        return exc.sqlstate


def test_an_error_on_a_worker_costs_a_new_worker_connection(cost_cluster: Any) -> None:
    scope = _scope()
    with psycopg.connect(cost_cluster.dsn, autocommit=True) as conn:
        token = conn.execute("SELECT lease_token FROM idempotency.claim(%s, 'held', '{}',"
                             " lease => '1 hour')", (scope,)).fetchone()[0]
        done = conn.execute("SELECT lease_token FROM idempotency.claim(%s, 'done', '{\"a\": 1}')",
                            (scope,)).fetchone()[0]
        conn.execute("SELECT idempotency.complete(%s, 'done', %s, 201, '{}')", (scope, done))

    cases: dict[str, tuple[Callable[[psycopg.Connection[Any]], str | None], str | None]] = {
        "heartbeat, right token": (lambda c: sqlstate(
            c, "SELECT idempotency.heartbeat(%s, 'held', %s)", (scope, token)), None),
        "heartbeat, wrong token (IK001)": (lambda c: sqlstate(
            c, "SELECT idempotency.heartbeat(%s, 'held', %s)", (scope, token + 1)), "IK001"),
        "heartbeat_outcome, wrong token (lease_lost)": (lambda c: _outcome(
            c, "SELECT outcome FROM idempotency.heartbeat_outcome(%s, 'held', %s)",
            (scope, token + 1)), "lease_lost"),
        "checkpoint, wrong token (IK001)": (lambda c: sqlstate(
            c, "SELECT idempotency.checkpoint(%s, 'held', %s, 'r')", (scope, token + 1)),
            "IK001"),
        "checkpoint_outcome, wrong token (lease_lost)": (lambda c: _outcome(
            c, "SELECT outcome FROM idempotency.checkpoint_outcome(%s, 'held', %s, 'r')",
            (scope, token + 1)), "lease_lost"),
        "release, wrong token (IK001)": (lambda c: sqlstate(
            c, "SELECT idempotency.release(%s, 'held', %s)", (scope, token + 1)), "IK001"),
        "release_outcome, wrong token (lease_lost)": (lambda c: _outcome(
            c, "SELECT outcome FROM idempotency.release_outcome(%s, 'held', %s)",
            (scope, token + 1)), "lease_lost"),
        "complete, wrong token (IK001)": (lambda c: sqlstate(
            c, "SELECT idempotency.complete(%s, 'held', %s, 200, '{}')", (scope, token + 1)),
            "IK001"),
        "claim of a held key (outcome in_progress)": (lambda c: sqlstate(
            c, "SELECT outcome FROM idempotency.claim(%s, 'held', '{}')", (scope,)), None),
        "claim of a completed key (outcome replay)": (lambda c: sqlstate(
            c, "SELECT outcome FROM idempotency.claim(%s, 'done', '{\"a\": 1}')", (scope,)),
            None),
        "claim, other request (outcome mismatch)": (lambda c: sqlstate(
            c, "SELECT outcome FROM idempotency.claim(%s, 'done', '{\"a\": 2}')", (scope,)),
            None),
        "claim strict, other request (IK002)": (lambda c: sqlstate(
            c, "SELECT outcome FROM idempotency.claim(%s, 'done', '{\"a\": 2}', strict => true)",
            (scope,)), "IK002"),
        "claim, bad lease (IK014)": (lambda c: sqlstate(
            c, "SELECT outcome FROM idempotency.claim(%s, 'x', '{}', lease => '0 s')",
            (scope,)), "IK014"),
    }
    report = []
    for name, (call, expected) in cases.items():
        per_call, median_ms, answers = _measure(cost_cluster, call)
        assert set(answers) == {expected}, (name, answers)
        report.append(f"{name:46} {per_call:4.2f} new worker sessions/call,"
                      f" median {median_ms:6.2f} ms")
        if expected is None or expected.islower():  # no error: rows, or an outcome
            assert per_call == 0, name
        else:
            # Every error on the worker: Citus closes the session's connection to it, and the
            # next call opens a new one.
            assert per_call == 1, name
    print("\n" + "\n".join(report))
