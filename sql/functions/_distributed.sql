-- Whether idempotency.distribute() has made keys a Citus distributed table. Read by functions
-- off the hot path only (route generation, maintenance): the catalog of Citus exists only where
-- the extension is installed, so it is read through dynamic SQL.
CREATE FUNCTION idempotency._distributed()
RETURNS boolean
LANGUAGE plpgsql
STABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_found boolean;
BEGIN
    IF to_regclass('pg_catalog.pg_dist_partition') IS NULL THEN
        RETURN false;
    END IF;
    EXECUTE 'SELECT EXISTS (SELECT FROM pg_catalog.pg_dist_partition AS p '
            'WHERE p.logicalrelid = $1)'
    INTO v_found
    USING 'idempotency.keys'::regclass;
    RETURN v_found;
END;
$$;

COMMENT ON FUNCTION idempotency._distributed() IS
'Internal: true when idempotency.keys is a Citus distributed table (see distribute()).';
