"""CPU time of a benchmark's PostgreSQL server, from /proc (Linux): the postmaster and every
process it started (backends, autovacuum, checkpointer, WAL writer ...), and how long they
waited for a CPU. Shared by bench/citus.py and bench/http.py."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

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
    """CPU ticks (user + system) of the postmaster and each of its children, by pid."""
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
