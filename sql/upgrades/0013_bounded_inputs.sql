-- Recipe of migrations/0013_bounded_inputs.sql (tools/build.py --migration 13
-- bounded_inputs); the syntax is explained in sql/upgrades/0002_maintenance.sql.
-- Self-contained: only the objects added or changed here.
--
-- 0013 (0.13.0): every limit holds whatever the input's origin, and maintain() keeps every key
-- for its retention whatever reference time it is given.
-- No table changes; no data moves.

-- As in sql/bootstrap.sql: nothing new is executable by PUBLIC.
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA idempotency FROM public;
