-- One row of idempotency.metrics_by_scope(): the keys in progress and released of one scope.
CREATE TYPE idempotency.scope_metrics AS (
    scope text,
    keys_in_progress bigint,
    keys_expired_leases bigint,
    oldest_in_progress_age_seconds double precision,
    keys_released bigint
);

COMMENT ON TYPE idempotency.scope_metrics IS
'Keys in progress and released of one scope, as idempotency.metrics_by_scope() returns them.';
