-- The inbox pattern for message consumers: call it in the transaction that applies the
-- message's effects. True the first time: the row commits with those effects. False for a
-- redelivery. A concurrent delivery of the same message waits on the key lock until the first
-- transaction ends, then gets false (committed) or true (rolled back).
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
BEGIN
    PERFORM idempotency._check_name('idempotency.inbox_accept', 'consumer',
                                    inbox_accept.consumer);
    PERFORM idempotency._check_name('idempotency.inbox_accept', 'message_id',
                                    inbox_accept.message_id);
    PERFORM idempotency._require_read_committed('idempotency.inbox_accept');

    PERFORM idempotency._lock_name(2, inbox_accept.consumer, inbox_accept.message_id);
    PERFORM
    FROM idempotency.inbox AS i
    WHERE i.consumer = inbox_accept.consumer AND i.message_id = inbox_accept.message_id;
    IF FOUND THEN
        RETURN false;
    END IF;
    INSERT INTO idempotency.inbox (consumer, message_id, received_at)
    VALUES (inbox_accept.consumer, inbox_accept.message_id,
            CASE WHEN inbox_accept.reference_time IS NULL THEN clock_timestamp()
                ELSE idempotency._test_clock('idempotency.inbox_accept',
                                             inbox_accept.reference_time) END);
    RETURN true;
END;
$$;

COMMENT ON FUNCTION idempotency.inbox_accept(text, text, timestamptz) IS
'Record message_id as processed by consumer, in the caller''s transaction: true the first time,
false for a redelivery.';
