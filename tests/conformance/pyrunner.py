"""Runner 1: Python with plain psycopg (no pg_idempotency code), one connection a session.

    run_scenario(dsn, scenario, api) -> list of failures (empty: the scenario passed)
    run(dsn, scenario, api) -> (failures, steps run, checks made), as the other runners print
"""

from __future__ import annotations

from typing import Any

import psycopg

from conformance import build_call, count_failures, json_equal, matcher_checks


def _sql(text: str, t0: str, nparams: int) -> str:
    """psycopg placeholders for {p0}…, t0 as a literal (it is our own timestamp text)."""
    subst = {f"p{i}": f"%(p{i})s" for i in range(nparams)}
    return text.replace("%", "%%").format(t0="'" + t0 + "'", **subst)


def _compare(kind: str, op: str, got: Any, want: Any) -> bool:
    if op == "eq":
        return json_equal(got, want) if kind == "json" else _num(kind, got) == _num(kind, want)
    if op == "ne":
        return not _compare(kind, "eq", got, want)
    if got is None or want is None:
        return False
    if op == "gt":
        return _num(kind, got) > _num(kind, want)
    return _num(kind, got) < _num(kind, want)


def _num(kind: str, value: Any) -> Any:
    if value is None:
        return None
    if kind == "bigint":
        return int(value)
    if kind == "float":
        return float(value)
    return value


def check_value(where: str, kind: str, matcher: Any, got: Any,
                captures: dict[str, Any], failures: list[str]) -> int:
    """Apply ``matcher`` to ``got``; the number of checks made."""
    checks = matcher_checks(matcher)
    for op, operand in checks:
        if op == "is_null":
            ok = got is None
        elif op == "not_null":
            ok = got is not None
        else:
            src, want = operand
            if src == "ref":
                want = captures.get(want)
            ok = _compare(kind, op, got, want)
        if not ok:
            failures.append(f"{where}: got {got!r}, expected {op} {operand!r}")
    if isinstance(matcher, dict) and "$capture" in matcher:
        captures[matcher["$capture"]] = got
    return len(checks)


def run_scenario(dsn: str, scenario: dict[str, Any], api: dict[str, Any]) -> list[str]:
    """The failures, and one more unless every step ran and every check was made."""
    failures, steps, checks = run(dsn, scenario, api)
    return failures + count_failures(scenario, steps, checks)


def run(dsn: str, scenario: dict[str, Any], api: dict[str, Any]) -> tuple[list[str], int, int]:
    failures: list[str] = []
    steps = checks = 0
    captures: dict[str, Any] = {}
    conns: dict[str, psycopg.Connection] = {}
    clock = scenario.get("clock", "virtual")
    try:
        with psycopg.connect(dsn, autocommit=True) as admin:
            for statement in api["reset"]:
                admin.execute(statement)
            (t0,) = admin.execute(api["clock"]["t0"]).fetchone()
        session, at = "a", 0.0
        for i, step in enumerate(scenario["steps"], 1):
            where = f"step {i}" + (f" ({step['note']})" if "note" in step else "")
            session = step.get("session", session)
            at = float(step.get("at", at))
            if session not in conns:
                conns[session] = psycopg.connect(dsn, autocommit=True)
            conn = conns[session]
            if "sql" in step:
                if "expect" in step:
                    sql = api["wrap_query"].format(sql=step["sql"])
                    columns, shape = [("rows", "json")], "value"
                else:
                    sql, columns, shape = step["sql"], [], "void"
                params: dict[str, str | None] | None = None
            else:
                call = build_call(api, step, clock, at,
                                  {k: None if v is None else str(v) for k, v in captures.items()})
                sql = _sql(call.sql, t0, len(call.params))
                params = {f"p{n}": v for n, v in enumerate(call.params)}
                columns, shape = call.columns, call.shape
            steps += 1
            try:
                cur = conn.execute(sql, params)
                rows = cur.fetchall() if cur.description else []
            except psycopg.Error as exc:
                err = step.get("error")
                if err is None:
                    failures.append(f"{where}: unexpected error {exc.sqlstate}: {exc}")
                    continue
                checks += 1 + ("column" in err)
                if exc.sqlstate != err["sqlstate"]:
                    failures.append(f"{where}: SQLSTATE {exc.sqlstate}, expected "
                                    f"{err['sqlstate']}: {exc}")
                if "column" in err and exc.diag.column_name != err["column"]:
                    failures.append(f"{where}: error COLUMN {exc.diag.column_name!r}, expected "
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
                got_rows = [{k: _num(kinds[k], dict(zip(names, r, strict=True))[k])
                             for k in keys} for r in rows]
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
            conn.close()
    return failures, steps, checks
