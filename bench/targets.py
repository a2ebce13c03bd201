#!/usr/bin/env python3
"""Issue 32's targets (engine v4: the price of a request in CPU), each with its per-round
figures, their median and met / not met.

Reads the --json files that the benchmarks wrote to build/bench/ (it measures nothing itself)
and prints one table; with --plot it also draws the server and the app CPU per request by
variant (none, recipe, ours), for the operation() pattern and for each HTTP load.

  operation   bench/operation.py --json:  the README's operation() pattern / the recipe
  http        bench/http.py --json:       the middleware / the recipe and / none
  run         bench/run.py --json:        pgbench engine / floor, fast
  citus       bench/citus.py --json:      what Citus adds to claim + complete and to the
                                          recipe's two statements; workers' CPU / one server's
  partitions  bench/partitions.py --json: 100 partitions / 5, 10 M keys / an empty install
  instructions bench/instructions.py --json: a payment's CPU instructions in its backend
                                          (context, not a target)

    .venv/bin/python bench/targets.py [--dir build/bench] [--plot PATH]

The targets (issue 32; the engine v3 statement-time and WAL targets are retired, WAL and the
statement time stay reported figures, printed as context):
  1. server CPU per request ours / recipe <= 1.3: operation() and the middleware (fresh and
     30% replays, 16 and 64 clients)
  2. app CPU per request ours / recipe <= 1.2: the same (the Python process for operation(),
     the uvicorn process for the middleware)
  3. HTTP throughput ours / recipe >= 0.95 fresh, >= 1.05 with 30% replays; ours / none >= 0.6
  4. pgbench engine / floor, fast >= 0.8
  5. Citus: what Citus adds to claim + complete (all nodes' CPU - one server's) / what it adds
     to the recipe's two statements <= 1.0; workers' CPU / one server's <= 3.0
  6. kept: 100 partitions and 10 M stored keys >= 0.9 of the small install

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
FILES = ("operation", "http", "run", "citus", "partitions", "instructions")

Row = tuple[str, str, str, str]


def load(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


def figure(name: str, rounds: list[float]) -> tuple[str, str, str]:
    """A figure's name, its per-round values and their median, as table cells."""
    return (name, ", ".join(f"{x:.2f}" for x in rounds), f"**{statistics.median(rounds):.2f}**")


def row(number: int, target: str, rounds: list[float], op: str, limit: float) -> Row:
    med = statistics.median(rounds)
    met = med <= limit if op == "<=" else med >= limit
    name, cells, median = figure(f"{number}. {target}", rounds)
    return (name, cells, median, f"{op} {limit:g}: {'met' if met else 'NOT met'}")


def missing(number: int, what: str, path: Path) -> Row:
    return (f"{number}. {what}", "-", "-", f"not measured (no {path})")


def ratio(rounds: list[dict[str, Any]], field: str, ours: str, base: str) -> list[float]:
    return [r[ours][field] / r[base][field] if r[base][field] else float("nan") for r in rounds]


def operation_rows(data: dict[str, Any] | None, path: Path) -> list[Row]:
    if data is None:
        return [missing(1, "server CPU ours/recipe (operation())", path),
                missing(2, "app CPU ours/recipe (operation())", path)]
    r = data["ratios"]
    return [row(1, f"server CPU ours/recipe (operation(), {data['threads']} threads)",
                r["pg_cpu_ms_over_recipe"], "<=", 1.3),
            row(2, f"app CPU ours/recipe (operation(), {data['threads']} threads)",
                r["app_cpu_ms_over_recipe"], "<=", 1.2)]


def http_rows(data: dict[str, Any] | None, path: Path) -> list[Row]:
    if data is None:
        return [missing(n, f"{what} (HTTP)", path)
                for n, what in ((1, "server CPU ours/recipe"), (2, "app CPU ours/recipe"),
                                (3, "throughput ours/recipe and ours/none"))]
    rows = []
    for r in data["results"]:
        where = f"middleware, {r['load']}, {r['clients']} clients"
        rows.append(row(1, f"server CPU ours/recipe ({where})",
                        r["ratios"]["pg_cpu_ms_over_recipe"], "<=", 1.3))
        rows.append(row(2, f"app CPU ours/recipe ({where}; uvicorn)",
                        ratio(r["rounds"], "server_cpu_ms", "middleware", "recipe"), "<=", 1.2))
    for r in data["results"]:
        where = f"{r['load']}, {r['clients']} clients"
        rows.append(row(3, f"throughput ours/recipe ({where})", r["ratios"]["rps_over_recipe"],
                        ">=", 0.95 if r["load"] == "fresh" else 1.05))
        rows.append(row(3, f"throughput ours/none ({where})", r["ratios"]["rps_over_none"],
                        ">=", 0.6))
    return rows


