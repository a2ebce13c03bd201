-- sha256 of a key's UTF-8 bytes, as key_directory and tombstones store it, for the statements
-- that hash a column (maintenance). Declared IMMUTABLE, which convert_to() is not (its
-- conversions live in the catalog): Citus refuses a non-immutable function applied to a column
-- in a distributed UPDATE or DELETE. The conversion to UTF-8 of a given text does not change
-- in practice. PL/pgSQL so that it is not inlined back into the STABLE expression. The hot
-- path hashes its argument inline instead (sha256(convert_to(key, 'UTF8'))), which is the same
-- value and saves a call.
CREATE FUNCTION idempotency._key_hash(key text)
RETURNS bytea
LANGUAGE plpgsql
IMMUTABLE
PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN sha256(convert_to(_key_hash.key, 'UTF8'));
END;
$$;

COMMENT ON FUNCTION idempotency._key_hash(text) IS
'Internal: sha256 of the key''s UTF-8 bytes (IMMUTABLE, for distributed statements on columns).';
