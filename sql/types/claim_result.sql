-- What claim() and takeover() return. Columns are public API: clients read them by name.
CREATE TYPE idempotency.claim_result AS (
    -- claimed | resumed | replay | accepted | in_progress | mismatch | expired
    outcome text,
    -- Fencing token: set for claimed and resumed only (never reveals another owner's token).
    lease_token bigint,
    lease_expires_at timestamptz,
    -- Last recovery point recorded by checkpoint(); on resumed, where to reconcile from.
    recovery_point text,
    -- How many times the operation has been started (claimed or resumed).
    attempts integer,
    response_status integer,
    response_headers jsonb,
    response_body jsonb,
    response_body_bytes bytea,
    response_content_type text,
    -- For in_progress: time left on the owner's lease, after which a retry can take it over.
    retry_after interval,
    created_at timestamptz,
    completed_at timestamptz
);

COMMENT ON TYPE idempotency.claim_result IS
'Result of idempotency.claim() and idempotency.takeover().';
