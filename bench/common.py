"""What the benchmarks share: the import path, a throwaway server with the engine installed,
pgbench, the CPU time of a server's processes (/proc, Linux), the per-round ratio cells and
the output files.

Importing it puts harness/ (pgharness, citus_cluster) on the import path; a script that measures
this tree's package rather than the venv's calls use_tree_package() before importing it.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
MIGRATIONS = ROOT / "migrations"

if str(ROOT / "harness") not in sys.path:
    sys.path.insert(0, str(ROOT / "harness"))

# PostgreSQL's default durability, as in production (the harness's own settings turn these off
# for speed; "fast" in the scripts' --modes is the harness's).
DURABLE = {"fsync": "on", "synchronous_commit": "on", "full_page_writes": "on"}
# psql: a migration in one transaction, and any other file; both stop at the first error.
PSQL_ONE_TX = ("-X", "-q", "-1", "-v", "ON_ERROR_STOP=1")
PSQL_FILE = ("-X", "-q", "-v", "ON_ERROR_STOP=1")


def use_tree_package() -> None:
    """Import pg_idempotency from this tree's python/, not the one installed in the venv."""
    if str(ROOT / "python") not in sys.path:
        sys.path.insert(0, str(ROOT / "python"))


# -- the server --------------------------------------------------------------------------------

def install_engine(server: Any, dsn: str, upto: int | None = None) -> None:
    """migrations/*.sql in order, each in one transaction, as docs/install.md says; ``upto``:
    only the migrations up to that number."""
    for migration in sorted(MIGRATIONS.glob("*.sql")):
        if upto is not None and int(migration.name[:4]) > upto:
            continue
        server.run_psql(dsn, migration, args=PSQL_ONE_TX)


def version(server: Any) -> str:
    """The server's name and version, "PostgreSQL 15.18"."""
    return " ".join(server.version.split()[:2])


TPS = re.compile(r"tps = ([0-9.]+) \(without initial connection time\)")


def pgbench_tps(stdout: str) -> float | None:
    """The throughput pgbench printed (None if it printed none)."""
    match = TPS.search(stdout)
    return float(match.group(1)) if match else None


def pgbench(server: Any, dsn: str, scripts: Sequence[Path], seconds: int, clients: int, *,
            mode: str = "prepared", what: str = "") -> float:
    """One pgbench run of ``scripts`` (-f each) with ``clients`` clients over at most two
    threads; its tps. A failed run ends the benchmark, pgbench's output in the message."""
    out = subprocess.run(
        [str(server.bindir / "pgbench"), "-n", "-M", mode, "-c", str(clients),
         "-j", str(min(clients, 2)), "-T", str(seconds),
         *(a for script in scripts for a in ("-f", str(script))), dsn],
        capture_output=True, text=True, check=False,
    )
    tps = pgbench_tps(out.stdout)
    if out.returncode != 0 or tps is None:
        raise SystemExit(f"pgbench failed{what}:\n{out.stdout}\n{out.stderr}")
    return tps


# -- CPU time from /proc -------------------------------------------------------------------------

TICKS = os.sysconf("SC_CLK_TCK")


def clock_ticks() -> int:
    return TICKS


def _server_procs(server: Any) -> list[tuple[Path, list[str]]]:
    """(/proc/PID, fields of its stat after the command) of the postmaster and its children."""
    pm = int((server.datadir / "postmaster.pid").read_text().split()[0])
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2:].split()
        if int(stat.parent.name) == pm or int(fields[1]) == pm:
            out.append((stat.parent, fields))
    return out


def server_cpu(server: Any) -> dict[int, int]:
    """CPU ticks (user + system) of the postmaster and each of its children (backends,
    autovacuum, checkpointer, WAL writer ...), by pid."""
    return {int(proc.name): int(fields[11]) + int(fields[12])
            for proc, fields in _server_procs(server)}


