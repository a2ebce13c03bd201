"""A caller written against any released version keeps working after the migrations that
follow it (docs/releasing.md, "What a version may change"):

- every public function (a name not starting with "_") of a released version is still there
  under its name, with the same arguments in the same order, names and types (new arguments
  only at the end, each with a default; an argument with a default keeps one), returning
  the same type;
- every composite result type keeps its fields in the same order, names and types (new fields
  only at the end), since drivers, and the Python package's own positional claim, read them
  by position.

Each migration is applied in turn to one database and the API is read from the catalog after
it; every released version (frozen in migrations/SHA256SUMS) is compared with the newest.
Versions 0.1.0 to 0.10.0 kept the rule before it was written down, so there is no exception.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import psycopg
from helpers.install import INSTALL_ARGS, MIGRATIONS, scratch_db

from pgharness import PgServer

ROOT = Path(__file__).resolve().parents[2]
RELEASED = [int(line.split()[1][:4]) for line in
            (ROOT / "migrations" / "SHA256SUMS").read_text().splitlines() if line.strip()]


class Fn(NamedTuple):
    args: tuple[tuple[str, str], ...]  # (name, type) of each input argument, in order
    defaults: int  # how many of the last arguments have a default
    returns: str


FUNCTIONS = """
SELECT p.proname, coalesce(p.proargnames, '{}'),
       array(SELECT format_type(t.oid_, NULL) FROM unnest(p.proargtypes::oid[])
             WITH ORDINALITY AS t (oid_, n) ORDER BY t.n),
       coalesce(p.proargmodes, '{}'), p.pronargdefaults,
       CASE WHEN p.proretset THEN 'SETOF ' ELSE '' END || format_type(p.prorettype, NULL)
FROM pg_proc AS p
WHERE p.pronamespace = 'idempotency'::regnamespace AND p.proname !~ '^_'
"""

TYPES = """
SELECT t.typname, array_agg(a.attname || ' ' || format_type(a.atttypid, a.atttypmod)
                            ORDER BY a.attnum)
FROM pg_type AS t
JOIN pg_class AS c ON c.oid = t.typrelid AND c.relkind = 'c'
JOIN pg_attribute AS a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
WHERE t.typnamespace = 'idempotency'::regnamespace
GROUP BY t.typname
"""


def api(conn: psycopg.Connection[Any]) -> tuple[dict[str, list[Fn]], dict[str, list[str]]]:
    functions: dict[str, list[Fn]] = {}
    for name, argnames, argtypes, modes, defaults, returns in conn.execute(FUNCTIONS):
        # proargnames covers OUT and TABLE arguments too; proargtypes only the input ones.
        if modes:
            argnames = [n for n, m in zip(argnames, modes, strict=True) if m in ("i", "b", "v")]
        names = list(argnames) + [""] * (len(argtypes) - len(argnames))
        functions.setdefault(name, []).append(
            Fn(tuple(zip(names, argtypes, strict=True)), defaults, returns))
    types = {name: list(fields) for name, fields in conn.execute(TYPES)}
    return functions, types


def compatible(old: Fn, new: Fn) -> bool:
    """A call that worked against old, positional or named, works against new."""
    added = len(new.args) - len(old.args)
    return (added >= 0 and new.args[:len(old.args)] == old.args
            and new.defaults >= old.defaults + added and new.returns == old.returns)


def breaks(old: tuple[dict[str, list[Fn]], dict[str, list[str]]],
           new: tuple[dict[str, list[Fn]], dict[str, list[str]]]) -> list[str]:
    found = []
    old_fns, old_types = old
    new_fns, new_types = new
    for name, overloads in old_fns.items():
        for fn in overloads:
            if not any(compatible(fn, candidate) for candidate in new_fns.get(name, [])):
                found.append(f"{name}({', '.join(' '.join(a) for a in fn.args)}) "
                             f"-> {fn.returns}: now {new_fns.get(name, 'gone')}")
    for name, fields in old_types.items():
        now = new_types.get(name)
        if now is None or now[:len(fields)] != fields:
            found.append(f"type {name} ({', '.join(fields)}): now {now or 'gone'}")
    return found


def test_the_released_versions_are_the_frozen_migrations() -> None:
    assert RELEASED == list(range(1, len(RELEASED) + 1))
    assert len(RELEASED) < len(MIGRATIONS) or RELEASED[-1] == len(MIGRATIONS)


def test_the_comparison_catches_a_reordered_a_retyped_and_a_required_new_argument() -> None:
    old = Fn((("scope", "text"), ("key", "text")), 0, "boolean")
    assert compatible(old, Fn((("scope", "text"), ("key", "text"), ("x", "integer")), 1,
                              "boolean"))
    assert not compatible(old, Fn((("key", "text"), ("scope", "text")), 0, "boolean"))
    assert not compatible(old, Fn((("scope", "text"), ("key", "bytea")), 0, "boolean"))
    assert not compatible(old, Fn((("scope", "text"), ("key", "text"), ("x", "integer")), 0,
                                  "boolean"))
    assert not compatible(old, Fn((("scope", "text"), ("key", "text")), 0, "integer"))
    assert breaks(({}, {"r": ["a text", "b integer"]}), ({}, {"r": ["b integer", "a text"]}))
    assert not breaks(({}, {"r": ["a text"]}), ({}, {"r": ["a text", "b integer"]}))


def test_every_released_api_is_kept_by_the_newest(server: PgServer) -> None:
    snapshots = {}
    with scratch_db(server, "api_compat") as dsn:
        for number, migration in enumerate(MIGRATIONS, start=1):
            server.run_psql(dsn, migration, args=INSTALL_ARGS)
            with psycopg.connect(dsn) as conn:
                snapshots[number] = api(conn)
    newest = snapshots[len(MIGRATIONS)]
    assert "claim" in newest[0] and "claim_result" in newest[1]
    problems = [f"{version:04d}: {what}" for version in RELEASED
                for what in breaks(snapshots[version], newest)]
    assert not problems, "\n".join(problems)
