-- The least-privilege setup for the two kinds of application role. Neither gets any privilege
-- on the tables, the sequence or the internal functions: they call public functions that run
-- as their owner. Run by the owner of the schema (the installer).
--
-- kind 'request' is for request handlers: claim and the fenced calls a handler makes with the
-- lease token its own claim returned. Every read it can make is of a key it presents with its
-- request (claim compares the request's fingerprint before it returns a stored response), so
-- it cannot read another scope's stored response through any function.
-- kind 'completer' is for background completers (python/pg_idempotency/jobs.py's worker, or
-- any language's): takeover and list_abandoned, which act on a key without its request, plus
-- the fenced calls that finish the work. A takeover returns a completed key's stored response,
-- so grant it only to roles trusted with every scope they can name (list_abandoned(scope =>)
-- limits a completer to one scope by convention, not by privilege).
-- kind 'monitor' is for scrapers (the Prometheus postgres exporter): metrics() and
-- metrics_by_scope() only, which read counts, ages and sizes, never a key or a response.
-- A role may be granted several kinds. Grants add up, and each is recorded in
-- idempotency.grants, so every later migration grants the role what its kind has then
-- (idempotency._reapply_grants). To take a kind away, delete its row and REVOKE EXECUTE
-- (docs/install.md, Privileges).
CREATE FUNCTION idempotency.grant_usage(grantee regrole, kind text DEFAULT 'request')
RETURNS void
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    -- What both kinds call with the token they hold, and the pure helpers.
    v_common text := 'idempotency.checkpoint(text, text, bigint, text, interval, timestamptz), '
        || 'idempotency.heartbeat(text, text, bigint, interval, timestamptz), '
        || 'idempotency.complete(text, text, bigint, integer, jsonb, jsonb, timestamptz), '
        || 'idempotency.complete_bytes(text, text, bigint, integer, bytea, text, jsonb, '
        || 'timestamptz), '
        || 'idempotency.accept(text, text, bigint, integer, jsonb, jsonb, interval, '
        || 'timestamptz), '
        || 'idempotency.release(text, text, bigint), '
        || 'idempotency.fingerprint(jsonb, jsonb, text[]), '
        || 'idempotency.canonical_json(jsonb), '
        || 'idempotency.derive_key(text, text, text)';
BEGIN
    IF grant_usage.grantee IS NULL THEN
        PERFORM idempotency._invalid_argument('idempotency.grant_usage', 'grantee', 'IK010',
                                              'must not be NULL');
    ELSIF grant_usage.kind IS NULL THEN
        PERFORM idempotency._invalid_argument('idempotency.grant_usage', 'kind', 'IK010',
                                              'must not be NULL');
    ELSIF grant_usage.kind NOT IN ('request', 'completer', 'monitor') THEN
        PERFORM idempotency._invalid_argument(
            'idempotency.grant_usage', 'kind', 'IK014',
            'must be ''request'', ''completer'' or ''monitor''',
            format('It is %s.', to_json(grant_usage.kind)));
    END IF;
    EXECUTE format('GRANT USAGE ON SCHEMA idempotency TO %s', grant_usage.grantee);
    INSERT INTO idempotency.grants (grantee, kind)
    VALUES (grant_usage.grantee, grant_usage.kind)
    ON CONFLICT DO NOTHING;
    IF grant_usage.kind = 'monitor' THEN
        EXECUTE format('GRANT EXECUTE ON FUNCTION idempotency.metrics(timestamptz, boolean), '
                       || 'idempotency.metrics_by_scope(timestamptz) TO %s',
                       grant_usage.grantee);
        RETURN;
    END IF;
    EXECUTE format(
        'GRANT EXECUTE ON FUNCTION %s, %s TO %s', v_common,
        CASE grant_usage.kind
            WHEN 'request' THEN
                'idempotency.claim(text, text, jsonb, interval, bytea, boolean, timestamptz), '
                || 'idempotency.inbox_accept(text, text, timestamptz)'
            ELSE
                'idempotency.takeover(text, text, interval, timestamptz), '
                || 'idempotency.list_abandoned(integer, text, timestamptz)'
        END,
        grant_usage.grantee);
END;
$$;

COMMENT ON FUNCTION idempotency.grant_usage(regrole, text) IS
'Let grantee call the functions of one kind of application role, without any privilege on the
tables. kind request (handlers): claim, inbox_accept; completer (background completers):
takeover, list_abandoned; both: checkpoint, heartbeat, complete, complete_bytes, accept,
release, fingerprint, canonical_json, derive_key; monitor (scrapers): metrics,
metrics_by_scope. Recorded in idempotency.grants and re-applied by later migrations. See
docs/sql-api.md.';
