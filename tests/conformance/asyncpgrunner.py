"""Runner 7: Python with plain asyncpg (no pg_idempotency code), one connection a session.

asyncpg binds parameters with the types the server infers for them, so every value goes as
text (``$n::text``) and the statement's own cast makes it the argument's type, as the text the
other runners send. jsonb comes back parsed (a codec on each connection), as psycopg gives it
to pyrunner.py.

    await run_scenario(dsn, scenario, api) -> list of failures (empty: the scenario passed)
    await run(dsn, scenario, api) -> (failures, steps run, checks made)
"""

from __future__ import annotations

import json
from typing import Any

import asyncpg

from conformance import build_call, count_failures, json_equal
from conformance.pyrunner import _num, check_value


def _sql(text: str, t0: str, nparams: int) -> str:
    """asyncpg placeholders (as text) for {p0}…, t0 as a literal (our own timestamp text)."""
    subst = {f"p{i}": f"${i + 1}::text" for i in range(nparams)}
    return text.format(t0="'" + t0 + "'", **subst)


async def _connect(dsn: str) -> asyncpg.Connection:
    conn = await asyncpg.connect(dsn)
    await conn.set_type_codec("jsonb", encoder=json.dumps, decoder=json.loads,
                              schema="pg_catalog")
    return conn


async def run_scenario(dsn: str, scenario: dict[str, Any], api: dict[str, Any]) -> list[str]:
    """The failures, and one more unless every step ran and every check was made."""
    failures, steps, checks = await run(dsn, scenario, api)
    return failures + count_failures(scenario, steps, checks)


async def run(dsn: str, scenario: dict[str, Any], api: dict[str, Any]
              ) -> tuple[list[str], int, int]:
    failures: list[str] = []
    steps = checks = 0
    captures: dict[str, Any] = {}
    conns: dict[str, asyncpg.Connection] = {}
    clock = scenario.get("clock", "virtual")
    try:
        admin = await _connect(dsn)
        try:
            for statement in api["reset"]:
                await admin.execute(statement)
            t0 = await admin.fetchval(api["clock"]["t0"])
        finally:
            await admin.close()
        session, at = "a", 0.0
        for i, step in enumerate(scenario["steps"], 1):
            where = f"step {i}" + (f" ({step['note']})" if "note" in step else "")
            session = step.get("session", session)
            at = float(step.get("at", at))
            if session not in conns:
                conns[session] = await _connect(dsn)
            conn = conns[session]
            params: list[str | None] = []
            if "sql" in step:
                if "expect" in step:
                    sql = api["wrap_query"].format(sql=step["sql"])
                    columns, shape = [("rows", "json")], "value"
                else:
                    sql, columns, shape = step["sql"], [], "void"
            else:
                call = build_call(api, step, clock, at,
                                  {k: None if v is None else str(v) for k, v in captures.items()})
                sql = _sql(call.sql, t0, len(call.params))
                params = call.params
                columns, shape = call.columns, call.shape
            steps += 1
            try:
                if shape == "void" and "sql" in step:
                    await conn.execute(sql)
                    rows: list[Any] = []
                else:
                    rows = await conn.fetch(sql, *params)
            except asyncpg.PostgresError as exc:
                err = step.get("error")
                if err is None:
                    failures.append(f"{where}: unexpected error {exc.sqlstate}: {exc}")
                    continue
                checks += 1 + ("column" in err)
                if exc.sqlstate != err["sqlstate"]:
                    failures.append(f"{where}: SQLSTATE {exc.sqlstate}, expected "
                                    f"{err['sqlstate']}: {exc}")
                column = getattr(exc, "column_name", None)
                if "column" in err and column != err["column"]:
                    failures.append(f"{where}: error COLUMN {column!r}, expected "
                                    f"{err['column']!r}")
                continue
            if "error" in step:
                want = step["error"]["sqlstate"]
                failures.append(f"{where}: succeeded, expected SQLSTATE {want}")
                continue
            expect = step.get("expect")
            if expect is None:
                continue
            names = [c for c, _ in columns]
            kinds = dict(columns)
            if "sql" in step:
                checks += 1
                got_rows = rows[0][0]
                if not json_equal(got_rows, expect["rows"]):
                    failures.append(f"{where}: rows {got_rows!r}, expected {expect['rows']!r}")
                continue
            if shape == "rows":
                checks += 1
                want_rows = expect["rows"]
                keys = list(want_rows[0]) if want_rows else []
                got_rows = [{k: _num(kinds[k], r[k]) for k in keys} for r in rows]
                if not json_equal(got_rows, want_rows):
                    failures.append(f"{where}: rows {got_rows!r}, expected {want_rows!r}")
                continue
            if len(rows) != 1:
                failures.append(f"{where}: {len(rows)} rows, expected one")
                continue
            record = dict(zip(names, rows[0], strict=True))
            for col, matcher in expect.items():
                checks += check_value(f"{where} {col}", kinds[col], matcher, record[col],
                                      captures, failures)
    finally:
        for conn in conns.values():
            await conn.close()
    return failures, steps, checks
