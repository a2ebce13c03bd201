"""Every migration route of docs/install.md, for real and as the docs show it, all files from an
empty database: the psql loop; psql with all files and the tool's own statements in one
transaction; Django's RunSQL inside Django's migration transaction and the files through
Alembic's connection inside Alembic's, each run as its own process the way a user runs it
(``python -m django migrate``, ``alembic upgrade head``), with the migration and revision code
taken from docs/install.md itself. Migrations 0001-0009 pin search_path until the end of the
transaction (they were released so, and released files never change); the documented pair of
statements around each file must keep that pin from leaking into what the tool runs after it:
Django records the migration in its unqualified ``django_migrations``, Alembic in
``alembic_version``. (`pg-idempotency migrate` and CREATE EXTENSION: tests/server/test_migrate.py,
tests/release/test_install.py.)
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import psycopg
from psycopg.conninfo import conninfo_to_dict

from pg_idempotency.migrate import RESTORE_SEARCH_PATH, SAVE_SEARCH_PATH
from pgharness import WAIT_BOUND, PgServer

ROOT = Path(__file__).resolve().parents[2]
MIGRATIONS = sorted((ROOT / "migrations").glob("*.sql"))
VERSIONS = list(range(1, len(MIGRATIONS) + 1))
INSTALL_MD = ROOT / "docs" / "install.md"


def _doc_blocks() -> list[str]:
    """The indented code blocks of docs/install.md, dedented."""
    blocks: list[list[str]] = []
    current: list[str] | None = None
    previous_blank = True
    for line in INSTALL_MD.read_text().splitlines():
        if line.startswith("    ") and (current is not None or previous_blank):
            if current is None:
                current = []
                blocks.append(current)
            current.append(line[4:])
        elif not line.strip() and current is not None:
            current.append("")
        else:
            current = None
        previous_blank = not line.strip()
    return ["\n".join(b).rstrip() + "\n" for b in blocks]


def _doc_block(first_line: str, containing: str) -> str:
    found = [b for b in _doc_blocks() if b.startswith(first_line) and containing in b]
    assert len(found) == 1, f"docs/install.md: {len(found)} blocks with {containing!r}"
    return found[0]


def _with_repo_files(code: str) -> str:
    """The documented code with its FILES line pointed at this checkout's migrations/."""
    code, n = re.subn(r"^FILES = .*$", f"FILES = sorted(Path({str(ROOT / 'migrations')!r})"
                      '.glob("*.sql"))', code, flags=re.MULTILINE)
    assert n == 1, code
    return code


DJANGO_DOC = _doc_block("from pathlib import Path", "migrations.RunSQL(")
ALEMBIC_DOC = _doc_block("from pathlib import Path", "def upgrade():")


def _run(args: list[str], cwd: Path, env: dict[str, str] | None = None
         ) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PG", "DJANGO"))}
    clean["PYTHONPATH"] = str(cwd)
    return subprocess.run(args, cwd=cwd, env={**clean, **(env or {})}, capture_output=True,
                          text=True, timeout=WAIT_BOUND)


def _applied(dsn: str) -> list[int]:
    with psycopg.connect(dsn) as conn:
        return [r[0] for r in conn.execute(
            "SELECT version FROM idempotency.migrations ORDER BY version").fetchall()]


def _table_schema(dsn: str, table: str) -> list[str]:
    with psycopg.connect(dsn) as conn:
        return [r[0] for r in conn.execute(
            "SELECT table_schema FROM information_schema.tables WHERE table_name = %s",
            (table,)).fetchall()]


def test_the_documented_pair_is_the_packages() -> None:
    # The SQL lines, the Django and Alembic code and pg_idempotency.migrate say the same.
    sql_block = _doc_block("SELECT set_config(", "-- the migration file")
    assert sql_block == SAVE_SEARCH_PATH + "-- the migration file\n" + RESTORE_SEARCH_PATH
    for code in (DJANGO_DOC, ALEMBIC_DOC):
        names: dict[str, object] = {}
        exec(code[code.index("SAVE = "):code.index("FILES = ")], names)
        assert (names["SAVE"], names["RESTORE"]) == (SAVE_SEARCH_PATH, RESTORE_SEARCH_PATH)