def run_rows(data: dict[str, Any] | None, path: Path) -> list[Row]:
    if data is None:
        return [missing(4, "pgbench engine/floor fast", path)]
    return [row(4, f"pgbench engine/floor fast ({r['version']}, {r['clients']} clients)",
                r["engine_over_floor_rounds"], ">=", 0.8)
            for r in data["results"] if r["mode"] == "fast"]


def citus_rows(data: dict[str, Any] | None, path: Path) -> list[Row]:
    if data is None or "recipe_cpu_us_per_pair" not in (data or {}):
        why = path if data is None else f"{path} without the recipe's figures"
        return [missing(5, "Citus", Path(str(why)))]
    ours, recipe = data["cpu_us_per_pair"], data["recipe_cpu_us_per_pair"]
    added = [a - s for a, s in zip(ours["all nodes"], ours["single server"], strict=True)]
    recipe_added = [a - s for a, s in zip(recipe["all nodes"], recipe["single server"],
                                          strict=True)]
    return [
        row(5, "Citus: what it adds to claim + complete / to the recipe's two statements "
               "(all nodes' CPU - one server's, through the coordinator)",
            [a / b if b else float("nan") for a, b in zip(added, recipe_added, strict=True)],
            "<=", 1.0),
        row(5, "Citus: workers' CPU per delegated claim + complete / one server's",
            [w / s for w, s in zip(ours["workers (sum)"], ours["single server"], strict=True)],
            "<=", 3.0),
    ]


def partitions_rows(data: dict[str, Any] | None, path: Path) -> list[Row]:
    if data is None:
        return [missing(6, "kept: 100 partitions and 10 M keys", path)]
    rows = []
    for run in data["runs"]:
        flat = run.get("flatness", [])
        most = max((r["partitions"] for r in flat), default=None)
        fewest = min((r["partitions"] for r in flat), default=None)
        for r in flat:
            if r["partitions"] == most:
                tombstones = "on" if r["tombstones"] else "off"
                rows.append(row(6, f"kept: {most} partitions / {fewest} ({run['version']}, "
                                   f"{run['mode']}, tombstones {tombstones})",
                                [x["ratio"] for x in r["rounds"]], ">=", 0.9))
        if "big" in run:
            big = run["big"]
            rows.append(row(6, f"kept: {big['keys']:,} keys / an empty install ({run['version']}, "
                               f"{run['mode']})", [x["ratio"] for x in big["rounds"]], ">=", 0.9))
    return rows


def context_rows(op: dict[str, Any] | None, http: dict[str, Any] | None,
                 run: dict[str, Any] | None, citus: dict[str, Any] | None,
                 instructions: dict[str, Any] | None = None) -> list[tuple[str, ...]]:
    """Figures that are not targets: throughput of operation() against the recipe, a
    payment's instructions in its backend (ours / recipe: one count, deterministic, so its
    "rounds" cell is the count itself), the retired statement-time and WAL ratios, the
    server's run-queue wait per HTTP request, what Citus adds in µs, and pgbench's floor /
    bare."""
    rows = []
    if op is not None:
        rows.append(figure(f"operation() payments/s ours/recipe ({op['threads']} threads)",
                           op["ratios"]["rps_over_recipe"]))
    for r in (instructions or {}).get("results", []):
        per = r["per_payment"]
        rows.append(figure(f"operation() backend instructions ours/recipe ({r['server']}: "
                           f"{per['ours']:,.0f} / {per['recipe']:,.0f})",
                           [per["ours"] / per["recipe"]]))
    for r in (http or {}).get("results", []):
        where = f"{r['load']}, {r['clients']} clients"
        rows.append(figure(f"HTTP statement time ours/recipe ({where})",
                           r["ratios"]["stmt_ms_over_recipe"]))
        rows.append(figure(f"HTTP WAL bytes ours/recipe ({where})",
                           r["ratios"]["wal_bytes_over_recipe"]))
        if "pg_wait_ms_over_recipe" in r["ratios"]:
            rows.append(figure(f"HTTP PG run-queue wait ours/recipe ({where})",
                               r["ratios"]["pg_wait_ms_over_recipe"]))
    if citus is not None and "recipe_cpu_us_per_pair" in citus:
        ours, recipe = citus["cpu_us_per_pair"], citus["recipe_cpu_us_per_pair"]
        rows.append(figure("Citus adds to claim + complete, µs",
                           [a - s for a, s in zip(ours["all nodes"], ours["single server"],
                                                  strict=True)]))
        rows.append(figure("Citus adds to the recipe's pair, µs",
                           [a - s for a, s in zip(recipe["all nodes"], recipe["single server"],
                                                  strict=True)]))
        rows.append(figure("Citus: workers' CPU per recipe pair / one server's",
                           [w / s for w, s in zip(recipe["workers (sum)"],
                                                  recipe["single server"], strict=True)]))
    rows += [figure(f"pgbench floor/bare {r['mode']} ({r['version']}, {r['clients']} clients)",
                    [rd["floor"] / rd["bare"] for rd in r["rounds"]])
             for r in (run or {}).get("results", [])]
    return rows


