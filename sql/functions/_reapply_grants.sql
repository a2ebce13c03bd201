-- Grants every role listed in idempotency.grants the functions of its kind again, as
-- grant_usage() defines them now, a completer with its scopes: every migration from 0010 on
-- ends with it (tools/build.py), so a function a migration adds, or drops and makes again, is
-- executable by the roles of its kind after the upgrade. Roles dropped since are passed over.
-- Returns how many grants it made.
CREATE FUNCTION idempotency._reapply_grants()
RETURNS integer
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_grant record;
    v_count integer := 0;
BEGIN
    FOR v_grant IN
        SELECT g.grantee, g.kind, g.scopes
        FROM idempotency.grants AS g
        INNER JOIN pg_roles AS r ON r.oid = g.grantee
        ORDER BY r.rolname, g.kind
    LOOP
        PERFORM idempotency.grant_usage(v_grant.grantee, v_grant.kind, v_grant.scopes);
        v_count := v_count + 1;
    END LOOP;
    RETURN v_count;
END;
$$;

COMMENT ON FUNCTION idempotency._reapply_grants() IS
'Internal: grant_usage() again for every role and kind in idempotency.grants (run by every
migration from 0010 on). Returns the number of grants made.';
