"""The ``pg_idempotency`` logger on real PostgreSQL 15 and 18: one line per claim outcome,
takeover, lost lease and release, naming the key by a hash of (scope, key) only: never the
raw key, the request or a body."""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import textwrap
from datetime import datetime, timedelta, timezone

import psycopg
import pytest

import pg_idempotency as idem
from pg_idempotency.core import key_hash
from pgharness import WAIT_BOUND

SECRET_KEY = "key-4f1c-SECRET"
SECRET_BODY = "card-4242-BODY"


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "pg_idempotency"]


def test_key_hash_is_sha256_of_scope_nul_key() -> None:
    assert key_hash("pay", "k") == hashlib.sha256(b"pay\0k").hexdigest()[:12]
    assert key_hash("pay", "k") != key_hash("pa", "yk")


def test_one_line_per_event_with_a_hash_and_no_raw_key_or_body(
        db: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="pg_idempotency")
    h = key_hash("pay", SECRET_KEY)
    request = {"card": SECRET_BODY}
    t0 = datetime.now(timezone.utc)
    with psycopg.connect(db, autocommit=True) as conn:
        with idem.operation(conn, "pay", SECRET_KEY, request) as op:
            op.complete(201, {"echo": SECRET_BODY}, headers={"X-Secret": SECRET_BODY})
        with idem.operation(conn, "pay", SECRET_KEY, request) as op:
            assert op.replay is not None
        with pytest.raises(idem.KeyMismatch):
            with idem.operation(conn, "pay", SECRET_KEY, {"card": "other"}):
                pass
        # released: explicitly, and by an exception before any side effect
        with idem.operation(conn, "pay", "r1", request) as op:
            op.release()
        with pytest.raises(ZeroDivisionError), idem.operation(conn, "pay", "r2", request):
            1 / 0  # noqa: B018
        # a lost lease: a stale attempt's complete() after another took the key over
        stale = idem.claim(conn, "pay", "l1", request, lease=1, reference_time=t0)
        later = t0 + timedelta(seconds=2)
        taken = idem.takeover(conn, "pay", "l1", reference_time=later)
        assert taken.outcome is idem.Outcome.RESUMED
        with pytest.raises(idem.LeaseLost):
            idem.complete(conn, "pay", "l1", stale.lease_token, 200, None, reference_time=later)
        with pytest.raises(idem.KeyInProgress):
            with idem.operation(conn, "pay", "l1", request, reference_time=later):
                pass
    got = lines(caplog)
    assert got[:4] == [f"claim key={h} outcome=claimed attempts=1",
                       f"complete key={h} status=201",
                       f"claim key={h} outcome=replay attempts=1",
                       f"claim key={h} outcome=mismatch"], got
    r1, r2, l1 = key_hash("pay", "r1"), key_hash("pay", "r2"), key_hash("pay", "l1")
    assert got[4:] == [
        f"claim key={r1} outcome=claimed attempts=1",
        f"release key={r1} reason=release()",
        f"claim key={r2} outcome=claimed attempts=1",
        f"release key={r2} reason=exception",
        f"claim key={l1} outcome=claimed attempts=1",
        f"takeover key={l1} outcome=resumed attempts=2",
        f"lease_lost key={l1} call=complete sqlstate=IK001",
        f"claim key={l1} outcome=in_progress attempts=2",
    ], got
    levels = {r.getMessage().split()[0]: r.levelname for r in caplog.records}
    assert levels["lease_lost"] == "WARNING" and levels["claim"] == "INFO"
    mismatch = next(r for r in caplog.records if "mismatch" in r.getMessage())
    assert mismatch.levelname == "WARNING"
    assert mismatch.idempotency == {"event": "claim", "key_hash": h, "outcome": "mismatch",
                                    "attempts": None, "recovery_point": None}
    text = caplog.text + repr([vars(r) for r in caplog.records])
    for secret in (SECRET_KEY, SECRET_BODY, "r1'", '"r1"'):
        assert secret not in text


def test_a_disabled_logger_formats_nothing(db: str, caplog: pytest.LogCaptureFixture,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    caplog.set_level(logging.WARNING, logger="pg_idempotency")
    calls: list[str] = []
    monkeypatch.setattr(idem._log, "key_hash", lambda s, k: calls.append(k) or "x")
    with psycopg.connect(db, autocommit=True) as conn:
        with idem.operation(conn, "pay", "quiet", {}) as op:
            op.complete(200, None)
    assert lines(caplog) == [] and calls == []


QUIET_APP = textwrap.dedent("""
    import os, sys
    from datetime import datetime, timedelta, timezone
    import psycopg
    import pg_idempotency as idem
    if sys.argv[1] == "without-nullhandler":  # the control: what 0.8.0 did
        idem.core.logger.handlers.clear()
    t0 = datetime.now(timezone.utc)
    with psycopg.connect(os.environ["IDEM_DSN"], autocommit=True) as conn:
        with idem.operation(conn, "quiet", "k1", {"a": 1}) as op:
            op.complete(200, None)
        try:  # a WARNING: mismatch
            with idem.operation(conn, "quiet", "k1", {"a": 2}):
                pass
        except idem.KeyMismatch:
            pass
        stale = idem.claim(conn, "quiet", "k2", {}, lease=1, reference_time=t0)
        later = t0 + timedelta(seconds=2)
        idem.takeover(conn, "quiet", "k2", reference_time=later)
        try:  # a WARNING: lease_lost
            idem.complete(conn, "quiet", "k2", stale.lease_token, 200, reference_time=later)
        except idem.LeaseLost:
            pass
    print("done")
""")


@pytest.mark.parametrize("variant", ["as shipped", "without-nullhandler"])
def test_no_stderr_in_an_app_without_logging_configured(db: str, variant: str) -> None:
    """The package's WARNING lines (mismatch, lease_lost) must not reach stderr through
    logging.lastResort in an application that configured no logging: the package logger has
    a NullHandler. The control run without it shows that this subprocess would print them."""
    out = subprocess.run([sys.executable, "-c", QUIET_APP, variant], capture_output=True,
                         text=True, timeout=WAIT_BOUND, env=dict(os.environ, IDEM_DSN=db))
    assert out.returncode == 0 and out.stdout == "done\n", out
    if variant == "as shipped":
        assert out.stderr == ""
    else:
        assert "claim key=" in out.stderr and "lease_lost key=" in out.stderr, out.stderr


def test_the_package_logger_has_a_null_handler() -> None:
    handlers = logging.getLogger("pg_idempotency").handlers
    assert any(isinstance(h, logging.NullHandler) for h in handlers)

