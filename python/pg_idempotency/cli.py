"""The ``pg-idempotency`` command line: install the schema, or print its SQL for another tool.

    pg-idempotency migrate [--dsn DSN]     apply pending migrations (DSN defaults to $DATABASE_URL)
    pg-idempotency sql > install.sql       print all migrations as one SQL script
    pg-idempotency --version

Every failure is one line on stderr and a non-zero exit status: 1 for a database or migration
error, 2 for a usage error, 130 when interrupted.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence

import psycopg
from psycopg.conninfo import conninfo_to_dict

from . import __version__
from .migrate import MigrationError, install_sql, migrate, migrations

PROG = "pg-idempotency"
# Seconds to wait for the server when neither the DSN nor PGCONNECT_TIMEOUT says: without it
# libpq waits for the kernel (minutes) when a firewall drops the packets.
DEFAULT_CONNECT_TIMEOUT = 10


class CliError(Exception):
    """A failure to report as one line; ``status`` is the exit code."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Idempotency keys done inside PostgreSQL: install and upgrade the "
        "'idempotency' schema.",
        epilog=f"Run '{PROG} COMMAND --help' for the options of a command.",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p_migrate = commands.add_parser(
        "migrate",
        help="apply pending migrations to a database",
        description="Apply the bundled migrations the database lacks, each in its own "
        "transaction under an advisory lock, so concurrent runs are safe and a second run "
        "does nothing. Migrations applied earlier with psql or another tool are recognised "
        "(each records itself in idempotency.migrations). Prints each migration it applies, "
        "or 'up to date'.",
    )
    p_migrate.add_argument(
        "--dsn",
        metavar="DSN",
        help="libpq connection string or URI, e.g. postgresql://user@host:5432/dbname "
        "(default: $DATABASE_URL). Prefer the environment variable or ~/.pgpass for a "
        "password: command lines are visible to other users.",
    )
    p_migrate.set_defaults(handler=cmd_migrate)

    p_sql = commands.add_parser(
        "sql",
        help="print the install SQL (all migrations) to stdout",
        description="Print every bundled migration, concatenated in order, for another "
        "migration tool or for psql: pg-idempotency sql | psql -X -1 -v ON_ERROR_STOP=1 "
        "-d DSN. The script records its versions in idempotency.migrations, so a later "
        "'pg-idempotency migrate' applies only newer migrations.",
    )
    p_sql.set_defaults(handler=cmd_sql)
    return parser


def cmd_sql(args: argparse.Namespace) -> int:
    try:
        text = install_sql()
    except MigrationError as exc:
        raise CliError(str(exc)) from None
    sys.stdout.write(text)
    sys.stdout.flush()
    return 0


def cmd_migrate(args: argparse.Namespace) -> int:
    dsn = args.dsn or os.environ.get("DATABASE_URL")
    if not dsn:
        raise CliError("no database given: pass --dsn DSN or set DATABASE_URL", status=2)
    try:
        names = {m.version: m.name for m in migrations()}
    except MigrationError as exc:
        raise CliError(str(exc)) from None
    with _connect(dsn) as conn:
        try:
            applied = migrate(conn)
        except MigrationError as exc:
            raise CliError(f"migrate failed: {exc}") from None
        except psycopg.Error as exc:
            raise CliError(f"migrate failed: {_describe(exc)}") from None
    if not applied:
        print(f"up to date (latest migration: {names[max(names)]})" if names else "up to date")
    for version in applied:
        print(f"applied {names[version]}")
    return 0


def _connect(dsn: str) -> psycopg.Connection:
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.Error as exc:
        raise CliError(f"invalid DSN: {_one_line(str(exc))}", status=2) from None
    kwargs: dict[str, object] = {"application_name": PROG}
    if "application_name" in params:
        kwargs.pop("application_name")
    if "connect_timeout" not in params and not os.environ.get("PGCONNECT_TIMEOUT"):
        kwargs["connect_timeout"] = DEFAULT_CONNECT_TIMEOUT
    try:
        return psycopg.connect(dsn, autocommit=True, **kwargs)
    except psycopg.ProgrammingError as exc:  # a malformed DSN libpq only refuses now
        raise CliError(f"invalid DSN: {_one_line(str(exc))}", status=2) from None
    except psycopg.Error as exc:
        raise CliError(f"cannot connect: {_one_line(str(exc))}") from None


def _describe(exc: psycopg.Error) -> str:
    """'SQLSTATE 42501: permission denied for ...' (the primary message only)."""
    message = exc.diag.message_primary or str(exc)
    if exc.sqlstate:
        return f"SQLSTATE {exc.sqlstate}: {_one_line(message)}"
    return _one_line(message)


def _one_line(text: str) -> str:
    text = re.sub(r"^connection failed: ", "", text.strip())
    lines = [re.sub(r"\s+", " ", line).strip() for line in text.splitlines()]
    return "; ".join(line for line in lines if line)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)  # exits 2 with a usage message on bad arguments
    try:
        return args.handler(args)
    except CliError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return exc.status
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (pg-idempotency sql | head): not an error worth a word.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
