-- Recipe of migrations/0014_citus_delegation.sql (tools/build.py --migration 14
-- citus_delegation); the syntax is explained in sql/upgrades/0002_maintenance.sql.
-- Self-contained: only the objects added or changed here.
--
-- 0014 (0.14.0): on Citus, function delegation becomes an explicit choice.
-- - distribute(shard_count, delegate boolean DEFAULT false): distribute() no longer delegates
--   the per-key functions unless delegate => true (a stock Citus crashes or answers wrongly on
--   some SQL around a delegated call, docs/scale-out.md), and delegate => false, the default,
--   undoes an earlier delegation. The migration itself changes no delegation: a distributed
--   install keeps what it has until distribute() runs again. Citus clears a delegation on
--   the coordinator only, so distribute() drops and recreates an undelegated function
--   (_recreate_function, new), which Citus does on every node.
-- No table changes; no data moves.

-- @include functions/_recreate_function.sql
DROP FUNCTION idempotency.distribute(integer);
-- @include functions/distribute.sql

-- As in sql/bootstrap.sql: nothing new is executable by PUBLIC.
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA idempotency FROM public;
