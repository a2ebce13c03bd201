#!/usr/bin/env python3
"""Benchmark: claim + complete throughput as partitions and stored keys pile up.

Two measurements, each a ratio of workloads run side by side on one throwaway server,
interleaved round by round so machine noise hits them alike. This is a benchmark, not a
test: it prints numbers and asserts nothing.

1. Partition flatness. One database per layout on the same server, each a fresh install
   with extra PAST daily partitions attached to idempotency.keys until it has 5, 25, 50 or
   100 partitions (the default one included). settings.retention is 120 days, so every
   partition holds live keys (--rows-per-partition completed keys each: the hard case).
   With tombstones on, settings.tombstones is true and idempotency.tombstones gets as many
   past partitions, each with --rows-per-partition tombstones. Rounds go layout 5, 25, 50,
   100, 5, 25, ... (tombstones off, then on); reported per layout: the median tps and the
   median over rounds of the round's ratio to the first layout (5).

2. Stored keys. --big-keys completed keys (default 10,000,000) spread over yesterday's and
   today's partitions, against an empty install, interleaved; reported: big / empty.

Both drive bench/engine.pgbench (claim + complete of a fresh key) with pgbench -M prepared.

    .venv/bin/python bench/partitions.py [--servers pg15,pg18] [--modes fast,durable]
        [--partitions 5,25,50,100] [--seconds 5] [--rounds 3] [--clients 2]
        [--big-keys 10000000] [--big-servers pg15] [--skip-big]
        [--plot build/benchmarks-partitions.png] [--json results.json]

The plot goes to build/ by default, where the unprivileged user the benchmarks run as may
write (docs/ belongs to whoever checked the tree out); `make bench` copies it to
docs/benchmarks-partitions.png. A --plot or --json path that cannot be written is refused
before the run, not after its ten minutes, and the JSON is written before the plot.

Modes: "fast" (the default) turns fsync, synchronous_commit and full_page_writes off, which
makes the run CPU-bound and shows the functions' own cost; "durable" is PostgreSQL's default.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import common
import psycopg
from common import BENCH, DURABLE, ROOT

import pgharness

ENGINE = BENCH / "engine.pgbench"

COUNT_SQL = {
    parent: f"SELECT count(*) FROM pg_inherits WHERE inhparent = 'idempotency.{parent}'::regclass"
    for parent in ("keys", "tombstones")
}

# Past daily partition number i (i = 2, 3, ...) covers [day_lo(i), day_lo(i) + 1 day).
DAY_LO = "date_trunc('day', now()) - {i} * interval '1 day'"

KEYS_ROWS_SQL = """
INSERT INTO idempotency.keys (scope, key, fingerprint, state, lease_token, created_at,
                              response_status, response_headers, response_body, completed_at)
SELECT 'acct_' || (g %% 100), 'd' || d || '_' || g, sha256(g::text::bytea), 'completed', g,
       date_trunc('day', now()) - d * interval '1 day' + (g %% 1440) * interval '1 minute',
       201, '{}', '{"id": "ch_pre"}',
       date_trunc('day', now()) - d * interval '1 day' + (g %% 1440) * interval '1 minute'
FROM generate_series(%(first)s::int, %(last)s::int) AS d, generate_series(1, %(rows)s::int) AS g
"""

TODAY_ROWS_SQL = """
INSERT INTO idempotency.keys (scope, key, fingerprint, state, lease_token, created_at,
                              response_status, response_headers, response_body, completed_at)
SELECT 'acct_' || (g %% 100), 'today' || g, sha256(g::text::bytea), 'completed', g,
       now() - (now() - date_trunc('day', now())) * g / (%(rows)s::int + 1),
       201, '{}', '{"id": "ch_pre"}', now()
FROM generate_series(1, %(rows)s::int) AS g
"""

TOMBSTONE_ROWS_SQL = """
INSERT INTO idempotency.tombstones (scope, key_hash, fingerprint, final_state, response_status,
                                    created_at, expires_at)
SELECT 'acct_1', sha256(('t' || d || '_' || g)::bytea), sha256(g::text::bytea), 'completed', 201,
       date_trunc('day', now()) - d * interval '1 day' + (g %% 1440) * interval '1 minute',
       now() + interval '100 days'
FROM generate_series(%(first)s::int, %(last)s::int) AS d, generate_series(1, %(rows)s::int) AS g
"""

# Rows made by hand need what claim() writes with them: from migration 0005 on, a row in
# idempotency.key_directory per key and per tombstone (skipped on an older install, --upto 4).
DIRECTORY_ROWS_SQL = """
DO $$
BEGIN
    IF to_regclass('idempotency.key_directory') IS NOT NULL THEN
        INSERT INTO idempotency.key_directory (scope, key_hash, created_at)
        SELECT k.scope, sha256(convert_to(k.key, 'UTF8')), k.created_at
        FROM idempotency.keys AS k
        UNION ALL
        SELECT t.scope, t.key_hash, t.created_at
        FROM idempotency.tombstones AS t;
    END IF;
