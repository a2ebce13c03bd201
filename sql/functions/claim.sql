-- The entry point of every attempt. Call it in its own transaction (autocommit) so that other
-- retries see the claim at once: a concurrent claim of the same key waits until this
-- transaction ends (see sql/tables/key_directory.sql).
--
-- Outcomes: claimed (new key, you own it until lease_expires_at), resumed (the previous owner's
-- lease expired; you own it under a higher token and should reconcile from recovery_point),
-- replay (completed: return the stored response), accepted (a long-running operation's owner
-- stored an interim response with accept(): return it), in_progress (someone holds a live lease:
-- retry after retry_after), mismatch (the key was used with a different request: never execute,
-- never replay), expired (maintain() dropped the key after its retention and kept only a
-- tombstone, settings.tombstones: never execute, never replay).
CREATE FUNCTION idempotency.claim(
    scope text,
    key text,
    request jsonb,
    lease interval DEFAULT '30 seconds',
    fingerprint bytea DEFAULT NULL,
    strict boolean DEFAULT false,
    reference_time timestamptz DEFAULT NULL
)
RETURNS idempotency.claim_result
LANGUAGE plpgsql
VOLATILE
-- SECURITY DEFINER so that an application role can claim keys without any privilege on the
-- tables (see grant_usage); search_path is pinned to pg_catalog and every object is qualified.
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
-- A generic plan prunes the partitions of keys at executor startup; see docs/design.md.
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    v_size integer;  -- _raw_size's, assigned before the PERFORM that uses it (see there)
    v_now timestamptz := clock_timestamp();
    v_key_hash bytea;
    v_created_at timestamptz;
    v_existing idempotency.keys;
    v_previous bigint;
    v_insert boolean;
    v_result idempotency.claim_result;
