-- Makes sure the partition holding reference_time and settings.premake partitions after it
-- exist, for both tables. Partition bounds are aligned as _partition_start aligns them, so
-- every installer and every run computes the same ranges.
CREATE FUNCTION idempotency._premake(reference_time timestamptz DEFAULT now())
RETURNS integer
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_settings idempotency.settings;
    v_start timestamptz;
    v_created integer := 0;
    v_parent text;
BEGIN
    -- The settings row is made on first use (see sql/tables/settings.sql).
    INSERT INTO idempotency.settings DEFAULT VALUES ON CONFLICT (id) DO NOTHING;
    SELECT s.* INTO STRICT v_settings FROM idempotency.settings AS s;
    v_start := idempotency._partition_start(v_settings.partition_interval,
                                            _premake.reference_time);
    FOREACH v_parent IN ARRAY ARRAY['keys', 'inbox'] LOOP
        FOR i IN 0 .. v_settings.premake LOOP
            IF idempotency._create_partition(
                v_parent,
                v_start + i * v_settings.partition_interval,
                v_start + (i + 1) * v_settings.partition_interval
            ) THEN
                v_created := v_created + 1;
            END IF;
        END LOOP;
    END LOOP;
    RETURN v_created;
END;
$$;

COMMENT ON FUNCTION idempotency._premake(timestamptz) IS
'Internal: create the current and the next settings.premake partitions of idempotency.keys and
idempotency.inbox; returns how many it created.';
