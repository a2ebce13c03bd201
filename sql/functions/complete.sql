-- Call inside the business transaction, after its writes: the response becomes replayable in
-- the same commit as the effect it describes.
CREATE FUNCTION idempotency.complete(
    scope text,
    key text,
    lease_token bigint,
    status integer,
    body jsonb,
    headers jsonb DEFAULT '{}',
    reference_time timestamptz DEFAULT NULL
)
RETURNS timestamptz
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER  -- for application roles without table privileges; see claim()
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN idempotency._finish(
        'idempotency.complete', complete.scope, complete.key, complete.lease_token,
        complete.status, coalesce(complete.headers, '{}'), complete.body, NULL,
        CASE WHEN complete.body IS NULL THEN NULL ELSE 'application/json' END,
        complete.reference_time);
END;
$$;

COMMENT ON FUNCTION idempotency.complete(text, text, bigint, integer, jsonb, jsonb, timestamptz) IS
'Complete a key you hold with a JSON response (body may be NULL, e.g. for 204), in the same
transaction as the business write; returns completed_at. Raises IK001 (not the key''s current
token: roll back) or IK004 (already completed with this token).';