VARIANTS = (("none", "no idempotency"), ("recipe", "hand-written recipe"), ("ours", "ours"))


def plot(op: dict[str, Any] | None, http: dict[str, Any] | None, path: Path) -> None:
    """Two panels, server and app CPU per request; a group of bars (none, recipe, ours) for
    operation() and for each HTTP load; a dot for every round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # (label, rounds as [{variant: {"server": ms, "app": ms}}])
    groups = []
    if op is not None:
        groups.append((f"operation()\n{op['threads']} threads",
                       [{v: {"server": r[v]["pg_cpu_ms"], "app": r[v]["app_cpu_ms"]}
                         for v, _ in VARIANTS} for r in op["rounds"]]))
    for res in (http or {}).get("results", []):
        names = {"none": "none", "recipe": "recipe", "ours": "middleware"}
        groups.append((f"HTTP {res['load']}\n{res['clients']} clients",
                       [{v: {"server": r[names[v]]["pg_cpu_ms"],
                             "app": r[names[v]]["server_cpu_ms"]} for v, _ in VARIANTS}
                        for r in res["rounds"]]))
    if not groups:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    width = 0.8 / len(VARIANTS)
    for ax, side, title in ((axes[0], "server", "server CPU (every postgres process)"),
                            (axes[1], "app", "app CPU (the Python / uvicorn process)")):
        for i, (variant, name) in enumerate(VARIANTS):
            xs = [j + (i - 1) * width for j in range(len(groups))]
            meds = [statistics.median(rd[variant][side] for rd in rounds)
                    for _, rounds in groups]
            ax.bar(xs, meds, width, label=name)
            for x, (_, rounds) in zip(xs, groups, strict=True):
                ys = [rd[variant][side] for rd in rounds]
                ax.plot([x] * len(ys), ys, "k.", markersize=3)
        ax.set_xticks(range(len(groups)), [g[0] for g in groups], fontsize=8)
        ax.set_ylabel("ms per request")
        ax.set_title(title, fontsize=10)
    axes[0].legend(fontsize=8)
    fig.suptitle("CPU per request by variant: median of the rounds; dots: each round",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=OUT, help="where the --json files are")
    for name in FILES:
        parser.add_argument(f"--{name}", type=Path, help=f"{name}.json elsewhere")
    parser.add_argument("--plot", type=Path, help="draw CPU per request by variant here")
    args = parser.parse_args()
    paths = {name: getattr(args, name) or args.dir / f"{name}.json" for name in FILES}
    data = {name: load(path) for name, path in paths.items()}
    rows = (operation_rows(data["operation"], paths["operation"])
            + http_rows(data["http"], paths["http"])
            + run_rows(data["run"], paths["run"])
            + citus_rows(data["citus"], paths["citus"])
            + partitions_rows(data["partitions"], paths["partitions"]))
    rows.sort(key=lambda r: int(r[0].split(".", 1)[0]))  # by target number, stable
    print("\nIssue 32 targets (engine v4): per-round figures, their median, the target\n")
    print("| target | rounds | median | target |")
    print("|---|---|---:|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    met = sum(r[3].endswith(": met") for r in rows)
    measured = sum(not r[3].startswith("not measured") for r in rows)
    print(f"\n{met} of {measured} measured figures meet their target "
          f"({len(rows) - measured} not measured)")
    context = context_rows(data["operation"], data["http"], data["run"], data["citus"],
                           data["instructions"])
    if context:
        print("\nContext, not targets: per-round figures and their median\n")
        print("| figure | rounds | median |")
        print("|---|---|---:|")
        for r in context:
            print("| " + " | ".join(r) + " |")
    if args.plot:
        plot(data["operation"], data["http"], args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
