"""CPU time of a benchmark's PostgreSQL server, from /proc (Linux): the postmaster and every
process it started (backends, autovacuum, checkpointer, WAL writer ...). Shared by
bench/citus.py and bench/http.py."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

TICKS = os.sysconf("SC_CLK_TCK")


def clock_ticks() -> int:
    return TICKS


def server_cpu(server: Any) -> dict[int, int]:
    """CPU ticks (user + system) of the postmaster and each of its children, by pid."""
    pm = int((server.datadir / "postmaster.pid").read_text().split()[0])
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2:].split()
        pid, ppid = int(stat.parent.name), int(fields[1])
        if pid == pm or ppid == pm:
            out[pid] = int(fields[11]) + int(fields[12])
    return out


def cpu_delta(before: dict[int, int], after: dict[int, int]) -> int:
    """Ticks spent between two server_cpu() snapshots (a process that started in between
    counts from zero; one that ended in between is lost: backends here live as long as their
    pool)."""
    return sum(t - before.get(pid, 0) for pid, t in after.items())
