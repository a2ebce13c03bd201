"""Long-running operations: answer ``202 Accepted`` now, let a worker finish the key later.

The queue is pgmq (``pip install 'pg-idempotency[jobs]'``; its SQL-only install, bundled in the
``pgmq`` package, needs no server extension). Its ``send`` is a plain SQL function, so the job is
enqueued in the caller's transaction: :func:`enqueue` and ``op.accept()`` commit together or not
at all, and a crash between them leaves neither.

    with idem.operation(conn, scope, key, request) as op:
        if op.replay or op.accepted:
            return op.replay or op.accepted             # final result, or the same 202
        jobs.enqueue(conn, "captures", op, {"amount": 50})
        op.accept(202, {"status_url": f"/captures/{key}"})   # commits the job with it

    worker = jobs.Worker(conn, heartbeat_conn, "captures", capture, lease=30)
    while True:
        worker.run_once() or time.sleep(1)

The worker runs the handler under the key's lease: a thread heartbeats the lease and hides the
message from other readers (pgmq visibility timeout) in short transactions on a second
connection, while the handler's writes, ``complete`` and the deletion of the message commit in
one transaction on the first. If the worker dies, the lease and the message's visibility run
out together; the next reader of the message takes the key over (outcome resumed, a new fencing
token, the recovery point) and runs the handler again, and the dead worker's token is fenced.
The worker takes sync connections; an async handler (the ASGI middleware's) enqueues with
:func:`aenqueue`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from . import _exec, _wire, api
from . import queries as Q
from ._calls import DEFAULT_LEASE
from ._results import Outcome, load_json
from .errors import AlreadyCompleted, KeyNotFound, LeaseLost, UsageError

__all__ = ["Job", "Worker", "aenqueue", "create_queue", "enqueue", "install_pgmq"]


def install_pgmq(conn: psycopg.Connection[Any]) -> bool:
    """Install pgmq's SQL (schema ``pgmq``) unless it is there; True if it was installed.
    Runs in its own transaction: ``conn`` must be idle."""
    from pgmq.install import get_embedded_install_sql  # the [jobs] extra

    with conn.transaction():
        row = conn.execute(Q.PGMQ_INSTALLED, prepare=_exec.PREPARE).fetchone()
        if row and row[0]:
            return False
        conn.execute(get_embedded_install_sql(), prepare=_exec.PREPARE)
    return True


def create_queue(conn: psycopg.Connection[Any], queue: str) -> None:
    """``pgmq.create(queue)`` (a no-op when it exists), in its own transaction."""
    with conn.transaction():
        conn.execute(Q.PGMQ_CREATE, {"queue": queue}, prepare=_exec.PREPARE)


def enqueue(conn: psycopg.Connection[Any], queue: str, op: Any, payload: Any = None) -> int:
    """Send the job of operation ``op`` (scope, key, its lease token) with ``payload`` (a JSON
    value) to ``queue``, in the transaction open on ``conn``: call ``op.accept()`` after it,
    which commits both. Returns the message id."""
    row = conn.execute(Q.PGMQ_SEND, _send_params("enqueue()", queue, op, payload),
                       prepare=_exec.PREPARE).fetchone()
    assert row is not None
    return int(row[0])


async def aenqueue(conn: psycopg.AsyncConnection[Any], queue: str, op: Any,
                   payload: Any = None) -> int:
    """:func:`enqueue` on an async connection (an ASGI handler's ``op.conn``)."""
    cur = await conn.execute(Q.PGMQ_SEND, _send_params("aenqueue()", queue, op, payload),
                             prepare=_exec.PREPARE)
    row = await cur.fetchone()
    assert row is not None
    return int(row[0])


def _send_params(what: str, queue: str, op: Any, payload: Any) -> dict[str, Any]:
    if op.lease_token is None:
        raise UsageError(f"{what}: the operation does not hold the key")
    msg = {"scope": op.scope, "key": op.key, "lease_token": op.lease_token, "payload": payload}
    return {"queue": queue, "msg": Jsonb(msg)}


@dataclass
class Job:
    """What the handler gets: run the work on ``conn`` (a transaction is open) and return
    ``(status, body)`` or ``(status, body, headers)``; it is stored with ``complete`` in that
    transaction. ``resumed``: an earlier worker died; reconcile from ``recovery_point``."""

    conn: psycopg.Connection[Any]
    scope: str
    key: str
    lease_token: int
    payload: Any
    msg_id: int
    resumed: bool = False
    recovery_point: str | None = None
    #: How often the message was read (1 the first time).
    read_count: int = 1


Handler = Callable[[Job], tuple[Any, ...]]


class Worker:
    """Runs jobs of one pgmq queue under their keys' leases.

    ``conn`` runs the handler's transaction; ``heartbeat_conn`` (another connection) extends
    the lease and the message's visibility every ``heartbeat_every`` seconds (default: a third
    of the lease). Both connections should be in autocommit mode."""

    def __init__(self, conn: psycopg.Connection[Any], heartbeat_conn: psycopg.Connection[Any],
                 queue: str, handler: Handler, *, lease: timedelta | float = DEFAULT_LEASE,
                 heartbeat_every: float | None = None) -> None:
        self.conn = conn
        self.heartbeat_conn = heartbeat_conn
        self.queue = queue
        self.handler = handler
        self.lease = lease.total_seconds() if isinstance(lease, timedelta) else float(lease)
        self.heartbeat_every = heartbeat_every or self.lease / 3
        self._vt = max(1, round(self.lease))

    def run_once(self) -> bool:
        """Read one message and handle it; False when the queue had none visible."""
        with self.conn.transaction():
            with self.conn.cursor(row_factory=_wire.dict_rows(self.conn)) as cur:
                msg = cur.execute(Q.PGMQ_READ, {"queue": self.queue, "vt": self._vt},
                                  prepare=_exec.PREPARE).fetchone()
        if msg is None:
            return False
        body = load_json(msg["message"])
        job = Job(self.conn, body["scope"], body["key"], body["lease_token"], body.get("payload"),
                  msg["msg_id"], read_count=msg["read_ct"])
        if not self._own(job):
            return True
        self._run(job)
        return True

    def _own(self, job: Job) -> bool:
        """Make sure this worker holds the key's lease, or dispose of the message."""
        try:
            if job.read_count == 1:
                # First delivery: the token the request enqueued is the key's token.
                with self.conn.transaction():
                    api.heartbeat(self.conn, job.scope, job.key, job.lease_token,
                                  lease=self.lease)
                return True
            # Redelivered: the reader before us died or stalled. Take the key over like a
            # retry would; the earlier reader's token is fenced from now on.
            with self.conn.transaction():
                result = api.takeover(self.conn, job.scope, job.key, lease=self.lease)
        except (LeaseLost, AlreadyCompleted, KeyNotFound):
            self._delete(job)  # completed, released or superseded: nothing to do
            return False
        if result.outcome is Outcome.RESUMED:
            assert result.lease_token is not None
            job.lease_token, job.resumed = result.lease_token, True
            job.recovery_point = result.recovery_point
            return True
        if result.outcome is Outcome.REPLAY:
            self._delete(job)
            return False
        # Someone holds a live lease (a stalled worker, or a retry that took over): look again
        # when it may have run out.
        wait = result.retry_after.total_seconds() if result.retry_after else self.lease
        with self.conn.transaction():
            self.conn.execute(Q.PGMQ_SET_VT, {"queue": self.queue, "msg_id": job.msg_id,
                                              "vt": max(1, round(wait))}, prepare=_exec.PREPARE)
        return False

    def _run(self, job: Job) -> None:
        stop = threading.Event()
        beat = threading.Thread(target=self._heartbeat, args=(job, stop), daemon=True)
        beat.start()
        try:
            with self.conn.transaction():
                answer = self.handler(job)
                status, body = answer[0], answer[1]
                headers: Mapping[str, str] | None = answer[2] if len(answer) > 2 else None
                api.complete(self.conn, job.scope, job.key, job.lease_token, status, body,
                             headers=headers)
                self.conn.execute(Q.PGMQ_DELETE, {"queue": self.queue, "msg_id": job.msg_id},
                                  prepare=_exec.PREPARE)
        finally:
            stop.set()
            beat.join()

    def _heartbeat(self, job: Job, stop: threading.Event) -> None:
        conn = self.heartbeat_conn
        while not stop.wait(self.heartbeat_every):
            try:
                with conn.transaction():
                    api.heartbeat(conn, job.scope, job.key, job.lease_token, lease=self.lease)
                    conn.execute(Q.PGMQ_SET_VT, {"queue": self.queue, "msg_id": job.msg_id,
                                                 "vt": self._vt}, prepare=_exec.PREPARE)
            except (LeaseLost, AlreadyCompleted, KeyNotFound, psycopg.Error):
                return  # fenced or disconnected: complete() will tell the handler's transaction

    def _delete(self, job: Job) -> None:
        with self.conn.transaction():
            self.conn.execute(Q.PGMQ_DELETE, {"queue": self.queue, "msg_id": job.msg_id},
                              prepare=_exec.PREPARE)
