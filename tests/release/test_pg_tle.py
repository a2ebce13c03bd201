"""pg_idempotency as a Trusted Language Extension (pg_tle), as on RDS, Aurora or Supabase.

On a server with pg_tle preloaded and no pg_idempotency files (harness/pg_tle_server.py), a role
that is no superuser (LOGIN CREATEROLE CREATEDB, owner of its database, granted ``pgtle_admin``)
registers the extension with the file tools/build_pg_tle.py writes from build/extension/ as it
is now, creates it, upgrades it 0.10.0 -> 0.11.0 -> the newest, and removes it; the
application's role claims, completes and replays a key after each step. The registration run
again, or an older one, changes nothing, and a new install of the newest has the same catalog
as an upgraded one. pg_tle itself is built by ``make setup`` (tools/build_pg_tle.py): without
it every test here fails, saying so.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
from helpers import ROOT, doc_block, sqlstate
from helpers.install import latest_extension_version
from psycopg import sql

from pg_tle_server import shared_pg_tle_server
from pgharness import WAIT_BOUND, PgServer

pytestmark = pytest.mark.pg_tle

TOOL = ROOT / "tools" / "build_pg_tle.py"
PSQL_FILE = ("-X", "-q", "-v", "ON_ERROR_STOP=1", "-1")
NEWEST = latest_extension_version()
# What each step of the upgrade is; the newest comes from build/extension/.
OLD, NEXT = "0.10.0", "0.11.0"
DUMP_AND_RESTORE = doc_block("managed.md", "sh", "pg_dump -Fc -f payments.dump")


def registration(tmp_path: Path, through: str | None = None) -> Path:
    """The tool's registration file, made now from build/extension/, as a user runs it."""
    out = tmp_path / f"pg_idempotency-{through or 'newest'}.sql"
    args = [sys.executable, str(TOOL), "sql", "--output", str(out)]
    done = subprocess.run(args + (["--through", through] if through else []),
                          capture_output=True, text=True, timeout=WAIT_BOUND)
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture(scope="module", params=["pg15", "pg18"])
def tle_server(request: pytest.FixtureRequest) -> PgServer:
    """The process's pg_tle server (shared with test_managed_docs.py: roles and databases here
    have names of their own)."""
    return shared_pg_tle_server(request.param)


@dataclass
class Managed:
    server: PgServer
    owner: str
    app: str
    db: str

    def dsn(self, user: str) -> str:
        return self.server.dsn(self.db, user=user)


@pytest.fixture
def managed(tle_server: PgServer) -> Iterator[Managed]:
    """A database owned by a CREATEROLE CREATEDB role that is no superuser, with pg_tle created
    and pgtle_admin granted to the owner (the provider's or the master user's steps)."""
    tag = uuid.uuid4().hex[:8]
    m = Managed(tle_server, f"owner_{tag}", f"api_{tag}", f"tle_{tag}")
    owner, app, db = (sql.Identifier(n) for n in (m.owner, m.app, m.db))
    with psycopg.connect(tle_server.dsn(), autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN CREATEROLE CREATEDB").format(owner))
        conn.execute(sql.SQL("CREATE DATABASE {} OWNER {}").format(db, owner))
    with psycopg.connect(tle_server.dsn(m.db), autocommit=True) as conn:
        conn.execute("CREATE EXTENSION pg_tle")
        conn.execute(sql.SQL("GRANT pgtle_admin TO {}").format(owner))
    try:
        yield m
    finally:
        with psycopg.connect(tle_server.dsn(), autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(db))
            conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(app))
            conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(owner))


def as_owner(m: Managed, query: str, params: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
    with psycopg.connect(m.dsn(m.owner), autocommit=True) as conn:
        assert conn.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user"
                            ).fetchone() == (False,)
        cur = conn.execute(query, params or None)
        return cur.fetchall() if cur.description else []


def register(m: Managed, path: Path) -> None:
    m.server.run_psql(m.dsn(m.owner), path, args=PSQL_FILE)


