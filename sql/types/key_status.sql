-- One row of idempotency.key_status(): the keys of one scope in one state.
CREATE TYPE idempotency.key_status AS (
    scope text,
    -- in_progress | completed | released | tombstone
    state text,
    keys bigint,
    oldest_created_at timestamptz,
    -- in_progress: the oldest key still in progress (the one most likely stuck).
    oldest_key text,
    -- in_progress: keys whose lease expired, waiting for a retry or a completer to take over.
    expired_leases bigint,
    oldest_expired_lease timestamptz
);

COMMENT ON TYPE idempotency.key_status IS
'Keys of one scope in one state, as reported by idempotency.key_status().';
