-- The arbiter of uniqueness and the map of where each key lives: one row per (scope, key) that
-- has a row in idempotency.keys or a tombstone, giving that row's created_at.
--
-- Why a plain table with a primary key on (scope, key_hash): PostgreSQL cannot make
-- (scope, key) unique across the time partitions of keys (a unique index on a partitioned table
-- must contain the partition column), and Citus cannot either, across shards, unless the
-- distribution column is in it. Here it is enforced by this primary key, on the one node that
-- holds the scope's shard: a claim inserts its directory row with ON CONFLICT DO NOTHING, and a
-- second claim of the same key waits for the first one's transaction and then sees its row.
-- No advisory lock (local to one node, so useless once calls arrive on several nodes) and no
-- snapshot argument take part in it: whichever node a call runs on, the index decides. One
-- index probe and one insert per new key, and a claim of an existing key finds its
-- created_at with one probe, so no call searches the partitions of keys.
--
-- The key is stored as its sha256, as in tombstones: the directory outlives the response.
-- inbox_accept() keeps its messages here too, as (consumer, sha256 of U+001F || message id):
-- one arbiter for both, and no key (which cannot hold U+001F) has the same hash.
-- Retention: maintain() deletes the rows of the keys (or tombstones) it drops, in the same
-- transaction as the drop (docs/maintenance.md). That is a DELETE of one small row per key,
-- not of the responses: the keys themselves still go by partition drop.
CREATE TABLE idempotency.key_directory (
    scope text NOT NULL,
    key_hash bytea NOT NULL,
    created_at timestamptz NOT NULL,
    PRIMARY KEY (scope, key_hash)
);

COMMENT ON TABLE idempotency.key_directory IS
'Where each retained key lives, and the arbiter of its uniqueness: (scope, sha256 of the key)
-> created_at of its row in idempotency.keys or idempotency.tombstones. Written only through
the idempotency.* functions.';

REVOKE ALL ON idempotency.key_directory FROM public;
