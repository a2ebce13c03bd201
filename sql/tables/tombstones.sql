-- Tombstones (opt-in, settings.tombstones): what is left of a key after maintain() dropped it
-- at the end of its retention, kept until expires_at. A retry that finds only a tombstone gets
-- outcome 'expired' from claim() instead of executing the operation a second time.
--
-- Compact on purpose: the key is stored as its sha256 (a tombstone outlives the response, and
-- the client's key may carry data nobody should keep for the longer window), no response body.
-- Partitioned by the key's created_at on the same boundaries as idempotency.keys, so expired
-- tombstones go by partition drop too.
CREATE TABLE idempotency.tombstones (
    scope text NOT NULL,
    -- sha256 of the key's UTF-8 bytes.
    key_hash bytea NOT NULL,
    fingerprint bytea NOT NULL,
    -- The key's state when it was dropped: 'completed', or 'in_progress' when its work never
    -- finished within the retention.
    final_state text NOT NULL,
    -- The stored response status of a completed key.
    response_status integer,
    created_at timestamptz NOT NULL,
    -- created_at + settings.tombstone_retention at the time of writing: claim() reads this
    -- instead of the settings, and ignores the row from then on.
    expires_at timestamptz NOT NULL,
    PRIMARY KEY (scope, key_hash, created_at)
) PARTITION BY RANGE (created_at);

COMMENT ON TABLE idempotency.tombstones IS
'Compact records of keys dropped after their retention (settings.tombstones), partitioned by the
key''s created_at. Written only by idempotency.maintain().';

REVOKE ALL ON idempotency.tombstones FROM public;

-- The safety net, as for keys: tombstones of a range without a partition land here, and
-- maintain() moves them out.
CREATE TABLE idempotency.tombstones_default PARTITION OF idempotency.tombstones DEFAULT;

REVOKE ALL ON idempotency.tombstones_default FROM public;
