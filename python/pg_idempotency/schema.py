"""The schema versions this package ships, and the one it needs.

The schema moves by migrations (``migrations/NNNN_name.sql``), each of which brings the
database to a schema version; the extension's versions are the same. The package moves on its
own: ``0.11.1`` is a Python fix that ships the same migrations as ``0.11.0``. Its version's
first two numbers are those of the newest schema version it ships, which is the one it needs:
its SQL calls what that migration made. ``pg-idempotency status`` and ``migrate`` say which
schema a database has and which one the package needs (docs/releasing.md).

This module imports nothing, so tools/build.py reads it from the source tree.
"""

from __future__ import annotations

from typing import Final

#: The schema version each migration brings the database to, by migration number.
SCHEMA_VERSIONS: Final[dict[int, str]] = {
    1: "0.1.0", 2: "0.2.0", 3: "0.3.0", 4: "0.4.0", 5: "0.5.0", 6: "0.6.0", 7: "0.7.0",
    8: "0.8.0", 9: "0.9.0", 10: "0.10.0", 11: "0.11.0",
    12: "0.12.0", 13: "0.13.0", 14: "0.14.0",
}

#: The newest migration the package ships: a database must have it before the package runs.
REQUIRED_MIGRATION: Final[int] = max(SCHEMA_VERSIONS)

#: The schema version the package needs (that of :data:`REQUIRED_MIGRATION`).
SCHEMA_VERSION: Final[str] = SCHEMA_VERSIONS[REQUIRED_MIGRATION]


def schema_version(migration: int | None) -> str:
    """The schema version migration number ``migration`` brings a database to (``"none"`` for
    a database without the schema, ``"unknown (NNNN)"`` for one newer than this package)."""
    if migration is None:
        return "none"
    return SCHEMA_VERSIONS.get(migration, f"unknown ({migration:04d})")
