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
-- the fenced calls that finish the work. A takeover returns a completed key's stored response
-- without the request, so a completer is trusted with every scope it may act on: scopes =>
-- ARRAY[...] limits it to those (takeover and list_abandoned raise IK023 for any other, and
-- list_abandoned without a scope lists only those; see _completer_scopes); NULL, the default,
-- is every scope. The fenced calls are not checked: they need the lease token, which such a
-- role gets only from a takeover in its scopes (docs/design.md, "Completer scopes").
-- kind 'monitor' is for scrapers (the Prometheus postgres exporter): metrics() and
-- metrics_by_scope() only, which read counts, ages and sizes, never a key or a response.
-- kind 'maintainer' is for schedulers (pg_cron, cron, a Kubernetes CronJob), so that none of
-- them holds the owner's password: maintain() at the clock (a reference_time other than now()
-- is the owner's test clock, IK017; see maintain), schedule_maintenance and
-- unschedule_maintenance (run as the caller, so that the pg_cron job runs as the maintainer;
-- hence also the three checks they call, which only raise), and the status reads: key_status,
-- partition_status, metrics, metrics_by_scope, and SELECT on maintenance_runs and migrations
-- (what pg-idempotency status and maintain read). It reads key names and counts, never a
-- request or a response, and writes nothing but what maintain() does.
-- A role may be granted several kinds. Grants add up, and each is recorded in
-- idempotency.grants, so every later migration grants the role what its kind has then
-- (idempotency._reapply_grants). A completer's scopes add up the same way (NULL, every scope,
-- absorbs any list); to narrow them, delete the row and grant again. To take a kind away,
-- delete its row and REVOKE EXECUTE (docs/install.md, Privileges).
CREATE FUNCTION idempotency.grant_usage(
    grantee regrole,
    kind text DEFAULT 'request',
    scopes text[] DEFAULT NULL
)
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
        || 'idempotency.heartbeat_outcome(text, text, bigint, interval, timestamptz), '
        || 'idempotency.checkpoint_outcome(text, text, bigint, text, interval, '
        || 'timestamptz), '
        || 'idempotency.release_outcome(text, text, bigint), '
        || 'idempotency.fingerprint(jsonb, jsonb, text[]), '
        || 'idempotency.canonical_json(jsonb), '
        || 'idempotency.derive_key(text, text, text)';
    v_scope text;
