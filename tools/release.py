#!/usr/bin/env python3
"""Release a version: check that everything agrees on it, freeze its migration if it ships
one, date its changelog section, commit and tag (docs/releasing.md).

    tools/release.py --check            what tests/release/test_release.py checks: the
                                        package's version (pyproject.toml, the installed
                                        __version__) is the
                                        newest schema version (python/pg_idempotency/schema.py,
                                        one per migration) or a patch of it; CHANGELOG.md and
                                        the docs agree; every released migration
                                        (migrations/SHA256SUMS) has a dated changelog section
                                        and every dated section a released schema
    tools/release.py X.Y.Z [--dry-run]  release X.Y.Z, the unreleased version: the checks
                                        above, a clean work tree, lint's build check; then
                                        tools/build.py --freeze N when X.Y.Z is the newest
                                        migration's schema version, the changelog section's
                                        date, one commit "Release X.Y.Z" and an annotated tag
                                        vX.Y.Z (a convenience: nothing reads tags). Pushes
                                        nothing. --dry-run stops before changing a file.

Two kinds of version. A schema version is one migration: X.Y.0 ships
migrations/000N_name.sql, and the extension has the same version. A package version X.Y.Z is
the schema version X.Y.0 it needs, or a patch of it (Z > 0) that ships no migration: a Python
fix released as 0.11.1. A release is readable from the tree alone: the dated CHANGELOG.md
section, and for a schema version its migration's line in migrations/SHA256SUMS.
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
# Where the docs name the current versions: each pattern must match with {package} (the
# package's version: the wheel, the tarball) and {schema} (the extension's).
DOC_MENTIONS = {
    "README.md": ["dist/pg_idempotency-{package}-py3-none-any.whl"],
    "docs/install.md": ["`pg_idempotency--{schema}.sql` (all migrations",
                        "as a fresh {schema};",
                        "dist/pg_idempotency-{package}-py3-none-any.whl",
                        "dist/pg_idempotency-{package}-extension.tar.gz"],
}


def parse(version: str) -> tuple[int, int, int]:
    major, minor, patch = version.split(".")
    return int(major), int(minor), int(patch)


def schema_of(version: str) -> str:
    """The schema version X.Y.0 a package version X.Y.Z needs."""
    major, minor, _ = parse(version)
    return f"{major}.{minor}.0"


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
    """Every way the versions' sources disagree; empty when they all agree."""
    found: list[str] = []
    latest = max(build.VERSIONS)
    schema = build.VERSIONS[latest]
    package = pyproject_version()
    if not re.fullmatch(r"\d+\.\d+\.\d+", package) or schema_of(package) != schema:
        found.append(f"pyproject.toml says {package}: the package's version must be the newest "
                     f"schema version, {schema} (migration {latest:04d}), or a patch of it")
    if installed_version is not None and installed_version != package:
        found.append(f"the installed package's __version__ is {installed_version}, not "
                     f"{package} (reinstall: pip install .)")
    names = {int(p.name[:4]): p.name for p in build.migrations()}
    if sorted(names) != sorted(build.VERSIONS):
        found.append(f"migrations {sorted(names)} and SCHEMA_VERSIONS {sorted(build.VERSIONS)} "
                     "differ")
    released = build.frozen()
    sections = changelog_sections()
    if not sections:
        return [*found, "CHANGELOG.md has no '## X.Y.Z (date or unreleased)' section"]
    by_version = {v: (date, body) for v, date, body in sections}
    if len(by_version) != len(sections):
        found.append("CHANGELOG.md has a version twice")
    order = [parse(v) for v, _, _ in sections]
    if order != sorted(order, reverse=True):
        found.append("CHANGELOG.md's sections are not newest first")
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
        if v not in known and schema_of(v) not in known:
            found.append(f"CHANGELOG.md has a section for {v}, which is neither a migration's "
                         "schema version nor a patch of one")
    unreleased = [v for v, date, _ in sections if date == "unreleased"]
    if latest_released(released) != latest:
        if package != schema or unreleased != [schema]:
            found.append(f"migration {latest:04d} is unreleased: pyproject.toml and exactly one "
                         f"unreleased CHANGELOG.md section must say {schema} (they say "
                         f"{package} and {unreleased or 'none'})")
    elif unreleased and unreleased != [package]:
        found.append(f"exactly one unreleased CHANGELOG.md section may be open, for the "
                     f"package's version {package}: it has {unreleased}")
    elif not unreleased and sections[0][0] != package:
        found.append(f"pyproject.toml says {package}, but CHANGELOG.md has no section for it: "
                     f"its newest is {sections[0][0]}")
    if unreleased and sections[0][1] != "unreleased":
        found.append(f"CHANGELOG.md's top section must be the unreleased {unreleased[0]}")
    for doc, patterns in DOC_MENTIONS.items():
        text = re.sub(r"\s+", " ", (ROOT / doc).read_text())
        for pattern in patterns:
            wanted = pattern.format(package=package, schema=schema)
            if wanted not in text:
                found.append(f"{doc} does not say {wanted!r}")
    return found


def latest_released(released: dict[str, str]) -> int:
    return max((int(name[:4]) for name in released), default=0)


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout


def release(version: str, dry_run: bool) -> int:
    latest = max(build.VERSIONS)
    schema = build.VERSIONS[latest]
    ships_migration = latest_released(build.frozen()) != latest
    dated = {v for v, date, _ in changelog_sections() if date != "unreleased"}
    if version in dated:
        sys.exit(f"release.py: {version} is already released (CHANGELOG.md dates it)")
    if ships_migration and version != schema:
        sys.exit(f"release.py: the unreleased version is {schema} (migration {latest:04d}), "
                 f"not {version}")
    if not ships_migration and version != pyproject_version():
        sys.exit(f"release.py: migration {latest:04d} is already released; a patch release "
                 f"is the package's version in pyproject.toml ({pyproject_version()}), not "
                 f"{version}")
    import pg_idempotency
    found = problems(pg_idempotency.__version__)
    found += build.frozen_problems()
    if f"## {version} (unreleased)" not in CHANGELOG.read_text():
        found.append(f"CHANGELOG.md has no '## {version} (unreleased)' section")
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
    freeze = f"freeze migration {latest:04d}, " if ships_migration else "no migration, "
    print(f"release {version}: {freeze}date the changelog {today}, commit, tag v{version}")
    if dry_run:
        print("dry run: nothing changed")
        return 0
    files = ["CHANGELOG.md"]
    if ships_migration:
        print(build.freeze(latest))
        files.append("migrations/SHA256SUMS")
    text = CHANGELOG.read_text()
    CHANGELOG.write_text(text.replace(f"## {version} (unreleased)", f"## {version} ({today})",
                                      1))
    what = (f"migration {latest:04d} frozen, changelog dated" if ships_migration
            else "changelog dated, no migration")
    git("commit", "-q", "-m", f"Release {version}: {what}", "--", *files)
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
