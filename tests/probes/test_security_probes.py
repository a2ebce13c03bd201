"""Security probes (issue 13), run as the application role itself.

- Least privilege: every application role that docs/install.md's "Privileges" section makes
  (its ``SELECT idempotency.grant_…('role')`` lines, run as written) is refused every direct
  SELECT/INSERT/UPDATE/DELETE/TRUNCATE on every table and partition of schema idempotency and
  every use of its sequences; the objects come from the catalog, so new tables, partitions and
  grant functions are covered without editing this file. PUBLIC can execute no function.
- search_path hijack: look-alike functions and operators planted in ``public``, an attacker's
  schema and ``pg_temp`` (one for every pg_catalog function whose name appears in an engine
  function body, with the same argument types, plus operators on the engine's types) count
  their calls in a sequence (not rolled back by an error); the app role walks the whole
  lifecycle with the attacker's schemas first on its search_path and the counter stays at 0.

tests/sql/40_privileges.sql checks the ACLs and function attributes from the owner's side;
tests/probes/test_hostile_settings.py checks migrations under a hostile search_path.
"""

from __future__ import annotations

import re
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import errors, sql
from psycopg.types.json import Jsonb

ROOT = Path(__file__).resolve().parents[2]
INSTALL_MD = ROOT / "docs" / "install.md"


def documented_grants() -> list[tuple[str, str]]:
    """(statement, role) for each ``SELECT idempotency.grant_…('role')`` of the Privileges
    section of docs/install.md."""
    text = INSTALL_MD.read_text()
    section = text[text.index("## Privileges"):]
    nxt = section.find("\n## ", 3)
    section = section if nxt < 0 else section[:nxt]
    found = re.findall(r"(SELECT\s+idempotency\.grant_\w+\(\s*'(\w+)'[^;]*\);)", section)
    assert found, "docs/install.md no longer shows how to grant an application role"
    return [(stmt, role) for stmt, role in found]


def make_documented_roles(db: str) -> list[str]:
    suffix = uuid.uuid4().hex[:6]
    roles = []
    with psycopg.connect(db, autocommit=True) as conn:
        for stmt, role in documented_grants():
            name = f"{role}_{suffix}"
            conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(name)))
            conn.execute(stmt.replace(f"'{role}'", f"'{name}'"))
            roles.append(name)
    return roles


MAINTAINER_READS = ("idempotency.maintenance_runs", "idempotency.migrations")


def kind_of(db: str, role: str) -> str:
    with psycopg.connect(db, autocommit=True) as conn:
        return conn.execute("SELECT kind FROM idempotency.grants WHERE grantee = %s::regrole",
                            (role,)).fetchone()[0]


def as_role(db: str, role: str) -> psycopg.Connection[Any]:
    return psycopg.connect(db.replace("postgres@", f"{role}@", 1), autocommit=True)


