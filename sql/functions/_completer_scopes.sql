-- The scopes the calling role may take over and list as a completer: NULL for every scope (the
-- schema owner's members, superusers, and roles reaching a completer grant without scopes);
-- otherwise the union of the scopes of the completer grants it reaches. With scope given,
-- raises IK023 unless scope is one of them. Called by takeover() and list_abandoned() first,
-- before they read any key, so a refusal tells nothing about any key.
--
-- Who calls: inside a SECURITY DEFINER function current_user is the owner, so the caller is
-- read as _test_clock reads it, from the "role" setting (what SET ROLE chose, which only a
-- member of that role can set) or else session_user. A role "reaches" a grant when it has the
-- privileges of the grant's role (pg_has_role USAGE: itself, or a role it inherits from), which
-- is how it got EXECUTE on these functions. The grants are read by name from completer_grants,
-- which is on every node of a Citus cluster (takeover runs on the scope's node there).
-- Fails closed: a role that reaches no completer grant (EXECUTE granted by hand, or renamed
-- since its grant: the mirror goes by name) is refused (IK023) until grant_usage() records it.
CREATE FUNCTION idempotency._completer_scopes(fn text, scope text)
RETURNS text[]
LANGUAGE plpgsql
STABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_invoker text := current_setting('role');
    v_grants integer;
    v_every boolean;
    v_scopes text[];
BEGIN
    IF v_invoker = 'none' THEN
        v_invoker := session_user::text;
    END IF;
    IF pg_has_role(
        v_invoker,
        (SELECT n.nspowner FROM pg_namespace AS n WHERE n.nspname = 'idempotency'),
        'MEMBER'
    ) THEN
        RETURN NULL;
    END IF;
    SELECT count(*)::integer, coalesce(bool_or(c.scopes IS NULL), false),
           coalesce(array_agg(DISTINCT s.scope) FILTER (WHERE s.scope IS NOT NULL), '{}')
    INTO v_grants, v_every, v_scopes
    FROM idempotency.completer_grants AS c
    INNER JOIN pg_roles AS r ON r.rolname = c.grantee
    LEFT JOIN LATERAL unnest(c.scopes) AS s (scope) ON true
    WHERE pg_has_role(v_invoker, r.oid, 'USAGE');
    IF v_every THEN
        RETURN NULL;
    END IF;
    IF v_grants = 0 OR (_completer_scopes.scope IS NOT NULL
                        AND NOT _completer_scopes.scope = ANY (v_scopes)) THEN
        RAISE EXCEPTION USING
            MESSAGE = CASE WHEN v_grants = 0
                THEN format('%s: role %s holds no completer grant', _completer_scopes.fn,
                            to_json(v_invoker))
                ELSE format('%s: role %s may not act on scope %s', _completer_scopes.fn,
                            to_json(v_invoker), to_json(_completer_scopes.scope)) END,
            ERRCODE = 'IK023',
            COLUMN = 'scope',
            DETAIL = CASE WHEN v_grants = 0
                THEN 'Its EXECUTE privilege was not given by idempotency.grant_usage(), or it '
                     'was renamed since.'
                ELSE 'Its completer grant is limited to other scopes. Nothing was read or '
                     'changed.' END,
            HINT = 'As the schema owner: SELECT idempotency.grant_usage(role, kind => '
                   '''completer'', scopes => ARRAY[...]).';
    END IF;
    RETURN v_scopes;
END;
$$;

COMMENT ON FUNCTION idempotency._completer_scopes(text, text) IS
'Internal: the scopes the calling role may act on as a completer (NULL: every scope); raises
IK023 when scope is not one of them or the role holds no completer grant.';
