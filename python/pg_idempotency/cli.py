"""The ``pg-idempotency`` command line: install the schema, or print its SQL for another tool.

    pg-idempotency migrate [--dsn DSN]     apply pending migrations (DSN defaults to $DATABASE_URL)
    pg-idempotency sql > install.sql       print all migrations as one SQL script
    pg-idempotency sql-path                the folder of the installed migration files
    pg-idempotency maintain [--dsn DSN]    retention: partitions ahead, expired partitions dropped
    pg-idempotency status [--dsn DSN]      keys per scope by state, partitions, the next drop
                  [--limit N] [--json]
    pg-idempotency demo [--dsn DSN]        the payments example under a retry storm (extra: demo)
    pg-idempotency keys show SCOPE KEY [--body] [--json]    one key (never its body by default)
    pg-idempotency keys list [--scope S] [--state in_progress|completed|released]
                             [--older-than SECONDS]
                             [--expired-leases] [--limit N] [--json]
    pg-idempotency keys release SCOPE KEY [--yes] [--json]  release a stuck key in progress
    pg-idempotency --version

Every failure is one line on stderr and a non-zero exit status: 1 for a database or migration
error (unreachable server, failed authentication, schema missing), 2 for a usage error (bad
arguments, no DSN, an invalid DSN), 3 when maintain still skipped a partition for a lock, 130
when interrupted. pg-idempotency keys: 4 when the key is not stored (show, release), 5 when
release was refused (the key is completed or released, or was taken over meanwhile), 6 when
release was not confirmed (answered no, or no terminal and no --yes).

A subcommand is one :class:`Command` in :data:`COMMANDS`: its name, help texts and a
``run(args, conn)`` function. ``database=True`` gives it ``--dsn`` / $DATABASE_URL and an open
connection; ``needs_schema=True`` also checks that the schema is installed and up to date.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from . import __version__, _wire, maintenance, queries
from .migrate import MigrationError, install_sql, migrate, migrations, sql_path
from .schema import SCHEMA_VERSION, schema_version

PROG = "pg-idempotency"
# Seconds to wait for the server when neither the DSN nor PGCONNECT_TIMEOUT says: without it
# libpq waits for the kernel (minutes) when a firewall drops the packets.
DEFAULT_CONNECT_TIMEOUT = 10


class CliError(Exception):
    """A failure to report as one line; ``status`` is the exit code."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Command:
    """One subcommand. A command with ``database`` gets ``--dsn`` (default $DATABASE_URL) and
    is called with an open autocommit connection; with ``needs_schema`` the connection is
    first checked for an up-to-date ``idempotency`` schema (one clear line if not)."""

    name: str
    help: str
    description: str
    run: Callable[[argparse.Namespace, psycopg.Connection | None], int]
    database: bool = False
    needs_schema: bool = False
    arguments: Callable[[argparse.ArgumentParser], None] | None = None


def cmd_sql(args: argparse.Namespace, conn: psycopg.Connection | None) -> int:
    try:
        text = install_sql()
    except MigrationError as exc:
        raise CliError(str(exc)) from None
    sys.stdout.write(text)
    sys.stdout.flush()
    return 0


def cmd_sql_path(args: argparse.Namespace, conn: psycopg.Connection | None) -> int:
    try:
        print(sql_path())
    except MigrationError as exc:
        raise CliError(str(exc)) from None
    return 0


def cmd_migrate(args: argparse.Namespace, conn: psycopg.Connection | None) -> int:
    assert conn is not None
    names = _bundled_names()
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


def cmd_demo(args: argparse.Namespace, conn: psycopg.Connection | None) -> int:
    assert conn is not None
    try:
        from . import demo
    except ImportError as exc:
        raise CliError(f"the demo needs the 'demo' extra (missing: {exc.name}): in the "
                       "clone, pip install '.[demo]' (or the wheel of make dist, with [demo])"
                       ) from None
    try:
        return demo.run(args.dsn or os.environ["DATABASE_URL"], conn, clients=args.clients,
                        payments_each=args.payments, seed=args.seed, as_json=args.json)
    except MigrationError as exc:
        raise CliError(f"migrate failed: {exc}") from None
    except psycopg.Error as exc:
        raise CliError(f"demo failed: {_describe(exc)}") from None


