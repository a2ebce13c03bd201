"""pg_idempotency.django's log lines on real PostgreSQL 15 and 18 (issue 23, item 7): exactly
one record per event, each with the core's shape (``<event> key=<hash> ...``). Before, the
adapter logged each claim outcome, release and lost lease itself on top of the core's line for
the same event, so every event came out twice."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
from django.test import Client
from helpers.django_example import _migrated, post, views  # test_django sets up the example app

from pg_idempotency.core import key_hash


@pytest.fixture
def example_db(empty_db: str) -> Iterator[str]:
    yield from _migrated(empty_db, False)


def records(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("pg_idempotency")]


def test_one_record_per_event_through_django(example_db: str, caplog: pytest.LogCaptureFixture,
                                             monkeypatch: Any) -> None:
    caplog.set_level(logging.INFO, logger="pg_idempotency")
    client = Client()
    k1, k2 = key_hash("merchant:m1", "k1"), key_hash("merchant:m1", "k2")
    assert post(client, "k1").status_code == 201
    assert post(client, "k1").status_code == 201  # a replay
    assert post(client, "k1", {"account": "alice", "amount": "99"}).status_code == 422
    original = views.record

    def failing(account: Any, amount: Any) -> Any:
        original(account, amount)
        raise RuntimeError("card network down")

    monkeypatch.setattr(views, "record", failing)
    with pytest.raises(RuntimeError):
        post(client, "k2")
    assert records(caplog) == [
        f"claim key={k1} outcome=claimed attempts=1",
        f"complete key={k1} status=201",
        f"claim key={k1} outcome=replay attempts=1",
        f"claim key={k1} outcome=mismatch",
        f"claim key={k2} outcome=claimed attempts=1",
        f"release key={k2} reason=release",
    ], caplog.text
    assert all(r.idempotency["key_hash"] in (k1, k2)
               for r in caplog.records if r.name.startswith("pg_idempotency"))
