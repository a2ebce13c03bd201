#!/usr/bin/env python3
"""Issue 22's targets (engine v3), each with its figure and met / not met.

Reads the --json files that the benchmarks wrote (it measures nothing itself) and prints one
table; with --plot it also draws server statement time per HTTP request by variant.

  http    bench/http.py --json:   ours (middleware) / recipe and / none, per round and median,
                                  for statement time, WAL and throughput
  run     bench/run.py --json:    pgbench engine / bare (durable) and engine / floor (fast)
  citus   bench/citus.py --json:  workers' CPU per delegated claim + complete / one server's

    .venv/bin/python bench/targets.py [--http build/bench/http.json] [--run build/bench/run.json]
                                      [--citus build/bench/citus.json] [--plot PATH]

After the targets, a "context" table that is not a target: the server CPU per HTTP request,
ours / recipe, and pgbench's floor / bare (what any PL/pgSQL design gives up).

A missing file is reported as "not measured" for its targets (exit status 0 all the same:
this is a report, the benchmarks are not tests).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "build" / "bench"


def load(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


def figure(name: str, rounds: list[float]) -> tuple[str, str, str]:
    """A figure's name, its per-round ratios and their median, as table cells."""
    return (name, ", ".join(f"{x:.2f}" for x in rounds), f"**{statistics.median(rounds):.2f}**")


def row(target: str, rounds: list[float], op: str, limit: float) -> tuple[str, str, str, str]:
    med = statistics.median(rounds)
    met = med <= limit if op == "<=" else med >= limit
    return (*figure(target, rounds), f"{op} {limit:g}: {'met' if met else 'NOT met'}")


def http_rows(data: dict[str, Any] | None, path: Path) -> list[tuple[str, ...]]:
    if data is None:
        return [("HTTP targets", "-", "-", f"not measured (no {path})")]
    rows = []
    for r in data["results"]:
        where = f"{r['load']}, {r['clients']} clients"
        ratios = r["ratios"]
        rows.append(row(f"statement time ours/recipe ({where})",
                        ratios["stmt_ms_over_recipe"], "<=", 2.0))
        rows.append(row(f"WAL bytes ours/recipe ({where})",
                        ratios["wal_bytes_over_recipe"], "<=", 1.15))
        rows.append(row(f"throughput ours/recipe ({where})", ratios["rps_over_recipe"], ">=",
                        1.1 if r["load"] == "fresh" else 1.3))
        rows.append(row(f"throughput ours/none ({where})", ratios["rps_over_none"], ">=", 0.75))
    return rows


def run_rows(data: dict[str, Any] | None, path: Path) -> list[tuple[str, ...]]:
    if data is None:
        return [("pgbench targets", "-", "-", f"not measured (no {path})")]
    rows = []
    for r in data["results"]:
        where = f"{r['version']}, {r['clients']} clients"
        if r["mode"] == "durable":
            rows.append(row(f"pgbench engine/bare durable ({where})", r["engine_rounds"],
                            ">=", 0.8))
        else:
            rows.append(row(f"pgbench engine/floor fast ({where})",
                            r["engine_over_floor_rounds"], ">=", 0.8))
    return rows


def citus_rows(data: dict[str, Any] | None, path: Path) -> list[tuple[str, ...]]:
    if data is None:
        return [("Citus worker CPU / single node", "-", "-", f"not measured (no {path})")]
    cpu = data["cpu_us_per_pair"]
    rounds = [w / s for w, s in zip(cpu["workers (sum)"], cpu["single server"], strict=True)]
    return [row("Citus: workers' CPU per delegated claim + complete / one server's", rounds,
                "<=", 1.2)]


def context_rows(http: dict[str, Any] | None, run: dict[str, Any] | None) -> list[tuple[str, ...]]:
    """Figures that are not targets but say what the targets leave out: the server CPU per
    HTTP request (statement time counts execution only, and a function call's inner statements
    are timed with their executor start-up, a top-level statement's are not: see
    docs/benchmarks.md, "The PL/pgSQL floor"), the server's run-queue wait per request (what
    of the statement time is waiting for a CPU), and pgbench's floor / bare, what any PL/pgSQL
    design gives up to the bare statements."""
    rows = [figure(f"PG CPU per request ours/recipe ({r['load']}, {r['clients']} clients)",
                   r["ratios"]["pg_cpu_ms_over_recipe"])
            for r in (http or {}).get("results", [])]
    # the time the server's processes waited for a CPU, inside the statement time when the
    # machine's cores are all busy (bench/http.py; absent from runs before it was measured)
    rows += [figure(f"PG run-queue wait per request ours/recipe ({r['load']}, "
                    f"{r['clients']} clients)", r["ratios"]["pg_wait_ms_over_recipe"])
             for r in (http or {}).get("results", [])
             if "pg_wait_ms_over_recipe" in r["ratios"]]
    rows += [figure(f"pgbench floor/bare {r['mode']} ({r['version']}, {r['clients']} clients)",
                    [rd["floor"] / rd["bare"] for rd in r["rounds"]])
             for r in (run or {}).get("results", [])]
    return rows


def plot(data: dict[str, Any], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = (("none", "no idempotency"), ("recipe", "hand-written recipe"),
                ("middleware", "ours (middleware)"))
    results = data["results"]
    labels = [f"{r['load']}\n{r['clients']} clients" for r in results]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(variants)
    for i, (variant, name) in enumerate(variants):
        xs = [j + (i - 1) * width for j in range(len(results))]
        meds = [r["per_request"]["stmt_ms"][variant] for r in results]
        ax.bar(xs, meds, width, label=name)
        for x, r in zip(xs, results, strict=True):  # every round as a dot
            ys = [rd[variant]["stmt_ms"] for rd in r["rounds"]]
            ax.plot([x] * len(ys), ys, "k.", markersize=3)
    ax.set_xticks(range(len(results)), labels)
    ax.set_ylabel("ms per request (pg_stat_statements, top level)")
    ax.set_title(f"{title}\nmedian of {len(results[0]['rounds'])} rounds; dots: each round",
                 fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--http", type=Path, default=OUT / "http.json")
    parser.add_argument("--run", type=Path, default=OUT / "run.json")
    parser.add_argument("--citus", type=Path, default=OUT / "citus.json")
    parser.add_argument("--plot", type=Path, help="draw statement time per request here")
    parser.add_argument("--title", default="PostgreSQL statement time per HTTP request")
    args = parser.parse_args()
    http = load(args.http)
    rows = (http_rows(http, args.http) + run_rows(load(args.run), args.run)
            + citus_rows(load(args.citus), args.citus))
    print("\nIssue 22 targets (engine v3): per-round ratios, their median, the target\n")
    print("| figure | rounds | median | target |")
    print("|---|---|---:|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    met = sum(r[3].endswith(": met") for r in rows)
    print(f"\n{met} of {len(rows)} figures meet their target")
    context = context_rows(http, load(args.run))
    if context:
        print("\nContext, not targets: per-round ratios and their median\n")
        print("| figure | rounds | median |")
        print("|---|---|---:|")
        for r in context:
            print("| " + " | ".join(r) + " |")
    if args.plot and http is not None:
        plot(http, args.plot, args.title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
