-- Recipe of migrations/0012_bounded_canonical.sql (tools/build.py --migration 12
-- bounded_canonical); the syntax is explained in sql/upgrades/0002_maintenance.sql.
-- Self-contained: only the objects added or changed here.
--
-- 0012 (0.12.0): the canonical form is bounded by the input.
-- - A number outside 1e-7 <= |n| < 1e21 (and not 0) is written as its significant digits and
--   exponent (1e21, -1.5e-30) by the new _canonical_number, never expanded to plain decimal:
--   1e131071 was 131,072 characters. Every other number keeps its text, so the fingerprints of
--   requests without such numbers do not change.
-- - _canonical_json measures the text as it builds it, after each array and object, against
--   settings.max_request_bytes (IK018 through the new _check_canonical_size); it becomes
--   STABLE and takes legacy (numbers in plain decimal, the form before 0.12.0). The old
--   signature is dropped.
-- - claim() recognises a key claimed before 0.12.0 with a request holding such a number: when
--   the fingerprints differ, it compares the old form's too (the new _legacy_fingerprint, which
--   measures that text before building it and builds none over the limit).
-- - derive_key() writes its three strings itself (same keys) and stays IMMUTABLE.
-- No table changes; no data moves.

-- @include functions/_check_canonical_size.sql
-- @include functions/_canonical_number.sql
-- @include functions/_canonical_json.sql
-- @include functions/_legacy_fingerprint.sql
-- @replace functions/canonical_json.sql
-- @replace functions/fingerprint.sql
-- @replace functions/derive_key.sql
-- @replace functions/claim.sql
DROP FUNCTION idempotency._canonical_json(jsonb, text, text, integer);

-- As in sql/bootstrap.sql: nothing new is executable by PUBLIC.
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA idempotency FROM public;