def extension_version(m: Managed) -> str | None:
    rows = as_owner(m, "SELECT extversion FROM pg_extension WHERE extname = 'pg_idempotency'")
    return str(rows[0][0]) if rows else None


def round_trip(m: Managed, key: str) -> None:
    """As the application's role: a key claimed, completed, then replayed with its body."""
    with psycopg.connect(m.dsn(m.app), autocommit=True) as conn:
        claim = ("SELECT outcome, lease_token, response_status, response_body "
                 "FROM idempotency.claim('payments', %s, '{\"amount\": 5}')")
        outcome, token, _, _ = conn.execute(claim, (key,)).fetchone()
        assert outcome == "claimed" and token is not None
        conn.execute("SELECT idempotency.complete('payments', %s, %s, 201, '{\"id\": 7}')",
                     (key, token))
        assert conn.execute(claim, (key,)).fetchone() == ("replay", None, 201, {"id": 7})


def catalog(m: Managed) -> list[tuple[object, ...]]:
    """Schema idempotency's objects as the catalog holds them: functions with their bodies and
    settings, relations, columns, constraints, and who owns and may use each."""
    return as_owner(m, """
        SELECT 'function', p.oid::regprocedure::text, md5(p.prosrc),
               coalesce(p.proconfig::text, ''), p.prosecdef::text, p.proowner::regrole::text,
               coalesce(p.proacl::text, '')
        FROM pg_proc AS p WHERE p.pronamespace = 'idempotency'::regnamespace
        UNION ALL
        SELECT 'relation', c.relname, c.relkind::text, coalesce(c.reloptions::text, ''), '',
               c.relowner::regrole::text, coalesce(c.relacl::text, '')
        FROM pg_class AS c WHERE c.relnamespace = 'idempotency'::regnamespace
          AND c.relname !~ '_p[0-9]'
        UNION ALL
        SELECT 'column', a.attrelid::regclass::text || '.' || a.attname,
               format_type(a.atttypid, a.atttypmod), a.attnotnull::text,
               coalesce(pg_get_expr(d.adbin, d.adrelid), ''), '', ''
        FROM pg_attribute AS a JOIN pg_class AS c ON c.oid = a.attrelid
        LEFT JOIN pg_attrdef AS d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
        WHERE c.relnamespace = 'idempotency'::regnamespace AND c.relname !~ '_p[0-9]'
          AND a.attnum > 0 AND NOT a.attisdropped
        UNION ALL
        SELECT 'constraint', conrelid::regclass::text || '.' || conname,
               pg_get_constraintdef(oid), '', '', '', ''
        FROM pg_constraint WHERE connamespace = 'idempotency'::regnamespace
          AND conrelid::regclass::text !~ '_p[0-9]'
        ORDER BY 1, 2, 3
    """)


