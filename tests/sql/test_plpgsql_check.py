"""Static checks of every PL/pgSQL body in schema idempotency with plpgsql_check.

sqlfluff sees a function body as one string literal; plpgsql_check compiles the body
against the real catalog and reports unknown columns, type mismatches, unused
variables, missing RETURN, implicit casts defeating indexes, SQL injection risks, ...

plpgsql_check is packaged for PostgreSQL 15 only here, so this test exists for pg15
only (it is not parametrized over pg18, rather than skipped there).
"""

from __future__ import annotations

import psycopg
import pytest
from psycopg.rows import dict_row

# Needs (tests/README.md): Debian's postgresql-15-plpgsql-check.
pytestmark = pytest.mark.plpgsql_check

# (function name, message substring) -> why this warning is acceptable.
# Keep every entry justified; an entry that no longer matches anything fails the test.
ALLOWED: dict[tuple[str, str], str] = {
    ("_make_routes", "should be STABLE"):
        "it runs CREATE OR REPLACE FUNCTION, REVOKE and COMMENT through EXECUTE (the functions "
        "it makes are named at run time), which the checker cannot see",
    ("_write_tombstones", "should be STABLE"):
        "it runs INSERT INTO idempotency.tombstones through EXECUTE (the source partition is "
        "named at run time), which the checker cannot see",
    # pg_cron is optional (it needs shared_preload_libraries, which this server lacks): the
    # scheduling functions reach cron.* through EXECUTE precisely so that they can be created
    # without it, and raise IK020 before any such EXECUTE when it is missing. The checker
    # still compiles the constant strings against this database.
    ("schedule_maintenance", 'schema "cron" does not exist'):
        "cron.schedule exists only where pg_cron is installed (tests/sql/test_pg_cron.py runs it)",
    ("unschedule_maintenance", 'schema "cron" does not exist'):
        "cron.unschedule exists only where pg_cron is installed (tests/sql/test_pg_cron.py)",
    ("unschedule_maintenance", 'relation "cron.job" does not exist'):
        "cron.job exists only where pg_cron is installed (tests/sql/test_pg_cron.py)",
    ("unschedule_maintenance", "should be STABLE"):
        "it calls cron.unschedule through EXECUTE, which the checker cannot see",
    ("_drop_directory_rows", "should be STABLE"):
        "it runs DELETE FROM idempotency.key_directory through EXECUTE (the partition it joins "
        "is named at run time), which the checker cannot see",
    # Citus is optional in the same way: its catalogs and functions exist only where the
    # citus extension is installed, so _distributed and distribute reach them through EXECUTE
    # (distribute raises IK021 first without it). tests/citus/test_citus.py runs both on a cluster.
    ("_distributed", 'relation "pg_catalog.pg_dist_partition" does not exist'):
        "pg_dist_partition exists only where Citus is installed (it returns false before)",
    ("distribute", "citus_is_coordinator() does not exist"):
        "a Citus function (tests/citus/test_citus.py)",
    ("distribute", 'relation "pg_catalog.pg_dist_partition" does not exist'):
        "a Citus catalog (tests/citus/test_citus.py)",
    ("distribute", 'relation "pg_catalog.pg_dist_object" does not exist'):
        "a Citus catalog (tests/citus/test_citus.py)",
    ("distribute", "create_reference_table(regclass) does not exist"):
        "a Citus function (tests/citus/test_citus.py)",
    ("distribute", "create_distributed_table(regclass, text"):
        "a Citus function (tests/citus/test_citus.py)",
    ("distribute", "truncate_local_data_after_distributing_table(regclass) does not exist"):
        "a Citus function (tests/citus/test_citus.py)",
    ("_require_coordinator", 'relation "pg_catalog.pg_dist_local_group" does not exist'):
        "a Citus catalog, read only when to_regclass finds it (tests/sql/test_bounds_sql.py runs "
        "it on a worker)",
    ("_make_routes", 'relation "pg_catalog.pg_dist_shard" does not exist'):
        "a Citus catalog, read after _distributed() says Citus is there, for the local halves "
        "of the routes (tests/citus/test_citus.py)",
    ("_citus_custom_plans", 'relation "pg_catalog.pg_dist_object" does not exist'):
        "a Citus catalog, read after _distributed() says Citus is there "
        "(tests/citus/test_citus.py)",
    ("_citus_custom_plans", "should be STABLE"):
        "it runs ALTER FUNCTION through EXECUTE (the function is named at run time), which the "
        "checker cannot see",
    ("metrics", "run_command_on_all_nodes("):
        "a Citus function: after distribute(), metrics() sums the shards' statistics on every "
        "node (tests/citus/test_citus_ops.py)",
    ("_recreate_function", "text type variable is not sanitized"):
        "it executes pg_get_functiondef()'s text of a function of the schema (distribute() "
        "undoing a Citus delegation, tests/citus/test_citus.py), not anything a caller wrote",
    ("distribute", 'unused variable "v_fn"'):
        "the loop variable of the FOR over the Citus catalog query above, which the checker "
        "could not compile",
}

