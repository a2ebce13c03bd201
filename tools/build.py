#!/usr/bin/env python3
"""Build the install artifacts from the SQL sources.

sql/manifest.txt lists the source files (one object per file) in install order.

    tools/build.py                     build/sources.sql and the CREATE EXTENSION package
                                       (build/extension/), made from migrations/
    tools/build.py --migration N NAME  (re)write migrations/NNNN_NAME.sql; refused for a
                                       released migration
    tools/build.py --check             fail when a released migration differs from its
                                       checksum in migrations/SHA256SUMS, or the newest
                                       unreleased migration from what its sources generate
    tools/build.py --freeze N          release migration N: add its checksum to
                                       migrations/SHA256SUMS

Migration 0001 is the whole manifest. Every later migration N has a recipe,
sql/upgrades/NNNN_NAME.sql: plain SQL (ALTER TABLE ...) plus lines

    -- @include PATH    the source sql/PATH as it is (a new object)
    -- @replace PATH    the source sql/PATH with CREATE FUNCTION turned into CREATE OR REPLACE
                        FUNCTION (a changed function; keeps its grants)

so that the migration carries only what changed since N - 1.

Migrations are append-only history; sql/ is the current definition. tests/release/test_install.py
checks that installing sql/ and applying migrations/ give the same schema.

A release freezes its migrations: making a release tag, run `tools/build.py --freeze N` for
each migration new in it and commit migrations/SHA256SUMS with the tag. From then on the file
must stay byte-identical, because Flyway, Liquibase and sqitch checksum the migrations they
applied and fail `validate` on every later upgrade when one changed. A fix to a released
migration (even to its comments or its header) is a new migration. So is a change to what this
script wraps around a migration: it applies from a version on (RESTORE_FROM, GUARD_FROM,
REGRANT_FROM), never to a released one. tests/release/test_build.py checks all of this.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SQL = ROOT / "sql"
MIGRATIONS = ROOT / "migrations"
BUILD = ROOT / "build"
UPGRADES = SQL / "upgrades"
EXTENSION = "pg_idempotency"


def _schema_versions() -> dict[int, str]:
    """SCHEMA_VERSIONS of python/pg_idempotency/schema.py, the one place they are written (the
    package reports them too), read from the source tree without importing the package."""
    namespace: dict[str, object] = {}
    source = ROOT / "python" / "pg_idempotency" / "schema.py"
    exec(compile(source.read_text(), str(source), "exec"), namespace)  # noqa: S102
    versions = namespace["SCHEMA_VERSIONS"]
    assert isinstance(versions, dict)
    return versions


# The extension (schema) version each migration brings the database to: CREATE EXTENSION
# installs the last one; ALTER EXTENSION pg_idempotency UPDATE runs one upgrade script per later
# migration. The package's own version may be a patch beyond it (docs/releasing.md).
VERSIONS = _schema_versions()
VERSION = VERSIONS[max(VERSIONS)]
# Members of an extension are left out of pg_dump unless marked: the default partitions hold
# keys (until maintenance moves them out), the sequence's position is what keeps fencing
# tokens increasing after a restore, and settings hold what the operator chose (its row is made
# by _premake(), never by the script, so restoring it cannot collide). Ranged partitions are
# not members at all (see sql/functions/_create_partition.sql), so they are dumped like any
# table.
# Per migration: the tables it adds whose rows pg_dump must keep.
CONFIG_DUMP = {
    1: ["idempotency.keys_default", "idempotency.inbox_default", "idempotency.lease_token_seq",
        "idempotency.settings"],
    2: ["idempotency.tombstones_default"],
    5: ["idempotency.key_directory_default"],
    9: ["idempotency.key_directory"],
    10: ["idempotency.grants"],
}
# Per migration: what it drops of the tables above (a full script must not mark them).
CONFIG_DROPPED = {
    9: ["idempotency.lease_token_seq", "idempotency.key_directory_default"],
}
EXTENSION_PROLOGUE = (
    "-- Tells sql/bootstrap.sql that it runs inside CREATE EXTENSION (see there).\n"
    "SELECT pg_catalog.set_config('idempotency.creating_extension', 'on', true);\n"
)
# Each migration pins search_path for its own statements first: CHECK constraints, column
# defaults and function defaults bind their operators and functions when they are created, so
# an installer whose search_path puts another schema first would otherwise bind them to that
# schema's look-alikes. (Inside CREATE EXTENSION the setting ends with the script anyway.)
# 0001-0009 were released with the pin alone, which lasts to the end of the transaction; they
# stay so (see FROZEN), and docs/install.md shows the two statements a tool that records its
# own bookkeeping in the same transaction puts around them (SEARCH_PATH_SAVE and
# SEARCH_PATH_RESTORE below, as plain statements).
SEARCH_PATH_PIN = (
    "-- Objects created below bind to pg_catalog, whatever the installer's search_path.\n"
    "SELECT pg_catalog.set_config('search_path', 'pg_catalog, pg_temp', true);\n\n"
)
# From 0010 on the pin must not outlive the file: a migration tool (Django's RunSQL, Alembic's
# op.execute) goes on in the same transaction and records the migration in its own unqualified
# table (django_migrations, alembic_version). So the file saves the installer's value first and
# puts it back last, both local to the transaction.
RESTORE_FROM = 10
SEARCH_PATH_SAVE_PIN = (
    "-- Objects created below bind to pg_catalog, whatever the installer's search_path; the\n"
    "-- installer's own value is saved here and put back at the end of the file.\n"
    "SELECT pg_catalog.set_config(\n"
    "    'idempotency.installer_search_path', pg_catalog.current_setting('search_path'), true\n"
    ");\n"
    "SELECT pg_catalog.set_config('search_path', 'pg_catalog, pg_temp', true);\n\n"
)
SEARCH_PATH_RESTORE = (
    "\n-- The installer's search_path again, for whatever its tool runs next in this "
    "transaction.\n"
    "SELECT pg_catalog.set_config(\n"
    "    'search_path', pg_catalog.current_setting('idempotency.installer_search_path'), true\n"
    ");\n"
)
# From 0004 on, a migration refuses to run a second time: re-running one after a later one
# would put its older functions back.
GUARD_FROM = 4
MIGRATION_GUARD = (
    "-- Refuse to run again: re-running a migration would put older functions back.\n"
    "DO $guard$\n"
    "BEGIN\n"
    "    IF EXISTS (SELECT FROM idempotency.migrations WHERE version >= {version}) THEN\n"
    "        RAISE EXCEPTION USING\n"
    "            ERRCODE = 'duplicate_object',\n"
    "            MESSAGE = 'pg_idempotency migration {label} was already applied '\n"
    "            || '(idempotency.migrations has it, or a later one)',\n"
    "            HINT = 'Nothing was changed.';\n"
    "    END IF;\n"
    "END\n"
    "$guard$;\n\n"
)
# From 0010 on, a migration ends by granting every role recorded by grant_usage() the
# functions of its kind again (sql/functions/_reapply_grants.sql): a function the migration
# adds, or drops and makes again, would otherwise be executable by its owner alone, and a role
# granted at an older version would get "permission denied" after the upgrade. (If this
# migration is renumbered, REGRANT_FROM follows it: the function must exist by then.)
REGRANT_FROM = 10
REGRANT = (
    "\n-- Every role granted with grant_usage() gets the functions of its kind as they are now.\n"
    "SELECT idempotency._reapply_grants() AS grants_reapplied;\n"
)
# From 0011 on, a migration then makes the functions it replaced plan each statement afresh
# again on a Citus cluster (sql/functions/_citus_custom_plans.sql; nothing on one server): their
# sources ask for generic plans, with which Citus's local plan cache grows with every call.
CUSTOM_PLANS_FROM = 11
CUSTOM_PLANS = (
    "\n-- On a Citus cluster: custom plans for the per-key functions again (_citus_custom_plans).\n"
    "SELECT count(*) AS custom_plans FROM idempotency._citus_custom_plans();\n"
)
MIGRATION_RE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")
# Released migrations, in sha256sum's format (`cd migrations && sha256sum -c SHA256SUMS`).
FROZEN = MIGRATIONS / "SHA256SUMS"
FROZEN_RE = re.compile(r"^([0-9a-f]{64})  (\d{4}_[a-z0-9_]+\.sql)$")


def manifest() -> list[Path]:
    files = []
    for line in (SQL / "manifest.txt").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            files.append(SQL / line)
    listed = {f.resolve() for f in files}
    unlisted = sorted(
        str(p.relative_to(ROOT)) for p in SQL.rglob("*.sql")
        if p.resolve() not in listed and UPGRADES not in p.parents
    )
    if unlisted:
        sys.exit(f"build.py: sources missing from sql/manifest.txt: {', '.join(unlisted)}")
    return files


def sources_sql() -> str:
    parts = []
    for path in manifest():
        parts.append(f"-- {path.relative_to(ROOT)}\n{path.read_text().rstrip()}\n")
    return "\n".join(parts)


DIRECTIVE_RE = re.compile(r"^-- @(include|replace) (\S+)$")
CREATE_FUNCTION_RE = re.compile(r"^CREATE FUNCTION ", re.MULTILINE)


def recipe_sql(version: int, name: str) -> str:
    """Expand sql/upgrades/NNNN_NAME.sql (see the module docstring)."""
    recipe = UPGRADES / f"{version:04d}_{name}.sql"
    if not recipe.exists():
        sys.exit(f"build.py: migration {version} needs its recipe {recipe.relative_to(ROOT)}")
    known = {p.resolve() for p in manifest()}
    out = []
    for line in recipe.read_text().splitlines():
        m = DIRECTIVE_RE.match(line)
        if not m:
            out.append(line)
            continue
        path = SQL / m.group(2)
        if path.resolve() not in known:
            sys.exit(f"build.py: {recipe.name}: {m.group(2)} is not in sql/manifest.txt")
        text = path.read_text().rstrip()
        if m.group(1) == "replace":
            text, n = CREATE_FUNCTION_RE.subn("CREATE OR REPLACE FUNCTION ", text)
            if n != 1:
                sys.exit(f"build.py: @replace {m.group(2)}: expected one CREATE FUNCTION")
        out.append(f"-- {path.relative_to(ROOT)}\n{text}\n")
    return "\n".join(out).rstrip() + "\n"


def migration_prologue(version: int, name: str) -> str:
    """What migration ``version`` says before its body (released ones: as they were released)."""
    origin = ("from sql/ (sql/manifest.txt order)" if version == 1
              else f"from sql/upgrades/{version:04d}_{name}.sql")
    return (
        f"-- pg_idempotency migration {version:04d}_{name}.\n"
        f"-- Generated by tools/build.py {origin}; do not edit by hand.\n"
        "-- Plain SQL for any migration tool: apply the files in lexical order, each in one\n"
        "-- transaction (psql -1 -f FILE, Flyway, golang-migrate, Alembic op.execute).\n\n"
        + (SEARCH_PATH_SAVE_PIN if version >= RESTORE_FROM else SEARCH_PATH_PIN)
        + (MIGRATION_GUARD.format(version=version, label=f"{version:04d}_{name}")
           if version >= GUARD_FROM else "")
    )


def migration_epilogue(version: int, name: str) -> str:
    """What migration ``version`` says after its body."""
    return (
        (REGRANT if version >= REGRANT_FROM else "")
        + (CUSTOM_PLANS if version >= CUSTOM_PLANS_FROM else "")
        + "\n-- Record this migration, whichever tool applied it.\n"
        "INSERT INTO idempotency.migrations (version, name)\n"
        f"VALUES ({version}, '{version:04d}_{name}')\n"
        "ON CONFLICT (version) DO NOTHING;\n"
        + (SEARCH_PATH_RESTORE if version >= RESTORE_FROM else "")
    )


def migration_text(version: int, name: str) -> str:
    body = sources_sql() if version == 1 else recipe_sql(version, name)
    return migration_prologue(version, name) + body + migration_epilogue(version, name)


def frozen() -> dict[str, str]:
    """migrations/SHA256SUMS: file name -> SHA-256 of every released migration, as released."""
    sums: dict[str, str] = {}
    for number, line in enumerate(FROZEN.read_text().splitlines(), start=1):
        m = FROZEN_RE.match(line)
        if not m:
            sys.exit(f"build.py: {FROZEN.relative_to(ROOT)} line {number} is not "
                     f"'<sha256>  NNNN_name.sql': {line!r}")
        sums[m.group(2)] = m.group(1)
    return sums


def frozen_problems() -> list[str]:
    """Every way the migrations differ from the released ones in migrations/SHA256SUMS."""
    sums = frozen()
    problems = []
    numbers = [int(MIGRATION_RE.match(f).group(1)) for f in sums]
    if numbers != list(range(1, len(numbers) + 1)):
        problems.append(f"{FROZEN.relative_to(ROOT)} must list 0001, 0002, ... in order "
                        f"without gaps: {numbers}")
    for filename, released in sums.items():
        path = MIGRATIONS / filename
        if not path.exists():
            problems.append(f"released migration migrations/{filename} is missing; released "
                            "migrations are never renamed or deleted")
            continue
        actual = hashlib.sha256(path.read_bytes()).hexdigest()
        if actual != released:
            problems.append(
                f"released migration migrations/{filename} changed (sha256 {actual}, released "
                f"as {released}); add a new migration instead: a tool that checksums applied "
                "migrations (Flyway, Liquibase, sqitch) fails on a released file that changed. "
                f"Put it back with: git checkout <release tag> -- migrations/{filename}")
    return problems


def freeze(version: int) -> str:
    """Record migration ``version`` (the next unreleased one) in migrations/SHA256SUMS."""
    sums = frozen()
    if version != len(sums) + 1:
        sys.exit(f"build.py: --freeze {version}: the next migration to release is "
                 f"{len(sums) + 1:04d} ({FROZEN.relative_to(ROOT)} lists {len(sums)})")
    path = next((p for p in migrations() if p.name.startswith(f"{version:04d}_")), None)
    if path is None:
        sys.exit(f"build.py: --freeze {version}: there is no migration {version:04d}")
    number, name = MIGRATION_RE.match(path.name).groups()
    if path.read_text() != migration_text(version, name):
        sys.exit(f"build.py: --freeze {version}: {path.relative_to(ROOT)} is stale: run "
                 f"tools/build.py --migration {version} {name} first")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    with FROZEN.open("a") as out:
        out.write(f"{digest}  {path.name}\n")
    return f"froze {path.relative_to(ROOT)} (sha256 {digest}) in {FROZEN.relative_to(ROOT)}"


def migrations() -> list[Path]:
    found = sorted(p for p in MIGRATIONS.glob("*.sql") if MIGRATION_RE.match(p.name))
    numbers = [int(MIGRATION_RE.match(p.name).group(1)) for p in found]
    if numbers != list(range(1, len(numbers) + 1)):
        sys.exit(f"build.py: migrations must be numbered 0001, 0002, ... without gaps: {numbers}")
    return found


def extension_script(paths: list[Path], numbers: list[int], command: str) -> str:
    """Migrations ``paths`` (numbered ``numbers``) as one extension script."""
    script = [f'\\echo Use "{command}" to load this file. \\quit\n', EXTENSION_PROLOGUE]
    for path in paths:
        script.append(f"-- {path.relative_to(ROOT)}\n{path.read_text()}")
    epilogue = ["", "-- Dumped with the data, not re-created empty, by pg_dump and pg_restore."]
    dropped = {table for n in numbers for table in CONFIG_DROPPED.get(n, [])}
    epilogue += [f"SELECT pg_catalog.pg_extension_config_dump('{table}', '');"
                 for n in numbers for table in CONFIG_DUMP.get(n, []) if table not in dropped]
    epilogue.append("SELECT pg_catalog.set_config('idempotency.creating_extension', 'off', true);")
    script.append("\n".join(epilogue) + "\n")
    return "\n".join(script)


def build() -> None:
    ext = BUILD / "extension"
    ext.mkdir(parents=True, exist_ok=True)
    for old in ext.glob(f"{EXTENSION}--*.sql"):  # a stale upgrade script must not linger
        old.unlink()
    (BUILD / "sources.sql").write_text(sources_sql())
    paths = migrations()
    numbers = [int(MIGRATION_RE.match(p.name).group(1)) for p in paths]
    if sorted(VERSIONS) != numbers:
        sys.exit(f"build.py: VERSIONS {VERSIONS} must name one version per migration {numbers}")
    # A full script for the first and the last version (CREATE EXTENSION ... VERSION '0.1.0'
    # is how the tests reach an old install), and one upgrade script per later migration.
    for last in sorted({numbers[0], numbers[-1]}):
        upto = [n for n in numbers if n <= last]
        (ext / f"{EXTENSION}--{VERSIONS[last]}.sql").write_text(extension_script(
            paths[:len(upto)], upto, f"CREATE EXTENSION {EXTENSION}"))
    for i, n in enumerate(numbers[1:], start=1):
        (ext / f"{EXTENSION}--{VERSIONS[numbers[i - 1]]}--{VERSIONS[n]}.sql").write_text(
            extension_script([paths[i]], [n], f"ALTER EXTENSION {EXTENSION} UPDATE"))
    (BUILD / "extension" / f"{EXTENSION}.control").write_text(
        "# pg_idempotency: idempotency keys inside PostgreSQL (made by tools/build.py)\n"
        "comment = 'Idempotency keys: claim, lease, fence, complete, replay'\n"
        f"default_version = '{VERSION}'\n"
        "relocatable = false\n"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--migration", nargs=2, metavar=("N", "NAME"))
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--freeze", type=int, metavar="N")
    args = parser.parse_args()
    if args.freeze is not None:
        print(freeze(args.freeze))
        return 0
    if args.migration:
        version, name = int(args.migration[0]), args.migration[1]
        target = MIGRATIONS / f"{version:04d}_{name}.sql"
        if target.name in frozen():
            sys.exit(f"build.py: {target.relative_to(ROOT)} is released ({FROZEN.name} has it) "
                     "and must stay as it is; add a new migration instead")
        target.write_text(migration_text(version, name))
        print(f"wrote {target.relative_to(ROOT)}")
        return 0
    if args.check:
        problems = frozen_problems()
        released = frozen()
        # Only the newest migration can still match its sources, and only while it is not
        # released: an older one is history, and the sources its recipe @replace'd have moved
        # on since (a later migration replaces them again). tests/release/test_install.py checks the
        # whole chain against sql/.
        for path in migrations()[-1:]:
            number, name = MIGRATION_RE.match(path.name).groups()
            version = int(number)
            if path.name not in released and path.read_text() != migration_text(version, name):
                problems.append(f"{path.relative_to(ROOT)} is stale: run tools/build.py "
                                f"--migration {version} {name}")
        if problems:
            print("\n".join(f"build.py --check: {p}" for p in problems), file=sys.stderr)
            return 1
        print("migrations are up to date; released ones as released")
        return 0
    build()
    return 0


if __name__ == "__main__":
    sys.exit(main())
