"""The harness leaves nothing behind: no server or pgbouncer outlives an interrupted pytest.

A child pytest starts a PG 15 and a PG 18 server and a pgbouncer, reports their process ids
and sleeps; it is then interrupted as a user (Ctrl-C), CI (SIGTERM on timeout) or the OOM
killer (SIGKILL) would, and then none of those processes may be alive.

Every wait here is for an event (the child's pid file, its exit, the processes' exit): on an
idle machine the test takes a few seconds. The bounds only stop a test that would hang, and are
far beyond need, because the machine may be loaded (make test on 2 cores with load 9-12 took
more than the 60 s this test used to allow the interrupted pytest to stop its servers).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import pgharness
from pgharness import WAIT_BOUND

# Needs (tests/README.md): the child starts a PG 15 and a pgbouncer of its own.
pytestmark = [pytest.mark.pgbouncer, pytest.mark.pg15]

HARNESS = Path(__file__).resolve().parents[2] / "harness"

CHILD = textwrap.dedent("""
    import faulthandler, json, os, signal, time
    from pathlib import Path
    from pgharness import PgBouncer, PgServer, flavour_bindir

    def children(pid):
        found = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(stat.parent.name))
        return found

    # SIGUSR1 prints every thread's stack: what the parent shows if this pytest hangs.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # Ctrl-C reaches a pytest in a terminal's foreground, with Python's SIGINT handler. This
    # one inherits the suite's dispositions, and a suite started in the background by a
    # shell without job control (nohup make test &) ignores SIGINT: Python then installs no
    # handler, and the interrupt this test sends would do nothing.
    signal.signal(signal.SIGINT, signal.default_int_handler)

    def test_sleep_with_servers():
        servers = [PgServer(flavour_bindir(f), name=f).start() for f in ("pg15", "pg18")]
        bouncer = PgBouncer(servers[0]).start()
        pids = [bouncer._proc.pid]
        for srv in servers:
            pids += [srv._pg.child_process.pid, *children(srv._pg.child_process.pid)]
        # Written whole or not at all: the parent reads it as soon as the name exists.
        tmp = Path(os.environ["PIDS_FILE"] + ".tmp")
        tmp.write_text(json.dumps(pids))
        os.replace(tmp, os.environ["PIDS_FILE"])
        time.sleep(3600)
""")


def _diagnosis(child: subprocess.Popen[bytes], output: Path) -> str:
    """What a hung child pytest is doing: its Python stacks (faulthandler, SIGUSR1), its
    output so far, and the state of it and its processes, so that a failure on a busy machine
    says where it waited."""
    child.send_signal(signal.SIGUSR1)
    time.sleep(2)
    table = subprocess.run(["ps", "-o", "pid,ppid,stat,wchan:24,etime,args", "-g",
                            str(child.pid)], capture_output=True, text=True).stdout
    return f"\n--- output and stacks ---\n{output.read_text(errors='replace')[-8000:]}" \
           f"\n--- its session's processes ---\n{table}"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


# Far beyond need (see the module docstring): an idle machine needs seconds for each.
START_BOUND = 1.5 * WAIT_BOUND  # the child starts two servers (initdb, cached) and pgbouncer
STOP_BOUND = WAIT_BOUND  # the interrupted child stops them, or its watchdog does


@pytest.mark.timeout(START_BOUND + 2 * STOP_BOUND + 60)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT],
                         ids=["SIGKILL", "SIGTERM", "SIGINT"])
def test_no_server_outlives_an_interrupted_pytest(tmp_path: Path, sig: signal.Signals) -> None:
    (tmp_path / "test_child.py").write_text(CHILD)
    pids_file = tmp_path / "pids.json"
    env = {**os.environ, "PYTHONPATH": str(HARNESS), "PIDS_FILE": str(pids_file)}
    # Its output goes to a file, not a pipe: nothing it writes can block it on a pipe nobody
    # reads, and what it wrote is there to show when it fails.
    output = tmp_path / "child.out"
    with output.open("wb") as out:
        child = subprocess.Popen(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_child.py"],
            cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        started = time.monotonic()
        while not pids_file.exists() and child.poll() is None:
            if time.monotonic() - started > START_BOUND:
                why = _diagnosis(child, output)
                child.kill()
                pytest.fail(f"the child pytest did not start its servers in {START_BOUND:.0f} s:"
                            + why)
            time.sleep(0.2)
        if not pids_file.exists():  # the child exited first
            pytest.fail("the child pytest exited before starting its servers:\n"
                        + output.read_text(errors="replace"))
        pids = json.loads(pids_file.read_text())
        assert len(pids) >= 5 and all(_alive(p) for p in pids)  # bouncer, postmasters, children
        child.send_signal(sig)
        try:
            child.wait(STOP_BOUND)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the child pytest was still running {STOP_BOUND:.0f} s after {sig.name}"
                        + _diagnosis(child, output))
        stopped = time.monotonic()
        while any(_alive(p) for p in pids) and time.monotonic() - stopped < STOP_BOUND:
            time.sleep(0.1)
        assert [p for p in pids if _alive(p)] == [], (
            f"alive {time.monotonic() - stopped:.0f} s after the child pytest ended ({sig.name})")
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    process_dir = Path(pgharness.tempfile.gettempdir()) / f"pgharness-{child.pid}"
    pgharness.sweep()
    assert not process_dir.exists()
