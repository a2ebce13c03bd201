"""Every migration route of docs/install.md, for real: plain psql in one transaction followed by
the tool's own statements, Django's RunSQL inside Django's migration transaction and the files
through Alembic's connection inside Alembic's, each run as its own process the way a user runs it
(``python -m django migrate``, ``alembic upgrade head``). What each file pins for its own
statements (search_path) must not leak into what the tool runs after it: Django records the
migration in its unqualified ``django_migrations``, Alembic in ``alembic_version``.
(`pg-idempotency migrate` and CREATE EXTENSION: tests/test_migrate.py, tests/test_install.py.)
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import psycopg
from psycopg.conninfo import conninfo_to_dict

from pgharness import PgServer

ROOT = Path(__file__).resolve().parent.parent
MIGRATIONS = sorted((ROOT / "migrations").glob("*.sql"))
VERSIONS = list(range(1, len(MIGRATIONS) + 1))


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PG", "DJANGO"))}
    env["PYTHONPATH"] = str(cwd)
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def _applied(dsn: str) -> list[int]:
    with psycopg.connect(dsn) as conn:
        return [r[0] for r in conn.execute(
            "SELECT version FROM idempotency.migrations ORDER BY version").fetchall()]


def _table_schema(dsn: str, table: str) -> list[str]:
    with psycopg.connect(dsn) as conn:
        return [r[0] for r in conn.execute(
            "SELECT table_schema FROM information_schema.tables WHERE table_name = %s",
            (table,)).fetchall()]


def test_psql_one_transaction_keeps_the_installers_search_path(
    server: PgServer, empty_db: str
) -> None:
    # Every file and then the tool's own bookkeeping, all in ONE transaction (psql -1 with
    # several -f/-c, as a tool that batches its migrations does).
    args = ["-X", "-v", "ON_ERROR_STOP=1", "-1", "-c", "SET search_path = public"]
    for path in MIGRATIONS:
        args += ["-f", str(path)]
    args += ["-c", "CREATE TABLE tool_history (file text)",
             "-c", "INSERT INTO tool_history VALUES ('all')",
             "-c", "SELECT 'after: ' || current_setting('search_path')"]
    out = server.run_psql(empty_db, "", args=args).stdout
    assert "after: public" in out, out[-2000:]
    assert _applied(empty_db) == VERSIONS
    assert _table_schema(empty_db, "tool_history") == ["public"]


DJANGO_SETTINGS = """\
SECRET_KEY = "test"
USE_TZ = True
INSTALLED_APPS = ["shop"]
DATABASES = {{"default": {{
    "ENGINE": "django.db.backends.postgresql",
    "NAME": {name!r}, "USER": {user!r}, "HOST": {host!r}, "PORT": {port!r},
}}}}
"""

DJANGO_MIGRATION = """\
from pathlib import Path

from django.db import migrations, models

FILES = [Path(p) for p in {files!r}]


class Migration(migrations.Migration):
    initial = True
    dependencies = []
    # What docs/install.md says: the SQL files through RunSQL, then the app's own models,
    # all in the one transaction Django runs this migration in.
    operations = [migrations.RunSQL(f.read_text()) for f in FILES] + [
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
        DJANGO_MIGRATION.format(files=[str(p) for p in MIGRATIONS]))
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

ALEMBIC_REVISION = """\
from pathlib import Path

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
FILES = [Path(p) for p in {files!r}]


def upgrade():
    # What docs/install.md says, then the app's own tables. The file goes to the driver's
    # cursor as it is: op.execute(str) wraps it in sqlalchemy.text(), which takes the files'
    # ":value" for a bind parameter, and exec_driver_sql() passes parameters, so psycopg
    # reads every "%" as a placeholder.
    cursor = op.get_bind().connection.cursor()
    for f in FILES:
        cursor.execute(f.read_text())
    op.create_table("orders", sa.Column("id", sa.BigInteger, primary_key=True))
"""


def test_alembic_op_execute_in_alembics_migration_transaction(
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
        ALEMBIC_REVISION.format(files=[str(p) for p in MIGRATIONS]))
    done = _run([sys.executable, "-m", "alembic", "-c", str(tmp_path / "alembic.ini"),
                 "upgrade", "head"], tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[:3000]
    assert _applied(empty_db) == VERSIONS
    with psycopg.connect(empty_db) as conn:
        assert conn.execute("SELECT version_num FROM public.alembic_version").fetchall() == [
            ("0001",)]
    assert _table_schema(empty_db, "orders") == ["public"]
