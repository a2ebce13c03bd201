-- Drops a function and creates it again from its own definition, with its comment and
-- privileges: distribute() uses it to undo Citus's delegation of a function on every node
-- (Citus clears a function's distribution argument on the coordinator only; dropping the
-- function removes its metadata on every node, and creating it again creates it everywhere,
-- undelegated). The definition keeps the body, the attributes and the SET clauses; the owner
-- becomes the caller, who is the schema's owner (distribute() is theirs to run).
CREATE FUNCTION idempotency._recreate_function(fn regprocedure)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_definition text;
    v_comment text;
    v_acl aclitem[];
    v_owner oid;
    v_schema oid;
    v_name name;
    v_arguments text;
    v_new regprocedure;
    v_grant record;
BEGIN
    SELECT pg_get_functiondef(p.oid), obj_description(p.oid, 'pg_proc'), p.proacl, p.proowner,
           p.pronamespace, p.proname, pg_get_function_identity_arguments(p.oid)
    INTO v_definition, v_comment, v_acl, v_owner, v_schema, v_name, v_arguments
    FROM pg_proc AS p
    WHERE p.oid = fn;
    EXECUTE format('DROP FUNCTION %s', fn);
    EXECUTE v_definition;
    -- The same function under a new OID: what the statements below name.
    SELECT p.oid::regprocedure INTO STRICT v_new
    FROM pg_proc AS p
    WHERE p.pronamespace = v_schema AND p.proname = v_name
      AND pg_get_function_identity_arguments(p.oid) = v_arguments;
    IF v_comment IS NOT NULL THEN
        EXECUTE format('COMMENT ON FUNCTION %s IS %L', v_new, v_comment);
    END IF;
    -- A NULL ACL is the default (the owner and PUBLIC), which CREATE FUNCTION gives again.
    IF v_acl IS NOT NULL THEN
        EXECUTE format('REVOKE ALL ON FUNCTION %s FROM PUBLIC', v_new);
        FOR v_grant IN
            SELECT a.grantee
            FROM aclexplode(v_acl) AS a
            WHERE a.privilege_type = 'EXECUTE' AND a.grantee <> v_owner
        LOOP
            IF v_grant.grantee = 0 THEN
                EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO PUBLIC', v_new);
            ELSE
                EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO %s', v_new,
                               v_grant.grantee::regrole);
            END IF;
        END LOOP;
    END IF;
END;
$$;

COMMENT ON FUNCTION idempotency._recreate_function(regprocedure) IS
'Internal: drop fn and create it again from its definition, comment and privileges (distribute()
undoes a Citus delegation on every node with it).';
