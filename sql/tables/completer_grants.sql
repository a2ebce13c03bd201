-- The completer grants of idempotency.grants, by role NAME, for the scope check of takeover()
-- and list_abandoned() (idempotency._completer_scopes). Kept apart from grants because the
-- check must run on whatever node runs the call: on Citus, takeover is delegated to the node
-- holding the scope's shard, where grants (coordinator-local, holding the coordinator's role
-- OIDs) is not; this table is a reference table (distribute()), and role names are the same on
-- every node (Citus propagates roles). Written only by the trigger on grants
-- (_mirror_completer_grants), which rebuilds it from grants after every change, so a DELETE
-- from grants (withdrawing a kind, docs/install.md) withdraws the scopes too.
CREATE TABLE idempotency.completer_grants (
    grantee name PRIMARY KEY,
    -- The scopes its completer grant allows; NULL for every scope.
    scopes text[]
);

COMMENT ON TABLE idempotency.completer_grants IS
'Completer grants by role name (scopes NULL: every scope), mirrored from idempotency.grants by
a trigger; read by takeover() and list_abandoned() on the node a call runs on.';

REVOKE ALL ON idempotency.completer_grants FROM public;
