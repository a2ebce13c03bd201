-- Partitions for now and the next settings.premake intervals, so the first claims land in real
-- partitions rather than in the default one. Not inside CREATE EXTENSION (tools/build.py sets
-- idempotency.creating_extension there): restoring a dump runs the extension script again and
-- then re-creates the dumped partitions, which would clash with partitions made here. After
-- CREATE EXTENSION, claims land in the default partition until _premake() runs.
SELECT idempotency._premake(now()) AS partitions_created
WHERE current_setting('idempotency.creating_extension', true) IS DISTINCT FROM 'on';

-- claim and complete call the functions this generates (only the parent when no partitions
-- exist yet, as inside CREATE EXTENSION).
SELECT idempotency._make_routes() AS routes_made;

-- Functions are executable by PUBLIC unless revoked; here nothing is, until grant_usage().
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA idempotency FROM public;
