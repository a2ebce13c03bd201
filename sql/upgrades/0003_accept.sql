-- Recipe of migrations/0003_accept.sql (tools/build.py --migration 3 accept); the syntax is
-- explained in sql/upgrades/0002_maintenance.sql.
--
-- 0003: long-running operations. accept() stores an interim response (e.g. 202 and a status
-- URL) on a key in progress; a claim under the live lease returns it as outcome accepted.
-- _check_response is the argument diagnosis accept() shares with complete() (via _finish).

-- @include functions/_check_response.sql
-- @replace functions/_finish.sql
-- @include functions/accept.sql
-- @replace functions/_resume_existing.sql
-- @replace functions/claim.sql
-- @replace functions/grant_usage.sql

-- As in sql/bootstrap.sql: nothing new is executable by PUBLIC.
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA idempotency FROM public;
