"""Long-running operations through pgmq: accept() and the job commit together, retries get the
same 202 while a worker runs the job under the key's lease, a dead worker's job is resumed once.

On both servers: pgmq's SQL-only install (the pgmq package) works on 15 and 18 alike.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

import pg_idempotency as idem
from pg_idempotency import jobs
from pgharness import WAIT_BOUND, wait_until

QUEUE = "captures"
SCOPE = "acct_1"
LEASE = 1.0  # seconds: a dead worker's job comes back after about this long
# The lease of the worker that dies: the retry right after its death must still find it live
# (time passes between the last heartbeat and that retry: the kill, the thread's end; several
# seconds on a loaded machine), and the message comes back after it.
DEAD_LEASE = 5 * LEASE


@pytest.fixture
def qdb(db: str) -> Iterator[str]:
    with psycopg.connect(db, autocommit=True) as conn:
        assert jobs.install_pgmq(conn)
        jobs.create_queue(conn, QUEUE)
        conn.execute("CREATE TABLE captured (key text PRIMARY KEY, amount int, resumed bool)")
    yield db


def request(conn: psycopg.Connection[Any], key: str, *, crash: bool = False) -> tuple[int, Any]:
    """What the HTTP handler does: the same 202 while the job runs, the final answer after."""
    with idem.operation(conn, SCOPE, key, {"amount": 50}, lease=LEASE) as op:
        if op.replay or op.accepted:
            answer = op.replay or op.accepted
            return answer.status, answer.body
        jobs.enqueue(conn, QUEUE, op, {"amount": 50})
        if crash:
            raise RuntimeError("crash between enqueue and accept")
        stored = op.accept(202, {"status_url": f"/captures/{key}", "state": "pending"})
        return stored.status, stored.body


def capture(job: jobs.Job) -> tuple[int, Any]:
    job.conn.execute("INSERT INTO captured VALUES (%s, %s, %s)",
                     (job.key, job.payload["amount"], job.resumed))
    return 200, {"state": "captured", "amount": job.payload["amount"]}


def messages_sent(conn: psycopg.Connection[Any]) -> int:
    return conn.execute("SELECT total_messages FROM pgmq.metrics(%s)", (QUEUE,)).fetchone()[0]


def test_retries_while_the_job_runs_get_the_same_202(qdb: str) -> None:
    started, finish = threading.Event(), threading.Event()
    runs = []

    def slow_capture(job: jobs.Job) -> tuple[int, Any]:
        runs.append(job.lease_token)
        started.set()
        assert finish.wait(WAIT_BOUND)
        return capture(job)

    with psycopg.connect(qdb, autocommit=True) as conn, \
            psycopg.connect(qdb, autocommit=True) as wconn, \
            psycopg.connect(qdb, autocommit=True) as hconn:
        first = request(conn, "k1")
        assert first == (202, {"status_url": "/captures/k1", "state": "pending"})
        worker = jobs.Worker(wconn, hconn, QUEUE, slow_capture, lease=LEASE,
                             heartbeat_every=0.2)
        thread = threading.Thread(target=worker.run_once)
        thread.start()
        assert started.wait(WAIT_BOUND)
        # Retries over 2 lease lengths (by the clock, however few a loaded machine makes):
        # the heartbeats keep it accepted.
        answers = []
        until = time.monotonic() + 2 * LEASE
        while time.monotonic() < until or len(answers) < 5:
            answers.append(request(conn, "k1"))
            time.sleep(0.1)
        finish.set()
        thread.join(WAIT_BOUND)
        assert not thread.is_alive()
        assert answers == [first] * len(answers)
        assert len(runs) == 1
        assert messages_sent(conn) == 1
        assert worker.run_once() is False  # the message went with the completion
        final = request(conn, "k1")
        assert final == (200, {"state": "captured", "amount": 50})
        assert conn.execute("SELECT count(*) FROM captured").fetchone()[0] == 1


def test_a_killed_worker_is_resumed_once_after_the_lease(qdb: str) -> None:
    started = threading.Event()
    errors: list[BaseException] = []

    def stuck(job: jobs.Job) -> tuple[int, Any]:
        job.conn.execute("INSERT INTO captured VALUES (%s, 0, false)", (job.key,))
        started.set()
        job.conn.execute("SELECT pg_sleep(30)")  # killed in here
        return 200, {}

    def run(worker: jobs.Worker) -> None:
        try:
            worker.run_once()
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            errors.append(exc)

    with psycopg.connect(qdb, autocommit=True) as conn:
        assert request(conn, "k2")[0] == 202
        dead_w = psycopg.connect(qdb, autocommit=True)
        dead_h = psycopg.connect(qdb, autocommit=True)
        worker = jobs.Worker(dead_w, dead_h, QUEUE, stuck, lease=DEAD_LEASE,
                             heartbeat_every=0.2)
        thread = threading.Thread(target=run, args=(worker,))
        thread.start()
        assert started.wait(WAIT_BOUND)
        # The worker dies: the server ends both of its sessions.
        conn.execute("SELECT pg_terminate_backend(pid) FROM (VALUES (%s), (%s)) AS t(pid)",
                     (dead_w.info.backend_pid, dead_h.info.backend_pid))
        thread.join(WAIT_BOUND)
        assert errors and isinstance(errors[0], psycopg.OperationalError)
        dead_w.close()
        dead_h.close()
        # Until the lease runs out, retries still get the 202.
        assert request(conn, "k2")[0] == 202
        with psycopg.connect(qdb, autocommit=True) as wconn, \
                psycopg.connect(qdb, autocommit=True) as hconn:
            worker = jobs.Worker(wconn, hconn, QUEUE, capture, lease=LEASE)

            def resumed() -> int:
                # run_once() is true for any visible message, also one it puts back because
                # the dead worker's lease is still live (the message's visibility counts from
                # its read, the lease from the heartbeat after it: apart on a loaded machine).
                worker.run_once()
                return conn.execute("SELECT count(*) FROM captured").fetchone()[0]

            wait_until(resumed, "the job to come back and be captured", interval=0.1)
            assert worker.run_once() is False
        assert conn.execute("SELECT key, resumed FROM captured").fetchall() == [("k2", True)]
        assert request(conn, "k2") == (200, {"state": "captured", "amount": 50})
        row = conn.execute("SELECT attempts, state FROM idempotency.keys WHERE key = 'k2'"
                           ).fetchone()
        assert row == (2, "completed")  # one takeover: resumed once
        assert messages_sent(conn) == 1


def test_a_crash_between_enqueue_and_accept_leaves_neither(qdb: str) -> None:
    with psycopg.connect(qdb, autocommit=True) as conn:
        with pytest.raises(RuntimeError, match="crash between"):
            request(conn, "k3", crash=True)
        assert conn.execute(f"SELECT count(*) FROM pgmq.q_{QUEUE}").fetchone()[0] == 0
        key_k3 = ("SELECT state, lease_token, attempts, response_status "
                  "FROM idempotency.keys WHERE key = 'k3'")
        [released] = conn.execute(key_k3).fetchall()  # released: nothing had happened
        assert released[0] == "released" and released[3] is None
        # The retry starts cleanly: a new claim (a greater token, the first attempt), one job,
        # the 202.
        assert request(conn, "k3") == (202, {"status_url": "/captures/k3", "state": "pending"})
        [claimed] = conn.execute(key_k3).fetchall()
        assert claimed[0] == "in_progress" and claimed[1] > released[1]
        assert claimed[2:] == (1, 202)
        assert conn.execute(f"SELECT count(*) FROM pgmq.q_{QUEUE}").fetchone()[0] == 1
        with psycopg.connect(qdb, autocommit=True) as wconn, \
                psycopg.connect(qdb, autocommit=True) as hconn:
            assert jobs.Worker(wconn, hconn, QUEUE, capture, lease=LEASE).run_once()
        assert request(conn, "k3") == (200, {"state": "captured", "amount": 50})
