-- Everything the engine owns lives in one schema with a fixed name: every client language calls
-- idempotency.claim(...) and friends by that name, and the extension is not relocatable.
CREATE SCHEMA IF NOT EXISTS idempotency;

COMMENT ON SCHEMA idempotency IS
'pg_idempotency: idempotency keys, leases with fencing tokens, recovery points and replayable
responses, implemented as SQL functions. See docs/sql-api.md.';

-- No one but the owner may use the schema until granted (idempotency.grant_usage).
REVOKE ALL ON SCHEMA idempotency FROM public;
