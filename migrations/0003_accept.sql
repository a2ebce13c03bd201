-- pg_idempotency migration 0003_accept.
-- Written by hand: only what changed since 0001 (0002 is the maintenance migration). The
-- sources in sql/ are the current definition; tests/test_install.py checks that they and
-- migrations/ give the same schema.
-- Plain SQL for any migration tool: apply the files in lexical order, each in one
-- transaction (psql -1 -f FILE, Flyway, golang-migrate, Alembic op.execute).

-- New: the interim response of a long-running operation (issue 7).
-- sql/functions/accept.sql
-- For long-running operations: the owner answers "202 Accepted" now and finishes later (a worker
-- that heartbeats the lease and calls complete). Call it in the transaction that hands the work
-- over (the one that enqueues the job), so that the hand-off and the interim response commit
-- together or not at all. Until complete, a claim of the key under a live lease returns outcome
-- accepted with this response instead of in_progress, so every retry gets the same answer.
--
-- Storage: the interim response lives in the response_* columns of the row, which stays
-- in_progress (no column of its own: complete() overwrites them with the final response, and a
-- row is "accepted" exactly when it is in progress with response_status set). Fenced like
-- complete(): a stale token raises IK001, IK003 or IK004 and the hand-off rolls back with it.
CREATE FUNCTION idempotency.accept(
    scope text,
    key text,
    lease_token bigint,
    status integer,
    body jsonb,
    headers jsonb DEFAULT '{}',
    lease interval DEFAULT NULL,
    reference_time timestamptz DEFAULT NULL
)
RETURNS timestamptz
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER  -- for application roles without table privileges; see claim()
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now timestamptz := coalesce(accept.reference_time, clock_timestamp());
    v_headers jsonb := coalesce(accept.headers, '{}');
    v_expires timestamptz;
BEGIN
    -- One inlined test for the common case; the checks below it say what is wrong.
    -- coalesce: one NULL operand would make the whole test NULL, and IF NOT NULL skips.
    IF NOT coalesce(idempotency._name_ok(accept.scope) AND idempotency._name_ok(accept.key)
                    AND accept.lease_token IS NOT NULL AND accept.status BETWEEN 100 AND 599
                    AND idempotency._headers_ok(v_headers)
                    AND (accept.lease IS NULL OR idempotency._lease_ok(accept.lease)),
                    false) THEN
        PERFORM idempotency._check_name('idempotency.accept', 'scope', accept.scope);
        PERFORM idempotency._check_name('idempotency.accept', 'key', accept.key);
        IF accept.lease_token IS NULL THEN
            PERFORM idempotency._invalid_argument('idempotency.accept', 'lease_token', 'IK010',
                                                  'must not be NULL');
        END IF;
        IF accept.status IS NULL THEN
            PERFORM idempotency._invalid_argument('idempotency.accept', 'status', 'IK010',
                                                  'must not be NULL');
        ELSIF accept.status NOT BETWEEN 100 AND 599 THEN
            PERFORM idempotency._invalid_argument('idempotency.accept', 'status', 'IK014',
                                                  'must be an HTTP status code (100 to 599)',
                                                  format('It is %s.', accept.status));
        END IF;
        PERFORM idempotency._check_headers('idempotency.accept', 'headers', v_headers);
        IF accept.lease IS NOT NULL THEN
            PERFORM idempotency._check_lease('idempotency.accept', 'lease', accept.lease);
        END IF;
    END IF;

    UPDATE idempotency.keys AS k
    SET response_status = accept.status,
        response_headers = v_headers,
        response_body = accept.body,
        response_body_bytes = NULL,
        response_content_type =
            CASE WHEN accept.body IS NULL THEN NULL ELSE 'application/json' END,
        lease_expires_at = CASE WHEN accept.lease IS NULL THEN k.lease_expires_at
            ELSE greatest(k.lease_expires_at, v_now + accept.lease) END
    WHERE k.scope = accept.scope AND k.key = accept.key
      AND k.lease_token = accept.lease_token AND k.state = 'in_progress'
      -- Lets the executor skip the partitions made ahead (see claim()).
      AND k.created_at < v_now + interval '1 hour'
    RETURNING k.lease_expires_at INTO v_expires;
    IF NOT FOUND THEN
        PERFORM idempotency._lease_error('idempotency.accept', accept.scope, accept.key,
                                         accept.lease_token);
    END IF;
    RETURN v_expires;
END;
$$;

COMMENT ON FUNCTION idempotency.accept(
    text, text, bigint, integer, jsonb, jsonb, interval, timestamptz
) IS
'Store an interim response (e.g. 202 Accepted with a status URL) on a key you hold, in the
transaction that hands the work over; optionally extend the lease to at least now + lease.
Returns the lease expiry. Until complete(), claims under a live lease get outcome accepted with
this response. Raises IK001 (lease lost), IK003 (no such key) or IK004 (already completed).';

