"""The release's version agrees everywhere, and tools/release.py makes a release.

No test needs git tags or history: a CI clone may have neither. The release itself is
rehearsed on a copy of the files it reads and writes, in a repository of its own."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

import pg_idempotency

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import release  # noqa: E402

build = release.build  # tools/build.py
# A patch of the newest schema version that CHANGELOG.md does not have.
PATCH = build.VERSIONS[max(build.VERSIONS)].rsplit(".", 1)[0] + ".99"


def test_version_agrees_everywhere() -> None:
    """pyproject.toml, the installed package, CHANGELOG.md and docs/install.md agree: the
    package's version is the newest schema version or a patch of it; every released migration
    has a dated changelog section naming it, and every dated section is a released schema
    version or a patch of one."""
    assert release.problems(pg_idempotency.__version__) == []
    latest = max(build.VERSIONS)
    assert pg_idempotency.__version__ == release.pyproject_version()
    assert release.schema_of(pg_idempotency.__version__) == build.VERSIONS[latest]
    assert pg_idempotency.SCHEMA_VERSION == build.VERSIONS[latest]
    sections = release.changelog_sections()
    released = build.frozen()
    dated = [v for v, date, _ in sections if date != "unreleased"]
    schemas = [v for v in dated if v in build.VERSIONS.values()]
    assert schemas == [build.VERSIONS[int(name[:4])] for name in reversed(list(released))]
    assert all(release.schema_of(v) in schemas for v in dated)


@pytest.mark.parametrize("edit, needle", [
    (lambda t: t.replace("## 0.10.0 (2026-12-04)", "## 0.10.0 (unreleased)"),
     "0010_operations.sql is released"),
    (lambda t: t.replace("Migration `0007_routes.sql`", "Migration 0007"),
     "does not name its migration `0007_routes.sql`"),
    (lambda t: t.replace("## 0.3.0 (2026-12-02)", "## 0.3.1 (2026-12-02)"),
     "no section for 0.3.0"),
    (lambda t: t + "\n## 0.0.1 (2026-12-01)\n",
     "neither a migration's schema version nor a patch"),
    (lambda t: t.replace("# Changelog\n", f"# Changelog\n\n## {PATCH} (unreleased)\n"),
     "unreleased CHANGELOG.md section"),
])
def test_a_changelog_that_disagrees_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              edit, needle: str) -> None:
    changed = tmp_path / "CHANGELOG.md"
    text = release.CHANGELOG.read_text()
    assert edit(text) != text, "the edit no longer applies to CHANGELOG.md"
    changed.write_text(edit(text))
    monkeypatch.setattr(release, "CHANGELOG", changed)
    found = release.problems()
    assert any(needle in line for line in found), found


def test_a_version_that_disagrees_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(release, "pyproject_version", lambda: "9.9.9")
    found = release.problems("0.0.1")
    assert any("pyproject.toml says 9.9.9" in line for line in found), found
    assert any("__version__ is 0.0.1" in line for line in found), found


def test_release_rehearsal(tmp_path: Path) -> None:
    """tools/release.py on a copy, through every kind of release: the pending version if there
    is one (the newest migration's: freeze, date, commit, tag; a patch's: date, commit, tag),
    then a patch of the package that ships no migration (date, commit, tag; SHA256SUMS
    untouched), then the next schema version started as docs/releasing.md says (a migration
    of its own) and released. After each the copy agrees with itself (--check) and the
    migrations check passes; wrong versions, a dirty tree and a second release of one version
    are refused."""
    repo = tmp_path / "repo"
    for part in ("tools/build.py", "tools/release.py", "pyproject.toml", "CHANGELOG.md",
                 "python/pg_idempotency/schema.py", *release.DOC_MENTIONS):
        (repo / part).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / part, repo / part)
    for folder in ("sql", "migrations"):
        shutil.copytree(ROOT / folder, repo / folder)
    # release.py compares the installed package's __version__ with pyproject.toml: the copy
    # gets a stand-in package that says the copy's version.
    stub = tmp_path / "stub" / "pg_idempotency"
    stub.mkdir(parents=True)
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@localhost",
               GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@localhost",
               GIT_CONFIG_GLOBAL=os.devnull, GIT_CONFIG_NOSYSTEM="1",
               PYTHONPATH=str(stub.parent))

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        (stub / "__init__.py").write_text(f"__version__ = {version_in_copy()!r}\n")
        return subprocess.run(list(args), cwd=repo, env=env, capture_output=True, text=True)

    def version_in_copy() -> str:
        return tomllib.loads((repo / "pyproject.toml").read_text())["project"]["version"]

    def git(*args: str) -> str:
        proc = run("git", *args)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    def edit(part: str, old: str, new: str, count: int = 1) -> None:
        path = repo / part
        text = path.read_text()
        assert old in text, (part, old)
        path.write_text(text.replace(old, new, count))

    def released_ok(version: str) -> None:
        assert git("tag", "--list", f"v{version}") == f"v{version}\n"
        assert git("cat-file", "-t", f"v{version}") == "tag\n"  # annotated
        assert git("status", "--porcelain") == ""
        assert f"## {version} (unreleased)" not in (repo / "CHANGELOG.md").read_text()
        proc = run(*tool, "--check")
        assert proc.returncode == 0, proc.stderr
        proc = run(sys.executable, "tools/build.py", "--check")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        proc = run(*tool, version)
        assert proc.returncode != 0 and "already released" in proc.stderr, proc.stderr

    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "copy")
    tool = [sys.executable, "tools/release.py"]
    latest = max(build.VERSIONS)
    schema = build.VERSIONS[latest]

    # 1. The pending version, if any: the newest migration's schema version when that is not
    # released yet, or else a patch of the package with an unreleased section.
    pending = [v for v, date, _ in release.changelog_sections() if date == "unreleased"]
    if pending:
        (version,) = pending
        ships = release.latest_released(build.frozen()) != latest
        assert version == (schema if ships else version_in_copy())
        newest = sorted((repo / "migrations").glob("*.sql"))[-1].name
        sums = (repo / "migrations/SHA256SUMS").read_text()
        proc = run(*tool, "0.0.9")
        assert proc.returncode != 0 and version in proc.stderr, proc.stderr
        edit("pyproject.toml", "[project]", "[project]\n")
        proc = run(*tool, version)
        assert proc.returncode != 0 and "uncommitted changes" in proc.stderr, proc.stderr
        git("checkout", "-q", "--", "pyproject.toml")
        proc = run(*tool, version, "--dry-run")
        assert proc.returncode == 0 and "nothing changed" in proc.stdout, proc.stderr
        assert git("status", "--porcelain") == "" and git("tag") == ""
        proc = run(*tool, version)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        if ships:
            assert (repo / "migrations/SHA256SUMS").read_text().splitlines()[-1].endswith(
                f"  {newest}")
        else:
            assert (repo / "migrations/SHA256SUMS").read_text() == sums
        released_ok(version)

    # 2. A patch of the package: no migration, the schema stays.
    major, minor, _ = release.parse(schema)
    current = version_in_copy()
    patch = f"{major}.{minor}.{release.parse(current)[2] + 1}"
    sums = (repo / "migrations/SHA256SUMS").read_text()
    edit("pyproject.toml", f'version = "{current}"', f'version = "{patch}"')
    for part in release.DOC_MENTIONS:
        for pattern in release.DOC_MENTIONS[part]:
            if "{package}" in pattern:
                edit(part, pattern.format(package=current, schema=schema),
                     pattern.format(package=patch, schema=schema), count=-1)
    proc = run(*tool, "--check")
    assert proc.returncode != 0 and "no section for it" in proc.stderr, proc.stderr
    edit("CHANGELOG.md", "\n## ", f"\n## {patch} (unreleased)\n\n### Fixed\n- A fix.\n\n## ")
    assert run(*tool, "--check").returncode == 0
    git("commit", "-q", "-am", f"start {patch}")
    proc = run(*tool, f"{major}.{minor + 1}.0")
    assert proc.returncode != 0 and "already released" in proc.stderr, proc.stderr
    proc = run(*tool, patch)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no migration" in proc.stdout
    assert (repo / "migrations/SHA256SUMS").read_text() == sums
    released_ok(patch)

    # 3. The next schema version: a migration of its own, started by hand as
    # docs/releasing.md says, then released like the first.
    nxt, number = f"{major}.{minor + 1}.0", latest + 1
    (repo / "sql/upgrades" / f"{number:04d}_next.sql").write_text(
        f"-- Recipe of migrations/{number:04d}_next.sql: a rehearsal.\n"
        "-- @replace functions/_partition_origin.sql\n")
    edit("python/pg_idempotency/schema.py", f'{latest}: "{schema}",',
         f'{latest}: "{schema}", {number}: "{nxt}",')
    proc = run(sys.executable, "tools/build.py", "--migration", str(number), "next")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    edit("pyproject.toml", f'version = "{patch}"', f'version = "{nxt}"')
    for part in release.DOC_MENTIONS:
        for pattern in release.DOC_MENTIONS[part]:
            edit(part, pattern.format(package=patch, schema=schema),
                 pattern.format(package=nxt, schema=nxt), count=-1)
    proc = run(*tool, "--check")
    assert proc.returncode != 0 and f"migration {number:04d} is unreleased" in proc.stderr
    edit("CHANGELOG.md", "\n## ",
         f"\n## {nxt} (unreleased)\n\nShips migration `{number:04d}_next.sql`.\n\n## ")
    proc = run(*tool, "--check")
    assert proc.returncode == 0, proc.stderr
    git("add", ".")
    git("commit", "-q", "-m", f"start {nxt}")
    proc = run(*tool, patch)
    assert proc.returncode != 0 and "already released" in proc.stderr, proc.stderr
    proc = run(*tool, nxt)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (repo / "migrations/SHA256SUMS").read_text().splitlines()[-1].endswith(
        f"  {number:04d}_next.sql")
    released_ok(nxt)
