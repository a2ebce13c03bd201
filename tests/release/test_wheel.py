"""The built wheel, as a user installs it: build/wheel-venv is a virtualenv with nothing but
dist/'s wheel and its demo extra (make dist wheel-venv; make test makes both). Every command
runs from a directory outside the checkout, so nothing of the source tree can stand in for a
file the wheel lacks."""

from __future__ import annotations

import json
import os
import subprocess
import zipfile
from pathlib import Path

import psycopg
import pytest
import tomllib

from pgharness import WAIT_BOUND

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / "build" / "wheel-venv"
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
WHEEL = ROOT / "dist" / f"pg_idempotency-{VERSION}-py3-none-any.whl"


def _venv() -> Path:
    if not (VENV / ".installed").exists() or not WHEEL.exists():
        pytest.fail(f"{WHEEL.relative_to(ROOT)} installed in {VENV.relative_to(ROOT)} is "
                    "missing: run make dist wheel-venv (make test does)")
    return VENV / "bin"


def _run(cwd: Path, *args: str, env: dict[str, str] | None = None
         ) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items()
            if k not in ("DATABASE_URL", "PYTHONPATH", "VIRTUAL_ENV") and not k.startswith("PG")}
    return subprocess.run(list(args), cwd=cwd, capture_output=True, text=True, timeout=WAIT_BOUND,
                          env={**base, "LC_ALL": "C", **(env or {})}, stdin=subprocess.DEVNULL)


def test_the_wheel_holds_what_the_package_reads() -> None:
    _venv()
    names = set(zipfile.ZipFile(WHEEL).namelist())
    for f in sorted((ROOT / "migrations").glob("*.sql")):
        assert f"pg_idempotency/migrations/{f.name}" in names, f.name
    assert "pg_idempotency/_payments_example.py" in names  # the demo's app
    assert f"pg_idempotency-{VERSION}.dist-info/licenses/LICENSE" in names
    assert not [n for n in names if n.startswith(("tests/", "sql/", "bench/"))]


@pytest.mark.parametrize("server", ["pg18"], indirect=True)
def test_installed_wheel_runs_the_demo_and_the_cli(tmp_path: Path, empty_db: str) -> None:
    bin_dir = _venv()
    python = str(bin_dir / "python")
    proc = _run(tmp_path, python, "-c",
                "import pg_idempotency as p, pg_idempotency.migrate as m; "
                "print(p.__version__); print(p.__file__); print(m.sql_path())")
    assert proc.returncode == 0, proc.stderr
    version, module, folder = proc.stdout.split("\n")[:3]
    assert version == VERSION
    site = VENV / "lib"
    assert site in Path(module).parents and site in Path(folder).parents, proc.stdout
    cli = str(bin_dir / "pg-idempotency")
    proc = _run(tmp_path, cli, "sql-path")
    assert proc.returncode == 0 and proc.stdout.strip() == folder
    for f in sorted((ROOT / "migrations").glob("*.sql")):
        assert (Path(folder) / f.name).read_bytes() == f.read_bytes(), f.name

    proc = _run(tmp_path, cli, "--version")
    assert proc.returncode == 0 and VERSION in proc.stdout + proc.stderr
    proc = _run(tmp_path, cli, "demo", "--clients", "2", "--payments", "3", "--seed", "1",
                "--json", env={"DATABASE_URL": empty_db})
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["ok"] is True
    assert summary["protected"]["duplicate_charges"] == 0
    assert summary["protected"]["lost_payments"] == 0
    assert summary["protected"]["charges_executed"] == 6
    assert summary["unprotected"]["duplicate_charges"] > 0
    proc = _run(tmp_path, cli, "migrate", "--dsn", empty_db)
    assert proc.returncode == 0 and "up to date" in proc.stdout, proc.stderr
    with psycopg.connect(empty_db) as conn:
        versions = [v for (v,) in conn.execute(
            "SELECT version FROM idempotency.migrations ORDER BY version")]
    assert versions == list(range(1, len(list((ROOT / "migrations").glob("*.sql"))) + 1))
