-- What a claim or a takeover of an existing, matching key gets: the stored response, the
-- owner's remaining lease (with its interim response, if accept() stored one), or, when the
-- lease has expired, the key itself under a new token.
-- Returns NULL when the takeover lost a race (the owner heartbeated, completed or released in
-- between); the caller then reads the key again.
CREATE FUNCTION idempotency._resume_existing(
    existing idempotency.keys, lease interval, reference_time timestamptz
)
RETURNS idempotency.claim_result
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
-- A generic plan prunes the partitions of keys at executor startup; see docs/design.md.
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    v_result idempotency.claim_result;
BEGIN
    IF (_resume_existing.existing).state = 'completed' THEN
        v_result.outcome := 'replay';
        v_result.recovery_point := (_resume_existing.existing).recovery_point;
        v_result.attempts := (_resume_existing.existing).attempts;
        v_result.response_status := (_resume_existing.existing).response_status;
        v_result.response_headers := (_resume_existing.existing).response_headers;
        v_result.response_body := (_resume_existing.existing).response_body;
        v_result.response_body_bytes := (_resume_existing.existing).response_body_bytes;
        v_result.response_content_type := (_resume_existing.existing).response_content_type;
        v_result.created_at := (_resume_existing.existing).created_at;
        v_result.completed_at := (_resume_existing.existing).completed_at;
        RETURN v_result;
    END IF;

    IF (_resume_existing.existing).lease_expires_at > _resume_existing.reference_time THEN
        v_result.outcome := 'in_progress';
        -- An owner that stored an interim response with accept() gets it replayed: every retry
        -- of a long-running operation sees the same 202 (and status URL) until it completes.
        IF (_resume_existing.existing).response_status IS NOT NULL THEN
            v_result.outcome := 'accepted';
            v_result.response_status := (_resume_existing.existing).response_status;
            v_result.response_headers := (_resume_existing.existing).response_headers;
            v_result.response_body := (_resume_existing.existing).response_body;
            v_result.response_content_type := (_resume_existing.existing).response_content_type;
        END IF;
        v_result.lease_expires_at := (_resume_existing.existing).lease_expires_at;
        v_result.recovery_point := (_resume_existing.existing).recovery_point;
        v_result.attempts := (_resume_existing.existing).attempts;
        v_result.retry_after :=
            (_resume_existing.existing).lease_expires_at - _resume_existing.reference_time;
        v_result.created_at := (_resume_existing.existing).created_at;
        RETURN v_result;
    END IF;

    -- Take over: a compare-and-set on the token we read. Under READ COMMITTED a concurrent
    -- heartbeat, complete or release makes the re-checked WHERE fail, and we report NULL. On
    -- the one partition created_at names (see _make_routes).
    v_result := idempotency._resume_row(
        (_resume_existing.existing).scope, (_resume_existing.existing).key,
        (_resume_existing.existing).created_at, (_resume_existing.existing).lease_token,
        -- Computed here, not in the UPDATE: Citus refuses volatile functions there.
        idempotency._new_token((_resume_existing.existing).lease_token),
        _resume_existing.reference_time + _resume_existing.lease,
        _resume_existing.reference_time);
    IF v_result.outcome IS NULL THEN
        RETURN NULL;
    END IF;
    RETURN v_result;
END;
$$;

COMMENT ON FUNCTION idempotency._resume_existing(idempotency.keys, interval, timestamptz) IS
'Internal: replay, report in progress or accepted, or take over an existing key whose
fingerprint matched.';
