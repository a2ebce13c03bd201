-- One key as idempotency.inspect_key() and list_keys() show it to an operator. Without its lease
-- token: the token is what lets its holder heartbeat, checkpoint, complete or release the key,
-- so whoever reads this (a support engineer, a script's log) must not be handed it.
CREATE TYPE idempotency.key_info AS (
    scope text,
    key text,
    -- in_progress | completed | released (by release() or force_release(); the key's next
    -- claim runs afresh)
    state text,
    lease_expires_at timestamptz,
    -- lease_expires_at is past: the next claim resumes the key, or a completer takes it over.
    lease_expired boolean,
    recovery_point text,
    attempts integer,
    response_status integer,
    response_content_type text,
    response_headers jsonb,
    -- Bytes of the stored body (jsonb text or raw bytes); the body itself only on request.
    response_body_size integer,
    response_body jsonb,
    response_body_bytes bytea,
    created_at timestamptz,
    completed_at timestamptz,
    -- The partition of idempotency.keys holding the row.
    partition_name text
);

COMMENT ON TYPE idempotency.key_info IS
'One key as idempotency.inspect_key() and idempotency.list_keys() show it (the body only from
inspect_key(..., body => true); never the lease token).';
