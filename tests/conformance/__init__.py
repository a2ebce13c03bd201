"""The conformance suite: scenarios as data, and what every runner shares.

The format is described in tests/conformance/README.md. This module loads and validates the
scenario files (so that a mistake in a scenario is reported as such, not as a runner failure),
and builds the SQL text that the Python and psql runners send; node/run.mjs, java/Run.java,
go/run.go and ruby/run.rb build the same text from the same ``functions.json`` templates.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SCENARIO_DIR = HERE / "scenarios"
API_FILE = HERE / "functions.json"
VECTORS_FILE = HERE.parent / "vectors" / "fingerprint.json"
VECTORS_SCENARIO = SCENARIO_DIR / "fingerprint_vectors.json"
NODE_DIR = HERE / "node"

STEP_KEYS = {"session", "at", "call", "args", "sql", "expect", "error", "note"}
MATCHERS = {"$capture", "$eq", "$ne", "$gt", "$lt", "$not_null"}
TX_START = re.compile(r"^\s*(BEGIN|START\s+TRANSACTION)\b", re.I)
TX_END = re.compile(r"^\s*(COMMIT|ROLLBACK|END|ABORT)\s*;?\s*$", re.I)
SESSION = re.compile(r"^[a-z][a-z0-9_]*$")
CAPTURE = re.compile(r"^[a-z][a-z0-9_]*$")


class ScenarioError(ValueError):
    """A scenario file does not follow the format (a mistake in the data, not in a runner)."""


def load_api() -> dict[str, Any]:
    return json.loads(API_FILE.read_text(encoding="utf-8"))


def scenario_files() -> list[Path]:
    return sorted(SCENARIO_DIR.glob("*.json"))


def load_scenario(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def node_command(script: str = "run.mjs") -> list[str]:
    """``node`` and a script of node/, failing loudly when make setup has not run npm ci."""
    node = shutil.which("node")
    if node is None:
        raise RuntimeError("node is not on PATH (Node.js 20 runs the conformance scenarios)")
    if not (NODE_DIR / "node_modules" / "pg").is_dir():
        raise RuntimeError(f"{NODE_DIR}/node_modules is missing: run make setup (npm ci)")
    return [node, str(NODE_DIR / script)]


def kind_of(sql_type: str) -> str:
    """How a projected value of ``sql_type`` is compared: int, bigint, float, bool, json, text."""
    return {
        "integer": "int", "bigint": "bigint", "timestamptz": "float", "interval": "float",
        "boolean": "bool", "jsonb": "json",
    }.get(sql_type, "text")


@dataclass(frozen=True)
class Call:
    """One step's SQL, built the same way by every runner.

    ``sql`` has ``{p0}``, ``{p1}`` … where the runner puts its own placeholders (and
    ``{t0}`` for the scenario's start time); ``params`` are the values, as text or None.
    ``columns`` are (name, kind) of the result; ``shape`` is row, rows, value or void.
    """

    sql: str
    params: list[str | None]
    columns: list[tuple[str, str]]
    shape: str


def arg_text(sql_type: str, value: Any) -> str | None:
    """A scenario argument as the text every runner sends (None for SQL NULL)."""
    if value is None:
        return None
    if sql_type == "jsonb" and not isinstance(value, str):
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    if sql_type == "text[]":
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def build_call(api: dict[str, Any], step: dict[str, Any], clock: str, at: float,
               refs: dict[str, str | None]) -> Call:
    """The SQL of a ``call`` step. ``refs`` gives captured values for ``{"$ref": name}``."""
    fn = api["functions"][step["call"]]
    given = step.get("args", {})
    params: list[str | None] = []
    parts = []
    for name, sql_type in fn["args"]:
        if name == "reference_time" and clock == "virtual":
            parts.append("reference_time => " + api["clock"]["reference_time"].format(
                t0="{t0}", at=number_text(at)))
            continue
        if name not in given:
            continue
        value = given[name]
        if isinstance(value, dict) and set(value) == {"$ref"}:
            text = refs[value["$ref"]]
        else:
            text = arg_text(sql_type, value)
        placeholder = "{p" + str(len(params)) + "}"
        params.append(text)
        template = api["bind"].get(sql_type, api["bind"]["*"])
        parts.append(f"{name} => " + template.format(p=placeholder, type=sql_type))
    call = f"idempotency.{step['call']}({', '.join(parts)})"
    returns = fn["returns"]
    if returns == "void":
        return Call(f"SELECT ({call}) IS NULL AS value", params, [], "void")
    setof = returns.startswith("setof ")
    type_name = returns.removeprefix("setof ")
    if type_name in api["types"]:
        cols = api["types"][type_name]
        proj = ", ".join(f"{project(api, t, 'r.' + c)} AS {c}" for c, t in cols)
        columns = [(c, kind_of(t)) for c, t in cols]
        if setof:
            return Call(f"SELECT {proj} FROM {call} WITH ORDINALITY AS r ORDER BY r.ordinality",
                        params, columns, "rows")
        return Call(f"SELECT {proj} FROM {call} AS r", params, columns, "row")
    return Call(f"SELECT {project(api, returns, call)} AS value", params,
                [("value", kind_of(returns))], "value")


def project(api: dict[str, Any], sql_type: str, expr: str) -> str:
    template = api["project"].get(sql_type, api["project"]["*"])
    return template.format(v=expr, t0="{t0}")


def number_text(x: float) -> str:
    """A number as JavaScript's String() writes it, so both runners send the same SQL."""
    if isinstance(x, bool):
        raise ScenarioError("a boolean is not a time")
    if float(x).is_integer():
        return str(int(x))
    return repr(float(x))


# -- validation -------------------------------------------------------------------------------

def validate(scenario: dict[str, Any], api: dict[str, Any]) -> None:
    """Raise ScenarioError unless ``scenario`` follows the format of tests/conformance/README.md."""
    name = scenario.get("name")
    where = f"scenario {name!r}"
    if not isinstance(name, str) or not name:
        raise ScenarioError("a scenario needs a name")
    extra = set(scenario) - {"name", "description", "clock", "steps", "generated_by"}
    if extra:
        raise ScenarioError(f"{where}: unknown keys {sorted(extra)}")
    clock = scenario.get("clock", "virtual")
    if clock not in ("virtual", "real"):
        raise ScenarioError(f"{where}: clock must be virtual or real")
    steps = scenario.get("steps")
    if not isinstance(steps, list) or not steps:
        raise ScenarioError(f"{where}: steps must be a non-empty list")
    captured: set[str] = set()
    open_tx: set[str] = set()
    session, at = "a", 0.0
    for i, step in enumerate(steps, 1):
        here = f"{where} step {i}"
        if not isinstance(step, dict) or set(step) - STEP_KEYS:
            raise ScenarioError(f"{here}: unknown keys {sorted(set(step) - STEP_KEYS)}")
        new_session = step.get("session", session)
        if not SESSION.match(new_session):
            raise ScenarioError(f"{here}: bad session name {new_session!r}")
        if new_session != session and session in open_tx:
            # psql has one connection at a time: a session is left only between transactions.
            raise ScenarioError(f"{here}: session {session} leaves a transaction open")
        session = new_session
        if "at" in step:
            if clock == "real":
                raise ScenarioError(f"{here}: 'at' needs the virtual clock")
            if not isinstance(step["at"], (int, float)) or step["at"] < at:
                raise ScenarioError(f"{here}: 'at' must be a number, never going back")
            at = float(step["at"])
        if "expect" in step and "error" in step:
            raise ScenarioError(f"{here}: expect and error exclude each other")
        if "error" in step:
            err = step["error"]
            if not isinstance(err, dict) or set(err) - {"sqlstate", "column"} or not re.match(
                    r"^[0-9A-Z]{5}$", str(err.get("sqlstate", ""))):
                raise ScenarioError(f"{here}: error must be {{sqlstate, column?}}")
        if ("call" in step) == ("sql" in step):
            raise ScenarioError(f"{here}: a step has either call or sql")
        if "sql" in step:
            sql = step["sql"]
            if TX_START.match(sql):
                open_tx.add(session)
            elif TX_END.match(sql):
                open_tx.discard(session)
            if "args" in step:
                raise ScenarioError(f"{here}: sql steps take no args")
            if "expect" in step:
                exp = step["expect"]
                if not isinstance(exp, dict) or set(exp) != {"rows"} or not isinstance(
                        exp["rows"], list):
                    raise ScenarioError(f"{here}: a sql step expects {{rows: [...]}}")
            continue
        fn = api["functions"].get(step["call"])
        if fn is None:
            raise ScenarioError(f"{here}: unknown function {step['call']!r}")
        arg_names = {a for a, _ in fn["args"]}
        if clock == "virtual":
            arg_names.discard("reference_time")
        args = step.get("args", {})
        if not isinstance(args, dict) or set(args) - arg_names:
            raise ScenarioError(f"{here}: unknown arguments {sorted(set(args) - arg_names)}")
        for value in args.values():
            if isinstance(value, dict) and "$ref" in value:
                if set(value) != {"$ref"} or value["$ref"] not in captured:
                    raise ScenarioError(f"{here}: {value} refers to nothing captured before")
        call = build_call(api, step, clock, at, {c: "0" for c in captured})
        if "expect" in step:
            exp = step["expect"]
            if call.shape == "void":
                raise ScenarioError(f"{here}: a void function has no result to expect")
            if call.shape == "rows":
                if set(exp) != {"rows"} or not isinstance(exp["rows"], list):
                    raise ScenarioError(f"{here}: {step['call']} expects {{rows: [...]}}")
                cols = {c for c, _ in call.columns}
                for row in exp["rows"]:
                    if set(row) - cols or set(row) != set(exp["rows"][0]) or any(
                            isinstance(v, dict) for v in row.values()):
                        raise ScenarioError(f"{here}: rows need the same columns, literal values")
                continue
            kinds = dict(call.columns)
            for col, matcher in exp.items():
                if col not in kinds:
                    raise ScenarioError(f"{here}: {step['call']} has no column {col!r}")
                if is_matcher(matcher):
                    _check_matcher(here, matcher, kinds[col], captured)
                    if "$capture" in matcher:
                        if not CAPTURE.match(matcher["$capture"]):
                            raise ScenarioError(f"{here}: bad capture name")
                        captured.add(matcher["$capture"])
    if open_tx:
        raise ScenarioError(f"{where}: ends with a transaction open in {sorted(open_tx)}")


def is_matcher(value: Any) -> bool:
    return isinstance(value, dict) and any(k.startswith("$") for k in value)


def _check_matcher(here: str, matcher: dict[str, Any], kind: str, captured: set[str]) -> None:
    if set(matcher) - MATCHERS:
        raise ScenarioError(f"{here}: unknown matchers {sorted(set(matcher) - MATCHERS)}")
    for op in ("$eq", "$ne", "$gt", "$lt"):
        if op not in matcher:
            continue
        ref = matcher[op]
        if isinstance(ref, str) and ref not in captured:
            raise ScenarioError(f"{here}: {op} {ref!r} refers to nothing captured before")
        if op in ("$gt", "$lt") and kind not in ("int", "bigint", "float"):
            raise ScenarioError(f"{here}: {op} needs a number column")
    if matcher.get("$not_null", True) is not True:
        raise ScenarioError(f"{here}: $not_null takes true")


def matcher_checks(matcher: Any) -> list[tuple[str, Any]]:
    """A matcher as (operation, operand) checks: eq/ne/gt/lt with a literal or a capture name
    (("ref", name) as operand), not_null, is_null. Every runner applies these in this order."""
    if not is_matcher(matcher):
        return [("is_null", None)] if matcher is None else [("eq", ("lit", matcher))]
    checks: list[tuple[str, Any]] = []
    if "$not_null" in matcher or "$capture" in matcher:
        checks.append(("not_null", None))
    for op in ("$eq", "$ne", "$gt", "$lt"):
        if op in matcher:
            ref = matcher[op]
            operand = ("ref", ref) if isinstance(ref, str) else ("lit", ref)
            checks.append((op[1:], operand))
    return checks


def step_checks(step: dict[str, Any]) -> int:
    """How many comparisons a runner makes for ``step`` when it passes: an error's SQLSTATE and
    its COLUMN (when expected), a query's or a set's rows as one, and every check of
    matcher_checks() for each expected column."""
    if "error" in step:
        return 1 + ("column" in step["error"])
    expect = step.get("expect")
    if expect is None:
        return 0
    if "sql" in step or set(expect) == {"rows"}:
        return 1
    return sum(len(matcher_checks(m)) for m in expect.values())


def expected_counts(scenario: dict[str, Any]) -> tuple[int, int]:
    """(steps, checks) that a runner reports after running ``scenario`` to its end."""
    return len(scenario["steps"]), sum(step_checks(s) for s in scenario["steps"])


def count_failures(scenario: dict[str, Any], steps: Any, checks: Any) -> list[str]:
    """A failure unless a runner ran every step of ``scenario`` and made every comparison:
    a runner that skips a step or a check it does not understand fails, it does not pass.
    ``steps`` and ``checks`` are what the runner reported (None: it reported nothing)."""
    want_steps, want_checks = expected_counts(scenario)
    if (steps, checks) == (want_steps, want_checks):
        return []
    return [f"the runner ran {steps} steps and made {checks} checks, "
            f"expected {want_steps} steps and {want_checks} checks"]


def json_equal(a: Any, b: Any) -> bool:
    """JSON equality as jsonb has it: numbers by value, booleans distinct from numbers."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


# -- the fingerprint vectors as a scenario ----------------------------------------------------

def vectors_scenario() -> dict[str, Any]:
    """tests/vectors/fingerprint.json as steps; scenarios/fingerprint_vectors.json is this."""
    vectors = json.loads(VECTORS_FILE.read_text(encoding="utf-8"))
    steps: list[dict[str, Any]] = []
    for v in vectors["fingerprint"]:
        args: dict[str, Any] = {"request": v["request"]}
        if "defaults" in v:
            args["defaults"] = v["defaults"]
        if "fields" in v:
            args["fields"] = v["fields"]
        if len(args) == 1:
            steps.append({"note": v["name"], "call": "canonical_json",
                          "args": {"value": v["request"]},
                          "expect": {"value": v["canonical"]}})
        steps.append({"note": v["name"], "call": "fingerprint", "args": args,
                      "expect": {"value": v["sha256_hex"]}})
    for v in vectors["derive_key"]:
        steps.append({"note": v["name"], "call": "derive_key",
                      "args": {k: v[k] for k in ("scope", "key", "step")},
                      "expect": {"value": v["derived"]}})
    for v in vectors["invalid"]:
        args = {k: a for k, a in v["args"].items() if a is not None or k != "defaults"}
        if v["function"] == "fingerprint" and args.get("fields") is None:
            args.pop("fields", None)
        error: dict[str, Any] = {"sqlstate": v["sqlstate"]}
        if v["argument"] is not None:
            error["column"] = v["argument"]
        steps.append({"note": v["name"], "call": v["function"], "args": args, "error": error})
    return {
        "name": "fingerprint_vectors",
        "description": "Every vector of tests/vectors/fingerprint.json: canonical_json, "
                       "fingerprint and derive_key give them, and the invalid inputs are "
                       "refused with their SQLSTATE and argument.",
        "generated_by": "tests/conformance/__init__.py vectors_scenario(); "
                        "tests/conformance/test_conformance.py checks it is current",
        "steps": steps,
    }


def dump_scenario(scenario: dict[str, Any]) -> str:
    """The committed form of a generated scenario: one step a line."""
    head = {k: v for k, v in scenario.items() if k != "steps"}
    lines = [json.dumps(s, ensure_ascii=False) for s in scenario["steps"]]
    body = json.dumps(head, ensure_ascii=False, indent=2)[:-2]
    return body + ',\n  "steps": [\n    ' + ",\n    ".join(lines) + "\n  ]\n}\n"
