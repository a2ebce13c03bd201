-- Partitions for now and the next settings.premake intervals, so the first claims land in real
-- partitions rather than in the default one.
SELECT idempotency._premake(now());

-- Functions are executable by PUBLIC unless revoked; here nothing is, until grant_usage().
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA idempotency FROM public;
