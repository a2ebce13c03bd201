-- Generates the two routed statements of the hot path, so that they touch one plain partition of
-- idempotency.keys instead of the partitioned parent:
--
--   _key_row(scope, key, created_at)      the key's row (claim's replay/in-progress/mismatch path)
--   _complete_row(scope, key, token, ...) complete()'s fenced UPDATE (through _finish)
--
-- Why generate code: a statement on the parent, even with a generic plan that prunes at executor
-- startup, locks every partition the plan names (PostgreSQL 15 to 18), about 1 µs per partition
-- and statement; with 100 partitions claim + complete ran at 0.71-0.76x the rate at 5
-- (docs/benchmarks.md). Dynamic SQL on the partition avoids the locks but plans on every call
-- (0.63x at any count). A static statement per partition, chosen by an IF on created_at, has a
-- cached plan on a plain table and locks one table: flat in the number of partitions.
--
-- The generated functions are a cache of the catalog, never the truth, so staleness is harmless:
-- - a partition made after the last generation (pg_partman, by hand) has no branch: its keys go
--   through the statement on the parent, which is always there last;
-- - a branch whose partition is gone (dropped by pg_partman, or by maintain() in a transaction
--   that committed after the caller compiled the function) is skipped by its to_regclass()
--   test. The callers hold a lock on the parent idempotency.keys from before that test (claim's
--   first statement inserts through it; _finish reads the directory joined with ONLY keys), and
--   every DROP or DETACH of a partition locks the parent exclusively, so the test cannot pass
--   for a partition dropped before the branch's statement runs;
-- - a branch that finds no row falls through to the parent, so a row in a partition the branch
--   did not expect (or the default partition) is still found. Only failures pay for that.
--
-- Called by _create_partition (when it makes a partition of keys) and at the end of maintain();
-- it replaces a function only when the text changes, since every replacement makes each session
-- compile the function again on its next call.
CREATE FUNCTION idempotency._make_routes()
RETURNS boolean
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
-- The bounds become literals in the generated text: ISO with a numeric UTC offset, which reads
-- back as the same instant under any DateStyle and TimeZone of the sessions that run it.
SET datestyle = 'ISO, YMD'
SET timezone = 'UTC'
AS $make$
DECLARE
    -- %1$s is the table the statement addresses: a partition, then the parent as the last word.
    v_row_sql constant text := $sql$
        SELECT k.* INTO v_row
        FROM %1$s AS k
        WHERE k.scope = _key_row.scope AND k.key = _key_row.key
          AND k.created_at = _key_row.created_at;$sql$;
    v_complete_sql constant text := $sql$
        UPDATE %1$s AS k
        SET state = 'completed',
            lease_expires_at = NULL,
            response_status = _complete_row.status,
            response_headers = _complete_row.headers,
            response_body = _complete_row.body,
            response_body_bytes = _complete_row.body_bytes,
            response_content_type = _complete_row.content_type,
            completed_at = _complete_row.completed_at
        WHERE k.scope = _complete_row.scope AND k.key = _complete_row.key
          AND k.lease_token = _complete_row.lease_token AND k.state = 'in_progress'
          AND k.created_at = _complete_row.created_at
        RETURNING k.completed_at INTO v_done;$sql$;
    v_row_branches text := '';
    v_complete_branches text := '';
    v_part record;
    v_test text;
    v_source text;
    v_changed boolean := false;
