-- Fencing tokens come from one sequence for all keys: every claim or takeover gets a token
-- greater than any token handed out before it, so a downstream system can reject a stale
-- writer by comparing tokens alone.
CREATE SEQUENCE idempotency.lease_token_seq AS bigint;

COMMENT ON SEQUENCE idempotency.lease_token_seq IS
'Source of fencing tokens: strictly increasing across claims and takeovers of all keys.';

REVOKE ALL ON SEQUENCE idempotency.lease_token_seq FROM public;
