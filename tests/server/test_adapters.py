"""The package does not depend on the connection's type adapters.

Django registers a text loader for jsonb on its psycopg connections, and an application can
register anything. Every replay used to go through psycopg's jsonb loader, so on a Django
connection `ClaimResult.from_row` got a str for the headers and crashed. The queries now cast
jsonb to text and the package parses it itself: these tests register hostile loaders on plain
psycopg connections (sync and async) and check that replays return the stored headers and body.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import psycopg
import pytest
import tomllib
from psycopg.adapt import Loader
from psycopg.types.string import TextLoader

import pg_idempotency as idem
from pg_idempotency import aio

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.anyio


class SentinelLoader(Loader):
    """A loader no package code could make sense of."""

    def load(self, data: Any) -> Any:
        return object()


async def call(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


@pytest.fixture(params=["sync-text", "async-text", "sync-sentinel", "async-sentinel"])
async def hostile(request: pytest.FixtureRequest, db: str) -> Any:
    """(api module, connection) with jsonb and json loaders replaced."""
    flavour, loader = request.param.split("-")
    loader_cls = TextLoader if loader == "text" else SentinelLoader
    if flavour == "sync":
        with psycopg.connect(db, autocommit=True) as conn:
            for typ in ("json", "jsonb"):
                conn.adapters.register_loader(typ, loader_cls)
            yield idem, conn
    else:
        async with await psycopg.AsyncConnection.connect(db, autocommit=True) as conn:
            for typ in ("json", "jsonb"):
                conn.adapters.register_loader(typ, loader_cls)
            yield aio, conn


async def _enter(op_cm: Any) -> Any:
    return await op_cm.__aenter__() if hasattr(op_cm, "__aenter__") else op_cm.__enter__()


async def _exit(op_cm: Any) -> None:
    if hasattr(op_cm, "__aexit__"):
        await op_cm.__aexit__(None, None, None)
    else:
        op_cm.__exit__(None, None, None)


async def test_operation_replay_with_hostile_jsonb_loaders(hostile: Any) -> None:
    api, conn = hostile
    request = {"amount": 50, "currency": "EUR"}
    body = {"id": "ch_1", "amount": 50, "nested": {"b": [1, 2.5, None, True]}}
    headers = {"Location": "/charges/ch_1", "X-Request": "r-1"}

    cm = api.operation(conn, "acct_42", "order-loaders", request)
    op = await _enter(cm)
    assert op.replay is None
    await call(op.complete(201, body, headers=headers))
    await _exit(cm)

    cm = api.operation(conn, "acct_42", "order-loaders", request)
    op = await _enter(cm)
    try:
        assert op.replay is not None
        assert op.replay.status == 201
        assert op.replay.headers == headers
        assert op.replay.body == body
        assert op.replay.json() == body
        assert op.replay.content == (
            b'{"id":"ch_1","amount":50,"nested":{"b":[1,2.5,null,true]}}')
    finally:
        await _exit(cm)

    # The lower-level claim gives the same stored response.
    r = await call(api.claim(conn, "acct_42", "order-loaders", request))
    assert r.outcome is idem.Outcome.REPLAY
    assert r.response.headers == headers and r.response.body == body


async def test_accept_and_takeover_with_hostile_jsonb_loaders(hostile: Any) -> None:
    api, conn = hostile
    r = await call(api.claim(conn, "acct_42", "capture-loaders", {"amount": 7}, lease=60))
    assert r.outcome is idem.Outcome.CLAIMED
    # accept() returns the body as jsonb stored it.
    await call(conn.execute("BEGIN"))
    row = await call(api.accept(conn, "acct_42", "capture-loaders", r.lease_token, 202,
                                {"status": "pending", "n": 1.50},
                                headers={"Location": "/captures/1"}))
    await call(conn.execute("COMMIT"))
    assert row is not None
    replay = await call(api.claim(conn, "acct_42", "capture-loaders", {"amount": 7}))
    assert replay.outcome is idem.Outcome.ACCEPTED
    assert replay.response.status == 202
    assert replay.response.headers == {"Location": "/captures/1"}
    assert replay.response.body == {"status": "pending", "n": 1.50}


def test_pure_functions_and_errors_are_exported_with_sync_async_parity() -> None:
    import importlib

    from pg_idempotency import api

    # The function shadows the submodule as a package attribute; the submodule still imports.
    fingerprint_module = importlib.import_module("pg_idempotency.fingerprint")

    assert idem.fingerprint is fingerprint_module.fingerprint
    assert idem.canonical_json({"b": 1, "a": [1.50]}) == '{"a":[1.5],"b":1}'
    assert len(idem.fingerprint({"amount": 50})) == 32
    assert aio.derive_key is api.derive_key is idem.derive_key
    assert sorted(aio.__all__) == sorted(api.__all__)
    assert all(hasattr(aio, name) and hasattr(api, name) for name in api.__all__)
    assert issubclass(idem.KeyExpired, idem.IdempotencyError)
    assert idem.PgCronNotInstalled.sqlstate == "IK020"
    # The installed package is the checkout's (make test installs it from here).
    assert idem.__version__ == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "version"]