def test_documented_app_roles_are_denied_every_direct_table_and_sequence_operation(db: str
                                                                                  ) -> None:
    with psycopg.connect(db, autocommit=True) as conn:
        conn.execute("SELECT idempotency._premake()")
        tables = [r[0] for r in conn.execute(
            "SELECT c.oid::regclass::text FROM pg_class AS c "
            "WHERE c.relnamespace = 'idempotency'::regnamespace "
            "AND c.relkind IN ('r', 'p', 'v', 'm', 'f') ORDER BY 1")]
        sequences = [r[0] for r in conn.execute(
            "SELECT c.oid::regclass::text FROM pg_class AS c "
            "WHERE c.relnamespace = 'idempotency'::regnamespace AND c.relkind = 'S' ORDER BY 1")]
    # No sequence since 0.9.0 (lease tokens are made per key by _new_token, not by
    # lease_token_seq); one added later is probed like the tables.
    assert len(tables) >= 15 and "idempotency.key_directory" in tables, (tables, sequences)
    probes = []
    for t in tables:
        probes += [f"SELECT * FROM {t} LIMIT 1", f"INSERT INTO {t} DEFAULT VALUES",
                   f"DELETE FROM {t} WHERE false", f"TRUNCATE {t}",
                   f"SELECT 1 FROM {t} FOR UPDATE"]
        # UPDATE needs a column name: take the first one.
        probes.append(("update", t))
    for s in sequences:
        probes += [f"SELECT nextval('{s}')", f"SELECT setval('{s}', 1)",
                   f"SELECT last_value FROM {s}", f"SELECT currval('{s}')"]
    roles = make_documented_roles(db)
    denied = allowed = 0
    for role in roles:
        # A maintainer reads these two (docs/install.md), and writes to neither.
        readable = {f"SELECT * FROM {t} LIMIT 1" for t in MAINTAINER_READS
                    } if kind_of(db, role) == "maintainer" else set()
        with as_role(db, role) as app:
            for probe in probes:
                if isinstance(probe, tuple):
                    col = app.execute(
                        "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass "
                        "AND attnum > 0 AND NOT attisdropped ORDER BY attnum LIMIT 1",
                        (probe[1],)).fetchone()[0]
                    probe = f"UPDATE {probe[1]} SET {col} = {col} WHERE false"
                if probe in readable:
                    app.execute(probe)
                    allowed += 1
                    continue
                with pytest.raises(errors.InsufficientPrivilege):
                    app.execute(probe)
                denied += 1
    assert allowed == len(MAINTAINER_READS)
    assert denied + allowed == len(roles) * len(probes) >= 100
    print(f"least privilege: {len(roles)} role(s) denied {denied} direct operations on "
          f"{len(tables)} tables and {len(sequences)} sequences")
    with psycopg.connect(db, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM idempotency.keys").fetchone()[0] == 0


def test_public_can_execute_no_function_and_roles_only_what_they_were_granted(db: str) -> None:
    with psycopg.connect(db, autocommit=True) as conn:
        funcs = conn.execute(
            "SELECT count(*) FROM pg_proc WHERE pronamespace = 'idempotency'::regnamespace"
        ).fetchone()[0]
        # A NULL proacl is the default ACL, which lets PUBLIC execute: expand it.
        public = conn.execute(
            "SELECT p.oid::regprocedure::text FROM pg_proc AS p "
            "CROSS JOIN LATERAL aclexplode(coalesce(p.proacl, acldefault('f', p.proowner))) AS a "
            "WHERE p.pronamespace = 'idempotency'::regnamespace AND a.grantee = 0").fetchall()
        assert funcs > 30 and public == []
        # Nor through a default privilege that would apply to functions made later.
        assert conn.execute(
            "SELECT count(*) FROM pg_default_acl AS d "
            "CROSS JOIN LATERAL aclexplode(d.defaclacl) AS a "
            "WHERE d.defaclnamespace = 'idempotency'::regnamespace AND a.grantee = 0"
        ).fetchone()[0] == 0
        conn.execute("CREATE ROLE idem_probe_nobody_" + uuid.uuid4().hex[:6] + " LOGIN")
        nobody = conn.execute(
            "SELECT rolname FROM pg_roles WHERE rolname LIKE 'idem_probe_nobody_%'"
        ).fetchone()[0]
        conn.execute(f"GRANT USAGE ON SCHEMA idempotency TO {nobody}")
        callable_ = conn.execute(
            "SELECT count(*) FROM pg_proc WHERE pronamespace = 'idempotency'::regnamespace "
            "AND has_function_privilege(%s, oid, 'EXECUTE')", (nobody,)).fetchone()[0]
        assert callable_ == 0
    with as_role(db, nobody) as conn, pytest.raises(errors.InsufficientPrivilege):
        conn.execute("SELECT idempotency.claim('s', 'k', '{}')")


# -- search_path hijack ------------------------------------------------------------------------

OPERATORS = [  # (operator, left, right): operators on the types the engine works with
    ("=", "text", "text"), ("<>", "text", "text"), ("||", "text", "text"),
    ("=", "bytea", "bytea"), ("=", "bigint", "bigint"), ("<", "timestamptz", "timestamptz"),
    ("<=", "timestamptz", "timestamptz"), (">", "timestamptz", "timestamptz"),
    ("+", "timestamptz", "interval"), ("-", "timestamptz", "timestamptz"),
    ("->>", "jsonb", "text"), ("->", "jsonb", "text"), ("=", "jsonb", "jsonb"),
    ("||", "jsonb", "jsonb"), ("~", "text", "text"), ("=", "integer", "integer"),
]


def _planted_functions(conn: psycopg.Connection[Any]) -> list[tuple[str, str, str]]:
    """(name, argument types, return type) of every plain pg_catalog function whose name
    appears as ``name(`` in an engine function's body."""
    bodies = " ".join(r[0] for r in conn.execute(
        "SELECT prosrc FROM pg_proc WHERE pronamespace = 'idempotency'::regnamespace"))
    words = set(re.findall(r"\b([a-z_][a-z0-9_]*)\s*\(", bodies.lower()))
    rows = conn.execute(
        """SELECT p.proname, pg_get_function_identity_arguments(p.oid),
                  format_type(p.prorettype, NULL)
           FROM pg_proc AS p
           WHERE p.pronamespace = 'pg_catalog'::regnamespace AND p.proname = ANY(%s)
             AND p.prokind = 'f' AND NOT p.proretset AND p.pronargs > 0
             AND p.prorettype NOT IN ('internal'::regtype, 'trigger'::regtype,
                                       'void'::regtype)
             AND NOT EXISTS (SELECT FROM unnest(p.proargtypes::oid[]) AS t(oid)
                             JOIN pg_type AS ty ON ty.oid = t.oid
                             WHERE ty.typtype = 'p')
             AND (SELECT typtype FROM pg_type WHERE oid = p.prorettype) <> 'p'
           ORDER BY 1, 2""", (sorted(words),)).fetchall()
    # Plus argument-less ones that matter for time: now(), clock_timestamp(), random().
    rows += [("now", "", "timestamp with time zone"),
             ("clock_timestamp", "", "timestamp with time zone"),
             ("statement_timestamp", "", "timestamp with time zone"),
             ("transaction_timestamp", "", "timestamp with time zone"),
             ("random", "", "double precision"), ("gen_random_uuid", "", "uuid"),
             ("sha256", "text", "bytea"), ("digest", "bytea, text", "bytea"),
             ("coalesce", "text, text", "text"), ("greatest", "timestamptz, timestamptz",
                                                   "timestamp with time zone")]
    return rows


def _plant(conn: psycopg.Connection[Any], schema: str, funcs: list[tuple[str, str, str]]
           ) -> int:
    planted = 0
    for name, args, ret in funcs:
        try:  # identity arguments are valid CREATE FUNCTION argument lists as they are
            with conn.transaction():
                conn.execute(
                    f"CREATE FUNCTION {schema}.{name}({args}) RETURNS {ret} "
                    "LANGUAGE plpgsql AS $f$ BEGIN "
                    "PERFORM pg_catalog.nextval('public.hijack_calls'); RETURN NULL; END $f$")
            planted += 1
        except psycopg.Error:
            continue  # a keyword (coalesce, greatest) cannot be a function name
    for op, left, right in OPERATORS:
        fname = f"hijack_op_{planted}"
        with conn.transaction():
            conn.execute(
                f"CREATE FUNCTION {schema}.{fname}({left}, {right}) RETURNS boolean "
                "LANGUAGE plpgsql AS $f$ BEGIN "
                "PERFORM pg_catalog.nextval('public.hijack_calls'); RETURN NULL; END $f$")
            conn.execute(f"CREATE OPERATOR {schema}.{op} (LEFTARG = {left}, RIGHTARG = {right}, "
                         f"FUNCTION = {schema}.{fname})")
        planted += 1
    return planted


def hijack_calls(conn: psycopg.Connection[Any]) -> int:
    return conn.execute("SELECT CASE WHEN is_called THEN last_value ELSE 0 END "
                        "FROM public.hijack_calls").fetchone()[0]


def test_lookalikes_in_public_attacker_schema_and_pg_temp_are_never_called(db: str) -> None:
    roles = make_documented_roles(db)
    with psycopg.connect(db, autocommit=True) as owner:
        owner.execute("SELECT idempotency._premake()")
        owner.execute("CREATE SEQUENCE public.hijack_calls")
        owner.execute("GRANT USAGE, UPDATE, SELECT ON SEQUENCE public.hijack_calls TO PUBLIC")
        owner.execute("CREATE SCHEMA evil")
        owner.execute("GRANT USAGE ON SCHEMA evil, public TO PUBLIC")
        funcs = _planted_functions(owner)
        planted = _plant(owner, "public", funcs) + _plant(owner, "evil", funcs)
        # The planted functions work when called: the counter is not dead.
        owner.execute("SET search_path = evil, public")
        owner.execute("SELECT evil.now()")
        assert hijack_calls(owner) == 1
        owner.execute("SELECT setval('public.hijack_calls', 1, false)")
        assert hijack_calls(owner) == 0
    hostile = "pg_temp, evil, public, pg_catalog"
    outcomes: list[str] = []
    request_scope = ""  # docs/install.md makes the request role first
    for role in roles:
        with as_role(db, role) as app:
            planted_temp = _plant(app, "pg_temp", funcs)
            app.execute(f"SET search_path = {hostile}")
            planted += planted_temp
            can_claim = app.execute(
                "SELECT has_function_privilege(current_user, 'idempotency.claim(text, text, "
                "jsonb, interval, bytea, boolean, timestamptz)', 'EXECUTE')").fetchone()[0]
            if can_claim:
                outcomes += _lifecycle(app, f"hj-{role}")
                request_scope = f"hj-{role}"
            elif kind_of(db, role) == "maintainer":
                _maintainer_run(app)
            else:  # a completer: takes over what a request role abandoned
                outcomes += _completer_lifecycle(app, request_scope)
            assert hijack_calls(app) == 0, f"a look-alike was called as {role}"
    assert planted >= 80, planted
    print(f"search_path: {planted} look-alikes planted, never called; lifecycle {outcomes}")
    assert outcomes[:6] == ["claimed", "replay", "mismatch", "claimed", "in_progress",
                            "claimed"], outcomes
    assert outcomes[-1] == "takeover:resumed", outcomes  # the completer's part ran


def _maintainer_run(app: psycopg.Connection[Any]) -> None:
    """maintain() and the status reads, as pg-idempotency maintain and status call them."""
    before = app.execute("SELECT count(*) FROM idempotency.maintenance_runs").fetchone()[0]
    app.execute("SELECT * FROM idempotency.maintain()").fetchall()
    assert app.execute("SELECT count(*) FROM idempotency.maintenance_runs").fetchone()[0] == (
        before + 1)
    assert app.execute("SELECT count(*) FROM idempotency.key_status()").fetchone()[0] > 0
    assert app.execute("SELECT count(*) FROM idempotency.partition_status()").fetchone()[0] > 0
    app.execute("SELECT * FROM idempotency.metrics()").fetchall()
    app.execute("SELECT * FROM idempotency.metrics_by_scope()").fetchall()


def _completer_lifecycle(app: psycopg.Connection[Any], scope: str) -> list[str]:
    """list_abandoned, takeover, heartbeat, checkpoint and complete of the key a request
    role's lifecycle left with an expired lease (k2 of ``scope``)."""
    listed = app.execute("SELECT scope, key FROM idempotency.list_abandoned(10, %s)",
                         (scope,)).fetchall()
    assert (scope, "k2") in listed, listed
    outcome, token = app.execute("SELECT (r).outcome, (r).lease_token FROM "
                                 "idempotency.takeover(%s, 'k2') AS r", (scope,)).fetchone()
    app.execute("SELECT idempotency.heartbeat(%s, 'k2', %s)", (scope, token))
    app.execute("SELECT idempotency.checkpoint(%s, 'k2', %s, 'step-2')", (scope, token))
    app.execute("SELECT idempotency.complete(%s, 'k2', %s, 200, %s)",
                (scope, token, Jsonb({"done": True})))
    return [f"takeover:{outcome}"]


def _lifecycle(app: psycopg.Connection[Any], scope: str) -> list[str]:
    """claim, complete, replay, mismatch, checkpoint, heartbeat, in_progress, release, claim
    again, takeover, list_abandoned, fingerprint/canonical_json/derive_key, inbox_accept."""
    out = []

    def claim(key: str, req: Any, lease: str = "30 seconds") -> Any:
        return app.execute("SELECT (r).outcome, (r).lease_token FROM "
                           "idempotency.claim(%s, %s, %s, %s::interval) AS r",
                           (scope, key, Jsonb(req), lease)).fetchone()

    def call(q: str, *args: Any) -> Any:
        try:
            return app.execute(q, args).fetchall()
        except psycopg.errors.InsufficientPrivilege:
            return None  # a role that is not granted this function (request vs completer)

    outcome, token = claim("k1", {"a": 1, "b": [1.50, "x"]})
    out.append(outcome)
    call("SELECT idempotency.complete(%s, 'k1', %s, 201, %s)", scope, token, Jsonb({"id": 1}))
    out.append(claim("k1", {"b": [1.5, "x"], "a": 1})[0])
    out.append(claim("k1", {"a": 2})[0])
    outcome, token = claim("k2", {"n": 1})
    out.append(outcome)
    call("SELECT idempotency.checkpoint(%s, 'k2', %s, 'step-1')", scope, token)
    call("SELECT idempotency.heartbeat(%s, 'k2', %s)", scope, token)
    out.append(claim("k2", {"n": 1})[0])
    call("SELECT idempotency.release(%s, 'k2', %s)", scope, token)
    released = token
    outcome, token = claim("k2", {"n": 1}, "1 microsecond")
    out.append(outcome)
    assert token > released, (token, released)  # the next owner's token is greater
    call("SELECT * FROM idempotency.takeover(%s, 'k2')", scope)
    call("SELECT * FROM idempotency.list_abandoned(10)")
    call("SELECT idempotency.fingerprint(%s, %s, ARRAY['a'])", Jsonb({"a": 1}), Jsonb({"b": 2}))
    call("SELECT idempotency.canonical_json(%s)", Jsonb({"z": [1e3, None, True]}))
    call("SELECT idempotency.derive_key(%s, 'k1', 'charge')", scope)
    call("SELECT idempotency.inbox_accept(%s, 'msg-1')", scope)
    return out
