"""Failover with a synchronous standby (docs/operations.md, "Replication and failover"): a
primary and a standby made with pg_basebackup -R, the primary waiting for the standby on every
commit (synchronous_standby_names); sessions claim and complete keys under load; the primary is
stopped in immediate mode (every process SIGQUIT, no shutdown checkpoint, as in a crash); the
standby is promoted and must hold every completion whose COMMIT was acknowledged."""

from __future__ import annotations

import os
import subprocess
import threading
import uuid
from pathlib import Path

import psycopg
from psycopg.types.json import Jsonb

from pgharness import WAIT_BOUND, PgServer, flavour_bindir, free_port, wait_until

ROOT = Path(__file__).resolve().parents[2]
SESSIONS = 4
LOAD = 50  # acknowledged completions before the crash; sessions go on committing meanwhile
# pg_ctl's -t: seconds it waits for the server to start, promote or stop.
PG_CTL_WAIT = str(int(WAIT_BOUND))
SCOPE = "failover"


def _run(*command: str) -> None:
    """A server tool, as the test user (the one the primary runs as), without PG* variables."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PG")}, "LC_MESSAGES": "C"}
    done = subprocess.run(command, env=env, capture_output=True, text=True,
                          timeout=WAIT_BOUND + 60)  # beyond pg_ctl's own -t
    assert done.returncode == 0, f"{command[0]} failed:\n{done.stdout}{done.stderr}"


class Standby:
    """A standby of ``primary`` in the primary's private dir."""

    def __init__(self, primary: PgServer) -> None:
        assert primary.tmpdir is not None
        self.primary = primary
        self.datadir = primary.tmpdir / "standby"
        self.port = free_port()
        self.log = primary.tmpdir / "standby.log"

    def start(self) -> None:
        p = self.primary
        _run(str(p.bindir / "pg_basebackup"), "-D", str(self.datadir), "-R",
             "-X", "stream", "-c", "fast", "-h", "127.0.0.1", "-p", str(p.port), "-U", "postgres")
        # The harness gives the primary its settings on the command line, which a base backup
        # does not copy; a standby needs max_connections and the like at least as high.
        with psycopg.connect(p.dsn("postgres"), autocommit=True) as conn:
            settings = conn.execute("SELECT name, setting FROM pg_settings"
                                    " WHERE source = 'command line' AND name <> 'port'"
                                    ).fetchall()
        with (self.datadir / "postgresql.auto.conf").open("a") as conf:
            for name, value in settings:
                conf.write(f"{name} = '{value}'\n")
            conf.write(f"port = {self.port}\ncluster_name = 'standby1'\n")
        try:
            self._pg_ctl("-l", str(self.log), "-w", "-t", PG_CTL_WAIT, "start")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.log.read_text(errors='replace')[-3000:]}"
                                 ) from None

    def _pg_ctl(self, *args: str) -> None:
        _run(str(self.primary.bindir / "pg_ctl"), "-D", str(self.datadir), *args)

    def promote(self) -> None:
        self._pg_ctl("-w", "-t", PG_CTL_WAIT, "promote")

    def stop(self) -> None:
        if (self.datadir / "postmaster.pid").exists():
            self._pg_ctl("-m", "immediate", "-w", "-t", PG_CTL_WAIT, "stop")

    def dsn(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"


def test_every_acknowledged_completion_survives_a_failover_to_a_synchronous_standby() -> None:
    primary = PgServer(flavour_bindir("pg18"), name="failover-primary", extra_conf={
        # Durable and replicated, unlike the harness's fast defaults.
        "fsync": "on", "synchronous_commit": "on", "full_page_writes": "on",
        "wal_level": "replica", "max_wal_senders": "4",
    })
    with primary:
        dsn = primary.dsn("postgres")
        for migration in sorted((ROOT / "migrations").glob("*.sql")):
            primary.run_psql(dsn, migration, args=("-X", "-q", "-1", "-v", "ON_ERROR_STOP=1"))
        standby = Standby(primary)
        try:
            standby.start()
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute("ALTER SYSTEM SET synchronous_standby_names = 'standby1'")
                conn.execute("SELECT pg_reload_conf()")
                wait_until(lambda: conn.execute(
                    "SELECT count(*) FROM pg_stat_replication WHERE application_name = "
                    "'standby1' AND sync_state = 'sync'").fetchone()[0] == 1,
                    "the standby to become synchronous")

            acknowledged: list[str] = []
            lock = threading.Lock()
            stop = threading.Event()

            def session(n: int) -> None:
                try:
                    conn = psycopg.connect(dsn, autocommit=True)
                except psycopg.Error:
                    return
                i = 0
                try:
                    while not stop.is_set():
                        key = f"s{n}-{i}-{uuid.uuid4().hex[:6]}"
                        i += 1
                        token = conn.execute(
                            "SELECT lease_token FROM idempotency.claim(%s, %s, %s)",
                            (SCOPE, key, Jsonb({"n": i}))).fetchone()[0]
                        with conn.transaction():
                            conn.execute("SELECT idempotency.complete(%s, %s, %s, 201, %s)",
                                         (SCOPE, key, token, Jsonb({"key": key})))
                        with lock:  # COMMIT returned: the client saw it acknowledged
                            acknowledged.append(key)
                except psycopg.Error:
                    return  # the primary went away mid-call: not acknowledged
                finally:
                    conn.close()

            threads = [threading.Thread(target=session, args=(n,)) for n in range(SESSIONS)]
            for t in threads:
                t.start()
            # Load, counted in acknowledged completions (a fixed time gives few on a busy
            # machine); a session that failed ends its thread.
            wait_until(lambda: len(acknowledged) >= LOAD
                       or not any(t.is_alive() for t in threads),
                       f"{LOAD} acknowledged completions")
            primary.crash()  # SIGQUIT, as pg_ctl stop -m immediate, while sessions commit
            stop.set()
            for t in threads:
                t.join(WAIT_BOUND)
            assert not any(t.is_alive() for t in threads), "a session hung after the crash"
            assert len(acknowledged) >= LOAD, f"too little load: {len(acknowledged)}"

            standby.promote()
            with psycopg.connect(standby.dsn(), autocommit=True) as conn:
                assert conn.execute("SELECT pg_is_in_recovery()").fetchone()[0] is False
                found = {r[0]: (r[1], r[2]) for r in conn.execute(
                    "SELECT key, state, response_status FROM idempotency.keys "
                    "WHERE scope = %s AND key = ANY(%s)", (SCOPE, acknowledged)).fetchall()}
                missing = [k for k in acknowledged if found.get(k) != ("completed", 201)]
                assert not missing, (f"{len(missing)} of {len(acknowledged)} acknowledged "
                                     f"completions lost: {missing[:5]}")
                # And a retry after the failover replays, it does not run again.
                key = acknowledged[-1]
                request = Jsonb({"n": int(key.split("-")[1]) + 1})
                assert conn.execute("SELECT outcome, response_status FROM idempotency.claim("
                                    "%s, %s, %s)", (SCOPE, key, request)).fetchone() == (
                    "replay", 201)
        finally:
            standby.stop()


