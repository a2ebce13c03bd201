-- Recipe of migrations/0009_citus.sql (tools/build.py --migration 9 citus); the syntax is
-- explained in sql/upgrades/0002_maintenance.sql.
--
-- 0009: the guarantees no longer depend on one node (docs/scale-out.md, docs/design.md).
-- - Uniqueness: key_directory becomes a plain table whose primary key (scope, key_hash) decides
--   which claim owns a new key; the advisory lock and the search of the directory's
--   partitions go. maintain() deletes the directory rows of the keys and tombstones it drops.
-- - Lease tokens: made per key by _new_token (greater than the previous owner's, 32 random
--   bits), not by lease_token_seq, which goes.
-- - release() keeps the row, in state released, so that the next owner's token is greater.
-- - A wrong token gets IK001 whatever the key's state (no IK003 from the fenced calls; IK004
--   only for the owner of a completed key).
-- - inbox_accept() uses the same arbiter (a directory row per message) instead of a lock.
-- - idempotency.distribute() spreads the schema over a Citus cluster.

-- No call may use the tables while they change: sessions running the old functions wait here
-- until this migration commits.
LOCK TABLE idempotency.keys, idempotency.tombstones, idempotency.key_directory,
idempotency.inbox IN ACCESS EXCLUSIVE MODE;

-- The rows move through a table of their own: the new key_directory is made after the old one
-- is dropped, so that its constraints and index get the names a fresh install gives them.
CREATE TABLE idempotency.key_directory_0009 AS
SELECT DISTINCT ON (d.scope, d.key_hash)
    d.scope,
    d.key_hash,
    d.created_at
FROM idempotency.key_directory AS d
ORDER BY d.scope ASC, d.key_hash ASC, d.created_at DESC;
-- Tables dumped with their data (pg_extension_config_dump) stay listed after a DROP: an
-- extension install forgets them first, as _create_partition does for partitions.
DO $forget$
BEGIN
    IF EXISTS (
        SELECT FROM pg_depend AS d
        INNER JOIN pg_extension AS e ON d.refobjid = e.oid
        WHERE d.classid = 'pg_class'::regclass
          AND d.objid = 'idempotency.key_directory_default'::regclass
          AND d.refclassid = 'pg_extension'::regclass AND d.deptype = 'e'
          AND e.extname = 'pg_idempotency'
    ) THEN
        ALTER EXTENSION pg_idempotency DROP TABLE idempotency.key_directory_default;
        ALTER EXTENSION pg_idempotency DROP SEQUENCE idempotency.lease_token_seq;
    END IF;
END
$forget$;
DROP TABLE idempotency.key_directory;
-- @include tables/key_directory.sql
-- One row per (scope, key_hash) already (claim held the key's lock to insert one).
INSERT INTO idempotency.key_directory (scope, key_hash, created_at)
SELECT
    d.scope,
    d.key_hash,
    d.created_at
FROM idempotency.key_directory_0009 AS d;
DROP TABLE idempotency.key_directory_0009;
-- The messages already in the inbox get their directory rows (see inbox_accept).
INSERT INTO idempotency.key_directory (scope, key_hash, created_at)
SELECT DISTINCT ON (i.consumer, i.message_id)
    i.consumer,
    sha256(convert_to(chr(31) || i.message_id, 'UTF8')) AS key_hash,
    i.received_at
FROM idempotency.inbox AS i
ORDER BY i.consumer ASC, i.message_id ASC, i.received_at DESC;
DROP FUNCTION idempotency._make_directory_partitions(
    idempotency.settings, timestamptz, timestamptz
);
DROP FUNCTION idempotency._directory_window(idempotency.settings);
-- The advisory lock of claim and inbox_accept is gone with them.
DROP FUNCTION idempotency._lock_name(integer, text, text);

-- @include functions/_new_token.sql
-- @include functions/_key_hash.sql
-- @include functions/_distributed.sql
-- @include functions/_drop_directory_rows.sql
-- @replace functions/_lease_error.sql
-- @replace functions/_create_partition.sql
-- @replace functions/_premake.sql
-- @replace functions/_resume_existing.sql
-- @replace functions/claim.sql
-- @replace functions/checkpoint.sql
-- @replace functions/heartbeat.sql
-- @replace functions/_finish.sql
-- @replace functions/accept.sql
-- @replace functions/release.sql
-- @replace functions/takeover.sql
-- @replace functions/list_abandoned.sql
-- @replace functions/inbox_accept.sql
-- @replace functions/_partitions.sql
-- @replace functions/_make_routes.sql
-- @replace functions/_write_tombstones.sql
-- @replace functions/maintain.sql
-- @replace functions/key_status.sql
-- @replace functions/partition_status.sql
-- @include functions/distribute.sql

DROP SEQUENCE idempotency.lease_token_seq;

COMMENT ON TYPE idempotency.partition_status IS
'One partition of keys, inbox or tombstones, as reported by idempotency.partition_status().';

-- _resume_row takes the new token as an argument now (Citus refuses volatile functions in an
-- UPDATE); it and the other generated functions are made again with this version's text.
DROP FUNCTION idempotency._resume_row(
    text, text, timestamptz, bigint, timestamptz, timestamptz
);
SELECT idempotency._make_routes() AS routes_made;

-- As in sql/bootstrap.sql: nothing new is executable by PUBLIC.
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA idempotency FROM public;
