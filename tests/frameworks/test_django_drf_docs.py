"""docs/django.md's Django REST framework section, run as written: its views module (an
APIView, a ViewSet and an ``@api_view`` function view) with the default settings (whose
``REPLAY_HEADERS`` keep DRF's Allow and Vary), on the example app's models, through Django's
test client on real PostgreSQL with ATOMIC_REQUESTS off and on."""

from __future__ import annotations

import importlib
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from django.test import Client, override_settings
from helpers import ROOT
from helpers.django_example import _migrated

FENCE = re.compile(r"^```(\w*)\n(.*?)^```[ \t]*$", re.M | re.S)
PATHS = ["/drf/payments/", "/drf/viewset/payments/", "/drf/pay/"]


def block(containing: str) -> str:
    """The one python block of docs/django.md that contains ``containing``."""
    found = [m.group(2) for m in FENCE.finditer((ROOT / "docs" / "django.md").read_text())
             if m.group(1) == "python" and containing in m.group(2)]
    assert len(found) == 1, f"docs/django.md: {len(found)} python blocks with {containing!r}"
    return found[0]


@pytest.fixture(params=[False, True], ids=["autocommit", "atomic_requests"])
def doc_app(request: pytest.FixtureRequest, empty_db: str, tmp_path: Path) -> Iterator[str]:
    """The page's views module as ``drf_doc_app.views`` (its ``.models``: the example's)."""
    package = tmp_path / "drf_doc_app"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "models.py").write_text("from ledger.models import Account, Payment, Receipt\n")
    (package / "views.py").write_text(block("class PaymentView(APIView)"))
    sys.path.insert(0, str(tmp_path))
    try:
        importlib.import_module("drf_doc_app.views")
        # The example app has no django.contrib.auth, which DRF's default authentication
        # needs (a startproject project has it): no authentication here.
        drf = {"DEFAULT_AUTHENTICATION_CLASSES": [], "UNAUTHENTICATED_USER": None}
        with override_settings(ROOT_URLCONF="drf_doc_app.views", MIDDLEWARE=[], DEBUG=False,
                               PG_IDEMPOTENCY={}, REST_FRAMEWORK=drf):
            yield from _migrated(empty_db, request.param)
    finally:
        sys.path.remove(str(tmp_path))
        for name in [n for n in sys.modules if n.startswith("drf_doc_app")]:
            del sys.modules[name]


def post(path: str, key: str, body: Any) -> Any:
    return Client(raise_request_exception=False).post(
        path, json.dumps(body), content_type="application/json", HTTP_IDEMPOTENCY_KEY=key,
        HTTP_X_MERCHANT="m1")


def counts(dsn: str) -> tuple[int, int]:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT (SELECT count(*) FROM ledger_payment), "
                           "(SELECT count(*) FROM ledger_receipt)").fetchone()
    assert row is not None
    return row[0], row[1]


def test_the_pages_drf_views(doc_app: str) -> None:
    body = {"account": "alice", "amount": "12.50"}
    for n, path in enumerate(PATHS, 1):
        invalid = post(path, f"k{n}", {"account": "alice", "amount": "x"})
        assert invalid.status_code == 400, invalid.content  # released: the key may be reused
        first = post(path, f"k{n}", body)
        assert first.status_code == 201, first.content
        assert "POST" in first.headers["Allow"]
        again = post(path, f"k{n}", body)
        assert again.headers["Idempotent-Replayed"] == "true"
        assert (again.status_code, again.content) == (201, first.content)
        for name in ("Location", "Allow", "Vary", "Content-Type"):
            assert again.headers[name] == first.headers[name], name
        assert post(path, f"k{n}", dict(body, amount="99")).status_code == 422
        assert counts(doc_app) == (n, n)
