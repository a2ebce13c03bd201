#!/usr/bin/env python3
"""Benchmark: generic against custom plans, and complete's guess, on Citus.

Citus 13.2.2 and 14.0.1 plan a generic plan's statement on its local shard again on every
execution and keep every such plan (citusdata/citus pull request 8824), so distribute() sets
plan_cache_mode = force_custom_plan on the per-key functions (sql/functions/
_citus_custom_plans.sql); and without partition branches _complete_row first tries the key's
last hour instead of reading key_directory (sql/functions/_make_routes.sql). This measures
both on one cluster (bench/citus.py's: a coordinator, two workers, PostgreSQL 18 + Citus 14,
fsync off):

1. Memory: claim + complete through the coordinator with 4 pgbench clients for 30 s with
   generic and with custom plans; the private memory (RssAnon, from /proc) of worker w1's
   client backends, the sessions that run the delegated bodies, every 6 s.
2. CPU: interleaved rounds of 8 s (after 2 s of warm-up with fresh sessions) of three variants
   and a single server: "generic" (the functions' own plan setting, no guess: 0.11.0 before
   both changes), "custom" (custom plans, no guess) and "custom+guess" (what distribute()
   leaves now); the workers' CPU per claim + complete and the throughput. Reported: per round
   and medians, each variant / generic, and each / the single server.

A benchmark: it asserts nothing.

    .venv/bin/python bench/citus_plans.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import citus as bench  # bench/citus.py: its cluster, script and pgbench rounds
import psycopg
from common import clock_ticks

# The functions of the schema with a plan_cache_mode setting: on the cluster, the ones
# distribute() set to custom plans; on the single server (no distribute()), the ones whose
# source asks for generic plans.
PLAN_MODE_SQL = """
SELECT p.oid::regprocedure::text
FROM pg_proc AS p
WHERE p.pronamespace = 'idempotency'::regnamespace
  AND %s = ANY (p.proconfig)
"""


def with_plan_mode(dsn: str, mode: str) -> list[str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return [r[0] for r in conn.execute(PLAN_MODE_SQL, (f"plan_cache_mode={mode}",))]


def set_plans(dsn: str, functions: list[str], generic: set[str], mode: str) -> None:
    """mode 'custom': what distribute() does; 'generic': the sources' own settings (a
    plan_cache_mode clause only on the functions in generic, whose source has one)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        for fn in functions:
            if mode == "custom":
                conn.execute(f"ALTER FUNCTION {fn} SET plan_cache_mode = force_custom_plan")
            elif fn in generic:
                conn.execute(f"ALTER FUNCTION {fn} SET plan_cache_mode = force_generic_plan")
            else:
                conn.execute(f"ALTER FUNCTION {fn} RESET plan_cache_mode")


def without_guess(definition: str) -> str:
    """_complete_row's definition without its guess: the directory read comes first."""
    start = "    IF _complete_row.created_at IS NULL THEN\n"
    i = definition.index(start) + len(start)
    return definition[:i] + definition[definition.index("    SELECT d.created_at INTO"):]


def rss_anon_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    return 0