def test_psql_loop_as_documented(server: PgServer, empty_db: str) -> None:
    loop = _doc_block("for f in migrations/*.sql; do psql", "")
    assert loop.count("\n") == 1, loop
    done = subprocess.run(["bash", "-euc", loop], cwd=ROOT, capture_output=True, text=True,
                          timeout=WAIT_BOUND, env={
                              **{k: v for k, v in os.environ.items() if not k.startswith("PG")},
                              "PATH": f"{server.bindir}:{os.environ['PATH']}",
                              "DATABASE_URL": empty_db})
    assert done.returncode == 0, done.stderr[-3000:]
    assert _applied(empty_db) == VERSIONS


UPGRADE_SCRIPT = _doc_block("set -e\n", "migrations/*.sql")


def _run_shell(shell: str, script: str, server: PgServer, dsn: str, migrations: Path = ROOT
               ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([shell, "-c", script], cwd=migrations, capture_output=True, text=True,
                          timeout=WAIT_BOUND, env={
                              **{k: v for k, v in os.environ.items() if not k.startswith("PG")},
                              "PATH": f"{server.bindir}:{os.environ['PATH']}",
                              "DATABASE_URL": dsn})


def test_psql_upgrade_script_applies_only_the_missing_files_silently(
    server: PgServer, empty_db: str, tmp_path: Path
) -> None:
    # A database at 0.10.0 (files 0001-0010, as the loop applied them), then the script of
    # docs/install.md, under POSIX sh and bash: the rest applied, not one line printed.
    older = tmp_path / "older"
    (older / "migrations").mkdir(parents=True)
    for path in MIGRATIONS[:10]:
        (older / "migrations" / path.name).write_bytes(path.read_bytes())
    first = _run_shell("bash", UPGRADE_SCRIPT, server, empty_db, older)
    assert (first.returncode, first.stdout, first.stderr) == (0, "", ""), first.stderr[-3000:]
    assert _applied(empty_db) == VERSIONS[:10]
    for shell in ("sh", "bash"):
        done = _run_shell(shell, UPGRADE_SCRIPT, server, empty_db)
        assert (done.returncode, done.stdout, done.stderr) == (0, "", ""), shell
        assert _applied(empty_db) == VERSIONS
    # A file that fails stops the script with a non-zero status and psql's error: the files
    # after it are not applied.
    broken = tmp_path / "broken"
    (broken / "migrations").mkdir(parents=True)
    for path in MIGRATIONS:
        (broken / "migrations" / path.name).write_bytes(path.read_bytes())
    (broken / "migrations" / "9998_bad.sql").write_text("SELECT 1/0;\n")
    (broken / "migrations" / "9999_after.sql").write_text("CREATE TABLE after_bad ();\n")
    failed = _run_shell("sh", UPGRADE_SCRIPT, server, empty_db, broken)
    assert failed.returncode != 0
    assert "division by zero" in failed.stderr
    assert _table_schema(empty_db, "after_bad") == []


def test_psql_one_transaction_keeps_the_installers_search_path(
    server: PgServer, empty_db: str
) -> None:
    # Without the pair, a released file's pin outlives it: the reason the docs give for it.
    bare = server.run_psql(empty_db, "", args=[
        "-X", "-v", "ON_ERROR_STOP=1", "-c", "BEGIN", "-c", "SET search_path = public",
        "-f", str(MIGRATIONS[0]), "-c", "SELECT 'after: ' || current_setting('search_path')",
        "-c", "ROLLBACK"]).stdout
    assert "after: pg_catalog, pg_temp" in bare, bare[-2000:]
    # Every file between the documented pair and then the tool's own bookkeeping, all in ONE
    # transaction (psql -1 with several -c/-f, as a tool that batches its migrations does).
    args = ["-X", "-v", "ON_ERROR_STOP=1", "-1", "-c", "SET search_path = public"]
    for path in MIGRATIONS:
        args += ["-c", SAVE_SEARCH_PATH, "-f", str(path), "-c", RESTORE_SEARCH_PATH]
    args += ["-c", "CREATE TABLE tool_history (file text)",
             "-c", "INSERT INTO tool_history VALUES ('all')",
             "-c", "SELECT 'after: ' || current_setting('search_path')"]
    out = server.run_psql(empty_db, "", args=args).stdout
    assert "after: public" in out, out[-2000:]
    assert _applied(empty_db) == VERSIONS
    assert _table_schema(empty_db, "tool_history") == ["public"]
    with psycopg.connect(empty_db) as conn:
        assert conn.execute("SELECT file FROM public.tool_history").fetchall() == [("all",)]


DJANGO_SETTINGS = """\
SECRET_KEY = "test"
USE_TZ = True
INSTALLED_APPS = ["shop"]
DATABASES = {{"default": {{
    "ENGINE": "django.db.backends.postgresql",
    "NAME": {name!r}, "USER": {user!r}, "HOST": {host!r}, "PORT": {port!r},
}}}}
"""

# The app's own model goes in the same migration, after the files.
DJANGO_OWN = """

from django.db import models

Migration.initial = True
Migration.operations = Migration.operations + [
    migrations.CreateModel("Order", [("id", models.BigAutoField(primary_key=True))]),
]
"""


def test_django_runsql_in_djangos_migration_transaction(
    server: PgServer, empty_db: str, tmp_path: Path
) -> None:
    info = conninfo_to_dict(empty_db)
    (tmp_path / "settings.py").write_text(DJANGO_SETTINGS.format(
        name=info["dbname"], user=info["user"], host=info["host"], port=str(info["port"])))
    app = tmp_path / "shop"
    (app / "migrations").mkdir(parents=True)
    (app / "__init__.py").write_text("")
    (app / "models.py").write_text(textwrap.dedent("""\
        from django.db import models


        class Order(models.Model):
            pass
    """))
    (app / "migrations" / "__init__.py").write_text("")
    (app / "migrations" / "0001_idempotency.py").write_text(
        _with_repo_files(DJANGO_DOC) + DJANGO_OWN)
    done = _run([sys.executable, "-m", "django", "migrate", "--settings=settings",
                 "--verbosity=1"], tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[:3000]
    assert "Applying shop.0001_idempotency... OK" in done.stdout
    assert _applied(empty_db) == VERSIONS
    with psycopg.connect(empty_db) as conn:
        assert conn.execute("SELECT app, name FROM public.django_migrations").fetchall() == [
            ("shop", "0001_idempotency")]
    assert _table_schema(empty_db, "shop_order") == ["public"]


ALEMBIC_INI = """\
[alembic]
script_location = {location}

[loggers]
keys = root

[handlers]
keys =

[formatters]
keys =

[logger_root]
level = WARN
handlers =
"""

ALEMBIC_ENV = """\
from alembic import context
from sqlalchemy import create_engine

engine = create_engine({url!r})
with engine.connect() as connection:
    context.configure(connection=connection, target_metadata=None)
    with context.begin_transaction():
        context.run_migrations()
"""

# The revision's identifiers, then the documented code, then the app's own table.
ALEMBIC_IDS = """\
revision = "0001"
down_revision = None

"""
ALEMBIC_OWN = """

import sqlalchemy as sa

_documented_upgrade = upgrade


def upgrade():
    _documented_upgrade()
    op.create_table("orders", sa.Column("id", sa.BigInteger, primary_key=True))
"""


def test_alembic_in_alembics_migration_transaction(
    server: PgServer, empty_db: str, tmp_path: Path
) -> None:
    info = conninfo_to_dict(empty_db)
    url = (f"postgresql+psycopg://{info['user']}@{info['host']}:{info['port']}/"
           f"{info['dbname']}")
    location = tmp_path / "alembic"
    (location / "versions").mkdir(parents=True)
    (tmp_path / "alembic.ini").write_text(ALEMBIC_INI.format(location=location))
    (location / "env.py").write_text(ALEMBIC_ENV.format(url=url))
    (location / "script.py.mako").write_text("")
    (location / "versions" / "0001_idempotency.py").write_text(
        ALEMBIC_IDS + _with_repo_files(ALEMBIC_DOC) + ALEMBIC_OWN)
    done = _run([sys.executable, "-m", "alembic", "-c", str(tmp_path / "alembic.ini"),
                 "upgrade", "head"], tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[:3000]
    assert _applied(empty_db) == VERSIONS
    with psycopg.connect(empty_db) as conn:
        assert conn.execute("SELECT version_num FROM public.alembic_version").fetchall() == [
            ("0001",)]
    assert _table_schema(empty_db, "orders") == ["public"]
