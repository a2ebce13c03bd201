-- Recipe of migrations/0008_fenced_routes.sql (tools/build.py --migration 8 fenced_routes); the
-- syntax is explained in sql/upgrades/0002_maintenance.sql.
--
-- 0008: heartbeat's, checkpoint's and accept's fenced UPDATE, release's DELETE, the takeover
-- of an expired lease (claim's and takeover()'s) and takeover()'s read go to the key's one
-- partition of keys through generated functions, as claim's read and complete's UPDATE did in
-- 0007 (docs/design.md, "Routing to one partition"). complete_bytes, heartbeat,
-- checkpoint and release check their arguments with the inlined tests first, as claim and
-- complete do (the PERFORMs of _check_name cost 10-14 µs each). No table changes.

-- @replace functions/_make_routes.sql
-- @replace functions/heartbeat.sql
-- @replace functions/checkpoint.sql
-- @replace functions/accept.sql
-- @replace functions/release.sql
-- @replace functions/complete_bytes.sql
-- @replace functions/_resume_existing.sql
-- @replace functions/takeover.sql

-- The two functions 0007 generated are made again below with this version's text and comments
-- (an install made fresh and an upgraded one have the same catalog).
DROP FUNCTION idempotency._key_row(text, text, timestamptz);
DROP FUNCTION idempotency._complete_row(
    text, text, bigint, timestamptz, integer, jsonb, jsonb, bytea, text, timestamptz
);
SELECT idempotency._make_routes() AS routes_made;

-- As in sql/bootstrap.sql: nothing new is executable by PUBLIC.
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA idempotency FROM public;