-- Functions are executable by PUBLIC unless revoked; accept() is granted by grant_usage().
REVOKE ALL ON FUNCTION idempotency.accept(
    text, text, bigint, integer, jsonb, jsonb, interval, timestamptz
) FROM public;

-- Changed: a claim under a live lease returns the interim response (outcome accepted).
-- CREATE OR REPLACE keeps the owner and the grants.
-- sql/functions/_resume_existing.sql
-- What a claim or a takeover of an existing, matching key gets: the stored response, the
-- owner's remaining lease (with its interim response, if accept() stored one), or, when the
-- lease has expired, the key itself under a new token.
-- Returns NULL when the takeover lost a race (the owner heartbeated, completed or released in
-- between); the caller then reads the key again.
CREATE OR REPLACE FUNCTION idempotency._resume_existing(
    existing idempotency.keys, lease interval, reference_time timestamptz
)
RETURNS idempotency.claim_result
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
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
    -- heartbeat, complete or release makes the re-checked WHERE fail, and we report NULL.
    UPDATE idempotency.keys AS k
    SET lease_token = nextval('idempotency.lease_token_seq'),
        lease_expires_at = _resume_existing.reference_time + _resume_existing.lease,
        attempts = k.attempts + 1
    WHERE k.scope = (_resume_existing.existing).scope
      AND k.key = (_resume_existing.existing).key
      AND k.created_at = (_resume_existing.existing).created_at
      AND k.lease_token = (_resume_existing.existing).lease_token
      AND k.state = 'in_progress'
      AND k.lease_expires_at <= _resume_existing.reference_time
    RETURNING 'resumed', k.lease_token, k.lease_expires_at, k.recovery_point, k.attempts,
              NULL::integer, NULL::jsonb, NULL::jsonb, NULL::bytea, NULL::text,
              NULL::interval, k.created_at, NULL::timestamptz
    INTO v_result;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    RETURN v_result;
END;
$$;

COMMENT ON FUNCTION idempotency._resume_existing(idempotency.keys, interval, timestamptz) IS
'Internal: replay, report in progress or accepted, or take over an existing key whose
fingerprint matched.';

-- Changed: grants accept() too. Roles granted before this migration: run it again.
-- sql/functions/grant_usage.sql
-- The least-privilege setup for an application role: it may call the lifecycle functions, which
-- run as their owner, and has no privilege at all on the tables, the sequence or the internal
-- functions. Run by the owner of the schema (the installer).
CREATE OR REPLACE FUNCTION idempotency.grant_usage(grantee regrole)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF grant_usage.grantee IS NULL THEN
        PERFORM idempotency._invalid_argument('idempotency.grant_usage', 'grantee', 'IK010',
                                              'must not be NULL');
    END IF;
    EXECUTE format('GRANT USAGE ON SCHEMA idempotency TO %s', grant_usage.grantee);
    EXECUTE format(
        'GRANT EXECUTE ON FUNCTION '
        || 'idempotency.claim(text, text, jsonb, interval, bytea, boolean, timestamptz), '
        || 'idempotency.checkpoint(text, text, bigint, text, interval, timestamptz), '
        || 'idempotency.heartbeat(text, text, bigint, interval, timestamptz), '
        || 'idempotency.complete(text, text, bigint, integer, jsonb, jsonb, timestamptz), '
        || 'idempotency.complete_bytes(text, text, bigint, integer, bytea, text, jsonb, '
        || 'timestamptz), '
        || 'idempotency.accept(text, text, bigint, integer, jsonb, jsonb, interval, '
        || 'timestamptz), '
        || 'idempotency.release(text, text, bigint), '
        || 'idempotency.takeover(text, text, interval, timestamptz), '
        || 'idempotency.list_abandoned(integer, text, timestamptz), '
        || 'idempotency.inbox_accept(text, text, timestamptz), '
        || 'idempotency.fingerprint(jsonb, jsonb, text[]), '
        || 'idempotency.canonical_json(jsonb), '
        || 'idempotency.derive_key(text, text, text), '
        -- Pure validation helpers the public pure functions (fingerprint, derive_key) call with
        -- the caller's rights; without them a bad argument would surface as 42501.
        || 'idempotency._invalid_argument(text, text, text, text, text), '
        || 'idempotency._check_name(text, text, text) '
        || 'TO %s', grant_usage.grantee);
END;
$$;

COMMENT ON FUNCTION idempotency.grant_usage(regrole) IS
'Let grantee call the lifecycle functions (claim, checkpoint, heartbeat, complete,
complete_bytes, accept, release, takeover, list_abandoned, inbox_accept, fingerprint,
canonical_json, derive_key) without any privilege on the tables.';

-- Record this migration, whichever tool applied it.
INSERT INTO idempotency.migrations (version, name)
VALUES (3, '0003_accept')
ON CONFLICT (version) DO NOTHING;
