"""pg-idempotency keys show | list | release, run as an operator runs them (the installed console
script), on a key stuck by a worker whose backend was killed while its lease still ran."""

from __future__ import annotations

import json

import psycopg
import pytest
from helpers import login_roles
from helpers.api import run
from psycopg.types.json import Jsonb

from pgharness import PgServer, wait_until

SCOPE = "acct_42"
REQUEST = {"amount": 50}


def claim(dsn: str, key: str) -> tuple[str, int | None]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute("SELECT outcome, lease_token FROM idempotency.claim(%s, %s, %s, "
                            "lease => '1 hour')", (SCOPE, key, Jsonb(REQUEST))).fetchone()


def keys(dsn: str, *args: str) -> tuple[int, object]:
    proc = run("keys", *args, "--json", env={"DATABASE_URL": dsn})
    assert proc.stdout, proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def test_a_key_stuck_by_a_killed_worker_is_found_explained_released_and_retried(
    server: PgServer, db: str
) -> None:
    # The worker claims with a long lease, records a recovery point, and its backend is killed.
    worker = psycopg.connect(db, autocommit=True)
    outcome, token = worker.execute(
        "SELECT outcome, lease_token FROM idempotency.claim(%s, 'stuck', %s, lease => '1 hour')",
        (SCOPE, Jsonb(REQUEST))).fetchone()
    assert outcome == "claimed"
    worker.execute("SELECT idempotency.checkpoint(%s, 'stuck', %s, 'charged')", (SCOPE, token))
    pid = worker.info.backend_pid
    with psycopg.connect(db, autocommit=True) as admin:
        assert admin.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone()[0]
        wait_until(lambda: not admin.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()[0],
            "the terminated backend to go")
    worker.close()
    assert claim(db, "stuck")[0] == "in_progress"  # every retry: 409 for the next hour

    # Found: by scope and state; not among expired leases (its lease still runs).
    status, listed = keys(db, "list", "--scope", SCOPE, "--state", "in_progress")
    assert status == 0
    assert [(k["key"], k["state"], k["lease_expired"], k["attempts"]) for k in listed] == [
        ("stuck", "in_progress", False, 1)]
    assert keys(db, "list", "--expired-leases") == (0, [])
    assert keys(db, "list", "--scope", SCOPE, "--older-than", "3600") == (0, [])

    # Explained: state, lease, recovery point, partition; never the body unless asked.
    status, shown = keys(db, "show", SCOPE, "stuck")
    assert status == 0
    # Never the lease token: whoever holds it can complete or release the key.
    assert shown["state"] == "in_progress" and "lease_token" not in shown
    assert str(token) not in json.dumps(shown)
    assert shown["recovery_point"] == "charged" and shown["lease_expired"] is False
    assert shown["partition_name"].startswith("idempotency.keys_")
    assert shown["response_body"] is None and shown["response_body_base64"] is None
    text = run("keys", "show", SCOPE, "stuck", env={"DATABASE_URL": db})
    assert text.returncode == 0 and "recovery_point:" in text.stdout and "charged" in text.stdout
    assert str(token) not in text.stdout

    # Released: not without confirmation (no terminal, no --yes), then with --yes.
    refused = run("keys", "release", SCOPE, "stuck", env={"DATABASE_URL": db})
    assert refused.returncode == 6 and "--yes" in refused.stderr
    assert keys(db, "show", SCOPE, "stuck")[0] == 0
    status, released = keys(db, "release", SCOPE, "stuck", "--yes")
    assert status == 0 and released["released"] is True
    assert str(token) not in json.dumps(released)
    # Left in state released (as release() leaves it, 0.9.0) until the next claim.
    status, shown = keys(db, "show", SCOPE, "stuck")
    assert status == 0 and shown["state"] == "released" and shown["lease_expires_at"] is None
    assert [k["key"] for k in keys(db, "list", "--state", "released")[1]] == ["stuck"]
    status, again = keys(db, "release", SCOPE, "stuck", "--yes")
    assert status == 5 and again["reason"] == "released"
    # The worker, had it survived, is fenced: its token no longer works.
    with psycopg.connect(db, autocommit=True) as conn, pytest.raises(psycopg.Error) as lost:
        conn.execute("SELECT idempotency.heartbeat(%s, 'stuck', %s)", (SCOPE, token))
    assert lost.value.sqlstate == "IK001"

    # The retry succeeds once: claimed, a racing retry still gets in_progress, then replay.
    outcome, new_token = claim(db, "stuck")
    assert outcome == "claimed" and new_token != token
    assert claim(db, "stuck")[0] == "in_progress"
    with psycopg.connect(db, autocommit=True) as conn:
        conn.execute("SELECT idempotency.complete(%s, 'stuck', %s, 201, '{\"id\": 1}')",
                     (SCOPE, new_token))
    assert claim(db, "stuck")[0] == "replay"
    with psycopg.connect(db) as conn:
        assert conn.execute("SELECT count(*) FROM idempotency.keys WHERE scope = %s",
                            (SCOPE,)).fetchone()[0] == 1

    # A completed key is not released (5); its body shows only with --body.
    assert keys(db, "release", SCOPE, "stuck", "--yes")[0] == 5
    status, shown = keys(db, "show", SCOPE, "stuck", "--body")
    assert status == 0 and shown["response_body"] == {"id": 1}
    assert keys(db, "show", SCOPE, "stuck")[1]["response_body"] is None


def test_keys_exit_codes_and_owner_only(server: PgServer, db: str) -> None:
    assert keys(db, "show", SCOPE, "nope") == (4, None)
    assert keys(db, "release", SCOPE, "nope", "--yes")[0] == 4
    usage = run("keys", "list", "--state", "bogus", env={"DATABASE_URL": db})
    assert usage.returncode == 2
    # Operator functions: no grant_usage() kind includes them, monitor and completer neither.
    with login_roles(server, db, "request", "completer", "monitor") as roles:
        claim(db, "mine")
        for role in roles:
            as_app = db.replace("postgres@", f"{role}@", 1)
            denied = run("keys", "release", SCOPE, "mine", "--yes", env={"DATABASE_URL": as_app})
            assert denied.returncode == 1 and "42501" in denied.stderr, (role, denied.stderr)
            shown = run("keys", "show", SCOPE, "mine", env={"DATABASE_URL": as_app})
            assert shown.returncode == 1 and "42501" in shown.stderr, (role, shown.stderr)
            with psycopg.connect(as_app, autocommit=True) as conn:
                for call in ("idempotency.force_release('acct_42', 'mine')",
                             "idempotency.inspect_key('acct_42', 'mine')",
                             "idempotency.list_keys()"):
                    with pytest.raises(psycopg.errors.InsufficientPrivilege):
                        conn.execute(f"SELECT * FROM {call}")
    assert claim(db, "mine")[0] == "in_progress"  # still there
