-- The inbox pattern for message consumers: call it in the transaction that applies the
-- message's effects. True the first time: the row commits with those effects. False for a
-- redelivery. A concurrent delivery of the same message waits until the first transaction
-- ends, then gets false (committed) or true (rolled back).
CREATE FUNCTION idempotency.inbox_accept(
    consumer text,
    message_id text,
    reference_time timestamptz DEFAULT NULL
)
RETURNS boolean
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER  -- for application roles without table privileges; see claim()
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now timestamptz;
    v_hash bytea;
    v_created_at timestamptz;
BEGIN
    PERFORM idempotency._check_name('idempotency.inbox_accept', 'consumer',
                                    inbox_accept.consumer);
    PERFORM idempotency._check_name('idempotency.inbox_accept', 'message_id',
                                    inbox_accept.message_id);
    PERFORM idempotency._require_read_committed('idempotency.inbox_accept');
    v_now := CASE WHEN inbox_accept.reference_time IS NULL THEN clock_timestamp()
        ELSE idempotency._test_clock('idempotency.inbox_accept', inbox_accept.reference_time) END;

    -- The arbiter is the key directory's primary key, as for claim(): a message's row there is
    -- (consumer, sha256 of U+001F and the message id). _check_name refuses control characters
    -- in a key, so no key's hash can be the same. A concurrent delivery of the same message
    -- waits for this transaction and then finds the row: false; if it rolled back: true.
    -- Whichever node runs this, the consumer's shard decides (Citus: co-located with keys).
    v_hash := sha256(convert_to(chr(31) || inbox_accept.message_id, 'UTF8'));
    INSERT INTO idempotency.key_directory AS d (scope, key_hash, created_at)
    VALUES (inbox_accept.consumer, v_hash, v_now)
    ON CONFLICT ON CONSTRAINT key_directory_pkey DO NOTHING;
    IF NOT FOUND THEN
        -- Accepted before, unless its inbox partition has gone since (pg_partman dropped it):
        -- then the message is new again, as after its retention.
        SELECT d.created_at INTO v_created_at
        FROM idempotency.key_directory AS d
        WHERE d.scope = inbox_accept.consumer AND d.key_hash = v_hash;
        PERFORM
        FROM idempotency.inbox AS i
        WHERE i.consumer = inbox_accept.consumer AND i.message_id = inbox_accept.message_id
          AND i.received_at = v_created_at;
        IF FOUND THEN
            RETURN false;
        END IF;
        UPDATE idempotency.key_directory AS d
        SET created_at = v_now
        WHERE d.scope = inbox_accept.consumer AND d.key_hash = v_hash
          AND d.created_at = v_created_at;
        IF NOT FOUND THEN
            -- Changed meanwhile by a concurrent delivery, which committed first.
            RETURN false;
        END IF;
    END IF;
    INSERT INTO idempotency.inbox (consumer, message_id, received_at)
    VALUES (inbox_accept.consumer, inbox_accept.message_id, v_now);
    RETURN true;
END;
$$;

COMMENT ON FUNCTION idempotency.inbox_accept(text, text, timestamptz) IS
'Record message_id as processed by consumer, in the caller''s transaction: true the first time,
false for a redelivery.';
