-- Recipe of migrations/0007_routes.sql (tools/build.py --migration 7 routes); the syntax is
-- explained in sql/upgrades/0002_maintenance.sql.
--
-- 0007: claim's read of an existing key and complete's UPDATE go to the key's one partition of
-- keys through a static statement per partition, in functions that _make_routes() generates
-- from the catalog (docs/design.md, "Routing to one partition"), instead of a generic plan on
-- the parent that locks every partition. No table changes; keys made before the upgrade are
-- found as before (a key whose partition has no branch goes through the parent).

-- @include functions/_make_routes.sql
-- @replace functions/_create_partition.sql
-- @replace functions/claim.sql
-- @replace functions/_finish.sql
-- @replace functions/maintain.sql

SELECT idempotency._make_routes() AS routes_made;

-- As in sql/bootstrap.sql: nothing new is executable by PUBLIC.
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA idempotency FROM public;