BEGIN
    -- On a worker Citus refuses the GRANTs (XX000 "operation is not allowed on this node").
    PERFORM idempotency._require_coordinator(
        'idempotency.grant_usage',
        'Grants are recorded in idempotency.grants, which the coordinator holds, and Citus '
        'propagates GRANTs to the other nodes from the coordinator only.');
    IF grant_usage.grantee IS NULL THEN
        PERFORM idempotency._invalid_argument('idempotency.grant_usage', 'grantee', 'IK010',
                                              'must not be NULL');
    ELSIF grant_usage.kind IS NULL THEN
        PERFORM idempotency._invalid_argument('idempotency.grant_usage', 'kind', 'IK010',
                                              'must not be NULL');
    ELSIF grant_usage.kind NOT IN ('request', 'completer', 'monitor', 'maintainer') THEN
        PERFORM idempotency._invalid_argument(
            'idempotency.grant_usage', 'kind', 'IK014',
            'must be ''request'', ''completer'', ''monitor'' or ''maintainer''',
            format('It is %s.', to_json(grant_usage.kind)));
    END IF;
    IF grant_usage.scopes IS NOT NULL THEN
        IF grant_usage.kind <> 'completer' THEN
            PERFORM idempotency._invalid_argument(
                'idempotency.grant_usage', 'scopes', 'IK016',
                'applies to kind ''completer'' only',
                format('kind is %s; a request role claims in any scope its caller names.',
                       to_json(grant_usage.kind)));
        ELSIF array_ndims(grant_usage.scopes) IS DISTINCT FROM 1
              OR cardinality(grant_usage.scopes) > 10000 THEN
            PERFORM idempotency._invalid_argument(
                'idempotency.grant_usage', 'scopes', 'IK014',
                'must be a one-dimensional array of 1 to 10000 scopes, or NULL for every scope',
                format('It has %s elements in %s dimensions.',
                       cardinality(grant_usage.scopes),
                       coalesce(array_ndims(grant_usage.scopes), 0)));
        END IF;
        FOREACH v_scope IN ARRAY grant_usage.scopes LOOP
            IF v_scope IS NULL THEN
                PERFORM idempotency._invalid_argument('idempotency.grant_usage', 'scopes',
                                                      'IK010', 'must not contain NULL');
            END IF;
            PERFORM idempotency._check_name('idempotency.grant_usage', 'scopes', v_scope);
        END LOOP;
    END IF;
    EXECUTE format('GRANT USAGE ON SCHEMA idempotency TO %s', grant_usage.grantee);
    -- Grants add up: a second list joins the first; NULL (every scope) wins over any list.
    -- The trigger on grants mirrors the completer rows into completer_grants.
    INSERT INTO idempotency.grants AS g (grantee, kind, scopes)
    VALUES (grant_usage.grantee, grant_usage.kind,
            (SELECT array_agg(DISTINCT s ORDER BY s) FROM unnest(grant_usage.scopes) AS s))
    ON CONFLICT ON CONSTRAINT grants_pkey DO UPDATE
    SET scopes = CASE WHEN g.scopes IS NULL OR excluded.scopes IS NULL THEN NULL
                      ELSE (SELECT array_agg(DISTINCT s ORDER BY s)
                            FROM unnest(g.scopes || excluded.scopes) AS s) END;
    IF grant_usage.kind = 'monitor' THEN
        EXECUTE format('GRANT EXECUTE ON FUNCTION idempotency.metrics(timestamptz, boolean), '
                       || 'idempotency.metrics_by_scope(timestamptz) TO %s',
                       grant_usage.grantee);
        RETURN;
    END IF;
    IF grant_usage.kind = 'maintainer' THEN
        -- The helpers are written "name (args)": these are grants, not calls, and
        -- tests/sql/test_bounds_sql.py reads "idempotency._name(" as a call when it works out
        -- which function can raise which SQLSTATE.
        EXECUTE format('GRANT EXECUTE ON FUNCTION idempotency.maintain(timestamptz), '
                       || 'idempotency.schedule_maintenance(text), '
                       || 'idempotency.unschedule_maintenance(), '
                       || 'idempotency.key_status(timestamptz), '
                       || 'idempotency.partition_status(timestamptz), '
                       || 'idempotency.metrics(timestamptz, boolean), '
                       || 'idempotency.metrics_by_scope(timestamptz), '
                       || 'idempotency._require_coordinator (text, text), '
                       || 'idempotency._require_pg_cron (text), '
                       || 'idempotency._invalid_argument (text, text, text, text, text) TO %s',
                       grant_usage.grantee);
        EXECUTE format('GRANT SELECT ON TABLE idempotency.maintenance_runs, '
                       || 'idempotency.migrations TO %s', grant_usage.grantee);
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

COMMENT ON FUNCTION idempotency.grant_usage(regrole, text, text[]) IS
'Let grantee call the functions of one kind of application role, without any privilege on the
tables. kind request (handlers): claim, inbox_accept; completer (background completers):
takeover, list_abandoned, limited to scopes when given (IK023 for others; NULL: every scope);
both: checkpoint, heartbeat, complete, complete_bytes, accept, release, heartbeat_outcome,
checkpoint_outcome, release_outcome, fingerprint, canonical_json, derive_key; monitor
(scrapers): metrics, metrics_by_scope; maintainer (schedulers): maintain at the clock,
schedule_maintenance, unschedule_maintenance, key_status, partition_status, metrics,
metrics_by_scope, SELECT on maintenance_runs and migrations. Recorded in idempotency.grants and re-applied by later
migrations. IK022 on a Citus worker. See docs/sql-api.md.';