def test_install_upgrade_uninstall_as_an_owner_who_is_no_superuser(
    managed: Managed, tmp_path: Path
) -> None:
    m = managed
    # As a release at 0.10.0 registered it, then CREATE EXTENSION at that version.
    register(m, registration(tmp_path, OLD))
    assert as_owner(m, "SELECT default_version FROM pgtle.available_extensions() "
                       "WHERE name = 'pg_idempotency'") == [(OLD,)]
    as_owner(m, f"CREATE EXTENSION pg_idempotency VERSION '{OLD}'")
    assert extension_version(m) == OLD
    # The schema and its objects are the owner's, not a superuser's.
    assert as_owner(m, "SELECT nspowner::regrole::text FROM pg_namespace "
                       "WHERE nspname = 'idempotency'") == [(m.owner,)]
    as_owner(m, f"CREATE ROLE {m.app} LOGIN")
    as_owner(m, "SELECT idempotency.grant_usage(%s::regrole)", (m.app,))
    assert as_owner(m, "SELECT count(*) FROM idempotency.maintain() WHERE action = 'skipped'"
                    ) == [(0,)]
    round_trip(m, "at-0.10")

    # The newest registration adds the upgrade scripts; the installed version stays.
    register(m, registration(tmp_path))
    assert extension_version(m) == OLD
    as_owner(m, f"ALTER EXTENSION pg_idempotency UPDATE TO '{NEXT}'")
    assert extension_version(m) == NEXT
    round_trip(m, "at-0.11")
    as_owner(m, "ALTER EXTENSION pg_idempotency UPDATE")
    assert extension_version(m) == NEWEST
    round_trip(m, "at-newest")
    assert as_owner(m, "SELECT count(*) FROM idempotency.maintain() WHERE action = 'skipped'"
                    ) == [(0,)]
    # Keys made before the upgrades still replay.
    with psycopg.connect(m.dsn(m.app), autocommit=True) as conn:
        assert conn.execute("SELECT outcome, response_body FROM idempotency.claim('payments', "
                            "'at-0.10', '{\"amount\": 5}')").fetchone() == ("replay", {"id": 7})

    # The newest registration again, and an older one, change nothing; the default stays.
    scripts = ("SELECT count(*) FROM pg_proc WHERE pronamespace = 'pgtle'::regnamespace "
               "AND proname LIKE 'pg_idempotency%'")
    before = as_owner(m, scripts)
    register(m, registration(tmp_path))
    register(m, registration(tmp_path, OLD))
    assert as_owner(m, scripts) == before
    assert as_owner(m, "SELECT default_version FROM pgtle.available_extensions() "
                       "WHERE name = 'pg_idempotency'") == [(NEWEST,)]

    # Removed: the extension with its schema, then its registration.
    as_owner(m, "DROP EXTENSION pg_idempotency")
    assert as_owner(m, "SELECT count(*) FROM pg_namespace WHERE nspname = 'idempotency'"
                    ) == [(0,)]
    assert as_owner(m, "SELECT pgtle.uninstall_extension('pg_idempotency')") == [(True,)]
    assert as_owner(m, "SELECT count(*) FROM pgtle.available_extensions()") == [(0,)]
    # feature_not_supported: 'extension "pg_idempotency" is not available'
    assert sqlstate(m.dsn(m.owner), "CREATE EXTENSION pg_idempotency") == "0A000"
    assert extension_version(m) is None

    # A new install of the newest (its one script) equals 0.10.0 upgraded through the chain.
    fresh, upgraded = fresh_and_upgraded_catalogs(m.server, registration(tmp_path))
    assert len(fresh) > 100
    assert sorted(fresh) == sorted(upgraded), set(fresh) ^ set(upgraded)


def fresh_and_upgraded_catalogs(tle_server: PgServer, newest: Path
                                ) -> list[list[tuple[object, ...]]]:
    """Two databases of one owner: CREATE EXTENSION at the newest (its one script), and 0.10.0
    upgraded through every script since; each one's catalog()."""
    tag = uuid.uuid4().hex[:8]
    owner = f"owner_{tag}"
    with psycopg.connect(tle_server.dsn(), autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN CREATEROLE CREATEDB")
                     .format(sql.Identifier(owner)))
    found = []
    try:
        for db, create in ((f"fresh_{tag}", "CREATE EXTENSION pg_idempotency"),
                           (f"upgraded_{tag}", f"CREATE EXTENSION pg_idempotency VERSION '{OLD}';"
                            "ALTER EXTENSION pg_idempotency UPDATE")):
            m = Managed(tle_server, owner, "", db)
            with psycopg.connect(tle_server.dsn(), autocommit=True) as conn:
                conn.execute(sql.SQL("CREATE DATABASE {} OWNER {}").format(
                    sql.Identifier(db), sql.Identifier(owner)))
            with psycopg.connect(tle_server.dsn(db), autocommit=True) as conn:
                conn.execute("CREATE EXTENSION pg_tle")
                conn.execute(sql.SQL("GRANT pgtle_admin TO {}").format(sql.Identifier(owner)))
            register(m, newest)
            tle_server.run_psql(m.dsn(owner), create)
            assert extension_version(m) == NEWEST
            found.append(catalog(m))
    finally:
        with psycopg.connect(tle_server.dsn(), autocommit=True) as conn:
            for db in (f"fresh_{tag}", f"upgraded_{tag}"):
                conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)")
                             .format(sql.Identifier(db)))
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(owner)))
    return found


