-- Recipe of migrations/0014_citus_delegation.sql (tools/build.py --migration 14
-- citus_delegation); the syntax is explained in sql/upgrades/0002_maintenance.sql.
-- Self-contained: only the objects added or changed here.
--
-- 0014 (0.14.0): on Citus, function delegation becomes an explicit choice.
-- No table changes; no data moves.

-- As in sql/bootstrap.sql: nothing new is executable by PUBLIC.
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA idempotency FROM public;
