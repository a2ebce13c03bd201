-- A key for a downstream call made while handling (scope, key): the same on every retry of the
-- intent, so the downstream system deduplicates the retries too, and different for each step,
-- so two calls of one intent never collide. Hashing keeps it short and opaque: the downstream
-- system sees neither the scope (often a tenant id) nor the client's key. IMMUTABLE, and so it
-- calls the IMMUTABLE internal _canonical_json, not canonical_json: that one is STABLE since
-- 0.11.0 (above 64 KiB it reads a setting), which three names of at most 255 characters never
-- reach; the text is the same.
CREATE FUNCTION idempotency.derive_key(scope text, key text, step text)
RETURNS text
LANGUAGE plpgsql
IMMUTABLE
-- SECURITY DEFINER: it calls the internal _check_name, which application roles may not.
SECURITY DEFINER
PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM idempotency._check_name('idempotency.derive_key', 'scope', derive_key.scope);
    PERFORM idempotency._check_name('idempotency.derive_key', 'key', derive_key.key);
    PERFORM idempotency._check_name('idempotency.derive_key', 'step', derive_key.step);
    RETURN encode(sha256(convert_to(idempotency._canonical_json(
        jsonb_build_array(derive_key.scope, derive_key.key, derive_key.step),
        'idempotency.derive_key', 'step', 1), 'UTF8')), 'hex');
END;
$$;

COMMENT ON FUNCTION idempotency.derive_key(text, text, text) IS
'Deterministic key (64 lower-case hex characters) for the downstream call "step" of (scope, key):
hex(sha256(canonical_json([scope, key, step]))).';
