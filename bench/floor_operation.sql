-- The PL/pgSQL floor in place of the engine, for bench/operation.py --extra-sql (and
-- bench/instructions.py --extra-sql): claim and complete_bytes keep their signatures, so the
-- package calls them exactly as it calls the engine, but their bodies are the recipe's two
-- statements on one unpartitioned table, in the thinnest function shaped like the engine's
-- (SECURITY DEFINER, pinned search_path, claim returning idempotency.claim_result). No
-- partitions, no key directory, no validation, no token, no fencing: what any design whose
-- way in is two PL/pgSQL calls pays before doing its job (see bench/floor.sql for pgbench).
-- An experiment only: it replaces the engine's functions in a throwaway database.
CREATE TABLE idempotency.floor_keys (
    scope text NOT NULL,
    key text NOT NULL,
    fingerprint bytea,
    state text NOT NULL,
    lease_token bigint,
    lease_expires_at timestamptz,
    created_at timestamptz NOT NULL,
    response_status integer,
    response_headers jsonb,
    response_body_bytes bytea,
    response_content_type text,
    completed_at timestamptz,
    PRIMARY KEY (scope, key)
);

CREATE OR REPLACE FUNCTION idempotency.claim(
    scope text,
    key text,
    request jsonb,
    lease interval DEFAULT '30 seconds',
    fingerprint bytea DEFAULT NULL,
    strict boolean DEFAULT false,
    reference_time timestamptz DEFAULT NULL
)
RETURNS idempotency.claim_result
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_result idempotency.claim_result;
BEGIN
    INSERT INTO idempotency.floor_keys AS k (
        scope, key, fingerprint, state, lease_token, lease_expires_at, created_at
    )
    VALUES (claim.scope, claim.key, claim.fingerprint, 'in_progress', 1,
            now() + claim.lease, now())
    ON CONFLICT DO NOTHING
    RETURNING 'claimed', k.lease_token, k.lease_expires_at, 1, k.created_at
    INTO v_result.outcome, v_result.lease_token, v_result.lease_expires_at,
         v_result.attempts, v_result.created_at;
    RETURN v_result;
END;
$$;

CREATE OR REPLACE FUNCTION idempotency.complete_bytes(
    scope text,
    key text,
    lease_token bigint,
    status integer,
    body bytea,
    content_type text,
    headers jsonb DEFAULT '{}',
    reference_time timestamptz DEFAULT NULL
)
RETURNS timestamptz
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    UPDATE idempotency.floor_keys AS k
    SET state = 'completed', lease_expires_at = NULL,
        response_status = complete_bytes.status, response_headers = complete_bytes.headers,
        response_body_bytes = complete_bytes.body,
        response_content_type = complete_bytes.content_type, completed_at = now()
    WHERE k.scope = complete_bytes.scope AND k.key = complete_bytes.key;
    RETURN now();
END;
$$;
