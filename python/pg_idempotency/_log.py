"""The package's one logger and the one shape of its lines."""

from __future__ import annotations

import logging
from typing import Any

from .fingerprint import key_hash

#: The package's one logger (docs/python.md, "Logging"). Its lines carry :func:`key_hash`,
#: never the raw key, a request or a body; every call is behind ``isEnabledFor``, so a
#: disabled logger costs one cached level check per event.
logger = logging.getLogger("pg_idempotency")
# A library's logger: without it, an application that configures no logging would get the
# WARNING lines (a mismatch, a lost lease) on stderr through logging.lastResort.
logger.addHandler(logging.NullHandler())


def log(level: int, event: str, scope: str, key: str, *, exc_info: bool = False,
        **fields: Any) -> None:
    """One line ``<event> key=<hash> k=v ...``; call it behind ``logger.isEnabledFor(level)``.
    The fields are also on the record (``record.idempotency``). The adapters log their own
    events (e.g. Django's ``kept``) through it too, so every line has one shape."""
    h = key_hash(scope, key)
    text = " ".join(f"{k}={v}" for k, v in fields.items() if v is not None)
    logger.log(level, "%s key=%s%s", event, h, f" {text}" if text else "", exc_info=exc_info,
               extra={"idempotency": {"event": event, "key_hash": h, **fields}})
