"""A payments service in Flask: the code of docs/flask.md, as one file.

    pip install '.[flask,binary]'                       # in the clone
    pg-idempotency migrate --dsn "$OWNER_URL"           # as the schema owner, who also makes
                                                        # the ledger table (docs/flask.md)
    DATABASE_URL=... flask --app examples/flask_payments/app.py run   # the application role

    curl -X POST localhost:5000/payments -H 'X-Account: acct_42' \\
         -H 'Idempotency-Key: order-7f3a' -H 'Content-Type: application/json' \\
         -d '{"amount": 50, "currency": "EUR"}'

POST /payments requires an Idempotency-Key. The decorator claims it on a connection of the pool
(given back at once) and hands the view ``get_operation().conn``, which takes a connection of
the pool at the view's first statement and holds an open transaction on it; the view
writes the ledger row on it and returns its answer, which the decorator stores with complete()
in the same transaction before it commits: the row and the replayable answer exist together or
not at all. A retry gets the stored answer, byte for byte, with Idempotent-Replayed: true.
"""

from __future__ import annotations

import os
import re
import uuid

from flask import Flask, Request, jsonify, request
from psycopg_pool import ConnectionPool

from pg_idempotency.flask import Idempotency, get_operation

# One row per payment: the retry storm of tests/frameworks/test_http_adapters.py counts them.
SCHEMA = """
CREATE TABLE ledger (
    payment_id text PRIMARY KEY,
    account text NOT NULL, amount integer NOT NULL CHECK (amount > 0), currency text NOT NULL
)
"""


def caller_account(req: Request) -> str | None:
    """Whose keys these are. A real service takes the authenticated account, not a header."""
    return req.headers.get("X-Account")


def create_app(dsn: str | None = None, *, wait: float = 10.0, lease: float = 30.0,
               pool_size: int = 10) -> Flask:
    """The app, on DATABASE_URL unless dsn is given (`flask --app app.py run` calls it so)."""
    if dsn is None and "DATABASE_URL" not in os.environ:
        raise RuntimeError("set DATABASE_URL to the application role's connection string")
    pool = ConnectionPool(dsn or os.environ["DATABASE_URL"], min_size=1, max_size=pool_size,
                          open=True)
    with pool.connection() as conn:
        # The table is the schema owner's to make: the application's role has no CREATE on
        # the schema, and CREATE TABLE IF NOT EXISTS asks for it even when the table exists.
        # Made here only where it is missing (a sandbox whose role owns the schema).
        if conn.execute("SELECT to_regclass('ledger')").fetchone()[0] is None:
            conn.execute(SCHEMA)
    # wait: a retry that finds the first attempt still running waits for its answer (then
    # replays it) up to this many seconds before a 409.
    idem = Idempotency(pool, scope=caller_account, wait=wait, lease=lease)
    app = Flask(__name__)
    app.extensions["pool"] = pool

    @app.post("/payments")
    @idem.idempotent  # the Idempotency-Key header is required here
    def create_payment():  # type: ignore[no-untyped-def]
        payment = request.get_json()  # not JSON: Flask's 400, not stored (the key is released)
        amount = payment.get("amount") if isinstance(payment, dict) else None
        currency = payment.get("currency", "EUR") if isinstance(payment, dict) else None
        # A client's mistake is a 4xx, stored as the key's result like any answer; checked
        # here so that no value the ledger's columns refuse reaches them (a 500).
        if (type(amount) is not int or not 0 < amount < 2**31
                or not isinstance(currency, str) or not re.fullmatch("[A-Z]{3}", currency)):
            return {"error": "send a JSON object: amount, a positive integer; currency, "
                             "three capital letters (default EUR)"}, 422
        op = get_operation()
        payment_id = f"pay_{uuid.uuid4().hex[:12]}"
        op.conn.execute(  # the business write, in the transaction the answer commits with
            "INSERT INTO ledger (account, amount, currency, payment_id) "
            "VALUES (%s, %s, %s, %s)",
            (caller_account(request), amount, currency, payment_id))
        response = jsonify(id=payment_id, amount=amount, currency=currency)
        response.status_code = 201
        response.headers["Location"] = f"/payments/{payment_id}"  # stored and replayed
        return response

    return app


if __name__ == "__main__":
    create_app().run(port=5000)