def cmd_maintain(args: argparse.Namespace, conn: psycopg.Connection | None) -> int:
    assert conn is not None
    try:
        steps = maintenance.run_maintenance(conn, attempts=args.attempts,
                                            retry_delay=args.retry_delay)
    except psycopg.Error as exc:
        raise CliError(f"maintain failed: {_describe(exc)}") from None
    print(maintenance.format_report(steps))
    # A step still skipped for a lock after every attempt is worth a non-zero status, so that
    # a CronJob shows it; a run skipped because another run held the lock is not.
    last = max((s.attempt for s in steps), default=1)
    if any(s.skipped_for_a_lock and s.attempt == last for s in steps):
        print(f"{PROG}: some partitions were skipped: a lock was not granted in time; "
              "run again later", file=sys.stderr)
        return 3
    return 0


def maintain_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--attempts", type=_positive, default=3, metavar="N",
                   help="runs at most, while a step is skipped for a lock (default 3)")
    p.add_argument("--retry-delay", type=_seconds, default=2.0, metavar="SECONDS",
                   help="pause between those runs (default 2)")


def cmd_status(args: argparse.Namespace, conn: psycopg.Connection | None) -> int:
    assert conn is not None
    try:
        status = maintenance.fetch_status(conn)
    except psycopg.Error as exc:
        raise CliError(f"status failed: {_describe(exc)}") from None
    installed = getattr(args, "schema_migration", None)
    schema = {"installed": schema_version(installed), "migration": installed,
              "required": SCHEMA_VERSION, "package": __version__}
    if args.json:
        print(json.dumps({**maintenance.status_json(status, args.limit), "schema": schema},
                         indent=2))
    else:
        print(maintenance.format_status(status, args.limit))
        print(f"schema: {schema['installed']} (migration {installed:04d}); {PROG} "
              f"{__version__} needs {SCHEMA_VERSION}")
    return 0


def status_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--limit", type=_positive, default=20, metavar="N",
                   help="show the N scopes with the most keys (default 20)")
    p.add_argument("--json", action="store_true",
                   help="print the scopes, partitions and next drop as JSON")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {text}")
    return value


