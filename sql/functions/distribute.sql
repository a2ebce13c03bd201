-- The one step that spreads an install over a Citus cluster (docs/scale-out.md). Run it on the
-- coordinator, after the migrations, as the schema's owner:
--
--   keys, key_directory and tombstones   distributed by scope, co-located: a scope (a tenant)
--                                        lives on one shard, with its business tables when
--                                        they are created with colocate_with => 'idempotency.keys'
--   inbox                                distributed by consumer, in the same co-location group
--   settings, migrations                 reference tables (a copy on every node)
--   completer_grants                     reference table, read by takeover/list_abandoned on
--                                        the node the call runs on
--   grants, maintenance_runs             left on the coordinator, as plain local tables: grants
--                                        holds regrole OIDs, which are the coordinator's own
--                                        (each node numbers its roles itself), and is read only
--                                        by _reapply_grants() in a migration, on the
--                                        coordinator (Citus propagates the GRANTs it makes);
--                                        maintenance_runs is written by maintain() and read by
--                                        metrics(), both run through the coordinator (the
--                                        partition DDL is the coordinator's), so a reference
--                                        table would only add a write to every node per run
--   every function                       created on every node; a call runs its body on the
--                                        node it reaches, each statement routed by scope to the
--                                        shard's node, as any nested call's
--   with delegate => true: claim,        delegated to the node holding the scope's shard, inside
--   complete, complete_bytes, heartbeat, transaction blocks too (force_delegation): a top-level
--   checkpoint, accept, release,         call's whole body runs there, next to the rows, in one
--   takeover, heartbeat_, checkpoint_    hop. Opt-in: Citus delegates by deparsing the query the
--   and release_outcome; inbox_accept    call is in, and a stock Citus 13.2.2 or 14.0.1 crashes or
--                                        answers wrongly for some of the SQL around a call that any
--                                        role allowed to call these can send; delegate only on a
--                                        Citus built with the guard that delegates nothing but the
--                                        plain forms (tools/build_citus.py, docs/scale-out.md).
--                                        delegate => false (the default) undoes an earlier
--                                        delegation, so running distribute() after a migration
--                                        leaves no function delegated unless asked again
--
-- What keeps the guarantees wherever a call runs (delegated, inside a subquery or a transaction
-- the coordinator executes itself, or sent straight to a worker) is in the tables, not in this
-- step: uniqueness is key_directory's primary key, on the shard's node; tokens are made per key
-- from the previous owner's (see _new_token). Delegation only saves hops.
-- Running it again distributes only what is not yet distributed (a function added by a later
-- migration, say) and delegates or undelegates what delegate asks. Returns one row per object
-- it changed.
CREATE FUNCTION idempotency.distribute(
    shard_count integer DEFAULT NULL, delegate boolean DEFAULT false
)
RETURNS TABLE (object text, action text)
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_table record;
    v_fn record;
    v_delegated constant text[] := ARRAY[
        'claim', 'complete', 'complete_bytes', 'heartbeat', 'checkpoint', 'accept', 'release',
        'takeover', 'inbox_accept', 'heartbeat_outcome', 'checkpoint_outcome',
        'release_outcome'];
    v_coordinator boolean;
    v_done boolean;
BEGIN
    IF NOT EXISTS (SELECT FROM pg_extension AS e WHERE e.extname = 'citus') THEN
        RAISE EXCEPTION USING
            MESSAGE = 'idempotency.distribute: Citus is not installed in this database',
            ERRCODE = 'IK021',
            DETAIL = 'distribute() spreads the schema over a Citus cluster; on a single '
                     'PostgreSQL server there is nothing to do.',
            HINT = 'Without Citus, skip this step. With it: CREATE EXTENSION citus on the '
                   'coordinator first (docs/scale-out.md).';
    END IF;
    EXECUTE 'SELECT pg_catalog.citus_is_coordinator()' INTO v_coordinator;
    IF NOT v_coordinator THEN
        RAISE EXCEPTION USING
            MESSAGE = 'idempotency.distribute: this node is not the Citus coordinator',
            ERRCODE = 'IK022',
            HINT = 'Run it on the coordinator (after citus_set_coordinator_host and '
                   'citus_add_node).';
    END IF;
    IF distribute.shard_count IS NOT NULL AND distribute.shard_count NOT BETWEEN 1 AND 64000 THEN
        PERFORM idempotency._invalid_argument('idempotency.distribute', 'shard_count', 'IK014',
                                              'must be between 1 and 64000',
                                              format('It is %s.', distribute.shard_count));
    END IF;

    IF distribute.delegate IS NULL THEN
        PERFORM idempotency._invalid_argument('idempotency.distribute', 'delegate', 'IK014',
                                              'must be true or false', 'It is NULL.');
    END IF;

    -- Functions may not be distributed after statements that used many connections per node
    -- in the same transaction (creating the shards does): one connection per node throughout.
    PERFORM set_config('citus.multi_shard_modify_mode', 'sequential', true);
    FOR v_table IN
        SELECT t.name, t.column_name, t.ord
        FROM (VALUES ('keys', 'scope', 1), ('key_directory', 'scope', 2),
                     ('tombstones', 'scope', 3), ('inbox', 'consumer', 4),
                     ('settings', NULL, 5), ('migrations', NULL, 6),
                     ('completer_grants', NULL, 7))
             AS t (name, column_name, ord)
        ORDER BY t.ord
    LOOP
        -- Citus's functions and catalogs exist only where it is installed: dynamic SQL, so
        -- that this function compiles (and plpgsql_check passes) on any server.
        EXECUTE 'SELECT EXISTS (SELECT FROM pg_catalog.pg_dist_partition AS p '
                'WHERE p.logicalrelid = $1)'
        INTO v_done
        USING format('idempotency.%I', v_table.name)::regclass;
        CONTINUE WHEN v_done;
        IF v_table.column_name IS NULL THEN
            EXECUTE 'SELECT pg_catalog.create_reference_table($1)'
            USING format('idempotency.%I', v_table.name)::regclass;
            object := 'idempotency.' || v_table.name;
            action := 'reference table';
        ELSIF v_table.name = 'keys' THEN
            IF distribute.shard_count IS NULL THEN
                EXECUTE 'SELECT pg_catalog.create_distributed_table($1, $2)'
                USING 'idempotency.keys'::regclass, 'scope';
            ELSE
                EXECUTE 'SELECT pg_catalog.create_distributed_table($1, $2, '
                        'shard_count => $3)'
                USING 'idempotency.keys'::regclass, 'scope', distribute.shard_count;
            END IF;
            object := 'idempotency.keys';
            action := 'distributed by scope';
        ELSE
            EXECUTE 'SELECT pg_catalog.create_distributed_table($1, $2, '
                    'colocate_with => $3)'
            USING format('idempotency.%I', v_table.name)::regclass, v_table.column_name,
                  'idempotency.keys';
            object := 'idempotency.' || v_table.name;
            action := format('distributed by %s, co-located with idempotency.keys',
                             v_table.column_name);
        END IF;
        -- The rows were copied into the shards; the coordinator's own copy is invisible now and
        -- only takes space.
        EXECUTE 'SELECT pg_catalog.truncate_local_data_after_distributing_table($1)'
        USING format('idempotency.%I', v_table.name)::regclass;
        RETURN NEXT;
    END LOOP;

    -- Statements by scope go to the scope's shard and the worker prunes its partitions there:
    -- the routes lose their per-partition branches, and complete's guess and claim's INSERTs
    -- gain their local halves (see _make_routes), before the loop below creates the functions
    -- on every node.
    IF idempotency._make_routes() THEN
        object := 'routes';
        action := 'regenerated for Citus: no per-partition branches, local halves';
        RETURN NEXT;
    END IF;

    -- Functions: created on every node; with delegate, the per-key ones delegated by their
    -- first argument. Those already as asked (pg_dist_object; Citus also propagates a new
    -- function by itself when it can) are left as they are. A delegated one is undelegated
    -- unless delegate: create_distributed_function without a distribution argument clears it
    -- on the coordinator only (the workers' metadata keeps the delegation, and a client on a
    -- worker would still be delegated from there), so the function is dropped and created
    -- again from its own definition, which Citus does on every node, with its comment and
    -- privileges put back.
    FOR v_fn IN EXECUTE
        'SELECT p.oid::pg_catalog.regprocedure::text AS signature, p.proname::text AS name, '
        '       p.proargnames[1] AS first_argument, '
        '       o.distribution_argument_index IS NOT NULL AS was_delegated '
        'FROM pg_catalog.pg_proc AS p '
        'LEFT JOIN pg_catalog.pg_dist_object AS o ON o.classid = $2 AND o.objid = p.oid '
        'WHERE p.pronamespace = $1 '
        '  AND (o.objid IS NULL '
        '       OR (o.distribution_argument_index IS NOT NULL) '
        '          IS DISTINCT FROM ($4 AND p.proname = ANY ($3))) '
        'ORDER BY p.proname <> ALL ($3), p.oid'
        USING 'idempotency'::regnamespace, 'pg_proc'::regclass, v_delegated,
              distribute.delegate
    LOOP
        IF distribute.delegate AND v_fn.name = ANY (v_delegated) THEN
            EXECUTE 'SELECT pg_catalog.create_distributed_function($1::regprocedure, $2, '
                    'colocate_with => $3, force_delegation => true)'
            USING v_fn.signature, '$1', 'idempotency.keys';
            object := v_fn.signature;
            action := format('delegated by %s', v_fn.first_argument);
        ELSE
            IF v_fn.was_delegated THEN
                PERFORM idempotency._recreate_function(v_fn.signature::regprocedure);
            END IF;
            EXECUTE 'SELECT pg_catalog.create_distributed_function($1::regprocedure)'
            USING v_fn.signature;
            object := v_fn.signature;
            action := CASE WHEN v_fn.was_delegated THEN 'no longer delegated'
                           ELSE 'created on every node' END;
        END IF;
        RETURN NEXT;
    END LOOP;

    -- Custom plans on a cluster (see _citus_custom_plans): Citus's local plan cache would grow
    -- with every call.
    FOR object IN SELECT f::text FROM idempotency._citus_custom_plans() AS f LOOP
        action := 'plans each statement afresh (plan_cache_mode = force_custom_plan)';
        RETURN NEXT;
    END LOOP;
END;
$$;

COMMENT ON FUNCTION idempotency.distribute(integer, boolean) IS
'Citus: distribute keys, key_directory and tombstones by scope and inbox by consumer (co-located;
shard_count optional), settings, migrations and completer_grants as reference tables, and
create every function on every node; delegate => true also delegates every per-key function to
the node that holds its scope (only on a Citus built with the delegation guard), false (the
default) undoes that. Run on the coordinator after the migrations; running it again changes
only what is new or asked. Raises IK021 without Citus. See docs/scale-out.md.';
