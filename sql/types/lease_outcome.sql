-- What heartbeat_outcome(), checkpoint_outcome() and release_outcome() return: the answer of a
-- fenced call as a value instead of an error. Columns are public API.
CREATE TYPE idempotency.lease_outcome AS (
    -- ok | lease_lost (IK001 from the raising form: not the key's current token, the same for
    -- every key state) | completed (IK004: the key was completed with this very token)
    outcome text,
    -- ok from heartbeat_outcome / checkpoint_outcome: the lease's expiry; NULL otherwise.
    lease_expires_at timestamptz
);

COMMENT ON TYPE idempotency.lease_outcome IS
'Result of idempotency.heartbeat_outcome(), checkpoint_outcome() and release_outcome(): outcome
ok, lease_lost or completed, and the lease expiry after ok.';
