-- Where each retained key lives: one row per (scope, key) that still has a row in
-- idempotency.keys or a tombstone, giving that row's created_at. The engine's answer to "a
-- unique index cannot span the time partitions": a claim looks the key up here, in a handful
-- of wide partitions, instead of in every partition of idempotency.keys, and then addresses
-- exactly one partition of keys (or of tombstones) by created_at equality, which the executor
-- prunes at startup even in a generic plan. So the cost of a claim, a completion or any other
-- call on a key does not grow with retention, partition_interval, premake, tombstones or the
-- number of partitions of keys, whoever made them (pg_partman included).
--
-- The partitions here are wide on purpose: one spans the directory window, that is the
-- longest a key or its tombstone can stay (retention or tombstone_retention, plus
-- partition_interval, rounded up to whole days; see idempotency._directory_window), so three
-- of them and the default one are all a lookup ever probes. maintain() creates and drops them
-- itself, also when pg_partman manages keys, and never drops one while a key or tombstone it
-- points to is left.
--
-- The key is stored as its sha256, as in tombstones: the directory outlives the response.
-- Uniqueness of (scope, key_hash) across these partitions is kept as for keys: claim() holds
-- the key's advisory lock, looks here with a fresh snapshot, and inserts only when nothing is
-- found. There is at most one row per (scope, key_hash).
CREATE TABLE idempotency.key_directory (
    scope text NOT NULL,
    key_hash bytea NOT NULL,
    created_at timestamptz NOT NULL,
    PRIMARY KEY (scope, key_hash, created_at)
) PARTITION BY RANGE (created_at);

COMMENT ON TABLE idempotency.key_directory IS
'Where each retained key lives: (scope, sha256 of the key) -> created_at of its row in
idempotency.keys or idempotency.tombstones. Written only through the idempotency.* functions.';

REVOKE ALL ON idempotency.key_directory FROM public;

-- The safety net, as for keys: rows of a range without a partition land here.
CREATE TABLE idempotency.key_directory_default PARTITION OF idempotency.key_directory DEFAULT;

REVOKE ALL ON idempotency.key_directory_default FROM public;
