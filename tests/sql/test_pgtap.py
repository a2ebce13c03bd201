"""Run every pgTAP file in tests/sql/ on every server, each in a fresh database clone."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pgharness import PgServer

SQL_DIR = Path(__file__).resolve().parent  # the pgTAP files sit beside this module
PGTAP_FILES = sorted(SQL_DIR.glob("*.sql"))
PSQL_ARGS = ("-X", "-q", "-t", "-A", "-v", "ON_ERROR_STOP=1")

PLAN_RE = re.compile(r"^1\.\.(\d+)\s*$")
RESULT_RE = re.compile(r"^(not ok|ok)\b(?:\s+(\d+))?(.*)$")
DIRECTIVE_RE = re.compile(r"#\s*(TODO|SKIP)\b", re.IGNORECASE)


@dataclass
class TapResult:
    plan: int | None = None
    passed: int = 0
    failed: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ran(self) -> int:
        return self.passed + len(self.failed)


def parse_tap(output: str) -> TapResult:
    """Top-level TAP only: indented lines are subtests, summarised by their parent line."""
    res = TapResult()
    expected_number = 1
    for line in output.splitlines():
        if line.startswith("Bail out!"):
            res.problems.append(line)
            continue
        if m := PLAN_RE.match(line):
            if res.plan is not None:
                res.problems.append(f"second plan line: {line!r}")
            res.plan = int(m.group(1))
            continue
        m = RESULT_RE.match(line)
        if not m:
            continue
        status, number, rest = m.groups()
        if number is not None and int(number) != expected_number:
            res.problems.append(f"test {number} out of sequence (expected {expected_number})")
        expected_number = (int(number) if number else expected_number) + 1
        directive = DIRECTIVE_RE.search(rest)
        # A failing TODO test is an expected failure in TAP, not a failure.
        if status == "ok" or (directive and directive.group(1).upper() == "TODO"):
            res.passed += 1
        else:
            res.failed.append(line)
    if res.plan is None:
        res.problems.append("no plan line (1..N): did the file call plan()?")
    elif res.ran != res.plan:
        res.problems.append(f"planned {res.plan} tests but ran {res.ran}")
    return res


@pytest.mark.parametrize("tap_file", PGTAP_FILES, ids=[p.name for p in PGTAP_FILES])
def test_pgtap(tap_file: Path, server: PgServer, db: str) -> None:
    proc = server.run_psql(db, tap_file, args=PSQL_ARGS, check=False)
    res = parse_tap(proc.stdout)
    reasons = list(res.problems)
    if proc.returncode != 0:
        reasons.insert(0, f"psql exited {proc.returncode}")
    if res.failed:
        reasons.append(f"{len(res.failed)} failed: " + "; ".join(res.failed))
    if reasons:
        pytest.fail(
            f"{tap_file.name} on {server.name}: " + " | ".join(reasons)
            + f"\n--- TAP output ---\n{proc.stdout}--- psql stderr ---\n{proc.stderr}",
            pytrace=False,
        )


def test_pgtap_files_exist() -> None:
    # An empty tests/sql/ would otherwise make test_pgtap vanish without a trace.
    assert PGTAP_FILES, f"no pgTAP files in {SQL_DIR}"