def memory(cluster, script: Path, seconds: int = 30) -> list[list[int]]:
    """RssAnon (kB) of w1's client backends every 6 s while pgbench runs."""
    worker = cluster.workers[0]
    proc = subprocess.Popen(
        [str(cluster.coordinator.bindir / "pgbench"), "-n", "-M", "prepared", "-c", "4",
         "-j", "2", "-T", str(seconds), "-f", str(script), cluster.coordinator.dsn(bench.DB)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    samples = []
    time.sleep(3)
    while proc.poll() is None and len(samples) < seconds // 6:
        with psycopg.connect(worker.dsn(bench.DB), autocommit=True) as conn:
            pids = [r[0] for r in conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE backend_type = 'client backend'"
                " AND pid <> pg_backend_pid() AND datname = %s", (bench.DB,)).fetchall()]
        samples.append(sorted((rss_anon_kb(p) for p in pids), reverse=True)[:4])
        time.sleep(6)
    proc.communicate()
    return samples


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    cluster, single, about = bench.setup(None, True)
    try:
        coordinator = cluster.coordinator.dsn(bench.DB)
        functions = with_plan_mode(coordinator, "force_custom_plan")
        generic = set(with_plan_mode(single.dsn(bench.DB), "force_generic_plan"))
        with psycopg.connect(coordinator, autocommit=True) as conn:
            guess = conn.execute("SELECT pg_get_functiondef("
                                 "'idempotency._complete_row'::regproc)").fetchone()[0]
        routes = {True: guess, False: without_guess(guess)}

        def variant(name: str) -> None:
            set_plans(coordinator, functions, generic,
                      "generic" if name == "generic" else "custom")
            with psycopg.connect(coordinator, autocommit=True) as conn:
                conn.execute(routes[name == "custom+guess"])

        print(f"{about}; distribute() set custom plans on {len(functions)} functions; the "
              f"sources ask for generic plans on {len(generic)}",
              flush=True)
        for node in [*cluster.nodes, single]:
            with psycopg.connect(node.dsn(bench.DB), autocommit=True) as conn:
                conn.execute("ALTER SYSTEM SET pg_stat_statements.track = 'top'")
                conn.execute("SELECT pg_reload_conf()")
        nodes = {n.name: n for n in cluster.nodes}
        workers = [w.name for w in cluster.workers]
        ticks = clock_ticks()
        with tempfile.TemporaryDirectory() as tmp:
            script = Path(tmp) / "claim_complete.pgbench"
            script.write_text(bench.PGBENCH_SCRIPT)
            print("\n1. RssAnon of w1's four busiest client backends (MB), every 6 s:")
            for mode in ("generic", "custom"):
                variant(mode)
                for i, sample in enumerate(memory(cluster, script)):
                    print(f"  {mode:<8s} t={3 + 6 * i:2d} s  "
                          + " ".join(f"{kb / 1024:7.1f}" for kb in sample), flush=True)
            print(f"\n2. claim + complete, 4 clients, {args.rounds} interleaved rounds of 8 s:")
            names = ("generic", "custom", "custom+guess", "single")
            cpu: dict[str, list[float]] = {n: [] for n in names}
            tps: dict[str, list[float]] = {n: [] for n in names}
            for i in range(1, args.rounds + 1):
                for name in names:
                    if name == "single":
                        r = bench.pgbench_round([single], {"single": single}, single, script, 8,
                                                4, ticks)
                        cpu[name].append(r["servers"]["single"]["cpu_us"] / max(r["pairs"], 1))
                    else:
                        variant(name)
                        bench.pgbench_round([cluster.coordinator], nodes, cluster.coordinator,
                                            script, 2, 4, ticks)
                        r = bench.pgbench_round([cluster.coordinator], nodes,
                                                cluster.coordinator, script, 8, 4, ticks)
                        cpu[name].append(sum(r["servers"][w]["cpu_us"] for w in workers)
                                         / max(r["pairs"], 1))
                    tps[name].append(r["tps"])
                print(f"  round {i}: workers' CPU per pair "
                      + ", ".join(f"{n} {cpu[n][-1]:5.0f} µs" for n in names[:3])
                      + f"; single server {cpu['single'][-1]:4.0f} µs; tps "
                      + ", ".join(f"{n} {tps[n][-1]:5.0f}" for n in names), flush=True)

            def ratio(top: list[float], bottom: list[float]) -> float:
                return statistics.median(t / b for t, b in zip(top, bottom, strict=True))

            for name in names[1:3]:
                print(f"  {name} / generic, medians: workers' CPU "
                      f"{ratio(cpu[name], cpu['generic']):.3f}, tps "
                      f"{ratio(tps[name], tps['generic']):.3f}")
            print("  workers' CPU / single server's, medians: " + ", ".join(
                f"{n} {ratio(cpu[n], cpu['single']):.2f}" for n in names[:3]))
        variant("custom+guess")
    finally:
        single.stop()
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
