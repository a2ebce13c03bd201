-- The PL/pgSQL floor: the bare baseline's two statements, each wrapped in the thinnest function
-- shaped like the engine's (SECURITY DEFINER, pinned search_path, claim returning
-- idempotency.claim_result). No partitions, no advisory lock, no canonical JSON, no validation,
-- no fencing: what any PL/pgSQL implementation of this API pays before doing its job.
CREATE FUNCTION public.floor_claim(scope text, key text, request jsonb)
RETURNS idempotency.claim_result
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_result idempotency.claim_result;
BEGIN
    INSERT INTO public.bench_bare (
        scope, key, fingerprint, state, lease_token, lease_expires_at, created_at
    )
    VALUES (floor_claim.scope, floor_claim.key,
            sha256(convert_to(floor_claim.request::text, 'UTF8')), 'in_progress', 1,
            now() + interval '30 seconds', now())
    ON CONFLICT DO NOTHING;
    v_result.outcome := 'claimed';
    v_result.lease_token := 1;
    RETURN v_result;
END;
$$;

CREATE FUNCTION public.floor_complete(
    scope text, key text, lease_token bigint, status integer, body jsonb
)
RETURNS timestamptz
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    UPDATE public.bench_bare AS b
    SET state = 'completed', response_status = floor_complete.status,
        response_headers = '{}', response_body = floor_complete.body,
        completed_at = now(), lease_expires_at = NULL
    WHERE b.scope = floor_complete.scope AND b.key = floor_complete.key;
    RETURN now();
END;
$$;
