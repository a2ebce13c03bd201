"""Django set up on the example app (examples/django_payments), as tests/frameworks/ and the HTTP
probes use it: importing this module puts the example on sys.path and calls django.setup()."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from psycopg.conninfo import conninfo_to_dict

from helpers import ROOT

EXAMPLE = ROOT / "examples" / "django_payments"
sys.path.insert(0, str(EXAMPLE))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "payments_site.settings")

import django  # noqa: E402

django.setup()

from django.core.management import call_command  # noqa: E402
from django.core.wsgi import get_wsgi_application  # noqa: E402
from django.db import connections  # noqa: E402
from django.test import Client, override_settings  # noqa: E402
from ledger import views  # noqa: E402, F401 (the example's views, for the tests)

MERCHANT = {"HTTP_X_MERCHANT": "m1"}
BODY = {"account": "alice", "amount": "12.50"}


def use_database(dsn: str, atomic_requests: bool) -> None:
    """Point Django's default alias (in every thread) at ``dsn``."""
    connections.close_all()
    info = conninfo_to_dict(dsn)
    settings_dict = connections.settings["default"]
    settings_dict.update(NAME=info["dbname"], USER=info.get("user", ""),
                         PASSWORD=info.get("password", ""), HOST=info.get("host", ""),
                         PORT=info.get("port", ""), ATOMIC_REQUESTS=atomic_requests)
    connections["default"].settings_dict.update(settings_dict)


def _migrated(dsn: str, atomic_requests: bool) -> Iterator[str]:
    use_database(dsn, atomic_requests)
    call_command("migrate", verbosity=0)
    connections.close_all()
    try:
        yield dsn
    finally:
        connections.close_all()


def post(client: Client, key: str | None, body: Any = BODY, path: str = "/payments/",
         **extra: str) -> Any:
    headers = dict(MERCHANT, **extra)
    if key is not None:
        headers["HTTP_IDEMPOTENCY_KEY"] = key
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return client.post(path, content, content_type="application/json", **headers)


@contextmanager
def django_on(dsn: str, urlconf: str) -> Iterator[Any]:
    use_database(dsn, False)
    try:
        with override_settings(ROOT_URLCONF=urlconf, MIDDLEWARE=[], DEBUG=False):
            yield get_wsgi_application()
    finally:
        connections.close_all()