FUNCTIONS_SQL = """
SELECT p.oid::regprocedure::text AS signature,
       p.proname AS name,
       p.prorettype = 'pg_catalog.trigger'::regtype AS is_trigger,
       coalesce((SELECT array_agg(DISTINCT t.tgrelid::regclass::text)
                 FROM pg_trigger t WHERE t.tgfoid = p.oid), '{}') AS trigger_tables,
       p.oid AS oid
FROM pg_proc p
JOIN pg_namespace n ON n.oid = p.pronamespace
JOIN pg_language l ON l.oid = p.prolang
WHERE n.nspname = 'idempotency' AND l.lanname = 'plpgsql'
ORDER BY 1
"""

CHECK_SQL = """
SELECT level, sqlstate, message, detail, hint, lineno, statement, query, context
FROM plpgsql_check_function_tb(
    %(oid)s::regprocedure,
    relid => coalesce(%(relid)s::text::regclass, 0::oid::regclass),
    fatal_errors => false,
    other_warnings => true,
    extra_warnings => true,
    performance_warnings => true,
    security_warnings => true)
"""


def _format(sig: str, row: dict) -> str:
    parts = [f"{sig}: {row['level']}"]
    if row["lineno"] is not None:
        parts.append(f"line {row['lineno']}")
    if row["statement"]:
        parts.append(f"({row['statement']})")
    text = " ".join(parts) + f": [{row['sqlstate']}] {row['message']}"
    for key in ("detail", "hint", "query", "context"):
        if row[key]:
            text += f"\n    {key}: {row[key]}"
    return text


@pytest.mark.parametrize("server", ["pg15"], indirect=True)
def test_plpgsql_check(db: str) -> None:
    used: set[tuple[str, str]] = set()
    problems: list[str] = []
    with psycopg.connect(db, autocommit=True, row_factory=dict_row) as conn:
        conn.execute("CREATE EXTENSION plpgsql_check")
        assert conn.execute(
            "SELECT 1 FROM pg_namespace WHERE nspname = 'idempotency'"
        ).fetchone(), "schema idempotency does not exist after the migrations"
        functions = conn.execute(FUNCTIONS_SQL).fetchall()
        assert functions, "no PL/pgSQL function in schema idempotency: nothing was checked"
        for fn in functions:
            relids: list[str | None] = [None]  # None: not a trigger, no relation
            if fn["is_trigger"]:
                if not fn["trigger_tables"]:
                    problems.append(f"{fn['signature']}: trigger function attached to no "
                                    "table, so plpgsql_check cannot check it")
                    continue
                relids = fn["trigger_tables"]
            for relid in relids:
                for row in conn.execute(CHECK_SQL, {"oid": fn["oid"], "relid": relid}):
                    allowed = [k for k in ALLOWED
                               if k[0] == fn["name"] and k[1] in (row["message"] or "")]
                    if allowed:
                        used.update(allowed)
                    else:
                        problems.append(_format(fn["signature"], row))
    stale = [f"{k}: {ALLOWED[k]}" for k in ALLOWED if k not in used]
    if stale:
        problems.append("allowlist entries that matched nothing (remove them):\n  "
                        + "\n  ".join(stale))
    if problems:
        pytest.fail(f"plpgsql_check found {len(problems)} problem(s):\n" + "\n".join(problems),
                    pytrace=False)
