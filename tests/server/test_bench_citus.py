"""bench/citus.py's pgbench processes draw keys of their own, even when started together.

pgbench seeds its random generator from the clock in microseconds unless told otherwise, and
two processes that bench/citus.py starts one after the other read the same microsecond now and
then (rarely with PostgreSQL 18's pgbench, often with PostgreSQL 15's). Their clients then
draw the same scopes and keys in the same order: each key's second claim answers in_progress
with no lease token, its complete fails, and pgbench aborts the round -- once in a warm-up of
the benchmark. Here the two processes are given the same seed through PGBENCH_RANDOM_SEED, as
a coinciding clock would, and the round must still finish every pair: the bench's own
--random-seed=rand overrides the environment's seed.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import psycopg
import pytest

from pgharness import PgServer

ROOT = Path(__file__).resolve().parents[2]


def _bench_citus(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))  # its common
    spec = importlib.util.spec_from_file_location("bench_citus", ROOT / "bench" / "citus.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_citus", module)
    spec.loader.exec_module(module)
    return module


def test_two_pgbench_processes_with_one_seed_still_claim_keys_of_their_own(
        server: PgServer, db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bench = _bench_citus(monkeypatch)
    monkeypatch.setattr(bench, "DB", psycopg.conninfo.conninfo_to_dict(db)["dbname"])
    monkeypatch.setenv("PGBENCH_RANDOM_SEED", "12345")
    script = tmp_path / "claim_complete.pgbench"
    script.write_text(bench.PGBENCH_SCRIPT)

    # Two processes on one server, two clients each: without a seed of each process's own,
    # their clients draw the same keys (pgbench aborts, and pgbench_round exits).
    result = bench.pgbench_round([server, server], {}, server, script, seconds=3, clients=4,
                                 ticks=100)

    with psycopg.connect(db) as conn:
        states = dict(conn.execute(
            "SELECT state, count(*) FROM idempotency.keys GROUP BY state").fetchall())
    assert result["tps"] > 0
    assert states.get("completed", 0) > 20, states
    # every claim of the round found a new key: nothing was left claimed and never completed
    assert set(states) == {"completed"}, states
