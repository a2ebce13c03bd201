"""SQLAlchemy engines on every driver pg_idempotency.sqlalchemy is tested with, by name:

- sync: ``psycopg`` (the package's statements on the psycopg connection itself, as by
  default), ``psycopg-text`` (the same driver, the statements through SQLAlchemy's ``text()``,
  as every other driver gets them) and ``pg8000``;
- async: ``psycopg``, ``psycopg-text`` and ``asyncpg``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import create_engine
from sqlalchemy.engine import Engine
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from pg_idempotency import sqlalchemy as pg_sa

SYNC = ["psycopg", "psycopg-text", "pg8000"]
ASYNC = ["psycopg", "psycopg-text", "asyncpg"]


def driver(flavour: str) -> str:
    return flavour.removesuffix("-text")


def sa_url(dsn: str, flavour: str) -> str:
    """A libpq URI (TCP, as the test servers give) as the flavour's SQLAlchemy URL."""
    return f"postgresql+{driver(flavour)}://" + dsn.split("://", 1)[1]


def connect_args(flavour: str, *, user: str | None = None,
                 settings: dict[str, str] | None = None) -> dict[str, Any]:
    """The login role and session settings (GUCs sent at connection start), as each driver
    takes them."""
    args: dict[str, Any] = {} if user is None else {"user": user}
    if settings:
        name = driver(flavour)
        if name == "psycopg":
            args["options"] = " ".join(f"-c {k}={v}" for k, v in settings.items())
        elif name == "asyncpg":
            args["server_settings"] = dict(settings)
        else:
            args["startup_params"] = dict(settings)
    return args


@contextmanager
def statements_path(flavour: str) -> Iterator[None]:
    """While the block runs, a ``-text`` flavour sends psycopg's statements through
    ``text()``."""
    before = pg_sa.PSYCOPG_DIRECT
    pg_sa.PSYCOPG_DIRECT = not flavour.endswith("-text")
    try:
        yield
    finally:
        pg_sa.PSYCOPG_DIRECT = before


def engine(dsn: str, flavour: str, **kwargs: Any) -> Engine:
    return create_engine(sa_url(dsn, flavour), **kwargs)


def async_engine(dsn: str, flavour: str, **kwargs: Any) -> AsyncEngine:
    return create_async_engine(sa_url(dsn, flavour), **kwargs)


def driver_error_module(flavour: str) -> str:
    """The top-level module of the driver's own exceptions (an error's ``pgerror``)."""
    return driver(flavour)
