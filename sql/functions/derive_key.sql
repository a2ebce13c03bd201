-- A key for a downstream call made while handling (scope, key): the same on every retry of the
-- intent, so the downstream system deduplicates the retries too, and different for each step,
-- so two calls of one intent never collide. Hashing keeps it short and opaque: the downstream
-- system sees neither the scope (often a tenant id) nor the client's key.
--
-- The hashed text is the canonical JSON of [scope, key, step] (docs/fingerprint.md), written
-- here directly: three strings, each as to_json writes it (the escaping jsonb's text output and
-- _canonical_json use). IMMUTABLE, so it calls neither canonical_json nor _canonical_json: both
-- are STABLE (they read settings.max_request_bytes), a limit three names of at most 255
-- characters never reach. The keys are those of every earlier version.
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
    RETURN encode(sha256(convert_to(
        '[' || to_json(derive_key.scope)::text || ',' || to_json(derive_key.key)::text || ','
        || to_json(derive_key.step)::text || ']', 'UTF8')), 'hex');
END;
$$;

COMMENT ON FUNCTION idempotency.derive_key(text, text, text) IS
'Deterministic key (64 lower-case hex characters) for the downstream call "step" of (scope, key):
hex(sha256(canonical_json([scope, key, step]))).';
