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

import pg_idempotency

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import release  # noqa: E402

build = release.build  # tools/build.py


def test_version_agrees_everywhere() -> None:
    """pyproject.toml, the newest migration's version, the installed package, CHANGELOG.md
    and docs/install.md name one version; every released migration has a dated changelog
    section naming it, and every dated section a released migration."""
    assert release.problems(pg_idempotency.__version__) == []
    latest = max(build.VERSIONS)
    assert pg_idempotency.__version__ == build.VERSIONS[latest] == release.pyproject_version()
    sections = release.changelog_sections()
    released = build.frozen()
    dated = [v for v, date, _ in sections if date != "unreleased"]
    assert dated == [build.VERSIONS[int(name[:4])] for name in reversed(list(released))]


@pytest.mark.parametrize("edit, needle", [
    (lambda t: t.replace("## 0.10.0 (2026-12-04)", "## 0.10.0 (unreleased)"),
     "0010_operations.sql is released"),
    (lambda t: t.replace("## 0.11.0 (unreleased)", "## 0.11.0 (2026-12-31)"),
     "is not released"),
    (lambda t: t.replace("Migration `0007_routes.sql`", "Migration 0007"),
     "does not name its migration `0007_routes.sql`"),
    (lambda t: t.replace("## 0.3.0 (2026-12-02)", "## 0.3.1 (2026-12-02)"),
     "no section for 0.3.0"),
])
def test_a_changelog_that_disagrees_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              edit, needle: str) -> None:
    changed = tmp_path / "CHANGELOG.md"
    changed.write_text(edit(release.CHANGELOG.read_text()))
    monkeypatch.setattr(release, "CHANGELOG", changed)
    found = release.problems()
    assert any(needle in line for line in found), found


def test_a_version_that_disagrees_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(release, "pyproject_version", lambda: "9.9.9")
    found = release.problems("0.0.1")
    assert any("pyproject.toml says 9.9.9" in line for line in found), found
    assert any("__version__ is 0.0.1" in line for line in found), found


def test_release_freezes_dates_commits_and_tags(tmp_path: Path) -> None:
    """tools/release.py on a copy: refuses a wrong version and a dirty tree, then freezes the
    newest migration, dates its section, commits and tags; afterwards the copy still agrees
    with itself (--check) and the migrations check (build.py --check) passes."""
    repo = tmp_path / "repo"
    for part in ("tools/build.py", "tools/release.py", "pyproject.toml", "CHANGELOG.md",
                 *release.DOC_MENTIONS):
        (repo / part).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / part, repo / part)
    for folder in ("sql", "migrations"):
        shutil.copytree(ROOT / folder, repo / folder)
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@localhost",
               GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@localhost",
               GIT_CONFIG_GLOBAL=os.devnull, GIT_CONFIG_NOSYSTEM="1")

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(args), cwd=repo, env=env, capture_output=True, text=True)

    def git(*args: str) -> str:
        proc = run("git", *args)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "copy")
    version = build.VERSIONS[max(build.VERSIONS)]
    newest = sorted((repo / "migrations").glob("*.sql"))[-1].name
    tool = [sys.executable, "tools/release.py"]

    proc = run(*tool, "0.0.9")
    assert proc.returncode != 0 and f"the unreleased version is {version}" in proc.stderr
    (repo / "pyproject.toml").write_text((repo / "pyproject.toml").read_text() + "\n")
    proc = run(*tool, version)
    assert proc.returncode != 0 and "uncommitted changes" in proc.stderr, proc.stderr
    git("checkout", "-q", "--", "pyproject.toml")
    proc = run(*tool, version, "--dry-run")
    assert proc.returncode == 0 and "nothing changed" in proc.stdout, proc.stderr
    assert git("status", "--porcelain") == "" and git("tag") == ""

    proc = run(*tool, version)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert git("tag") == f"v{version}\n"
    assert git("cat-file", "-t", f"v{version}") == "tag\n"  # annotated
    assert git("status", "--porcelain") == ""
    assert (repo / "migrations/SHA256SUMS").read_text().splitlines()[-1].endswith(f"  {newest}")
    assert f"## {version} (unreleased)" not in (repo / "CHANGELOG.md").read_text()
    assert run(sys.executable, "tools/release.py", "--check").returncode == 0
    proc = run(sys.executable, "tools/build.py", "--check")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = run(*tool, version)
    assert proc.returncode != 0 and "already released" in proc.stderr