BEGIN
    -- Newest first: most calls concern keys claimed moments ago (the partitions made ahead come
    -- first, but they are only a few).
    FOR v_part IN
        SELECT p.partition_name, p.lower_bound, p.upper_bound
        FROM idempotency._partitions('keys') AS p
        WHERE NOT p.is_default AND p.lower_bound IS NOT NULL AND p.upper_bound IS NOT NULL
        ORDER BY p.lower_bound DESC
    LOOP
        -- @fn@ becomes the generated function's name (replace(), not format(): a partition's
        -- name may hold a %).
        v_test := format(
            E'\n    %s @fn@.created_at >= %L::timestamptz AND @fn@.created_at < %L::timestamptz'
            || E'\n       AND to_regclass(%L) IS NOT NULL THEN',
            CASE WHEN v_row_branches = '' THEN 'IF' ELSE 'ELSIF' END,
            v_part.lower_bound, v_part.upper_bound,
            format('idempotency.%I', v_part.partition_name));
        v_row_branches := v_row_branches
            || replace(v_test, '@fn@', '_key_row')
            || format(v_row_sql, format('idempotency.%I', v_part.partition_name));
        v_complete_branches := v_complete_branches
            || replace(v_test, '@fn@', '_complete_row')
            || format(v_complete_sql, format('idempotency.%I', v_part.partition_name));
    END LOOP;
    IF v_row_branches <> '' THEN
        v_row_branches := v_row_branches
            || E'\n    END IF;\n    IF FOUND THEN\n        RETURN v_row;\n    END IF;';
        v_complete_branches := v_complete_branches
            || E'\n    END IF;\n    IF FOUND THEN\n        RETURN v_done;\n    END IF;';
    END IF;

    v_source := format(
        E'\n-- Generated by idempotency._make_routes(): do not edit.\n'
        'DECLARE\n    v_row idempotency.keys;\nBEGIN%s%s\n    RETURN v_row;\nEND;\n',
        v_row_branches, format(v_row_sql, 'idempotency.keys'));
    IF v_source IS DISTINCT FROM (
        SELECT p.prosrc FROM pg_proc AS p
        WHERE p.oid = to_regprocedure('idempotency._key_row(text, text, timestamptz)')
    ) THEN
        -- No SET clauses: only claim (which pins search_path and generic plans) calls it, and a
        -- SET would cost a GUC save and restore on every call.
        EXECUTE format($ddl$
            CREATE OR REPLACE FUNCTION idempotency._key_row(
                scope text, key text, created_at timestamptz
            )
            RETURNS idempotency.keys
            LANGUAGE plpgsql
            -- VOLATILE: each statement takes its own snapshot, after the caller's key lock.
            VOLATILE
            AS %L$ddl$, v_source);
        v_changed := true;
    END IF;

    v_source := format(
        E'\n-- Generated by idempotency._make_routes(): do not edit.\n'
        'DECLARE\n    v_done timestamptz;\nBEGIN%s%s\n    RETURN v_done;\nEND;\n',
        v_complete_branches, format(v_complete_sql, 'idempotency.keys'));
    IF v_source IS DISTINCT FROM (
        SELECT p.prosrc FROM pg_proc AS p
        WHERE p.oid = to_regprocedure(
            'idempotency._complete_row(text, text, bigint, timestamptz, integer, jsonb, jsonb, '
            'bytea, text, timestamptz)')
    ) THEN
        -- Only _finish (search_path and generic plans pinned) calls it; no SET, as above.
        EXECUTE format($ddl$
            CREATE OR REPLACE FUNCTION idempotency._complete_row(
                scope text, key text, lease_token bigint, created_at timestamptz,
                status integer, headers jsonb, body jsonb, body_bytes bytea,
                content_type text, completed_at timestamptz
            )
            RETURNS timestamptz
            LANGUAGE plpgsql
            VOLATILE
            AS %L$ddl$, v_source);
        v_changed := true;
    END IF;

    IF v_changed THEN
        -- CREATE OR REPLACE keeps the privileges of a function that existed; a new one would be
        -- executable by PUBLIC.
        REVOKE ALL ON FUNCTION idempotency._key_row(text, text, timestamptz) FROM public;
        REVOKE ALL ON FUNCTION idempotency._complete_row(
            text, text, bigint, timestamptz, integer, jsonb, jsonb, bytea, text, timestamptz
        ) FROM public;
        COMMENT ON FUNCTION idempotency._key_row(text, text, timestamptz) IS
        'Internal, generated by _make_routes(): the row of a key in the partition its created_at
names, through the parent when no branch finds it.';
        COMMENT ON FUNCTION idempotency._complete_row(
            text, text, bigint, timestamptz, integer, jsonb, jsonb, bytea, text, timestamptz
        ) IS
        'Internal, generated by _make_routes(): complete()''s fenced UPDATE on the partition the
key''s created_at names, through the parent when no branch finds the row.';
    END IF;
    RETURN v_changed;
END;
$make$;

COMMENT ON FUNCTION idempotency._make_routes() IS
'Internal: (re)generate _key_row and _complete_row, which address one partition of keys by a
static statement per partition; true when either was replaced. Run by _create_partition and
maintain().';