def _seconds(text: str) -> float:
    """A finite, non-negative number of seconds (time.sleep refuses the others)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds, at least 0: {text}")
    return value


def demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--clients", type=_positive, default=8, metavar="N",
                   help="concurrent clients (default 8)")
    p.add_argument("--payments", type=_positive, default=25, metavar="M",
                   help="payments per client (default 25)")
    p.add_argument("--seed", type=int, default=6,
                   help="seed of the fault schedule: the same seed, the same faults (default 6)")
    p.add_argument("--json", action="store_true",
                   help="print the summary as JSON on stdout, no progress bar")


# -- keys show | list | release ----------------------------------------------------------------

KEY_NOT_FOUND = 4
RELEASE_REFUSED = 5
NOT_CONFIRMED = 6


def _key_rows(conn: psycopg.Connection, query: str, params: dict[str, Any]) -> list[dict]:
    with conn.cursor(row_factory=_wire.dict_rows(conn)) as cur:
        return cur.execute(query, params).fetchall()


def _jsonable(row: dict) -> dict:
    return {k: v.isoformat() if isinstance(v, datetime) else v for k, v in row.items()}


def _key_text(row: dict, body: bool) -> str:
    fields = ["state", "lease_expires_at", "lease_expired", "recovery_point",
              "attempts", "response_status", "response_content_type", "response_headers",
              "response_body_size", "created_at", "completed_at", "partition_name"]
    if body:
        fields += ["response_body", "response_body_base64"]
    lines = [f"key {row['key']!r} of scope {row['scope']!r}"]
    for name in fields:
        value = row[name]
        if isinstance(value, dict):
            value = json.dumps(value, sort_keys=True)
        lines.append(f"  {name + ':':<24}{'-' if value is None else value}")
    return "\n".join(lines)


def _show(conn: psycopg.Connection, scope: str, key: str, body: bool) -> dict | None:
    rows = _key_rows(conn, queries.KEY_SHOW, {"scope": scope, "key": key, "body": body})
    return rows[0] if rows else None


def cmd_keys(args: argparse.Namespace, conn: psycopg.Connection | None) -> int:
    assert conn is not None
    try:
        if args.keys_action == "show":
            row = _show(conn, args.scope, args.key, args.body)
            if row is None:
                print(json.dumps(None) if args.json else
                      f"no key {args.key!r} in scope {args.scope!r} (never claimed, or past "
                      "its retention)")
                return KEY_NOT_FOUND
            print(json.dumps(_jsonable(row), indent=2) if args.json
                  else _key_text(row, args.body))
            return 0
        if args.keys_action == "list":
            rows = _key_rows(conn, queries.KEY_LIST, {
                "scope": args.scope, "state": args.state,
                "older_than": None if args.older_than is None else f"{args.older_than} seconds",
                "expired_leases": args.expired_leases, "max_keys": args.limit})
            if args.json:
                print(json.dumps([_jsonable(r) for r in rows], indent=2))
            else:
                for r in rows:
                    lease = ("expired" if r["lease_expired"] else
                             f"until {r['lease_expires_at']:%Y-%m-%d %H:%M:%S%z}"
                             if r["state"] == "in_progress" else "")
                    print(f"{r['scope']}\t{r['key']}\t{r['state']}\t{lease}\t"
                          f"attempts={r['attempts']}\tcreated={r['created_at']:%Y-%m-%d %H:%M:%S%z}"
                          f"\t{r['partition_name']}")
                print(f"{len(rows)} key(s)", file=sys.stderr)
            return 0
        return _release(args, conn)
    except psycopg.Error as exc:
        raise CliError(f"keys {args.keys_action} failed: {_describe(exc)}") from None


def _release(args: argparse.Namespace, conn: psycopg.Connection) -> int:
    row = _show(conn, args.scope, args.key, False)
    if row is None:
        print(json.dumps({"released": False, "reason": "not stored"}) if args.json else
              f"no key {args.key!r} in scope {args.scope!r}: nothing to release")
        return KEY_NOT_FOUND
    if row["state"] != "in_progress":
        print(json.dumps({"released": False, "reason": row["state"], "key": _jsonable(row)})
              if args.json else
              f"key {args.key!r} of scope {args.scope!r} is {row['state']}: "
              + ("retries replay its stored response" if row["state"] == "completed" else
                 "its next claim runs afresh") + "; nothing to release")
        return RELEASE_REFUSED
    if not args.yes:
        if not sys.stdin.isatty():
            print(f"{PROG}: not released: confirm on a terminal, or pass --yes",
                  file=sys.stderr)
            return NOT_CONFIRMED
        lease = "expired" if row["lease_expired"] else f"live until {row['lease_expires_at']}"
        print(f"{_key_text(row, False)}\n\nRelease it? Its holder (lease {lease}) must be gone: "
              "the next retry runs the operation afresh, without the recovery point.",
              file=sys.stderr)
        answer = input("Release this key? [y/N] ").strip().lower()
        if answer not in ("y", "yes"):
            print("not released", file=sys.stderr)
            return NOT_CONFIRMED
    try:
        conn.execute(queries.KEY_RELEASE, {"scope": args.scope, "key": args.key})
    except psycopg.Error as exc:
        if exc.sqlstate in ("IK001", "IK004"):
            print(json.dumps({"released": False, "reason": _describe(exc)}) if args.json else
                  f"not released: {_describe(exc)}")
            return RELEASE_REFUSED
        if exc.sqlstate == "IK003":  # gone or released since it was shown
            print(json.dumps({"released": False, "reason": "not in progress"}) if args.json
                  else f"not released: {_describe(exc)}")
            return KEY_NOT_FOUND
        raise
    if args.json:
        print(json.dumps({"released": True, "key": _jsonable(row)}, indent=2))
    else:
        print(f"released key {args.key!r} of scope {args.scope!r} ({row['attempts']} "
              f"attempt(s), in progress since {row['created_at']}, recovery point "
              f"{row['recovery_point']!r}): the next retry runs afresh")
    return 0


def _older_than(text: str) -> float:
    return _seconds(text)


def keys_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="keys_action", metavar="ACTION", required=True)
    show = sub.add_parser("show", help="everything stored about one key but its body",
                          description="State, lease (expiry, expired?; never the token), attempts, "
                          "recovery point, stored status, content type and headers, body "
                          "size, timestamps and the partition holding the key. The body only "
                          "with --body. Exit status 4 when the key is not stored.")
    show.add_argument("scope")
    show.add_argument("key")
    show.add_argument("--body", action="store_true", help="include the stored body")
    show.add_argument("--json", action="store_true", help="print one JSON object")
    lst = sub.add_parser("list", help="stored keys, oldest first, without bodies",
                         description="Reads every partition of idempotency.keys: for an "
                         "investigation, not for monitoring (use idempotency.metrics()).")
    lst.add_argument("--scope", help="only this scope")
    lst.add_argument("--state", choices=("in_progress", "completed", "released"),
                     help="only this state")
    lst.add_argument("--older-than", type=_older_than, metavar="SECONDS",
                     help="only keys created at least SECONDS ago")
    lst.add_argument("--expired-leases", action="store_true",
                     help="only keys in progress whose lease expired")
    lst.add_argument("--limit", type=_positive, default=100, metavar="N",
                     help="at most N keys (default 100, at most 10000)")
    lst.add_argument("--json", action="store_true", help="print a JSON array")
    rel = sub.add_parser("release", help="release a stuck key in progress (schema owner only)",
                         description="For a key whose worker is gone while its lease still "
                         "runs (every retry answers 409): release it so the next retry runs "
                         "afresh (without the recovery point). Fenced: if a retry or a "
                         "completer takes the key over meanwhile, nothing is released (exit "
                         "5). Asks for confirmation unless --yes. Exit status 4: not stored; "
                         "5: completed, released or taken over; 6: not confirmed.")
    rel.add_argument("scope")
    rel.add_argument("key")
    rel.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    rel.add_argument("--json", action="store_true", help="print the outcome as JSON")
    for action in (show, lst, rel):  # --dsn after the action too (keys show --dsn DSN S K)
        action.add_argument("--dsn", metavar="DSN", default=argparse.SUPPRESS,
                            help="as for keys (default: $DATABASE_URL)")


COMMANDS: list[Command] = [
    Command(
        "migrate", run=cmd_migrate, database=True,
        help="apply pending migrations to a database",
        description="Apply the bundled migrations the database lacks, each in its own "
        "transaction under an advisory lock, so concurrent runs are safe and a second run "
        "does nothing. Migrations applied earlier with psql or another tool are recognised "
        "(each records itself in idempotency.migrations). Prints each migration it applies, "
        "or 'up to date'.",
    ),
    Command(
        "sql", run=cmd_sql,
        help="print the install SQL (all migrations) to stdout",
        description="Print every bundled migration, concatenated in order, each between two "
        "statements that save and restore the installer's search_path, for another "
        "migration tool or for psql: pg-idempotency sql | psql -X -1 -v ON_ERROR_STOP=1 "
        "-d DSN. The script records its versions in idempotency.migrations, so a later "
        "'pg-idempotency migrate' applies only newer migrations.",
    ),
    Command(
        "sql-path", run=cmd_sql_path,
        help="print the folder of the installed migration files",
        description="Print the folder where the installed package keeps its migration files "
        "(NNNN_name.sql), for a tool that reads them itself: Django RunSQL, Alembic, Flyway, "
        "a psql loop (docs/install.md). Also pg_idempotency.migrate.sql_path().",
    ),
    Command(
        "maintain", run=cmd_maintain, database=True, needs_schema=True,
        arguments=maintain_arguments,
        help="run retention maintenance once (for cron or a Kubernetes CronJob)",
        description="Run idempotency.maintain(): create partitions ahead, move rows out of "
        "the default partition, write tombstones if enabled, drop partitions wholly older "
        "than the retention. A drop never waits long for its lock: it is skipped and "
        "reported, and the run is retried a few times. Prints every step. Exit status 3 "
        "when a partition was still skipped for a lock after the last attempt. Run it as "
        "the schema owner or a role granted kind 'maintainer' (grant_usage). See "
        "docs/maintenance.md.",
    ),
    Command(
        "status", run=cmd_status, database=True, needs_schema=True,
        arguments=status_arguments,
        help="show keys by scope and state, expired leases, partitions and the next drop",
        description="Read idempotency.key_status() and idempotency.partition_status() and "
        "print one line per scope (the busiest --limit scopes) with its keys in progress, "
        "completed and as tombstones, the oldest in-progress key and the expired leases "
        "waiting for a takeover; then the partitions with row counts and sizes, and the "
        "next drop. --json prints the same as one JSON object.",
    ),
    Command(
        "keys", run=cmd_keys, database=True, needs_schema=True, arguments=keys_arguments,
        help="show, list or release keys (schema owner)",
        description="Inspect one key (show), find keys by scope, state, age or expired lease "
        "(list), and release a key stuck in progress (release). Bodies are never shown "
        "unless asked for. Exit status: 0 done, 1 database error, 2 usage, 4 key not "
        "stored, 5 release refused, 6 release not confirmed. See docs/operations.md.",
    ),
    Command(
        "demo", run=cmd_demo, database=True, arguments=demo_arguments,
        help="put the payments example through a retry storm (needs the 'demo' extra)",
        description="Serve the payments example and an unprotected twin of its POST "
        "/payments with uvicorn on 127.0.0.1, drive both with the retrying client under "
        "injected faults (answers lost after commit, client timeouts, double submits, "
        "workers killed after charging, keys reused with another amount), then print what "
        "the database shows: charges, ledger rows, duplicates, lost payments. Installs the "
        "idempotency schema if missing; the demo's tables go to schema idempotency_demo. "
        "Exits 1 if the protected endpoint shows any duplicate or lost payment. "
        "See docs/demo.md.",
    ),
]


def build_parser(commands: Sequence[Command] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Idempotency keys done inside PostgreSQL: install and upgrade the "
        "'idempotency' schema.",
        epilog=f"Run '{PROG} COMMAND --help' for the options of a command. Commands that "
        "use a database take --dsn, or read the DATABASE_URL environment variable.",
    )
    parser.add_argument("--version", action="version",
                        version=f"{PROG} {__version__} (needs schema {SCHEMA_VERSION})")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS if commands is None else commands:
        p = sub.add_parser(command.name, help=command.help, description=command.description)
        if command.database:
            p.add_argument(
                "--dsn",
                metavar="DSN",
                help="libpq connection string or URI, e.g. "
                "postgresql://user@host:5432/dbname (default: the DATABASE_URL environment "
                "variable). Prefer the environment variable or ~/.pgpass for a password: "
                "command lines are visible to other users.",
            )
        if command.arguments is not None:
            command.arguments(p)
        p.set_defaults(command_spec=command)
    return parser


def run_command(command: Command, args: argparse.Namespace) -> int:
    if not command.database:
        return command.run(args, None)
    dsn = args.dsn or os.environ.get("DATABASE_URL")
    if not dsn:
        raise CliError("no database given: pass --dsn DSN or set DATABASE_URL", status=2)
    with _connect(dsn) as conn:
        if command.needs_schema:
            args.schema_migration = _require_schema(conn)
        return command.run(args, conn)


def _bundled_names() -> dict[int, str]:
    try:
        return {m.version: m.name for m in migrations()}
    except MigrationError as exc:
        raise CliError(str(exc)) from None


def _require_schema(conn: psycopg.Connection) -> int:
    """The newest migration the database has; one line when the schema is missing or older
    than the one this package needs."""
    names = _bundled_names()
    try:
        row = conn.execute(queries.SCHEMA_INSTALLED, prepare=False).fetchone()
        present = row[0] if row else False
        version = (conn.execute(queries.SCHEMA_VERSION, prepare=False).fetchone()
                   if present else None)
        installed = version[0] if version else None
    except psycopg.Error as exc:
        raise CliError(f"cannot read the idempotency schema: {_describe(exc)}") from None
    where = f"database {conn.info.dbname!r}"
    if installed is None:
        raise CliError(f"the idempotency schema is not installed in {where}: run "
                       f"'{PROG} migrate' first")
    if names and installed < max(names):
        raise CliError(f"the idempotency schema in {where} is at {schema_version(installed)} "
                       f"(migration {installed:04d}), {PROG} {__version__} needs "
                       f"{SCHEMA_VERSION} (migration {max(names):04d}): run '{PROG} migrate' "
                       "first")
    return int(installed)


def _connect(dsn: str) -> psycopg.Connection:
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.Error as exc:
        raise CliError(f"invalid DSN: {_one_line(str(exc))}", status=2) from None
    for port in str(params.get("port") or "").split(","):
        if port and not (port.isdigit() and 1 <= int(port) <= 65535):
            raise CliError(f"invalid DSN: port {port!r} is not a number from 1 to 65535",
                           status=2)
    kwargs: dict[str, Any] = {"application_name": PROG}
    if "application_name" in params:
        kwargs.pop("application_name")
    if "connect_timeout" not in params and not os.environ.get("PGCONNECT_TIMEOUT"):
        kwargs["connect_timeout"] = DEFAULT_CONNECT_TIMEOUT
    try:
        return psycopg.connect(dsn, autocommit=True, **kwargs)
    except psycopg.ProgrammingError as exc:  # a malformed DSN libpq only refuses now
        raise CliError(f"invalid DSN: {_one_line(str(exc))}", status=2) from None
    except psycopg.Error as exc:
        message = _one_line(str(exc))
        if _BAD_OPTION.search(message):  # libpq refused an option's value: still the DSN
            raise CliError(f"invalid DSN: {message}", status=2) from None
        raise CliError(f"cannot connect: {message}") from None


#: libpq's words for an option value it refuses before connecting (sslmode=bogus,
#: connect_timeout=x, port=abc): a usage error, not an unreachable server.
_BAD_OPTION = re.compile(r"invalid (\w+ )+value|invalid integer value|invalid port number")


def _describe(exc: psycopg.Error) -> str:
    """'SQLSTATE 23505: duplicate key ...' (the primary message only). A permission error
    (42501) says first what to do: the CLI's commands read the schema's tables, which only the
    schema owner can (an application role granted by grant_usage() has its functions alone;
    a 'maintainer' role may run maintain and status)."""
    message = exc.diag.message_primary or str(exc)
    if exc.sqlstate == "42501":
        return (f"run this as the schema owner (the role that ran '{PROG} migrate'; for "
                f"maintain and status, a role granted kind 'maintainer' will do), not as an "
                f"application role (SQLSTATE 42501: {_one_line(message)})")
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
        return run_command(args.command_spec, args)
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