def test_a_script_with_pg_tles_own_delimiters_is_refused_by_the_tool(tmp_path: Path) -> None:
    # pg_tle wraps each script in $_pgtle_o_$ / $_pgtle_i_$ and refuses one containing either;
    # the tool says so when it writes the file, naming the script, rather than leaving it to
    # the server.
    ext = tmp_path / "extension"
    ext.mkdir()
    for path in (ROOT / "build" / "extension").iterdir():
        (ext / path.name).write_bytes(path.read_bytes())
    bad = ext / f"pg_idempotency--{OLD}--{NEXT}.sql"
    bad.write_text(bad.read_text() + "\nSELECT $_pgtle_i_$ x $_pgtle_i_$;\n")
    done = subprocess.run(
        [sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
         "import build_pg_tle as b; b.registration(b.Path(sys.argv[2]))",
         str(TOOL.parent), str(ext)], capture_output=True, text=True, timeout=WAIT_BOUND)
    assert done.returncode != 0
    assert f"{bad.name}: contains $_pgtle_i_$" in done.stderr


def test_dump_and_restore_of_a_pg_tle_install(managed: Managed, tmp_path: Path) -> None:
    """docs/managed.md's dump and restore as written: ``pg_dump -Fc`` of a database where the
    owner (no superuser) installed the extension through pg_tle, restored by that owner into a
    new database of theirs with pg_tle created: the extension at the same version, its keys
    replaying, new keys claimed, pg_tle still holding its scripts."""
    m = managed
    register(m, registration(tmp_path))
    as_owner(m, "CREATE EXTENSION pg_idempotency")
    as_owner(m, f"CREATE ROLE {m.app} LOGIN")
    as_owner(m, "SELECT idempotency.grant_usage(%s::regrole)", (m.app,))
    round_trip(m, "before-dump")
    target = f"{m.db}_r"
    with psycopg.connect(m.server.dsn(), autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {} OWNER {}").format(
            sql.Identifier(target), sql.Identifier(m.owner)))
    with psycopg.connect(m.server.dsn(target), autocommit=True) as conn:
        conn.execute("CREATE EXTENSION pg_tle")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env.update(PATH=f"{m.server.bindir}:/usr/bin:/bin", LC_ALL="C",
               DATABASE_URL=m.dsn(m.owner), RESTORE_URL=m.server.dsn(target, user=m.owner))
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", DUMP_AND_RESTORE], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=WAIT_BOUND)
    try:
        assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
        restored = Managed(m.server, m.owner, m.app, target)
        assert extension_version(restored) == NEWEST
        with psycopg.connect(restored.dsn(m.app), autocommit=True) as conn:
            assert conn.execute(
                "SELECT outcome, response_status, response_body FROM idempotency.claim("
                "'payments', 'before-dump', '{\"amount\": 5}')").fetchone() == (
                    "replay", 201, {"id": 7})
        round_trip(restored, "after-restore")
        # pg_tle still knows the extension's scripts there: the registration run again adds
        # nothing, DROP and CREATE EXTENSION work from them.
        assert as_owner(restored, "SELECT default_version FROM pgtle.available_extensions() "
                                  "WHERE name = 'pg_idempotency'") == [(NEWEST,)]
        scripts = ("SELECT count(*) FROM pg_proc WHERE pronamespace = 'pgtle'::regnamespace "
                   "AND proname LIKE 'pg_idempotency%'")
        before = as_owner(restored, scripts)
        assert before == as_owner(m, scripts)
        register(restored, registration(tmp_path))
        assert as_owner(restored, scripts) == before
        as_owner(restored, "DROP EXTENSION pg_idempotency")
        as_owner(restored, "CREATE EXTENSION pg_idempotency")
        assert extension_version(restored) == NEWEST
    finally:
        with psycopg.connect(m.server.dsn(), autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(target)))
