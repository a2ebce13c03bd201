-- Recipe of migrations/0006_roles.sql (tools/build.py --migration 6 roles); the syntax is
-- explained in sql/upgrades/0002_maintenance.sql.
--
-- 0006: two kinds of application role. grant_usage(grantee, kind => 'request' | 'completer'):
-- a request role can claim and finish keys it presents with their request, but not take over
-- or list another scope's keys; a completer role can (docs/install.md, Privileges).
-- Roles granted before 0006 keep every function they had (takeover and list_abandoned too);
-- only the internal helpers are revoked from them below.
-- Also: claim(strict => true) no longer puts the stored fingerprint in IK002's DETAIL (passed
-- back as claim(fingerprint => ...), it replayed the stored response without the request), and
-- derive_key runs as its owner, so no role needs EXECUTE on the internal _check_name.

DROP FUNCTION idempotency.grant_usage(regrole);
-- @include functions/grant_usage.sql
-- @replace functions/claim.sql
-- @replace functions/derive_key.sql

-- No one but the owner executes an internal function (0001-0005's grant_usage granted
-- _invalid_argument and _check_name).
DO $revoke$
DECLARE
    v_grant record;
BEGIN
    FOR v_grant IN
        SELECT p.oid::regprocedure AS fn, a.grantee::regrole AS grantee
        FROM pg_proc AS p
        CROSS JOIN LATERAL aclexplode(p.proacl) AS a
        WHERE p.pronamespace = 'idempotency'::regnamespace
          AND p.proname LIKE '\_%'
          AND a.privilege_type = 'EXECUTE'
          AND a.grantee <> p.proowner
          AND a.grantee <> 0
    LOOP
        EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM %s', v_grant.fn, v_grant.grantee);
    END LOOP;
END
$revoke$;

-- As in sql/bootstrap.sql: nothing new is executable by PUBLIC.
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA idempotency FROM public;
