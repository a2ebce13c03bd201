-- Recipe of migrations/0005_directory.sql (tools/build.py --migration 5 directory); the syntax
-- is explained in sql/upgrades/0002_maintenance.sql.
--
-- 0005: Engine v2. A key is found through idempotency.key_directory, (scope, sha256 of key) ->
-- created_at, in a few wide partitions, and then in the one partition of keys or tombstones
-- its created_at names. The cost of every call no longer grows with the partitions of keys or
-- tombstones, and no time bound (so no reference_time) decides where a key is looked for.
-- reference_time is now a test clock only the schema owner may pass (_test_clock).
-- Also (hardening): JSON nested deeper than 128 arrays and objects is refused with IK014 instead
-- of running out of stack (54001), and a multi-dimensional fingerprint fields array with IK015
-- instead of 0A000.

-- No claim, completion or release may change keys until the directory holds every one of
-- them: sessions still running the old functions wait here until this migration commits.
LOCK TABLE idempotency.keys, idempotency.tombstones IN SHARE MODE;

-- @include tables/key_directory.sql
-- @include functions/_test_clock.sql
-- @include functions/_directory_window.sql
-- @include functions/_make_directory_partitions.sql
-- @include functions/_canonical_json.sql
-- @replace functions/canonical_json.sql
-- @replace functions/fingerprint.sql
-- @replace functions/_create_partition.sql
-- @replace functions/_partitions.sql
-- @replace functions/_premake.sql
-- @replace functions/_lease_error.sql
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
-- @replace functions/maintain.sql
-- @replace functions/partition_status.sql

COMMENT ON TYPE idempotency.partition_status IS
'One partition of keys, inbox, tombstones or key_directory, as reported by
idempotency.partition_status().';

-- Partitions of the directory from the oldest key or tombstone on (none before the settings
-- row exists, as inside CREATE EXTENSION before its first maintain(): the rows then wait in
-- the default partition, and maintain() moves them out).
WITH oldest AS (
    SELECT least(
        (SELECT min(k.created_at) FROM idempotency.keys AS k),
        (SELECT min(t.created_at) FROM idempotency.tombstones AS t)
    ) AS created_at
),

made AS (
    SELECT a.action
    FROM idempotency.settings AS s
    CROSS JOIN oldest AS o
    CROSS JOIN LATERAL idempotency._make_directory_partitions(s, now(), o.created_at) AS a
)

SELECT count(*) AS directory_partitions_created
FROM made
WHERE made.action = 'created';

-- One row per (scope, key): the key's own row if it has one, else its newest live tombstone,
-- which is what claim() used to find first.
INSERT INTO idempotency.key_directory (scope, key_hash, created_at)
SELECT DISTINCT ON (c.scope, c.key_hash)
    c.scope,
    c.key_hash,
    c.created_at
FROM (
    SELECT
        k.scope,
        sha256(convert_to(k.key, 'UTF8')) AS key_hash,
        k.created_at,
        0 AS source_rank
    FROM idempotency.keys AS k
    UNION ALL
    SELECT
        t.scope,
        t.key_hash,
        t.created_at,
        1 AS source_rank
    FROM idempotency.tombstones AS t
    WHERE t.expires_at > now()
) AS c
ORDER BY c.scope ASC, c.key_hash ASC, c.source_rank ASC, c.created_at DESC;

-- As in sql/bootstrap.sql: nothing new is executable by PUBLIC.
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA idempotency FROM public;
