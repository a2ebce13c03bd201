"""docs/python.md's "On asyncpg" examples, run as written: the program (a subprocess with
DATABASE_URL) and the FastAPI app on an asyncpg pool made in its lifespan (served by uvicorn)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import types
from pathlib import Path

import httpx
import psycopg
from helpers.http import uvicorn_server

from pgharness import WAIT_BOUND

DOC = Path(__file__).resolve().parents[2] / "docs" / "python.md"
FENCE = re.compile(r"^```python\n(.*?)^```[ \t]*$", re.M | re.S)


def example(containing: str) -> str:
    found = [m.group(1) for m in FENCE.finditer(DOC.read_text()) if containing in m.group(1)]
    assert len(found) == 1, f"docs/python.md: {len(found)} python blocks with {containing!r}"
    return found[0]


def test_the_program(db: str, tmp_path: Path) -> None:
    script = tmp_path / "charge.py"
    script.write_text(example("asyncio.run(main())"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=WAIT_BOUND, env={**env, "DATABASE_URL": db},
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    first, again = done.stdout.splitlines()
    assert first == again == "(201, {'entry': 1, 'amount': 50})"
    with psycopg.connect(db) as conn:
        assert conn.execute("SELECT account, amount FROM ledger").fetchall() == [
            ("acct_42", 50)]


def test_the_fastapi_app(db: str) -> None:
    with psycopg.connect(db, autocommit=True) as conn:
        conn.execute(example("asyncio.run(main())").split('LEDGER = """')[1].split('"""')[0])
    module = types.ModuleType("asyncpg_doc_app")
    os.environ["DATABASE_URL"] = db
    try:
        exec(compile(example("pool=lambda: app.state.pool"), "docs/python.md", "exec"),  # noqa: S102
             module.__dict__)
        with uvicorn_server(module.app) as base, httpx.Client(base_url=base,
                                                                timeout=WAIT_BOUND) as client:
            def pay(account: str | None, amount: int) -> httpx.Response:
                headers = {"Idempotency-Key": "order-1"}
                if account is not None:
                    headers["X-Account"] = account
                return client.post("/payments", json={"amount": amount}, headers=headers)

            first = pay("acct_42", 50)
            assert first.status_code == 201, first.text
            assert first.json() == {"entry": 1} and first.headers["location"] == "/payments/1"
            again = pay("acct_42", 50)
            assert again.status_code == 201 and again.content == first.content
            assert again.headers["idempotent-replayed"] == "true"
            assert again.headers["location"] == "/payments/1"
            assert pay("acct_42", 51).status_code == 422
            assert pay(None, 50).status_code == 401
            other = pay("acct_7", 50)  # another caller's key: its own
            assert other.status_code == 201 and other.json() == {"entry": 2}
    finally:
        del os.environ["DATABASE_URL"]
    with psycopg.connect(db) as conn:
        assert conn.execute("SELECT account, amount FROM ledger ORDER BY id").fetchall() == [
            ("acct_42", 50), ("acct_7", 50)]
