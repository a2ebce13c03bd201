-- Lease tokens (fencing tokens) are made here, per key, not from a sequence:
--
--   token = h * 2^32 + r    h: greater than the previous owner's h (previous >> 32) and at
--                              least the seconds since 2024-01-01 on this node's clock;
--                           r: 32 bits of a gen_random_uuid() (pg_strong_random), hashed.
--
-- Increasing per key: a takeover or a new claim after release() passes the previous owner's
-- token, so h grows by at least one with every owner of the key, on any node and after a shard
-- move (the row carries the token with it). A key claimed afresh (new, or past its retention)
-- has no previous owner on record; its h is the clock's, greater than the h of every token
-- handed out more than a retention ago unless a node's clock is that far behind.
-- Unguessable: knowing the scope and the key, and even the h part, a caller still has to guess
-- 32 random bits to act as the owner. A sequence (before 0.9.0) made the next token one more
-- than the last one seen, and gave each Citus node its own range.
-- r is uuid_hash() of a fresh version-4 UUID: 32 bits that depend on all of its 122 random
-- bits, so as hard to guess as the UUID. Until 0.11.0 r was the UUID's first 8 hex digits,
-- through a text and a bit(32) cast: two I/O conversions and four more calls, which the
-- INSERT that calls this compiles and runs again on every claim (docs/design.md,
-- "Performance decisions").
-- h fits 31 bits until 2092, so the token stays a positive bigint. Without SET search_path so
-- that it is inlined into the caller; everything is schema-qualified (greatest is syntax).
CREATE FUNCTION idempotency._new_token(previous bigint)
RETURNS bigint
LANGUAGE sql
VOLATILE
RETURN (
    greatest(
        (previous OPERATOR(pg_catalog.>>) 32) OPERATOR(pg_catalog.+) 1,
        pg_catalog.floor(
            pg_catalog.date_part('epoch', pg_catalog.clock_timestamp())
            OPERATOR(pg_catalog.-) 1704067200
        )::pg_catalog.int8
    ) OPERATOR(pg_catalog.<<) 32
) OPERATOR(pg_catalog.|) (
    pg_catalog.uuid_hash(pg_catalog.gen_random_uuid())::pg_catalog.int8
    OPERATOR(pg_catalog.&) 4294967295
);

COMMENT ON FUNCTION idempotency._new_token(bigint) IS
'Internal: a new lease token for a key, greater than previous (its last owner''s token, or
NULL), with 32 random low bits.';
