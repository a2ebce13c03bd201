-- One row of idempotency.list_abandoned(): enough to decide whether and how to take it over.
CREATE TYPE idempotency.abandoned_key AS (
    scope text,
    key text,
    lease_expires_at timestamptz,
    recovery_point text,
    attempts integer,
    created_at timestamptz
);

COMMENT ON TYPE idempotency.abandoned_key IS
'A key whose lease expired while in progress, as listed by idempotency.list_abandoned().';
