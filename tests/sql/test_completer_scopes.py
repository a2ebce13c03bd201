"""Completers limited to scopes (issue 34): ``grant_usage(role, kind => 'completer', scopes =>
ARRAY[...])``. Tested as the role itself, on one server and on a Citus cluster (where takeover
runs on the worker holding the scope's shard):

- list_abandoned() lists only the role's scopes, and list_abandoned(scope => other) and
  takeover(other, ...) raise IK023 and change nothing: no attempt, token or lease of another
  scope moves, and no stored response comes back;
- the role is found whether it logs in itself, is a member that inherits the grant, or SET ROLEs
  to it (inside the SECURITY DEFINER functions current_user is the owner);
- a completer granted without scopes keeps every scope (existing calls unchanged); grants add
  up; withdrawing the grant's row refuses the role (fails closed);
- grant_usage's scopes argument is checked (IK016, IK014, IK010, IK011).
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from helpers import MIGRATION_PSQL_ARGS, MIGRATIONS, sqlstate
from psycopg import sql

# The owner makes the keys an hour in the past with a one-second lease, so their leases are
# long expired by the wall clock the completer role runs on (it may not pass reference_time).
CLAIM_PAST = ("SELECT lease_token FROM idempotency.claim(%s, %s, '{}', lease => '1 second',"
              " reference_time => clock_timestamp() - interval '1 hour')")


def _new(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


@contextlib.contextmanager
def _roles(owner_dsn: str, admin_dsn: str, *names: str) -> Iterator[None]:
    try:
        yield
    finally:
        with psycopg.connect(owner_dsn, autocommit=True) as conn:
            for name in names:
                conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(name)))
        with psycopg.connect(admin_dsn, autocommit=True) as conn:
            for name in names:
                conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(name)))


def _key_rows(conn: psycopg.Connection[Any], scope: str) -> list[tuple[Any, ...]]:
    return conn.execute(
        "SELECT key, state, lease_token, lease_expires_at, attempts, response_status"
        " FROM idempotency.keys WHERE scope = %s ORDER BY key", (scope,)).fetchall()


def _setup_keys(owner: psycopg.Connection[Any], mine: str, other: str) -> None:
    """An expired key in each scope, and a completed key with a stored response in the other."""
    owner.execute(CLAIM_PAST, (mine, "m1"))
    owner.execute(CLAIM_PAST, (other, "o1"))
    token = owner.execute("SELECT lease_token FROM idempotency.claim(%s, 'done', '{}')",
                          (other,)).fetchone()[0]
    owner.execute("SELECT idempotency.complete(%s, 'done', %s, 201, '{\"secret\": 1}')",
                  (other, token))


def _clear(owner: psycopg.Connection[Any], *scopes: str) -> None:
    owner.execute("DELETE FROM idempotency.key_directory WHERE scope = ANY (%s)", (list(scopes),))
    owner.execute("DELETE FROM idempotency.keys WHERE scope = ANY (%s)", (list(scopes),))


def _check_limited(dsn: str, role: str, mine: str, other: str,
                   owner: psycopg.Connection[Any], *, citus: bool = False) -> None:
    """As ``role`` (limited to ``mine``): the other scope is refused and left as it was.
    (``citus``: the call is delegated, and Citus passes a worker's error on without its COLUMN
    field.)"""
    before = _key_rows(owner, other)
    with psycopg.connect(dsn, user=role, autocommit=True) as conn:
        with conn.transaction():
            listed = conn.execute("SELECT scope, key FROM idempotency.list_abandoned(10000)"
                                  ).fetchall()
        assert (mine, "m1") in listed
        assert all(scope != other for scope, _ in listed), listed
        for query, params in [
            ("SELECT * FROM idempotency.list_abandoned(10, scope => %s)", (other,)),
            ("SELECT * FROM idempotency.takeover(%s, 'o1')", (other,)),
            ("SELECT * FROM idempotency.takeover(%s, 'done')", (other,)),
            ("SELECT * FROM idempotency.takeover(%s, 'never-claimed')", (other,)),
        ]:
            assert sqlstate(conn, query, params, savepoint=True) == "IK023", query
        # The message names the scope and the role, never anything about a key.
        with pytest.raises(psycopg.Error) as info:
            conn.execute("SELECT * FROM idempotency.takeover(%s, 'done')", (other,))
        assert info.value.sqlstate == "IK023"
        assert info.value.diag.column_name == (None if citus else "scope")
        assert "done" not in info.value.diag.message_primary
        outcome = conn.execute("SELECT outcome FROM idempotency.takeover(%s, 'm1')",
                               (mine,)).fetchone()[0]
        assert outcome == "resumed"
    assert _key_rows(owner, other) == before


@pytest.fixture
def owner(db: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(db, autocommit=True) as conn:
        yield conn


def test_completer_limited_to_its_scopes(server: Any, db: str,
                                         owner: psycopg.Connection[Any]) -> None:
    mine, other = _new("mine"), _new("other")
    limited, member, wide, both = (_new("lim"), _new("mem"), _new("wide"), _new("both"))
    with _roles(db, server.dsn("postgres"), limited, member, wide, both):
        for role in (limited, member, wide, both):
            owner.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
        owner.execute("SELECT idempotency.grant_usage(%s::regrole, 'completer', ARRAY[%s])",
                      (limited, mine))
        # A member inheriting the limited role's privileges, without a grant of its own.
        owner.execute(sql.SQL("GRANT {} TO {}").format(sql.Identifier(limited),
                                                       sql.Identifier(member)))
        owner.execute("SELECT idempotency.grant_usage(%s::regrole, kind => 'completer')", (wide,))
        # A request role may claim in any scope; as a completer it is still limited.
        owner.execute("SELECT idempotency.grant_usage(%s::regrole)", (both,))
        owner.execute("SELECT idempotency.grant_usage(%s::regrole, kind => 'completer',"
                      " scopes => %s)", (both, [mine]))
        assert owner.execute("SELECT scopes FROM idempotency.completer_grants"
                             " WHERE grantee = %s", (limited,)).fetchone() == ([mine],)

        for role in (limited, member, both):
            _clear(owner, mine, other)
            _setup_keys(owner, mine, other)
            _check_limited(db, role, mine, other, owner)

        # SET ROLE: the member acting as the limited role is limited too.
        _clear(owner, mine, other)
        _setup_keys(owner, mine, other)
        with psycopg.connect(db, user=member, autocommit=True) as conn:
            conn.execute(sql.SQL("SET ROLE {}").format(sql.Identifier(limited)))
            assert sqlstate(conn, "SELECT * FROM idempotency.takeover(%s, 'o1')",
                            (other,), savepoint=True) == "IK023"
            # Nor can it pretend to be the owner.
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute("SET ROLE NONE; SET ROLE postgres")

        # A completer without scopes keeps every scope, as before 0.11.0.
        with psycopg.connect(db, user=wide, autocommit=True) as conn:
            assert conn.execute("SELECT outcome FROM idempotency.takeover(%s, 'o1')",
                                (other,)).fetchone() == ("resumed",)
            assert conn.execute("SELECT outcome, response_body FROM"
                                " idempotency.takeover(%s, 'done')", (other,)).fetchone() \
                == ("replay", {"secret": 1})

        # Grants add up: the other scope granted too.
        owner.execute("SELECT idempotency.grant_usage(%s::regrole, 'completer', ARRAY[%s])",
                      (limited, other))
        assert owner.execute("SELECT scopes FROM idempotency.grants WHERE grantee = %s::regrole",
                             (limited,)).fetchone() == (sorted([mine, other]),)
        with psycopg.connect(db, user=limited, autocommit=True) as conn:
            assert conn.execute("SELECT outcome FROM idempotency.takeover(%s, 'done')",
                                (other,)).fetchone() == ("replay",)
        # NULL (every scope) absorbs any list.
        owner.execute("SELECT idempotency.grant_usage(%s::regrole, 'completer')", (both,))
        assert owner.execute("SELECT scopes FROM idempotency.completer_grants"
                             " WHERE grantee = %s", (both,)).fetchone() == (None,)

        # Withdrawn (its row deleted; EXECUTE left in place by mistake): refused, not widened.
        owner.execute("DELETE FROM idempotency.grants WHERE grantee = %s::regrole", (limited,))
        assert owner.execute("SELECT count(*) FROM idempotency.completer_grants"
                             " WHERE grantee = %s", (limited,)).fetchone() == (0,)
        with psycopg.connect(db, user=limited, autocommit=True) as conn:
            assert sqlstate(conn, "SELECT * FROM idempotency.list_abandoned()",
                            (), savepoint=True) == "IK023"
            assert sqlstate(conn, "SELECT * FROM idempotency.takeover(%s, 'm1')",
                            (mine,), savepoint=True) == "IK023"
            # A migration's re-grant does not bring it back either.
        assert owner.execute("SELECT idempotency._reapply_grants()").fetchone()[0] >= 2
        with psycopg.connect(db, user=limited, autocommit=True) as conn:
            assert sqlstate(conn, "SELECT * FROM idempotency.list_abandoned()",
                            (), savepoint=True) == "IK023"


@pytest.mark.parametrize(("scopes", "kind", "sqlstate"), [
    (["a"], "request", "IK016"),
    (["a"], "monitor", "IK016"),
    ([], "completer", "IK014"),
    ([["a"], ["b"]], "completer", "IK014"),
    (["a", None], "completer", "IK010"),
    (["a", ""], "completer", "IK011"),
    (["x" * 256], "completer", "IK012"),
    (["a\x01"], "completer", "IK013"),
])
def test_grant_usage_checks_scopes(server: Any, db: str, owner: psycopg.Connection[Any],
                                   scopes: list[Any], kind: str, sqlstate: str) -> None:
    role = _new("bad")
    with _roles(db, server.dsn("postgres"), role):
        owner.execute(sql.SQL("CREATE ROLE {}").format(sql.Identifier(role)))
        with pytest.raises(psycopg.Error) as info:
            owner.execute("SELECT idempotency.grant_usage(%s::regrole, %s, %s::text[])",
                          (role, kind, scopes))
        assert info.value.sqlstate == sqlstate
        assert info.value.diag.column_name == "scopes"
        # Nothing half-written: no grant recorded, no privilege given.
        assert owner.execute("SELECT count(*) FROM idempotency.grants WHERE grantee::oid ="
                             " (SELECT oid FROM pg_roles WHERE rolname = %s)",
                             (role,)).fetchone() == (0,)
        assert owner.execute("SELECT has_schema_privilege(%s, 'idempotency', 'USAGE')",
                             (role,)).fetchone() == (False,)


# -- Citus --------------------------------------------------------------------------------------

@pytest.fixture(params=[False, True], ids=["default", "delegated"])
def distributed_db(request: pytest.FixtureRequest, citus_cluster: Any,
                   citus_db: str) -> Iterator[str]:
    """citus_db with the migrations applied on the coordinator, then distribute(), by default
    or with delegation (``request.param``)."""
    for migration in sorted(MIGRATIONS.glob("*.sql")):
        citus_cluster.coordinator.run_psql(citus_db, migration, args=MIGRATION_PSQL_ARGS)
    with psycopg.connect(citus_db, autocommit=True) as conn:
        conn.execute("SELECT * FROM idempotency.distribute(shard_count => 4, delegate => %s)",
                     (request.param,)).fetchall()
        placed = conn.execute(
            "SELECT partmethod FROM pg_dist_partition"
            " WHERE logicalrelid = 'idempotency.completer_grants'::regclass").fetchone()
        assert placed == ("n",), "completer_grants is not a reference table"
    yield citus_db


def test_completer_limited_to_its_scopes_on_citus(citus_cluster: Any, distributed_db: str,
                                                  request: pytest.FixtureRequest) -> None:
    """Through the coordinator, with the two scopes on different workers' shards: takeover
    runs on the coordinator (by default) or on the worker holding the scope's shard
    (delegated), and is refused there."""
    dsn = distributed_db
    delegated = "delegated" in request.node.callspec.id
    with psycopg.connect(dsn, autocommit=True) as owner:
        # Two scopes whose shards are on different workers.
        found: dict[int, str] = {}
        for i in range(200):
            scope = f"tenant_{uuid.uuid4().hex[:6]}_{i}"
            port = owner.execute(
                "SELECT nodeport FROM pg_dist_shard_placement WHERE shardid ="
                " get_shard_id_for_distribution_column('idempotency.keys', %s::text)",
                (scope,)).fetchone()[0]
            found.setdefault(port, scope)
            if len(found) == 2:
                break
        assert len(found) == 2
        mine, other = found.values()
        limited, wide = _new("lim"), _new("wide")
        with _roles(dsn, citus_cluster.coordinator.dsn("postgres"), limited, wide):
            for role in (limited, wide):
                owner.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
            owner.execute("SELECT idempotency.grant_usage(%s::regrole, 'completer',"
                          " ARRAY[%s])", (limited, mine))
            owner.execute("SELECT idempotency.grant_usage(%s::regrole, 'completer')", (wide,))
            _setup_keys(owner, mine, other)
            _check_limited(dsn, limited, mine, other, owner, citus=delegated)
            with psycopg.connect(dsn, user=wide, autocommit=True) as conn:
                assert conn.execute("SELECT outcome FROM idempotency.takeover(%s, 'o1')",
                                    (other,)).fetchone() == ("resumed",)
            # The mirror is on every worker, by name.
            for worker in citus_cluster.workers:
                with psycopg.connect(worker.dsn(dsn_db(dsn)), autocommit=True) as wconn:
                    assert wconn.execute(
                        "SELECT scopes FROM idempotency.completer_grants WHERE grantee = %s",
                        (limited,)).fetchone() == ([mine],)


def dsn_db(dsn: str) -> str:
    return psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]
