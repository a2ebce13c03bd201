#!/usr/bin/env python3
"""The benchmarks' figures against the cost targets of bench/targets.toml: each target with its
per-round figures, their median and met / not met, then the tracked figures (not targets).

Reads the --json files that the benchmarks wrote to build/bench/ (it measures nothing itself)
and prints two tables; with --plot it also draws the server and the app CPU per request by
variant (none, recipe, ours), for the operation() pattern and for each HTTP load.

  operation    bench/operation.py --json:    the README's operation() pattern / the recipe
  http         bench/http.py --json:         the middleware / the recipe and / none
  run          bench/run.py --json:          pgbench engine / floor / bare
  citus        bench/citus.py --json:        what Citus adds to claim + complete and to the
                                             recipe's two statements; workers' CPU / one server's
  partitions   bench/partitions.py --json:   100 partitions / 5, 10 M keys / an empty install
  instructions bench/instructions.py --json: a payment's CPU instructions in its backend

    .venv/bin/python bench/targets.py [--dir build/bench] [--targets bench/targets.toml]
                                      [--plot PATH]

bench/targets.toml says which figures are targets and with what limit, and which are tracked
(with the threshold some were once targets with, shown beside them and not judged); the figures
themselves, their names and how each is read from the JSON, are FIGURES below. A target whose
file is missing is reported as "not measured"; a tracked figure whose file is missing is left
out (exit status 0 all the same: this is a report, the benchmarks are not tests).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the backport, which pytest depends on there
    import tomli as tomllib

from common import ROOT, rounds_text

OUT = ROOT / "build" / "bench"
TARGETS = ROOT / "bench" / "targets.toml"
FILES = ("operation", "http", "provider", "run", "citus", "partitions", "instructions")

Data = dict[str, Any]
#: A figure as rows: (what and where, the per-round values).
Rows = list[tuple[str, list[float]]]


def load(path: Path) -> Data | None:
    return json.loads(path.read_text()) if path.exists() else None


def ratio(rounds: list[Data], field: str, ours: str, base: str) -> list[float]:
    return [r[ours][field] / r[base][field] if r[base][field] else float("nan") for r in rounds]


def _diff(a: list[float], b: list[float]) -> list[float]:
    return [x - y for x, y in zip(a, b, strict=True)]


def _div(a: list[float], b: list[float]) -> list[float]:
    return [x / y if y else float("nan") for x, y in zip(a, b, strict=True)]


# -- the figures: name -> (file, how its rows are read) -------------------------------------------

def _operation(field: str, what: str) -> Callable[[Data], Rows]:
    return lambda d: [(f"{what} (operation(), {d['threads']} threads)",
                       d["ratios"][f"{field}_over_recipe"])]


def _http(what: str, get: Callable[[Data], list[float] | None], who: str = "") -> \
        Callable[[Data], Rows]:
    def rows(d: Data) -> Rows:
        out = []
        for r in d["results"]:
            values = get(r)
            if values is not None:
                out.append((f"{what} ({who}{r['load']}, {r['clients']} clients)", values))
        return out
    return rows


def _provider(what: str, ratio_key: str, slow: bool) -> Callable[[Data], Rows]:
    """bench/provider.py's per-round ratios, for the slow provider call (0.2 s and longer)
    or the fast path."""
    def rows(d: Data) -> Rows:
        return [(f"{what} (provider call {r['delay'] * 1000:g} ms, pool {d['pool']}, "
                 f"{d['clients']} clients)", r["ratios"][ratio_key])
                for r in d["results"] if (r["delay"] >= 0.1) == slow
                and ratio_key in r["ratios"]]
    return rows


def _instructions(d: Data) -> Rows:
    out = []
    for r in d.get("results", []):
        per = r["per_payment"]
        out.append((f"operation() backend instructions ours/recipe ({r['server']}: "
                    f"{per['ours']:,.0f} / {per['recipe']:,.0f}; one deterministic count)",
                    [per["ours"] / per["recipe"]]))
    return out


def _citus(what: str, get: Callable[[Data, Data], list[float]]) -> Callable[[Data], Rows]:
    def rows(d: Data) -> Rows:
        if "recipe_cpu_us_per_pair" not in d:  # a file from before the recipe was measured
            return []
        return [(what, get(d["cpu_us_per_pair"], d["recipe_cpu_us_per_pair"]))]
    return rows


def _flatness(d: Data) -> Rows:
    out = []
    for run in d["runs"]:
        flat = run.get("flatness", [])
        most = max((r["partitions"] for r in flat), default=None)
        fewest = min((r["partitions"] for r in flat), default=None)
        for r in flat:
            if r["partitions"] == most:
                tombstones = "on" if r["tombstones"] else "off"
                out.append((f"kept: {most} partitions / {fewest} ({run['version']}, "
                            f"{run['mode']}, tombstones {tombstones})",
                            [x["ratio"] for x in r["rounds"]]))
    return out


def _stored_keys(d: Data) -> Rows:
    return [(f"kept: {run['big']['keys']:,} keys / an empty install ({run['version']}, "
             f"{run['mode']})", [x["ratio"] for x in run["big"]["rounds"]])
            for run in d["runs"] if "big" in run]


FIGURES: dict[str, tuple[str, Callable[[Data], Rows]]] = {
    "operation.server_cpu_over_recipe": (
        "operation", _operation("pg_cpu_ms", "server CPU ours/recipe")),
    "operation.app_cpu_over_recipe": (
        "operation", _operation("app_cpu_ms", "app CPU ours/recipe")),
    "operation.rps_over_recipe": ("operation", _operation("rps", "payments/s ours/recipe")),
    "instructions.ours_over_recipe": ("instructions", _instructions),
    "http.server_cpu_over_recipe": ("http", _http(
        "HTTP server CPU ours/recipe", lambda r: r["ratios"]["pg_cpu_ms_over_recipe"],
        "middleware, ")),
    "http.app_cpu_over_recipe": ("http", _http(
        "HTTP app CPU ours/recipe", lambda r: ratio(r["rounds"], "server_cpu_ms", "middleware",
                                                     "recipe"), "uvicorn, ")),
    "http.rps_over_recipe": ("http", _http(
        "HTTP throughput ours/recipe", lambda r: r["ratios"]["rps_over_recipe"])),
    "http.rps_over_none": ("http", _http(
        "HTTP throughput ours/none", lambda r: r["ratios"]["rps_over_none"])),
    "http.stmt_over_recipe": ("http", _http(
        "HTTP statement time ours/recipe", lambda r: r["ratios"]["stmt_ms_over_recipe"])),
    "http.wal_over_recipe": ("http", _http(
        "HTTP WAL bytes ours/recipe", lambda r: r["ratios"]["wal_bytes_over_recipe"])),
    "http.wait_over_recipe": ("http", _http(
        "HTTP PG run-queue wait ours/recipe",
        lambda r: r["ratios"].get("pg_wait_ms_over_recipe"))),
    "provider.rps_over_recipe": ("provider", _provider(
        "HTTP, slow provider call: throughput ours/recipe", "rps_over_recipe", True)),
    "provider.rps_over_none": ("provider", _provider(
        "HTTP, slow provider call: throughput ours/none", "rps_over_none", True)),
    "provider.p50_over_none": ("provider", _provider(
        "HTTP, slow provider call: p50 latency ours/none", "p50_over_none", True)),
    "provider.fast_rps_over_baseline": ("provider", _provider(
        "HTTP, fast path: throughput ours/main's middleware", "rps_over_baseline", False)),
    "provider.fast_p50_over_baseline": ("provider", _provider(
        "HTTP, fast path: p50 latency ours/main's middleware", "p50_over_baseline", False)),
    "provider.fast_rps_over_none": ("provider", _provider(
        "HTTP, fast path: throughput ours/none", "rps_over_none", False)),
    "run.engine_over_floor_fast": ("run", lambda d: [
        (f"pgbench engine/floor fast ({r['version']}, {r['clients']} clients)",
         r["engine_over_floor_rounds"]) for r in d["results"] if r["mode"] == "fast"]),
    "run.floor_over_bare": ("run", lambda d: [
        (f"pgbench floor/bare {r['mode']} ({r['version']}, {r['clients']} clients)",
         [rd["floor"] / rd["bare"] for rd in r["rounds"]]) for r in d["results"]]),
    "citus.added_over_recipe_added": ("citus", _citus(
        "Citus: what it adds to claim + complete / to the recipe's two statements (all nodes' "
        "CPU - one server's, through the coordinator)",
        lambda o, r: _div(_diff(o["all nodes"], o["single server"]),
                          _diff(r["all nodes"], r["single server"])))),
    "citus.workers_over_single": ("citus", _citus(
        "Citus: workers' CPU per delegated claim + complete / one server's",
        lambda o, r: _div(o["workers (sum)"], o["single server"]))),
    "citus.added_us": ("citus", _citus(
        "Citus adds to claim + complete, µs",
        lambda o, r: _diff(o["all nodes"], o["single server"]))),
    "citus.recipe_added_us": ("citus", _citus(
        "Citus adds to the recipe's pair, µs",
        lambda o, r: _diff(r["all nodes"], r["single server"]))),
    "citus.recipe_workers_over_single": ("citus", _citus(
        "Citus: workers' CPU per recipe pair / one server's",
        lambda o, r: _div(r["workers (sum)"], r["single server"]))),
    "partitions.flatness": ("partitions", _flatness),
    "partitions.stored_keys": ("partitions", _stored_keys),
}


#: What each figure is, for a target that was not measured.
TITLES = {
    "operation.server_cpu_over_recipe": "server CPU ours/recipe (operation())",
    "operation.app_cpu_over_recipe": "app CPU ours/recipe (operation())",
    "http.rps_over_recipe": "HTTP throughput ours/recipe",
    "provider.rps_over_recipe": "HTTP, slow provider call: throughput ours/recipe",
    "provider.rps_over_none": "HTTP, slow provider call: throughput ours/none",
    "provider.p50_over_none": "HTTP, slow provider call: p50 latency ours/none",
}


# -- the report ----------------------------------------------------------------------------------

def read_targets(path: Path) -> dict[str, list[dict[str, Any]]]:
    """bench/targets.toml, checked: every figure known, every target with an op and a limit."""
    spec = tomllib.loads(path.read_text())
    for kind in ("target", "tracked"):
        for entry in spec.get(kind, []):
            if entry.get("figure") not in FIGURES:
                raise SystemExit(f"{path}: unknown figure {entry.get('figure')!r} "
                                 f"(known: {', '.join(FIGURES)})")
    for entry in spec.get("target", []):
        if entry.get("op") not in ("<=", ">=") or not isinstance(entry.get("limit"),
                                                                  (int, float)):
            raise SystemExit(f"{path}: target {entry['figure']} needs op (<= or >=) and a limit")
    for entry in spec.get("tracked", []):
        former = entry.get("former")
        if former is not None and _threshold(former) is None:
            raise SystemExit(f"{path}: tracked {entry['figure']}: former must read like "
                             f"'<= 1.3' or '>= 0.9', not {former!r}")
    return {"target": spec.get("target", []), "tracked": spec.get("tracked", [])}


def _threshold(text: str) -> tuple[str, float] | None:
    op, _, limit = text.strip().partition(" ")
    try:
        return (op, float(limit)) if op in ("<=", ">=") else None
    except ValueError:
        return None


def _holds(value: float, op: str, limit: float) -> bool:
    return value <= limit if op == "<=" else value >= limit


def _sign(op: str) -> str:
    return "≤" if op == "<=" else "≥"


def report(spec: dict[str, list[dict[str, Any]]], data: dict[str, Data | None],
           paths: dict[str, Path]) -> None:
    print("\nTargets: per-round figures, their median, the target\n")
    print("| target | rounds | median | target |")
    print("|---|---|---:|---|")
    met = measured = missing = 0
    for number, entry in enumerate(spec["target"], 1):
        source, rows = FIGURES[entry["figure"]]
        op, limit = entry["op"], entry["limit"]
        if data[source] is None or not rows(data[source]):
            missing += 1
            print(f"| {number}. {TITLES.get(entry['figure'], entry['figure'])} | - | - | "
                  f"not measured (no figures in {paths[source]}) |")
            continue
        for what, values in rows(data[source]):
            median = statistics.median(values)
            ok = _holds(median, op, limit)
            met += ok
            measured += 1
            print(f"| {number}. {what} | {rounds_text(values)} | **{median:.2f}** | "
                  f"{_sign(op)} {limit:g}: {'met' if ok else 'NOT met'} |")
    print(f"\n{met} of {measured} measured figures meet their target"
          + (f" ({missing} target(s) not measured)" if missing else ""))

    tracked = []
    for entry in spec["tracked"]:
        source, rows = FIGURES[entry["figure"]]
        if data[source] is None:
            continue
        former = _threshold(entry["former"]) if entry.get("former") else None
        for what, values in rows(data[source]):
            median = statistics.median(values)
            note = ""
            if former is not None:
                op, limit = former
                note = (f"{_sign(op)} {limit:g}: "
                        f"{'within' if _holds(median, op, limit) else 'outside'}")
            tracked.append((what, rounds_text(values), f"**{median:.2f}**", note))
    if tracked:
        print("\nTracked figures, not targets: per-round figures, their median, and where a "
              "figure once had a threshold, that threshold (not judged)\n")
        print("| figure | rounds | median | former threshold |")
        print("|---|---|---:|---|")
        for row in tracked:
            print("| " + " | ".join(row) + " |")
    absent = [str(paths[name]) for name in FILES if data[name] is None]
    if absent:
        print(f"\nnot found: {', '.join(absent)}")


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
    parser.add_argument("--targets", type=Path, default=TARGETS,
                        help="the targets and tracked figures (TOML)")
    parser.add_argument("--plot", type=Path, help="draw CPU per request by variant here")
    args = parser.parse_args()
    spec = read_targets(args.targets)
    paths = {name: getattr(args, name) or args.dir / f"{name}.json" for name in FILES}
    data = {name: load(path) for name, path in paths.items()}
    report(spec, data, paths)
    if args.plot:
        plot(data["operation"], data["http"], args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
