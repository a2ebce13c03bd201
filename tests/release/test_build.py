"""tools/build.py and released migrations: a released file stays byte-identical.

Flyway, Liquibase and sqitch checksum every migration they applied and fail ``validate`` when one
changed, so migrations/SHA256SUMS freezes each released file; ``tools/build.py --check`` (run
by ``make lint``) fails when one differs, and ``--migration`` refuses to rewrite one. The
header and footer build.py wraps around a migration are versioned the same way: 0001-0009 keep
the search_path pin they were released with, the save/restore pair starts at 0010.
"""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from pgharness import WAIT_BOUND

ROOT = Path(__file__).resolve().parents[2]
BUILD_PY = ROOT / "tools" / "build.py"
# Released as 0.1.0 ... 0.9.0; a later release adds its own (tools/build.py --freeze N).
RELEASED = ["0001_core.sql", "0002_maintenance.sql", "0003_accept.sql", "0004_hardening.sql",
            "0005_directory.sql", "0006_roles.sql", "0007_routes.sql",
            "0008_fenced_routes.sql", "0009_citus.sql"]


def _load_build() -> ModuleType:
    spec = importlib.util.spec_from_file_location("pg_idempotency_build", BUILD_PY)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build = _load_build()


def _build_py(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(root / "tools" / "build.py"), *args],
                          capture_output=True, text=True, timeout=WAIT_BOUND)


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A copy of what build.py reads and writes (tools/, sql/, migrations/, and the schema
    versions in python/pg_idempotency/schema.py)."""
    (tmp_path / "tools").mkdir()
    shutil.copy2(BUILD_PY, tmp_path / "tools" / "build.py")
    (tmp_path / "python" / "pg_idempotency").mkdir(parents=True)
    shutil.copy2(ROOT / "python" / "pg_idempotency" / "schema.py",
                 tmp_path / "python" / "pg_idempotency" / "schema.py")
    shutil.copytree(ROOT / "sql", tmp_path / "sql")
    shutil.copytree(ROOT / "migrations", tmp_path / "migrations")
    return tmp_path


def test_check_passes_on_this_checkout() -> None:
    done = _build_py(ROOT, "--check")
    assert done.returncode == 0, done.stderr
    assert "released ones as released" in done.stdout


def test_released_migrations_are_frozen_as_released() -> None:
    sums = build.frozen()
    assert list(sums)[:len(RELEASED)] == RELEASED
    for name, digest in sums.items():
        assert hashlib.sha256((ROOT / "migrations" / name).read_bytes()).hexdigest() == digest
    # The file is sha256sum's own format, so a user can check a copy with sha256sum -c.
    done = subprocess.run(["sha256sum", "--check", "--strict", "SHA256SUMS"],
                          cwd=ROOT / "migrations", capture_output=True, text=True,
                          timeout=WAIT_BOUND)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count(": OK") == len(sums)


def test_header_and_footer_are_versioned() -> None:
    """build.py wraps 0001-0009 as they were released, the newest exactly as it generates it."""
    found = build.migrations()
    for path in found:
        number, name = build.MIGRATION_RE.match(path.name).groups()
        version, text = int(number), path.read_text()
        assert text.startswith(build.migration_prologue(version, name)), path.name
        assert text.endswith(build.migration_epilogue(version, name)), path.name
        restores = "idempotency.installer_search_path" in text
        assert restores == (version >= build.RESTORE_FROM), path.name
    assert build.RESTORE_FROM == 10  # not one released migration gets the new wrapping
    newest = found[-1]
    if newest.name not in build.frozen():
        number, name = build.MIGRATION_RE.match(newest.name).groups()
        assert newest.read_text() == build.migration_text(int(number), name)


def test_a_changed_released_migration_fails_check(checkout: Path) -> None:
    path = checkout / "migrations" / "0009_citus.sql"
    before = path.read_bytes()
    path.write_bytes(before.replace(b"-- Record this migration", b"-- Records this migration"))
    assert path.read_bytes() != before
    done = _build_py(checkout, "--check")
    assert done.returncode == 1
    assert ("released migration migrations/0009_citus.sql changed" in done.stderr
            and "add a new migration instead" in done.stderr), done.stderr
    assert "0001_core.sql" not in done.stderr  # only the one that changed
    path.write_bytes(before)
    assert _build_py(checkout, "--check").returncode == 0


def test_a_missing_released_migration_fails_check(checkout: Path) -> None:
    with (checkout / "migrations" / "SHA256SUMS").open("a") as sums:
        sums.write(f"{'0' * 64}  {len(build.migrations()) + 1:04d}_never_made.sql\n")
    done = _build_py(checkout, "--check")
    assert done.returncode == 1
    assert "never_made.sql is missing" in done.stderr, done.stderr


def test_migration_refuses_to_rewrite_a_released_one(checkout: Path) -> None:
    path = checkout / "migrations" / "0009_citus.sql"
    before = path.read_bytes()
    done = _build_py(checkout, "--migration", "9", "citus")
    assert done.returncode == 1
    assert "0009_citus.sql is released" in done.stderr, done.stderr
    assert "add a new migration instead" in done.stderr
    assert path.read_bytes() == before


def test_freeze_releases_the_next_migration(checkout: Path) -> None:
    sums = checkout / "migrations" / "SHA256SUMS"
    frozen_before = sums.read_text().splitlines()
    found = sorted(p.name for p in (checkout / "migrations").glob("*.sql"))
    released = {line.split("  ", 1)[1] for line in frozen_before}
    unreleased = [name for name in found if name not in released]
    if not unreleased:
        # Every migration is released: the next one is started in the copy, as
        # docs/releasing.md says (a recipe, its schema version, tools/build.py --migration).
        number = len(found) + 1
        name = f"{number:04d}_next.sql"
        (checkout / "sql" / "upgrades" / name).write_text(
            f"-- Recipe of migrations/{name}: a rehearsal.\n"
            "-- @replace functions/_partition_origin.sql\n")
        schema_py = checkout / "python" / "pg_idempotency" / "schema.py"
        text = schema_py.read_text()
        last = text.rindex('",')
        schema_py.write_text(f'{text[:last + 2]} {number}: "0.{number}.0",{text[last + 2:]}')
        made = _build_py(checkout, "--migration", str(number), "next")
        assert made.returncode == 0, made.stdout + made.stderr
        unreleased = [name]
    nxt = int(unreleased[0][:4])
    # Only the next one, never one further on.
    skip = _build_py(checkout, "--freeze", str(nxt + 1))
    assert skip.returncode == 1 and "next migration to release" in skip.stderr, skip.stderr
    done = _build_py(checkout, "--freeze", str(nxt))
    assert done.returncode == 0, done.stderr
    lines = sums.read_text().splitlines()
    assert lines[:-1] == frozen_before
    digest = hashlib.sha256((checkout / "migrations" / unreleased[0]).read_bytes()).hexdigest()
    assert lines[-1] == f"{digest}  {unreleased[0]}"
    assert _build_py(checkout, "--check").returncode == 0
    # From now on it is frozen like the others.
    number, name = unreleased[0][:4], unreleased[0][5:-4]
    refused = _build_py(checkout, "--migration", str(int(number)), name)
    assert refused.returncode == 1 and "is released" in refused.stderr, refused.stderr
