"""The conformance suite (tests/conformance/): the same scenario files pass in seven runners,
Python (psycopg), Python (asyncpg), psql only, Node.js (pg), Java (pgJDBC), Go (lib/pq) and
Ruby (pg), on PostgreSQL 15 and 18; changing one expected value makes all seven fail.
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from helpers import MIGRATION_PSQL_ARGS, MIGRATIONS, admin_execute
from helpers.servers import ServerPool
from psycopg import sql

import conformance as conf
from conformance import asyncpgrunner, langs, psqlrunner, pyrunner
from conformance.langs import run_node
from pgharness import WAIT_BOUND, PgServer

ROOT = Path(__file__).resolve().parents[2]
API = conf.load_api()
FILES = conf.scenario_files()
IDS = [p.stem for p in FILES]


# -- fixtures ---------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def conformance_dsn(server: PgServer, server_pool: ServerPool) -> Iterator[str]:
    """One database a server, installed from migrations/ with plain psql (docs/install.md).
    Every scenario starts with the reset statements of functions.json, so runs do not mix."""
    name = server_pool.new_db_name("conf")
    admin_execute(server, sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    dsn = server.dsn(name)
    for migration in sorted(MIGRATIONS.glob("*.sql")):
        server.run_psql(dsn, migration, args=MIGRATION_PSQL_ARGS)
    yield dsn
    admin_execute(server, sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
        sql.Identifier(name)))


@pytest.fixture(scope="session")
def node_results(conformance_dsn: str) -> tuple[int, dict[str, list[str]], str]:
    """All scenarios in one node process a server (starting node once per file costs more)."""
    return run_node(conformance_dsn, FILES)


LangResults = Callable[[str], tuple[int, dict[str, list[str]], str]]


@pytest.fixture(scope="session")
def lang_results(conformance_dsn: str) -> LangResults:
    """Java, Go and Ruby: each runs all scenarios in one process a server, on first use
    (compiled once, cached under build/conformance/)."""
    done: dict[str, tuple[int, dict[str, list[str]], str]] = {}

    def results(lang: str) -> tuple[int, dict[str, list[str]], str]:
        if lang not in done:
            done[lang] = langs.run_runner(lang, conformance_dsn, FILES)
        return done[lang]
    return results


def run_psql_scenario(server: PgServer, dsn: str, scenario: dict[str, Any]) -> list[str]:
    script, checks = psqlrunner.generate(scenario, API)
    proc = server.run_psql(dsn, script, args=psqlrunner.PSQL_ARGS, check=False)
    if proc.returncode != 0:
        return [f"psql exited {proc.returncode}: {proc.stderr[-2000:]}"]
    return psqlrunner.check_output(scenario, checks, proc.stdout, proc.stderr)


# -- the data ---------------------------------------------------------------------------------

@pytest.mark.parametrize("path", FILES, ids=IDS)
def test_scenario_is_valid(path: Path) -> None:
    scenario = conf.load_scenario(path)
    conf.validate(scenario, API)
    assert scenario["name"] == path.stem


def test_vectors_scenario_is_current() -> None:
    """scenarios/fingerprint_vectors.json is tests/vectors/fingerprint.json, as steps."""
    expected = conf.dump_scenario(conf.vectors_scenario())
    assert conf.VECTORS_SCENARIO.read_text(encoding="utf-8") == expected, (
        "regenerate: python -c 'import sys; sys.path.insert(0, \"tests\"); import conformance as c;"
        " c.VECTORS_SCENARIO.write_text(c.dump_scenario(c.vectors_scenario()))'")


def _documented_codes() -> set[str]:
    text = (ROOT / "docs" / "errors.md").read_text(encoding="utf-8")
    return set(re.findall(r"^\| `(IK\d{3})` \|", text, re.M))


def test_scenarios_cover_every_outcome_error_and_function() -> None:
    outcomes, codes, calls = set(), set(), set()
    for path in FILES:
        for step in conf.load_scenario(path)["steps"]:
            calls.add(step.get("call"))
            outcome = step.get("expect", {}).get("outcome")
            if isinstance(outcome, str):
                outcomes.add((step["call"], outcome))
            if "error" in step:
                codes.add(step["error"]["sqlstate"])
    assert {o for c, o in outcomes if c == "claim"} == {
        "claimed", "resumed", "replay", "accepted", "in_progress", "mismatch", "expired"}
    assert {o for c, o in outcomes if c == "takeover"} == {"resumed", "replay", "in_progress"}
    for fn in ("heartbeat_outcome", "checkpoint_outcome", "release_outcome"):
        assert {o for c, o in outcomes if c == fn} == {"ok", "lease_lost", "completed"}, fn
    documented = _documented_codes()
    assert len(documented) == 18, documented
    # IK021 (distribute() without Citus) and IK022 (distribute() on a Citus worker) belong to the
    # install, not to the lifecycle: no scenario can raise either one both on a single server and
    # through a Citus coordinator. tests/citus/test_citus.py raises both (distribute() on a
    # database without the extension, and on a worker); tests/release/test_install.py raises
    # IK021. IK018 needs a body over the smallest limit a setting allows (64 KiB) and IK023 a
    # completer role limited to scopes: tests/sql/test_bounds_sql.py and
    # tests/sql/test_completer_scopes.py raise them as the application roles, on one server and
    # on Citus.
    install_only = {"IK018", "IK021", "IK022", "IK023"}
    assert install_only <= documented, documented
    assert documented - install_only <= codes, (
        f"not covered: {sorted(documented - install_only - codes)}")
    assert set(API["functions"]) <= calls, f"never called: {set(API['functions']) - calls}"


def test_functions_json_matches_the_catalog(conformance_dsn: str) -> None:
    """The signatures the runners use are the installed ones (names, order, types)."""
    with psycopg.connect(conformance_dsn, autocommit=True) as conn:
        for name, fn in API["functions"].items():
            rows = conn.execute(
                "SELECT pg_get_function_identity_arguments(p.oid),"
                " pg_get_function_result(p.oid) FROM pg_proc AS p"
                " WHERE p.pronamespace = 'idempotency'::regnamespace AND p.proname = %s",
                (name,)).fetchall()
            assert len(rows) == 1, name
            args, result = rows[0]
            types = {"timestamptz": "timestamp with time zone", "text[]": "text[]"}
            assert args == ", ".join(f"{a} {types.get(t, t)}" for a, t in fn["args"]), name
            want = fn["returns"].replace("setof ", "SETOF idempotency.") if fn[
                "returns"].startswith("setof ") else fn["returns"]
            if want in API["types"]:
                want = f"idempotency.{want}"
            assert result == types.get(want, want), name
        for type_name, columns in API["types"].items():
            got = conn.execute(
                "SELECT a.attname, format_type(a.atttypid, a.atttypmod) FROM pg_attribute AS a"
                " WHERE a.attrelid = %s::regclass AND a.attnum > 0 ORDER BY a.attnum",
                (f"idempotency.{type_name}",)).fetchall()
            types = {"timestamptz": "timestamp with time zone"}
            assert got == [(c, types.get(t, t)) for c, t in columns], type_name


# -- the seven runners --------------------------------------------------------------------------

@pytest.mark.parametrize("path", FILES, ids=IDS)
def test_python_runner(conformance_dsn: str, path: Path) -> None:
    assert pyrunner.run_scenario(conformance_dsn, conf.load_scenario(path), API) == []


@pytest.mark.parametrize("path", FILES, ids=IDS)
def test_asyncpg_runner(conformance_dsn: str, path: Path) -> None:
    scenario = conf.load_scenario(path)
    assert asyncio.run(asyncpgrunner.run_scenario(conformance_dsn, scenario, API)) == []


@pytest.mark.parametrize("path", FILES, ids=IDS)
def test_psql_runner(server: PgServer, conformance_dsn: str, path: Path) -> None:
    assert run_psql_scenario(server, conformance_dsn, conf.load_scenario(path)) == []


@pytest.mark.node
@pytest.mark.parametrize("path", FILES, ids=IDS)
def test_node_runner(node_results: tuple[int, dict[str, list[str]], str], path: Path) -> None:
    code, results, stderr = node_results
    assert path.stem in results, f"node printed no result for {path.stem}:\n{stderr}"
    assert results[path.stem] == []


@pytest.mark.node
def test_node_runner_exit_code(node_results: tuple[int, dict[str, list[str]], str]) -> None:
    code, results, stderr = node_results
    assert code == 0, stderr
    assert sorted(results) == sorted(IDS)


@pytest.mark.parametrize("path", FILES, ids=IDS)
@pytest.mark.parametrize("lang", langs.LANGS)
def test_lang_runner(lang_results: LangResults, lang: str,
                     path: Path) -> None:
    code, results, stderr = lang_results(lang)
    assert path.stem in results, f"{lang} printed no result for {path.stem}:\n{stderr}"
    assert results[path.stem] == []


@pytest.mark.parametrize("lang", langs.LANGS)
def test_lang_runner_exit_code(lang_results: LangResults,
                               lang: str) -> None:
    code, results, stderr = lang_results(lang)
    assert code == 0, stderr
    assert sorted(results) == sorted(IDS)


# -- one changed expectation fails every runner ---------------------------------------------

def _step(scenario: dict[str, Any], pred: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    return next(s for s in scenario["steps"] if pred(s))


def _outcome(s: dict[str, Any], value: str) -> bool:
    return s.get("expect", {}).get("outcome") == value


MUTATIONS: dict[str, tuple[str, Callable[[dict[str, Any]], None]]] = {
    "outcome": ("claim_outcomes", lambda sc: _step(sc, lambda s: _outcome(s, "in_progress"))[
        "expect"].update(outcome="claimed")),
    "stored status": ("claim_outcomes", lambda sc: _step(sc, lambda s: _outcome(s, "replay"))[
        "expect"].update(response_status=202)),
    "stored body": ("claim_outcomes", lambda sc: _step(sc, lambda s: _outcome(s, "replay"))[
        "expect"]["response_body"].update(amount=51)),
    "token order": ("fencing_after_takeover", lambda sc: _step(
        sc, lambda s: _outcome(s, "resumed"))["expect"]["lease_token"].update({"$lt": "t1"})),
    "lease expiry": ("leases", lambda sc: _step(sc, lambda s: s.get("call") == "heartbeat")[
        "expect"].update(value=19)),
    "sqlstate": ("fencing_after_takeover", lambda sc: _step(sc, lambda s: "error" in s)[
        "error"].update(sqlstate="IK003")),
    "error column": ("argument_errors", lambda sc: _step(sc, lambda s: "error" in s)[
        "error"].update(column="key")),
    "business write": ("fencing_after_takeover", lambda sc: _step(sc, lambda s: "sql" in s and (
        "expect" in s))["expect"]["rows"].append({"ref": "stale"})),
    "fingerprint vector": ("fingerprint_vectors", lambda sc: _step(
        sc, lambda s: s.get("call") == "fingerprint")["expect"].update(value="00" * 32)),
    "abandoned list": ("takeover_and_list_abandoned", lambda sc: _step(
        sc, lambda s: s.get("call") == "list_abandoned" and s["expect"]["rows"])[
        "expect"]["rows"][0].update(lease_expires_at=6)),
    "lease outcome": ("lease_outcomes", lambda sc: _step(
        sc, lambda s: s.get("call") == "release_outcome" and _outcome(s, "lease_lost"))[
        "expect"].update(outcome="ok")),
    "completed outcome": ("lease_outcomes", lambda sc: _step(
        sc, lambda s: s.get("call") == "checkpoint_outcome" and _outcome(s, "completed"))[
        "expect"].update(outcome="lease_lost")),
    "outcome expiry": ("lease_outcomes", lambda sc: _step(
        sc, lambda s: s.get("call") == "heartbeat_outcome" and _outcome(s, "ok"))[
        "expect"].update(lease_expires_at=23)),
    "outcome error column": ("lease_outcomes", lambda sc: _step(
        sc, lambda s: s.get("call") == "checkpoint_outcome" and "error" in s)[
        "error"].update(column="lease_token")),
}


@pytest.mark.jvm
@pytest.mark.go
@pytest.mark.ruby
@pytest.mark.node
@pytest.mark.parametrize("server", ["pg18"], indirect=True)
@pytest.mark.parametrize("mutation", MUTATIONS, ids=list(MUTATIONS))
def test_one_changed_expectation_fails_all_seven(
    mutation: str, server: PgServer, conformance_dsn: str, tmp_path: Path
) -> None:
    name, change = MUTATIONS[mutation]
    original = conf.load_scenario(conf.SCENARIO_DIR / f"{name}.json")
    mutated = copy.deepcopy(original)
    change(mutated)
    assert mutated != original
    conf.validate(mutated, API)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(mutated, ensure_ascii=False), encoding="utf-8")

    assert pyrunner.run_scenario(conformance_dsn, mutated, API), "python runner passed"
    assert asyncio.run(asyncpgrunner.run_scenario(conformance_dsn, mutated, API)), \
        "asyncpg runner passed"
    assert run_psql_scenario(server, conformance_dsn, mutated), "psql runner passed"
    code, results, stderr = run_node(conformance_dsn, [path])
    assert code == 1 and results.get(name), f"node runner passed ({code}):\n{stderr}"
    for lang in langs.LANGS:
        code, results, stderr = langs.run_runner(lang, conformance_dsn, [path])
        assert code == 1 and results.get(name), f"{lang} runner passed ({code}):\n{stderr}"


# -- a runner that skips a step fails -------------------------------------------------------

@pytest.mark.jvm
@pytest.mark.go
@pytest.mark.ruby
@pytest.mark.node
@pytest.mark.parametrize("server", ["pg18"], indirect=True)
def test_a_runner_that_skips_a_step_fails(server: PgServer, conformance_dsn: str,
                                          tmp_path: Path) -> None:
    """Every runner reports the steps it ran and the checks it made, exactly; the tests compare
    them with the scenario's, so a runner that leaves a step out (a function or a result it
    does not know) fails instead of passing on what it did check. Here each runner runs
    lease_outcomes without its last step: all it checks passes, its counts are those of the
    shorter scenario, and read against the whole scenario it fails."""
    full_path = conf.SCENARIO_DIR / "lease_outcomes.json"
    full = conf.load_scenario(full_path)
    short = {**full, "steps": full["steps"][:-1]}
    assert conf.step_checks(full["steps"][-1]) > 0
    path = tmp_path / full_path.name
    path.write_text(json.dumps(short, ensure_ascii=False), encoding="utf-8")
    missing = conf.count_failures(full, *conf.expected_counts(short))
    assert missing, "the last step adds nothing to count"

    failures, steps, checks = pyrunner.run(conformance_dsn, short, API)
    assert failures == [] and (steps, checks) == conf.expected_counts(short)
    assert pyrunner.run_scenario(conformance_dsn, short, API) == []
    failures, steps, checks = asyncio.run(asyncpgrunner.run(conformance_dsn, short, API))
    assert failures == [] and (steps, checks) == conf.expected_counts(short)
    assert conf.count_failures(full, steps, checks) == missing

    script, generated = psqlrunner.generate(short, API)
    proc = server.run_psql(conformance_dsn, script, args=psqlrunner.PSQL_ARGS, check=False)
    assert psqlrunner.check_output(short, generated, proc.stdout, proc.stderr) == []
    assert psqlrunner.check_output(full, generated, proc.stdout, proc.stderr) == missing

    commands = {"node": conf.node_command(),
                **{lang: [*langs.runner_command(lang), str(conf.API_FILE)]
                   for lang in langs.LANGS}}
    for lang, command in commands.items():
        proc = subprocess.run([*command, conformance_dsn, str(path)], capture_output=True,
                              text=True, timeout=WAIT_BOUND, cwd=conf.NODE_DIR)
        assert proc.returncode == 0, f"{lang}: {proc.stdout}{proc.stderr}"
        assert langs.read_results(proc.stdout, [path]) == {"lease_outcomes": []}, lang
        assert langs.read_results(proc.stdout, [full_path]) == {"lease_outcomes": missing}, lang