def server_runqueue(server: Any) -> dict[int, int]:
    """Nanoseconds the postmaster and each of its children spent runnable but waiting for a
    CPU (the second field of /proc/PID/schedstat; needs a kernel with schedstats, else
    empty), by pid. On a machine whose cores are all busy a statement's execution time
    includes such waits, so this tells how much of the statement time is the machine's."""
    out = {}
    for proc, _fields in _server_procs(server):
        try:
            out[int(proc.name)] = int((proc / "schedstat").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return out


def cpu_delta(before: dict[int, int], after: dict[int, int]) -> int:
    """Ticks spent between two server_cpu() snapshots (a process that started in between
    counts from zero; one that ended in between is lost: backends here live as long as their
    pool)."""
    return sum(t - before.get(pid, 0) for pid, t in after.items())


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` (0 when /proc cannot tell)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICKS


# -- per-round ratios and their medians ----------------------------------------------------------

def rounds_text(values: Iterable[float]) -> str:
    """Per-round figures as a table cell: "1.41, 1.39, 1.38"."""
    return ", ".join(f"{x:.2f}" for x in values)


def rounds_cell(values: Sequence[float]) -> str:
    """Per-round figures and their median in bold: "1.41, 1.39, 1.38 (**1.39**)"."""
    return f"{rounds_text(values)} (**{statistics.median(values):.2f}**)"


def ratio_summary(rounds: list[dict[str, dict[str, float]]], ours: str, bases: Iterable[str],
                  fields: Iterable[str]) -> dict[str, Any]:
    """For interleaved rounds ({variant: {field: value}} each): per round, ``ours`` over each
    base for each field (NaN where the base is 0), their medians, and each variant's median
    per field."""
    fields = list(fields)
    ratios = {f"{field}_over_{base}": [r[ours][field] / r[base][field]
                                       if r[base][field] else float("nan") for r in rounds]
              for field in fields for base in bases}
    return {
        "ratios": ratios,
        "ratio_medians": {k: statistics.median(v) for k, v in ratios.items()},
        "per_request": {field: {v: statistics.median(r[v][field] for r in rounds)
                                for v in rounds[0]} for field in fields},
    }


# -- output files --------------------------------------------------------------------------------

def unwritable(path: Path | str | None) -> str | None:
    """Why this process could not write ``path`` (None if it can, or if no path is given):
    checked before the run, so that a root-owned docs/ file does not end a ten-minute run."""
    if path is None:
        return None
    try:
        path = Path(path).resolve()
        if path.exists():
            return None if os.access(path, os.W_OK) else "exists and is not writable by this user"
        parent = path.parent
        while not parent.exists():
            parent = parent.parent
    except OSError as exc:  # a directory on the way this user may not enter
        return f"cannot be checked: {exc.strerror}"
    return None if os.access(parent, os.W_OK | os.X_OK) else \
        f"cannot be created: {parent} is not writable by this user (pass another path)"


def check_writable(parser: Any, **paths: Path | str | None) -> None:
    """parser.error() for the first output path (option name: path) this user cannot write."""
    for option, path in paths.items():
        problem = unwritable(path)
        if problem:
            parser.error(f"--{option.replace('_', '-')} {path}: {problem}")


def write_json(path: Path | str, data: Any) -> None:
    """The figures for bench/targets.py (and for a reader): indented, strings for anything
    JSON has no type for."""
    Path(path).write_text(json.dumps(data, indent=2, default=str) + "\n")


# -- the HTTP benchmarks (bench/http.py, bench/provider.py): app servers and a raw client --------

def free_port() -> int:
    """A loopback TCP port nothing listens on now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def serve_uvicorn(app: Any, port: int) -> None:
    """Run ``app`` under one uvicorn worker on 127.0.0.1:``port`` until killed (httptools when
    installed: the parser a production install uses)."""
    import importlib.util

    import uvicorn

    http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    config = uvicorn.Config(app, host="127.0.0.1", port=port, loop="asyncio", http=http,
                            log_level="warning", access_log=False, lifespan="on")
    uvicorn.Server(config).run()


def wait_listening(servers: dict[str, tuple[subprocess.Popen[bytes], int]],
                   seconds: float = 60) -> None:
    """Return once every server process accepts connections on its port; exit the benchmark
    when one exits or does not listen within ``seconds``."""
    import socket
    import time

    for variant, (proc, port) in servers.items():
        deadline = time.monotonic() + seconds
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"the {variant} server exited with {proc.returncode}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit(f"the {variant} server did not start") from None
                time.sleep(0.05)


async def read_response(reader: Any) -> tuple[int, dict[bytes, bytes], bytes]:
    """One HTTP/1.1 response from an asyncio StreamReader: status, headers (lower-case names),
    body (by Content-Length, chunked, or to the end)."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head[:-4].split(b"\r\n")
    status = int(lines[0].split(b" ", 2)[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip()
    if b"content-length" in headers:
        body = await reader.readexactly(int(headers[b"content-length"]))
    elif headers.get(b"transfer-encoding", b"").lower() == b"chunked":
        parts = []
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            parts.append(await reader.readexactly(size + 2))
            if size == 0:
                break
        body = b"".join(p[:-2] for p in parts)
    else:
        body = await reader.read()
    return status, headers, body
