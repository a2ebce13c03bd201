-- Recipe of migrations/0010_operations.sql (tools/build.py --migration 10 operations); the
-- syntax is explained in sql/upgrades/0002_maintenance.sql. Self-contained: only the objects
-- added or changed here (docs/operations.md).
--
-- 0010: operations (0.10.0).
-- - Metrics for any scraper: idempotency.metrics() and metrics_by_scope(), and
--   idempotency.maintenance_runs, written by maintain() at the end of each run (maintain()
--   becomes a wrapper of _maintain(), whose steps are 0009's maintain() unchanged).
-- - Grants that survive upgrades: grant_usage() records each role and kind in
--   idempotency.grants (and has a third kind, 'monitor', for metrics()), and every migration
--   from this one on re-applies them (_reapply_grants(), appended by tools/build.py). The roles
--   granted before this migration are recorded from what they can execute now: claim makes a
--   role a request role, takeover a completer (a role granted before 0006 has both), so a
--   role granted at 0002 gets accept, complete_bytes and every later function of its kind.
-- - Key inspection and repair for operators (pg-idempotency keys show | list | release):
--   inspect_key(), list_keys(), force_release(), the schema owner's alone; they find a key
--   through key_directory as the engine does and never show its lease token.
-- - On Citus, grants and maintenance_runs stay coordinator-local tables (see distribute.sql);
--   run idempotency.distribute() again after this migration to create the new functions on
--   every node.
-- - claim() of a released key locks one partition of keys (_drop_released_row).

-- @include tables/grants.sql
-- @include tables/maintenance_runs.sql
-- @include types/metrics_result.sql
-- @include types/scope_metrics.sql
-- @include types/key_info.sql

INSERT INTO idempotency.grants (grantee, kind)
SELECT DISTINCT
    a.grantee::regrole AS grantee,
    CASE p.proname WHEN 'claim' THEN 'request' ELSE 'completer' END AS kind
FROM pg_proc AS p
CROSS JOIN LATERAL aclexplode(p.proacl) AS a
WHERE
    p.pronamespace = 'idempotency'::regnamespace
    AND p.proname IN ('claim', 'takeover')
    AND a.privilege_type = 'EXECUTE'
    AND a.grantee <> p.proowner
    AND a.grantee <> 0
ON CONFLICT DO NOTHING;

-- @replace functions/grant_usage.sql
-- @include functions/_reapply_grants.sql

-- maintain() keeps its signature and its report; its steps move to _maintain().
-- @include functions/_maintain.sql
-- @replace functions/maintain.sql
-- @include functions/metrics.sql
-- @include functions/metrics_by_scope.sql
-- @include functions/inspect_key.sql
-- @include functions/list_keys.sql
-- @include functions/force_release.sql

-- claim() removes a released key's row through a generated route, _drop_released_row, so
-- that it locks the row's one partition, not all of them (0.9.0's DELETE on the parent did).
-- @replace functions/_make_routes.sql
SELECT idempotency._make_routes() AS routes_made;
-- @replace functions/claim.sql
-- Comments only: since 0.9.0 the fenced calls raise IK001 or IK004 (never IK003), and
-- key_status reports released keys.
-- @replace functions/complete.sql
-- @replace functions/complete_bytes.sql
-- @replace functions/heartbeat.sql
-- @replace functions/checkpoint.sql
-- @replace functions/accept.sql
-- @replace functions/release.sql
-- @replace functions/key_status.sql

-- As in sql/bootstrap.sql: nothing new is executable by PUBLIC.
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA idempotency FROM public;
