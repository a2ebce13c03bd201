-- Creates one partition of idempotency.keys, inbox or tombstones, unless it
-- exists. Returns true when it made one. A range that overlaps an existing partition (say, one
-- pg_partman made) or rows already in the default partition is left alone and reported as not
-- created.
CREATE FUNCTION idempotency._create_partition(
    parent text, lower_bound timestamptz, upper_bound timestamptz
)
RETURNS boolean
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
-- The bounds go into the DDL as text (%L): ISO with a numeric UTC offset, whatever the
-- session's DateStyle and TimeZone (see _partitions for what a zone abbreviation can do).
SET datestyle = 'ISO, YMD'
SET timezone = 'UTC'
AS $$
DECLARE
    v_name text := idempotency._partition_name(
        _create_partition.parent, _create_partition.lower_bound,
        _create_partition.upper_bound - _create_partition.lower_bound);
    v_oid oid;
BEGIN
    IF _create_partition.parent NOT IN ('keys', 'inbox', 'tombstones') THEN
        RAISE EXCEPTION USING
            MESSAGE = format('idempotency._create_partition: argument "parent" must be keys, '
                             'inbox or tombstones, not %s',
                             to_json(_create_partition.parent)),
            ERRCODE = 'IK014', COLUMN = 'parent';
    END IF;
    IF to_regclass(format('idempotency.%I', v_name)) IS NOT NULL THEN
        RETURN false;
    END IF;
    BEGIN
        -- fillfactor 80 leaves room on each page so complete() can usually write the response
        -- as a HOT update next to the claim it finishes.
        IF _create_partition.parent = 'keys' THEN
            EXECUTE format('CREATE TABLE idempotency.%I PARTITION OF idempotency.keys '
                           'FOR VALUES FROM (%L) TO (%L) WITH (fillfactor = 80)',
                           v_name, _create_partition.lower_bound, _create_partition.upper_bound);
        ELSE
            EXECUTE format('CREATE TABLE idempotency.%I PARTITION OF idempotency.%I '
                           'FOR VALUES FROM (%L) TO (%L)',
                           v_name, _create_partition.parent, _create_partition.lower_bound,
                           _create_partition.upper_bound);
        END IF;
    EXCEPTION
        -- 42P17: overlaps another partition; 23514: rows for this range sit in the default
        -- partition. Both are for maintenance to report, never for a claim to fail on.
        WHEN invalid_object_definition OR check_violation THEN
            RETURN false;
    END;
    v_oid := format('idempotency.%I', v_name)::regclass::oid;
    EXECUTE format('REVOKE ALL ON idempotency.%I FROM public', v_name);
    -- Made while CREATE EXTENSION runs, the partition would become a member of the extension,
    -- and pg_dump would then leave out its rows. Partitions are data, not extension code.
    IF EXISTS (
        SELECT FROM pg_depend AS d
        JOIN pg_extension AS e ON e.oid = d.refobjid
        WHERE d.classid = 'pg_class'::regclass AND d.objid = v_oid
          AND d.refclassid = 'pg_extension'::regclass AND d.deptype = 'e'
          AND e.extname = 'pg_idempotency'
    ) THEN
        EXECUTE format('ALTER EXTENSION pg_idempotency DROP TABLE idempotency.%I', v_name);
    END IF;
    IF _create_partition.parent = 'keys' THEN
        -- So that claim and complete address the new partition directly.
        PERFORM idempotency._make_routes();
    END IF;
    RETURN true;
END;
$$;

COMMENT ON FUNCTION idempotency._create_partition(text, timestamptz, timestamptz) IS
'Internal: create the partition [lower_bound, upper_bound) of idempotency.keys, inbox or
tombstones; false when it exists, overlaps another one, or rows for it are in
the default partition.';