END
$$
"""

BIG_ROWS_SQL = """
INSERT INTO idempotency.keys (scope, key, fingerprint, state, lease_token, created_at,
                              response_status, response_headers, response_body, completed_at)
SELECT 'acct_' || (g %% 100), 'big' || g, sha256(g::text::bytea), 'completed', g,
       now() - (g %% 1440) * interval '1 minute', 201, '{}', '{"id": "ch_big"}', now()
FROM generate_series(1, %(rows)s::int) AS g
"""


def pgbench(server: pgharness.PgServer, db: str, seconds: int, clients: int) -> float:
    return common.pgbench(server, server.dsn(db), [ENGINE], seconds, clients, what=f" on {db}")


UPTO = 9999  # --upto: install the migrations up to this number only (4: the engine before v2)


def install(server: pgharness.PgServer, db: str) -> None:
    server.run_psql(server.dsn(), f"CREATE DATABASE {db}")
    common.install_engine(server, server.dsn(db), upto=UPTO)


def count(conn: psycopg.Connection, parent: str) -> int:
    return conn.execute(COUNT_SQL[parent]).fetchone()[0]


def setup_layout(server: pgharness.PgServer, db: str, partitions: int, tombstones: bool,
                 rows: int) -> dict:
    """A fresh install in ``db`` with ``partitions`` partitions of keys, all inside retention."""
    install(server, db)
    with psycopg.connect(server.dsn(db), autocommit=True) as conn:
        conn.execute("SET TimeZone = 'UTC'")  # date_trunc('day') on the partitions' boundaries
        base = count(conn, "keys")
        if partitions < base:
            raise SystemExit(f"a fresh install has {base} partitions of keys, more than "
                             f"the {partitions} asked for")
        # tombstone_retention must stay above retention (settings_tombstones_outlive_keys),
        # so it moves with it even when tombstones stay off.
        conn.execute("UPDATE idempotency.settings SET retention = interval '120 days', "
                     "tombstone_retention = interval '200 days'")
        if tombstones:
            conn.execute("UPDATE idempotency.settings SET tombstones = true, "
                         "tombstone_retention = interval '200 days'")
        extra = partitions - base
        parents = ("keys", "tombstones") if tombstones else ("keys",)
        for i in range(2, 2 + extra):
            lo = DAY_LO.format(i=i)
            for parent in parents:
                made = conn.execute(
                    f"SELECT idempotency._create_partition(%s, {lo}, {lo} + interval '1 day')",
                    (parent,)).fetchone()[0]
                if not made:
                    raise SystemExit(f"{db}: idempotency._create_partition('{parent}', "
                                     f"day -{i}) made no partition")
        if count(conn, "keys") != partitions:
            raise SystemExit(f"{db}: {count(conn, 'keys')} partitions of keys, "
                             f"expected {partitions}")
        params = {"first": 2, "last": 1 + extra, "rows": rows}
        conn.execute(TODAY_ROWS_SQL, params)
        if extra:
            conn.execute(KEYS_ROWS_SQL, params)
            if tombstones:
                conn.execute(TOMBSTONE_ROWS_SQL, params)
        conn.execute(DIRECTORY_ROWS_SQL)
        conn.execute("VACUUM ANALYZE")
        conn.execute("CHECKPOINT")
        return {"keys_partitions": count(conn, "keys"),
                "tombstone_partitions": count(conn, "tombstones"),
                "keys_rows": conn.execute("SELECT count(*) FROM idempotency.keys").fetchone()[0],
                "tombstone_rows": conn.execute(
                    "SELECT count(*) FROM idempotency.tombstones").fetchone()[0]}


def flatness(server: pgharness.PgServer, label: str, args: argparse.Namespace) -> list[dict]:
    layouts = args.partitions
    results = []
    dbs = {}
    for tombstones in (False, True):
        for n in layouts:
            db = f"p{n}_{'on' if tombstones else 'off'}"
            t0 = time.monotonic()
            info = setup_layout(server, db, n, tombstones, args.rows_per_partition)
            dbs[tombstones, n] = db
            print(f"  {label} set up {db}: {info['keys_partitions']} keys partitions "
                  f"({info['keys_rows']} rows), {info['tombstone_partitions']} tombstones "
                  f"partitions ({info['tombstone_rows']} rows) in {time.monotonic() - t0:.1f}s",
                  flush=True)
            results.append({"tombstones": tombstones, "partitions": n, "setup": info,
                            "rounds": []})
    for db in dbs.values():  # warm up every database once
        pgbench(server, db, 1, args.clients)
    by_key = {(r["tombstones"], r["partitions"]): r for r in results}
    for rnd in range(args.rounds):
        for tombstones in (False, True):
            tps = {n: pgbench(server, dbs[tombstones, n], args.seconds, args.clients)
                   for n in layouts}
            for n in layouts:
                by_key[tombstones, n]["rounds"].append(
                    {"tps": tps[n], "ratio": tps[n] / tps[layouts[0]]})
            print(f"  {label} round {rnd + 1} tombstones {'on ' if tombstones else 'off'} "
                  + "   ".join(f"{n}: {tps[n]:6.0f} ({tps[n] / tps[layouts[0]]:.2f})"
                             for n in layouts), flush=True)
    for r in results:
        r["median_tps"] = statistics.median(x["tps"] for x in r["rounds"])
        r["ratio"] = statistics.median(x["ratio"] for x in r["rounds"])
    return results


def big(server: pgharness.PgServer, label: str, args: argparse.Namespace) -> dict:
    for db in ("empty", "big"):
        install(server, db)
        with psycopg.connect(server.dsn(db), autocommit=True) as conn:
            conn.execute("SET TimeZone = 'UTC'")
            conn.execute("SELECT idempotency._create_partition('keys', "
                         "date_trunc('day', now()) - interval '1 day', date_trunc('day', now()))")
            fill = vacuum = 0.0
            if db == "big":
                t0 = time.monotonic()
                conn.execute(BIG_ROWS_SQL, {"rows": args.big_keys})
                conn.execute(DIRECTORY_ROWS_SQL)
                fill = time.monotonic() - t0
            t0 = time.monotonic()
            conn.execute("VACUUM ANALYZE")
            vacuum = time.monotonic() - t0
            conn.execute("CHECKPOINT")
            if db == "big":
                stored = conn.execute("SELECT count(*) FROM idempotency.keys").fetchone()[0]
                default_rows = conn.execute(
                    "SELECT count(*) FROM idempotency.keys_default").fetchone()[0]
                size = conn.execute(
                    "SELECT sum(pg_total_relation_size(inhrelid))::bigint FROM pg_inherits "
                    "WHERE inhparent = 'idempotency.keys'::regclass").fetchone()[0]
                print(f"  {label} filled {stored} keys ({size / 2**20:.0f} MiB, "
                      f"{default_rows} in the default partition): INSERT {fill:.1f}s, "
                      f"VACUUM ANALYZE {vacuum:.1f}s", flush=True)
    pgbench(server, "empty", 1, args.clients)
    pgbench(server, "big", 1, args.clients)
    rounds = []
    for rnd in range(args.rounds):
        tps = {db: pgbench(server, db, args.seconds, args.clients) for db in ("empty", "big")}
        rounds.append({**tps, "ratio": tps["big"] / tps["empty"]})
        print(f"  {label} round {rnd + 1} empty {tps['empty']:6.0f}   big {tps['big']:6.0f} "
              f"({tps['big'] / tps['empty']:.2f})", flush=True)
    return {"keys": stored, "size_bytes": size, "fill_seconds": fill, "vacuum_seconds": vacuum,
            "rounds": rounds,
            "empty_tps": statistics.median(r["empty"] for r in rounds),
            "big_tps": statistics.median(r["big"] for r in rounds),
            "ratio": statistics.median(r["ratio"] for r in rounds)}


def plot(runs: list[dict], layouts: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    modes = {run["mode"] for run in runs}
    for index, run in enumerate(runs):
        color = f"C{index % 10}"  # one colour per server (and mode); tombstones on dotted
        for tombstones in (False, True):
            rows = [r for r in run["flatness"] if r["tombstones"] == tombstones]
            if not rows:
                continue
            label = f"{run['version']}, tombstones {'on' if tombstones else 'off'}"
            if len(modes) > 1:
                label += f" ({run['mode']})"
            ax.plot([r["partitions"] for r in rows], [r["ratio"] for r in rows],
                    color=color, marker="o" if not tombstones else "s",
                    linestyle="-" if not tombstones else ":", label=label)
    ax.axhline(0.9, color="grey", linestyle="--", linewidth=1, label="target")
    ax.set_xticks(layouts)
    ax.set_xlabel("partitions attached to idempotency.keys")
    ax.set_ylabel(f"claim + complete throughput / {layouts[0]} partitions")
    ax.set_ylim(0, max(1.2, *(r["ratio"] for run in runs for r in run["flatness"])) + 0.05)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    ax.set_title("pg_idempotency: throughput vs partitions (all partitions live)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", default="pg15,pg18", help="partition flatness servers")
    parser.add_argument("--modes", default="fast", help="fast and/or durable")
    parser.add_argument("--partitions", default="5,25,50,100",
                        help="partitions of keys per layout; ratios are to the first")
    parser.add_argument("--seconds", type=int, default=5, help="seconds per measurement")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--rows-per-partition", type=int, default=2000)
    parser.add_argument("--big-keys", type=int, default=10_000_000)
    parser.add_argument("--big-servers", default="pg15", help="servers for the stored-keys run")
    parser.add_argument("--skip-big", action="store_true", help="skip the stored-keys run")
    parser.add_argument("--plot", type=Path, default=ROOT / "build" / "benchmarks-partitions.png")
    parser.add_argument("--json", type=Path, help="dump all results here")
    parser.add_argument("--upto", type=int, default=9999,
                        help="install migrations up to this number only (4: before Engine v2)")
    args = parser.parse_args()
    common.check_writable(parser, plot=args.plot, json=args.json)
    global UPTO
    UPTO = args.upto
    args.partitions = [int(n) for n in args.partitions.split(",")]
    servers = [s for s in args.servers.split(",") if s]
    big_servers = [] if args.skip_big else [s for s in args.big_servers.split(",") if s]
    modes = [m for m in args.modes.split(",") if m]
    for mode in modes:
        if mode not in ("fast", "durable"):
            parser.error(f"unknown mode {mode!r} (expected fast or durable)")

    started = time.monotonic()
    runs = []
    for flavour in dict.fromkeys(servers + big_servers):
        for mode in modes:
            conf = DURABLE if mode == "durable" else {}
            with pgharness.PgServer(pgharness.flavour_bindir(flavour), extra_conf=conf,
                                    name=f"bench-partitions-{flavour}") as server:
                version = common.version(server)  # "PostgreSQL 15.18"
                label = f"{flavour} {mode}"
                run = {"flavour": flavour, "mode": mode, "version": version}
                if flavour in servers:
                    run["flatness"] = flatness(server, label, args)
                    for db in server.run_psql(server.dsn(), "SELECT datname FROM pg_database "
                                              "WHERE datname ~ '^p[0-9]+_'",
                                              args=("-X", "-At")).stdout.split():
                        server.run_psql(server.dsn(), f"DROP DATABASE {db}")  # free the disk
                if flavour in big_servers:
                    run["big"] = big(server, label, args)
                runs.append(run)
    elapsed = time.monotonic() - started

    layouts = args.partitions
    flat = [run for run in runs if "flatness" in run]
    if flat:
        print(f"\n### Partition flatness: claim + complete, throughput relative to {layouts[0]} "
              "partitions of keys\n")
        print(f"{args.clients} clients, pgbench -M prepared, median of {args.rounds} rounds x "
              f"{args.seconds}s; retention 120 days (every partition live), "
              f"{args.rows_per_partition} keys per partition; tombstones on: as many "
              "tombstone partitions, same rows each. Cells: ratio (median tps).\n")
        print("| server | mode | tombstones | " + " | ".join(str(n) for n in layouts) + " |")
        print("|---|---|---|" + "---:|" * len(layouts))
        for run in flat:
            for tombstones in (False, True):
                cells = [f"{r['ratio']:.2f} ({r['median_tps']:.0f})" for r in run["flatness"]
                         if r["tombstones"] == tombstones]
                print(f"| {run['version']} | {run['mode']} | {'on' if tombstones else 'off'} | "
                      + " | ".join(cells) + " |")
    bigs = [run for run in runs if "big" in run]
    if bigs:
        print("\n### Stored keys: claim + complete with keys stored vs an empty install\n")
        print(f"{args.clients} clients, pgbench -M prepared, median of {args.rounds} rounds x "
              f"{args.seconds}s; keys spread over yesterday's and today's partitions.\n")
        print("| server | mode | keys stored | size | fill (INSERT + VACUUM ANALYZE) "
              "| empty tps | big tps | big / empty |")
        print("|---|---|---:|---:|---:|---:|---:|---:|")
        for run in bigs:
            b = run["big"]
            print(f"| {run['version']} | {run['mode']} | {b['keys']:,} | "
                  f"{b['size_bytes'] / 2**20:.0f} MiB | "
                  f"{b['fill_seconds']:.0f}s + {b['vacuum_seconds']:.0f}s | "
                  f"{b['empty_tps']:.0f} | {b['big_tps']:.0f} | {b['ratio']:.2f} |")
    print(f"\ntotal run time {elapsed:.0f}s")

    if args.json:
        common.write_json(args.json, {"args": vars(args), "elapsed_seconds": elapsed,
                                      "runs": runs})
        print(f"json: {args.json}")
    if flat:
        plot(flat, layouts, args.plot)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
