-- Which roles idempotency.grant_usage() let in, and as which kind. A migration that adds or
-- re-creates a public function calls idempotency._reapply_grants() (tools/build.py appends the
-- call to every migration from 0010 on), so a role granted at any version can call every
-- function of its kind after any upgrade: a new function gets its grants, and a function that
-- was dropped and made again gets them back. Revoking by hand (REVOKE EXECUTE) is undone by
-- the next upgrade unless the row goes too (docs/install.md, Privileges).
CREATE TABLE idempotency.grants (
    grantee regrole NOT NULL,
    -- request | completer | monitor | maintainer
    kind text NOT NULL,
    granted_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- kind completer only: the scopes it may take over and list (grant_usage(scopes => ...));
    -- NULL for every scope. Mirrored by role name into idempotency.completer_grants, where the
    -- check reads it (see there).
    scopes text[],
    PRIMARY KEY (grantee, kind)
);

COMMENT ON TABLE idempotency.grants IS
'Roles let in by idempotency.grant_usage() and their kind (request, completer, monitor,
maintainer), and a completer''s scopes (NULL: every scope); re-applied by every migration
from 0010 on.';

REVOKE ALL ON idempotency.grants FROM public;