BEGIN
    -- The common call (a fresh key, valid arguments, our own fingerprint, READ COMMITTED, no
    -- test clock) passes one inlined test: PL/pgSQL builds each expression's executor state
    -- once per transaction, and every claim is a transaction of its own, so each IF and
    -- assignment has a cost per call however cheap its test, and more for every function
    -- it calls (docs/design.md, "Performance decisions"). Anything else
    -- takes the branch below, which checks in the documented order and says what is wrong.
    -- coalesce: one NULL operand would make the whole test NULL.
    IF NOT coalesce(claim.reference_time IS NULL AND claim.request IS NULL
                    AND octet_length(claim.fingerprint) = 32
                    AND idempotency._name_ok(claim.scope) AND idempotency._name_ok(claim.key)
                    AND idempotency._lease_ok(claim.lease)
                    AND current_setting('transaction_isolation') = 'read committed',
                    false) THEN
        IF claim.reference_time IS NOT NULL THEN
            v_now := idempotency._test_clock('idempotency.claim', claim.reference_time);
        END IF;
        PERFORM idempotency._check_name('idempotency.claim', 'scope', claim.scope);
        PERFORM idempotency._check_name('idempotency.claim', 'key', claim.key);
        PERFORM idempotency._check_lease('idempotency.claim', 'lease', claim.lease);
        IF claim.fingerprint IS NOT NULL THEN
            IF claim.request IS NOT NULL THEN
                PERFORM idempotency._invalid_argument(
                    'idempotency.claim', 'fingerprint', 'IK016',
                    'must be NULL when request is given',
                    'Pass either the request (hashed by idempotency.fingerprint) or your own '
                    || 'fingerprint, not both.');
            ELSIF octet_length(claim.fingerprint) <> 32 THEN
                PERFORM idempotency._invalid_argument(
                    'idempotency.claim', 'fingerprint', 'IK014', 'must be 32 bytes (a sha256)',
                    format('It is %s bytes long.', octet_length(claim.fingerprint)));
            END IF;
        ELSIF claim.request IS NULL THEN
            PERFORM idempotency._invalid_argument(
                'idempotency.claim', 'request', 'IK010', 'must not be NULL',
                'Pass the request as jsonb, or NULL with your own 32-byte fingerprint.');
        ELSE
            -- The size first, uncompressed, before canonicalizing (see _check_size and
            -- _raw_size; the settings row is read only above 64 KiB, the smallest limit
            -- allowed, or for a compressed value, read from a table).
            IF pg_column_size(claim.request) > 65536
               OR pg_column_compression(claim.request) IS NOT NULL THEN
                v_size := idempotency._raw_size(claim.request);
                PERFORM idempotency._check_size('idempotency.claim', 'request', v_size,
                                                'max_request_bytes');
            END IF;
            -- fingerprint(request) without its defaults/fields handling, saving a call. The
            -- argument holds the fingerprint from here on, whichever way it came.
            claim.fingerprint := sha256(convert_to(
                idempotency._canonical_json(claim.request, 'idempotency.claim', 'request', 1,
                                            false),
                'UTF8'));
        END IF;
        IF current_setting('transaction_isolation') <> 'read committed' THEN
            PERFORM idempotency._require_read_committed('idempotency.claim');
        END IF;
    END IF;
    -- Citus: a new key's two rows by static statements on the scope's shards, when this node
    -- holds them (see _make_routes); otherwise (a NULL outcome: the key exists, or its shards
    -- are elsewhere) the statements below, through Citus. _local_shards() folds to a constant:
    -- false on one server, where this IF is one cheap test per call; true on a cluster.
    -- Outside the branch above, so that a common call on a cluster skips the checks: there
    -- each is planned afresh on every call (_citus_custom_plans), a noticeable part of a
    -- worker's CPU when every claim took them.
    IF idempotency._local_shards() THEN
        v_result := idempotency._claim_row_local(claim.scope, claim.key, claim.fingerprint,
                                                 claim.lease, v_now);
        IF v_result.outcome IS NOT NULL THEN
            RETURN v_result;
        END IF;
    END IF;

    -- Uniqueness is the directory's primary key (see sql/tables/key_directory.sql): the insert
    -- below either makes this claim the key's one owner, or waits for a concurrent claim of the
    -- same key to end and then does nothing. Each later statement takes a snapshot after that,
    -- so it sees the row that won. Every statement addresses one scope, so on Citus each runs
    -- on the node that holds the scope's shard, however the call arrived.
    INSERT INTO idempotency.key_directory AS d (scope, key_hash, created_at)
    VALUES (claim.scope, sha256(convert_to(claim.key, 'UTF8')), v_now)
    ON CONFLICT ON CONSTRAINT key_directory_pkey DO NOTHING;
    -- A new key (the common case) goes straight to its row below; a taken one is looked at.
    IF NOT FOUND THEN
        v_key_hash := sha256(convert_to(claim.key, 'UTF8'));
        v_insert := false;
        FOR attempt IN 1 .. 5 LOOP
            IF attempt > 1 THEN
                -- Looking again (see the CONTINUEs below): the key may be free by now.
                INSERT INTO idempotency.key_directory AS d (scope, key_hash, created_at)
                VALUES (claim.scope, v_key_hash, v_now)
                ON CONFLICT ON CONSTRAINT key_directory_pkey DO NOTHING;
                v_insert := FOUND;
                EXIT WHEN v_insert;
            END IF;

            SELECT e.created_at INTO v_created_at
            FROM idempotency.key_directory AS e
            WHERE e.scope = claim.scope AND e.key_hash = v_key_hash;
            IF NOT FOUND THEN
                -- Dropped (maintain) since the insert looked: insert again.
                CONTINUE;
            END IF;
            -- The row in the one partition created_at names, by a static statement on that
            -- partition (see _make_routes).
            v_existing := idempotency._key_row(claim.scope, claim.key, v_created_at);
            IF v_existing.scope IS NULL THEN
                -- The key's row is gone (its partition was dropped after its retention): a
                -- tombstone answers expired (settings.tombstones); without one the key is new
                -- again, under the same directory row.
                SELECT 'expired', t.response_status, t.created_at
                INTO v_result.outcome, v_result.response_status, v_result.created_at
                FROM idempotency.tombstones AS t
                WHERE t.scope = claim.scope AND t.key_hash = v_key_hash
                  AND t.created_at = v_created_at AND t.expires_at > v_now;
                IF FOUND THEN
                    RETURN v_result;
                END IF;
            ELSIF v_existing.state = 'released' THEN
                -- Released by its owner after a failure with no side effect: the key is new
                -- again (even for another request), and its next owner's token must still be
                -- greater than the released owner's (see _new_token). The released row goes,
                -- compared and set on its token so that only one of two concurrent claims
                -- takes it, by a static statement on its one partition (see _make_routes; a
                -- DELETE on the parent would lock every partition).
                CONTINUE WHEN NOT coalesce(idempotency._drop_released_row(
                    claim.scope, claim.key, v_created_at, v_existing.lease_token), false);
                v_previous := v_existing.lease_token;
            ELSIF v_existing.fingerprint <> claim.fingerprint
                  -- A key claimed before 0.12.0 may hold the sha256 of the request's old
                  -- canonical text (numbers in plain decimal): computed only here, when the
                  -- fingerprints differ, and only from a request (a caller's own fingerprint
                  -- cannot be recomputed). AND evaluates left to right and stops at false.
                  AND coalesce(v_existing.fingerprint IS DISTINCT FROM
                               idempotency._legacy_fingerprint(
                                   claim.request, 'idempotency.claim', 'request'),
                               true) THEN
                IF claim.strict THEN
                    RAISE EXCEPTION USING
                        MESSAGE = format('idempotency.claim: key %s in scope %s was used with '
                                         'a different request', to_json(claim.key),
                                         to_json(claim.scope)),
                        ERRCODE = 'IK002',
                        -- Never the stored fingerprint: with it, claim(fingerprint =>) would
                        -- replay the stored response to a caller that does not know the
                        -- request.
                        DETAIL = format('This request''s fingerprint is %s.',
                                        encode(claim.fingerprint, 'hex')),
                        HINT = 'Use a new idempotency key for a different request.';
                END IF;
                v_result.outcome := 'mismatch';
                v_result.created_at := v_existing.created_at;
                RETURN v_result;
            ELSE
                v_result := idempotency._resume_existing(v_existing, claim.lease, v_now);
                -- (A composite IS NOT NULL only when every field is; test the outcome.)
                IF v_result.outcome IS NOT NULL THEN
                    RETURN v_result;
                END IF;
                -- Lost a takeover race to the owner's own heartbeat/complete/release: look
                -- again.
                CONTINUE;
            END IF;
            -- Gone or released: the directory row moves to the new key row, compared on the
            -- created_at read above; a concurrent claim that moved it first makes this one
            -- look again.
            UPDATE idempotency.key_directory AS e
            SET created_at = v_now
            WHERE e.scope = claim.scope AND e.key_hash = v_key_hash
              AND e.created_at = v_created_at;
            v_insert := FOUND;
            EXIT WHEN v_insert;
        END LOOP;
        IF NOT v_insert THEN
            -- Five lost races in a row means the owner is actively heartbeating: in progress.
            v_result.outcome := 'in_progress';
            v_result.retry_after := claim.lease;
            RETURN v_result;
        END IF;
    END IF;

    -- This claim owns the key: its row, in the partition v_now names, with a token above the
    -- released owner's if there was one.
    INSERT INTO idempotency.keys AS k (
        scope, key, fingerprint, state, lease_token, lease_expires_at, created_at
    )
    VALUES (claim.scope, claim.key, claim.fingerprint, 'in_progress',
            idempotency._new_token(v_previous), v_now + claim.lease, v_now)
    -- Only the fields a new claim has (the others are NULL): each column returned costs
    -- executor set-up twice per call, for the parent and for the partition the row goes to.
    RETURNING 'claimed', k.lease_token, k.lease_expires_at, k.attempts, k.created_at
    INTO v_result.outcome, v_result.lease_token, v_result.lease_expires_at, v_result.attempts,
         v_result.created_at;
    RETURN v_result;
END;
$$;

COMMENT ON FUNCTION idempotency.claim(text, text, jsonb, interval, bytea, boolean, timestamptz) IS
'Claim an idempotency key: outcome claimed | resumed | replay | accepted | in_progress |
mismatch | expired (with strict => true a mismatch raises IK002). Pass request (hashed by
idempotency.fingerprint) or your own 32-byte fingerprint. reference_time is a test clock that
only the schema owner may pass; leave it NULL. See docs/sql-api.md.';
