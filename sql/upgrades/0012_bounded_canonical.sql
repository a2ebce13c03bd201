-- Recipe of migrations/0012_bounded_canonical.sql (tools/build.py --migration 12
-- bounded_canonical); the syntax is explained in sql/upgrades/0002_maintenance.sql.
-- Self-contained: only the objects added or changed here.
--
-- 0012 (0.12.0): the canonical form is bounded by the input.
-- No table changes; no data moves.

-- As in sql/bootstrap.sql: nothing new is executable by PUBLIC.
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA idempotency FROM public;
