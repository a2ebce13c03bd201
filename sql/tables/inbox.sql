-- Message ids already processed per consumer (the inbox pattern), partitioned like
-- idempotency.keys and made unique across partitions the same way: idempotency.inbox_accept()
-- locks (consumer, message_id), looks it up in every partition, then inserts.
CREATE TABLE idempotency.inbox (
    consumer text NOT NULL,
    message_id text NOT NULL,
    received_at timestamptz NOT NULL,
    PRIMARY KEY (consumer, message_id, received_at)
) PARTITION BY RANGE (received_at);

COMMENT ON TABLE idempotency.inbox IS
'Processed message ids per consumer, partitioned by received_at. Written only through
idempotency.inbox_accept().';

REVOKE ALL ON idempotency.inbox FROM public;

CREATE TABLE idempotency.inbox_default PARTITION OF idempotency.inbox DEFAULT;

REVOKE ALL ON idempotency.inbox_default FROM public;
