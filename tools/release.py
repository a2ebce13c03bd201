#!/usr/bin/env python3
"""Release a version: check that everything agrees on it, freeze its migration, date its
changelog section, commit and tag (docs/releasing.md).

    tools/release.py --check            what tests/test_release.py checks: pyproject.toml, the
                                        newest migration (tools/build.py's VERSIONS), the
                                        installed package's __version__, CHANGELOG.md and the
                                        docs name the same version; every released migration
                                        (migrations/SHA256SUMS) has a dated changelog section
                                        and every dated section a released migration
    tools/release.py X.Y.Z [--dry-run]  release X.Y.Z, the unreleased version: the checks
                                        above, a clean work tree, lint's build check; then
                                        tools/build.py --freeze N, the changelog section's date,
                                        one commit "Release X.Y.Z" and the annotated tag vX.Y.Z.
                                        Pushes nothing. --dry-run stops before changing a file.

One version is one migration: 0.N.0 ships migrations/000N_name.sql. After a release the next
version starts by hand (docs/releasing.md): a new VERSIONS entry with its first migration, the
version in pyproject.toml, and a "## X.Y.Z (unreleased)" section on top of CHANGELOG.md.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import tomllib

ROOT = Path(__file__).resolve().parent.parent


def _load_build() -> ModuleType:
    """tools/build.py (VERSIONS, frozen(), freeze()), loaded from its path: the name `build`
    is also pypa's build frontend, which make dist installs."""
    spec = importlib.util.spec_from_file_location("pg_idempotency_tools_build",
                                                  ROOT / "tools" / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build = _load_build()

CHANGELOG = ROOT / "CHANGELOG.md"
SECTION_RE = re.compile(r"^## (\d+\.\d+\.\d+) \((unreleased|\d{4}-\d{2}-\d{2})\)$", re.M)
# Where the docs name the current version: each pattern must match with {version}.
DOC_MENTIONS = {
    "README.md": ["dist/pg_idempotency-{version}-py3-none-any.whl"],
    "docs/install.md": ["`pg_idempotency--{version}.sql` (all migrations",
                        "as a fresh {version};",
                        "dist/pg_idempotency-{version}-py3-none-any.whl",
                        "dist/pg_idempotency-{version}-extension.tar.gz"],
}


def pyproject_version() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def changelog_sections() -> list[tuple[str, str, str]]:
    """(version, date or 'unreleased', body) of every '## X.Y.Z (...)' section, in order."""
    text = CHANGELOG.read_text()
    heads = list(SECTION_RE.finditer(text))
    return [(m.group(1), m.group(2), text[m.end():heads[i + 1].start() if i + 1 < len(heads)
                                          else len(text)])
            for i, m in enumerate(heads)]


def problems(installed_version: str | None = None) -> list[str]:
    """Every way the version's sources disagree; empty when they all agree."""
    found: list[str] = []
    latest = max(build.VERSIONS)
    version = build.VERSIONS[latest]
    if pyproject_version() != version:
        found.append(f"pyproject.toml says {pyproject_version()}, tools/build.py's VERSIONS "
                     f"gives migration {latest:04d} version {version}")
    if installed_version is not None and installed_version != version:
        found.append(f"the installed package's __version__ is {installed_version}, not "
                     f"{version} (reinstall: pip install .)")
    names = {int(p.name[:4]): p.name for p in build.migrations()}
    if sorted(names) != sorted(build.VERSIONS):
        found.append(f"migrations {sorted(names)} and VERSIONS {sorted(build.VERSIONS)} differ")
    released = build.frozen()
    sections = changelog_sections()
    if not sections:
        return [*found, "CHANGELOG.md has no '## X.Y.Z (date or unreleased)' section"]
    by_version = {v: (date, body) for v, date, body in sections}
    if len(by_version) != len(sections):
        found.append("CHANGELOG.md has a version twice")
    order = [tuple(map(int, v.split("."))) for v, _, _ in sections]
    if order != sorted(order, reverse=True):
        found.append("CHANGELOG.md's sections are not newest first")
    unreleased = [v for v, date, _ in sections if date == "unreleased"]
    for number, filename in sorted(names.items()):
        v = build.VERSIONS.get(number)
        if v is None:
            continue
        if v not in by_version:
            found.append(f"CHANGELOG.md has no section for {v} (migration {filename})")
            continue
        date, body = by_version[v]
        if f"`{filename}`" not in body:
            found.append(f"CHANGELOG.md's {v} section does not name its migration `{filename}`")
        if filename in released and date == "unreleased":
            found.append(f"{filename} is released (migrations/SHA256SUMS) but CHANGELOG.md "
                         f"says {v} is unreleased")
        if filename not in released and date != "unreleased":
            found.append(f"CHANGELOG.md dates {v} ({date}) but {filename} is not released "
                         "(not in migrations/SHA256SUMS)")
    known = set(build.VERSIONS.values())
    for v in by_version:
        if v not in known:
            found.append(f"CHANGELOG.md has a section for {v}, which no migration ships")
    if latest_released(released) == latest:
        if unreleased:
            found.append(f"every migration is released, yet CHANGELOG.md has {unreleased} "
                         "unreleased")
    elif unreleased != [version]:
        found.append(f"CHANGELOG.md must have exactly one unreleased section, {version} on top: "
                     f"it has {unreleased or 'none'}")
    elif sections[0][0] != version:
        found.append(f"CHANGELOG.md's top section must be the unreleased {version}")
    for doc, patterns in DOC_MENTIONS.items():
        text = re.sub(r"\s+", " ", (ROOT / doc).read_text())
        for pattern in patterns:
            if pattern.format(version=version) not in text:
                found.append(f"{doc} does not say {pattern.format(version=version)!r}")
    return found


def latest_released(released: dict[str, str]) -> int:
    return max((int(name[:4]) for name in released), default=0)


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout


def release(version: str, dry_run: bool) -> int:
    latest = max(build.VERSIONS)
    if build.VERSIONS[latest] != version:
        sys.exit(f"release.py: the unreleased version is {build.VERSIONS[latest]} "
                 f"(migration {latest:04d}), not {version}")
    if latest_released(build.frozen()) == latest:
        sys.exit(f"release.py: migration {latest:04d} is already released")
    import pg_idempotency
    found = problems(pg_idempotency.__version__)
    found += build.frozen_problems()
    if git("status", "--porcelain", "--untracked-files=no").strip():
        found.append("the work tree has uncommitted changes: commit or drop them first")
    if git("tag", "--list", f"v{version}").strip():
        found.append(f"tag v{version} exists already")
    if found:
        sys.exit("release.py: not released:\n  " + "\n  ".join(found))
    # The newest migration must be what its recipe generates now (tools/build.py --check).
    subprocess.run([sys.executable, str(ROOT / "tools" / "build.py"), "--check"], cwd=ROOT,
                   check=True, stdout=subprocess.DEVNULL)
    today = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    print(f"release {version}: freeze migration {latest:04d}, date the changelog {today}, "
          f"commit, tag v{version}")
    if dry_run:
        print("dry run: nothing changed")
        return 0
    print(build.freeze(latest))
    text = CHANGELOG.read_text()
    CHANGELOG.write_text(text.replace(f"## {version} (unreleased)", f"## {version} ({today})",
                                      1))
    git("commit", "-q", "-m", f"Release {version}: migration {latest:04d} frozen in "
        "migrations/SHA256SUMS, CHANGELOG.md dated", "--", "CHANGELOG.md",
        "migrations/SHA256SUMS")
    git("tag", "-a", f"v{version}", "-m", f"pg_idempotency {version}")
    print(f"tagged v{version}; push with: git push origin HEAD v{version}; "
          "then start the next version (docs/releasing.md)")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("version", nargs="?")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    if args.check:
        found = problems()
        for line in found:
            print(line, file=sys.stderr)
        return 1 if found else 0
    if not args.version:
        parser.error("give the version to release, or --check")
    return release(args.version, args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
