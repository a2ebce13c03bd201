-- Rebuilds idempotency.completer_grants from idempotency.grants after any change to grants
-- (grant_usage, _reapply_grants, or an operator's DELETE when withdrawing a kind): the scope
-- check reads the mirror, by role name, on whatever node runs the call (see
-- sql/tables/completer_grants.sql). A rebuild, not a row-by-row copy: the table holds a row
-- per completer role, and grants change only in administration.
CREATE FUNCTION idempotency._mirror_completer_grants()
RETURNS trigger
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    DELETE FROM idempotency.completer_grants;
    -- A role dropped since its grant has no name to go by: left out (it can call nothing).
    INSERT INTO idempotency.completer_grants (grantee, scopes)
    SELECT r.rolname, g.scopes
    FROM idempotency.grants AS g
    INNER JOIN pg_roles AS r ON r.oid = g.grantee
    WHERE g.kind = 'completer';
    RETURN NULL;
END;
$$;

COMMENT ON FUNCTION idempotency._mirror_completer_grants() IS
'Internal (trigger on idempotency.grants): rebuild idempotency.completer_grants, the completer
grants by role name.';

CREATE TRIGGER mirror_completer_grants
AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON idempotency.grants
FOR EACH STATEMENT EXECUTE FUNCTION idempotency._mirror_completer_grants();
