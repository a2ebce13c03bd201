-- The least-privilege setup for an application role: it may call the lifecycle functions, which
-- run as their owner, and has no privilege at all on the tables, the sequence or the internal
-- functions. Run by the owner of the schema (the installer).
CREATE FUNCTION idempotency.grant_usage(grantee regrole)
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
