-- Whether this install's routes have local halves: false here, true once _make_routes has
-- generated them on a Citus cluster (it replaces this function there; see _make_routes).
--
-- A SQL function that PostgreSQL inlines and folds: claim() tests it inside the one
-- expression of its common path, where on one server it folds to a constant and costs nothing
-- per call, and replacing it invalidates the plans that folded it.
CREATE FUNCTION idempotency._local_shards()
RETURNS boolean
LANGUAGE sql
IMMUTABLE
AS $$
SELECT false
$$;

COMMENT ON FUNCTION idempotency._local_shards() IS
'Internal: true when _make_routes has generated the local halves of the routes (Citus); false
on one server.';
