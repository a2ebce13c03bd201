-- Engine v3 PROTOTYPE (bench/prototype_v3.py): not the engine, not installed by anything else.
-- Same tables' shape as idempotency.* in a schema of its own, and a claim and a complete
-- designed for the least server time: one PL/pgSQL level each, no nested function call on the
-- success path, checks inlined, the token computed inline, and complete addressing the key's
-- partition by the created_at that claim returned (no directory read).
CREATE SCHEMA proto;

-- Arbiter of uniqueness, as in the engine: (scope, sha256 of key) -> created_at.
CREATE TABLE proto.key_directory (
    scope text NOT NULL,
    key_hash bytea NOT NULL,
    created_at timestamptz NOT NULL,
    PRIMARY KEY (scope, key_hash)
);

CREATE TABLE proto.keys (
    LIKE idempotency.keys INCLUDING DEFAULTS,
    PRIMARY KEY (scope, key, created_at)
) PARTITION BY RANGE (created_at);

CREATE TYPE proto.claim_result AS (
    outcome text,
    lease_token bigint,
    created_at timestamptz,
    response_status integer,
    response_headers jsonb,
    response_body_bytes bytea,
    response_content_type text,
    retry_after interval
);

-- claim_parent: fresh key = one directory insert + one key-row insert (through the parent;
-- bench/prototype_v3.py generates proto.claim, the same with one static INSERT per partition);
-- replay = the directory probe
-- (the conflicting insert) + one read of the key row in its partition.
CREATE FUNCTION proto.claim_parent(
    p_scope text,
    p_key text,
    p_fingerprint bytea,
    p_lease interval DEFAULT '30 seconds'
)
RETURNS proto.claim_result
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now timestamptz := clock_timestamp();
    v_hash bytea := sha256(convert_to(p_key, 'UTF8'));
    v_created timestamptz;
    v_row proto.keys;
    v_result proto.claim_result;
BEGIN
    IF NOT coalesce(length(p_scope) BETWEEN 1 AND 255 AND length(p_key) BETWEEN 1 AND 255
                    AND octet_length(p_fingerprint) = 32 AND p_lease > interval '0', false)
    THEN
        RAISE EXCEPTION 'proto.claim: invalid argument' USING ERRCODE = '22023';
    END IF;
    INSERT INTO proto.key_directory AS d (scope, key_hash, created_at)
    VALUES (p_scope, v_hash, v_now)
    ON CONFLICT ON CONSTRAINT key_directory_pkey DO NOTHING;
    IF FOUND THEN
        -- token: seconds since 2024 in the high 32 bits, 32 random bits from gen_random_uuid
        INSERT INTO proto.keys AS k (scope, key, fingerprint, state, lease_token,
                                     lease_expires_at, created_at)
        VALUES (p_scope, p_key, p_fingerprint, 'in_progress',
                (floor(extract(EPOCH FROM v_now) - 1704067200)::int8 << 32)
                | ('x' || left(gen_random_uuid()::text, 8))::bit(32)::int8,
                v_now + p_lease, v_now)
        RETURNING 'claimed', k.lease_token, k.created_at INTO v_result.outcome,
                  v_result.lease_token, v_result.created_at;
        RETURN v_result;
    END IF;
    SELECT d.created_at INTO v_created FROM proto.key_directory AS d
    WHERE d.scope = p_scope AND d.key_hash = v_hash;
    SELECT * INTO v_row FROM proto.keys AS k
    WHERE k.scope = p_scope AND k.key = p_key AND k.created_at = v_created;
    v_result.created_at := v_created;
    IF v_row.fingerprint <> p_fingerprint THEN
        v_result.outcome := 'mismatch';
    ELSIF v_row.state = 'completed' THEN
        v_result.outcome := 'replay';
        v_result.response_status := v_row.response_status;
        v_result.response_headers := v_row.response_headers;
        v_result.response_body_bytes := v_row.response_body_bytes;
        v_result.response_content_type := v_row.response_content_type;
    ELSIF v_row.lease_expires_at > v_now THEN
        v_result.outcome := 'in_progress';
        v_result.retry_after := v_row.lease_expires_at - v_now;
    ELSE
        -- takeover of an expired lease, fenced on the old token; the new one is greater
        UPDATE proto.keys AS k
        SET lease_token = greatest((v_row.lease_token >> 32) + 1,
                                   floor(extract(EPOCH FROM v_now) - 1704067200)::int8) << 32
                          | ('x' || left(gen_random_uuid()::text, 8))::bit(32)::int8,
            lease_expires_at = v_now + p_lease, attempts = k.attempts + 1
        WHERE k.scope = p_scope AND k.key = p_key AND k.created_at = v_created
          AND k.lease_token = v_row.lease_token AND k.state = 'in_progress'
        RETURNING 'resumed', k.lease_token INTO v_result.outcome, v_result.lease_token;
        IF NOT FOUND THEN
            v_result.outcome := 'in_progress';
            v_result.retry_after := p_lease;
        END IF;
    END IF;
    RETURN v_result;
END;
$$;

COMMENT ON FUNCTION proto.claim_parent(text, text, bytea, interval) IS
'PROTOTYPE (bench/prototype_v3.py): claim with one PL/pgSQL level; not the engine.';

-- complete_parent: one fenced UPDATE through the parent table, given the created_at claim
-- returned. bench/prototype_v3.py also generates proto.complete, the same with one static
-- UPDATE per partition (an IF on created_at picks it), as the engine's routes do.
CREATE FUNCTION proto.complete_parent(
    p_scope text,
    p_key text,
    p_token bigint,
    p_created_at timestamptz,
    p_status integer,
    p_body bytea,
    p_content_type text,
    p_headers jsonb DEFAULT '{}'
)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF NOT coalesce(p_status BETWEEN 100 AND 599 AND length(p_content_type) <= 255, false) THEN
        RAISE EXCEPTION 'proto.complete_parent: invalid argument' USING ERRCODE = '22023';
    END IF;
    UPDATE proto.keys AS k
    SET state = 'completed', response_status = p_status, response_headers = p_headers,
        response_body_bytes = p_body, response_content_type = p_content_type,
        completed_at = clock_timestamp(), lease_expires_at = NULL
    WHERE k.scope = p_scope AND k.key = p_key AND k.created_at = p_created_at
      AND k.lease_token = p_token AND k.state = 'in_progress';
    IF NOT FOUND THEN
        RAISE EXCEPTION 'proto.complete_parent: lease lost or key gone' USING ERRCODE = '55000';
    END IF;
END;
$$;

COMMENT ON FUNCTION proto.complete_parent(
    text, text, bigint, timestamptz, integer, bytea, text, jsonb
) IS 'PROTOTYPE (bench/prototype_v3.py): fenced complete with one PL/pgSQL level; not the engine.';

-- Design S (bench/prototype_v3.py, workloads s*): the arbiter is the key row itself. proto_s.keys
-- is UNPARTITIONED with PRIMARY KEY (scope, key) and holds all an in-progress key needs, so a
-- fresh claim is ONE insert. The response lives in proto_s.responses, partitioned by the time
-- complete wrote it (retention by partition drop); the key row says where (response_created_at).
-- Key rows are deleted by maintenance in batches (as key_directory rows are today).
CREATE SCHEMA proto_s;

CREATE TABLE proto_s.keys (
    scope text NOT NULL,
    key text NOT NULL,
    fingerprint bytea NOT NULL,
    state text NOT NULL,
    lease_token bigint NOT NULL,
    lease_expires_at timestamptz,
    recovery_point text,
    attempts integer NOT NULL DEFAULT 1,
    created_at timestamptz NOT NULL,
    completed_at timestamptz,
    -- partition key of the response row (NULL until complete)
    response_created_at timestamptz,
    -- variant s_ctid only: the response row's ctid in proto_s.responses_t
    response_ctid tid,
    PRIMARY KEY (scope, key)
);

-- Variant s_hash: the same with the arbiter on (scope, sha256 of key), the key kept unindexed.
CREATE TABLE proto_s.keys_h (
    scope text NOT NULL,
    key_hash bytea NOT NULL,
    key text NOT NULL,
    fingerprint bytea NOT NULL,
    state text NOT NULL,
    lease_token bigint NOT NULL,
    lease_expires_at timestamptz,
    recovery_point text,
    attempts integer NOT NULL DEFAULT 1,
    created_at timestamptz NOT NULL,
    completed_at timestamptz,
    response_created_at timestamptz,
    PRIMARY KEY (scope, key_hash)
);

-- Partitions: the bounds of idempotency.keys, made by bench/prototype_v3.py.
CREATE TABLE proto_s.responses (
    scope text NOT NULL,
    key text NOT NULL,
    created_at timestamptz NOT NULL,
    status integer NOT NULL,
    headers jsonb NOT NULL,
    body_bytes bytea,
    content_type text,
    PRIMARY KEY (scope, key, created_at)
) PARTITION BY RANGE (created_at);

-- Variant s_ctid: responses without any index, found by the ctid the key row keeps (the
-- table is insert-only; VACUUM FULL or pg_repack would move rows). Partitions: as responses.
CREATE TABLE proto_s.responses_t (
    scope text NOT NULL,
    key text NOT NULL,
    created_at timestamptz NOT NULL,
    status integer NOT NULL,
    headers jsonb NOT NULL,
    body_bytes bytea,
    content_type text
) PARTITION BY RANGE (created_at);

-- Variant s_inline (a reference floor, not a proposal: no retention by partition drop): the
-- response in the key row itself.
CREATE TABLE proto_s.keys_inline (
    scope text NOT NULL,
    key text NOT NULL,
    fingerprint bytea NOT NULL,
    state text NOT NULL,
    lease_token bigint NOT NULL,
    lease_expires_at timestamptz,
    recovery_point text,
    attempts integer NOT NULL DEFAULT 1,
    created_at timestamptz NOT NULL,
    completed_at timestamptz,
    response_status integer,
    response_headers jsonb,
    response_body_bytes bytea,
    response_content_type text,
    PRIMARY KEY (scope, key)
);

-- claim: a fresh key is the one INSERT ... ON CONFLICT DO NOTHING RETURNING; a known key is the
-- conflict, one read of its row and, when completed, one read of its response row by
-- (scope, key, response_created_at) (through the parent here; bench/prototype_v3.py generates
-- claim_routed with one static SELECT per partition).
CREATE FUNCTION proto_s.claim(
    p_scope text,
    p_key text,
    p_fingerprint bytea,
    p_lease interval DEFAULT '30 seconds'
)
RETURNS proto.claim_result
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now timestamptz := clock_timestamp();
    v_fingerprint bytea;
    v_state text;
    v_token bigint;
    v_expires timestamptz;
    v_response_at timestamptz;
    v_result proto.claim_result;
BEGIN
    IF NOT coalesce(length(p_scope) BETWEEN 1 AND 255 AND length(p_key) BETWEEN 1 AND 255
                    AND octet_length(p_fingerprint) = 32 AND p_lease > interval '0', false)
    THEN
        RAISE EXCEPTION 'proto_s.claim: invalid argument' USING ERRCODE = '22023';
    END IF;
    -- token: seconds since 2024 in the high 32 bits, 32 random bits from gen_random_uuid
    INSERT INTO proto_s.keys AS k (scope, key, fingerprint, state, lease_token,
                                   lease_expires_at, created_at)
    VALUES (p_scope, p_key, p_fingerprint, 'in_progress',
            (floor(extract(EPOCH FROM v_now) - 1704067200)::int8 << 32)
            | ('x' || left(gen_random_uuid()::text, 8))::bit(32)::int8,
            v_now + p_lease, v_now)
    ON CONFLICT (scope, key) DO NOTHING
    RETURNING 'claimed', k.lease_token, k.created_at INTO v_result.outcome,
              v_result.lease_token, v_result.created_at;
    IF FOUND THEN
        RETURN v_result;
    END IF;
    SELECT k.fingerprint, k.state, k.lease_token, k.lease_expires_at, k.created_at,
           k.response_created_at
    INTO v_fingerprint, v_state, v_token, v_expires, v_result.created_at, v_response_at
    FROM proto_s.keys AS k WHERE k.scope = p_scope AND k.key = p_key;
    IF NOT FOUND THEN
        -- deleted by maintenance between the two statements: the engine would loop
        RAISE EXCEPTION 'proto_s.claim: key vanished, retry' USING ERRCODE = '40001';
    END IF;
    IF v_fingerprint <> p_fingerprint THEN
        v_result.outcome := 'mismatch';
    ELSIF v_state = 'completed' THEN
        SELECT 'replay', r.status, r.headers, r.body_bytes, r.content_type
        INTO v_result.outcome, v_result.response_status, v_result.response_headers,
             v_result.response_body_bytes, v_result.response_content_type
        FROM proto_s.responses AS r
        WHERE r.scope = p_scope AND r.key = p_key AND r.created_at = v_response_at;
    ELSIF v_expires > v_now THEN
        v_result.outcome := 'in_progress';
        v_result.retry_after := v_expires - v_now;
    ELSE
        -- takeover of an expired lease, fenced on the old token; the new one is greater
        UPDATE proto_s.keys AS k
        SET lease_token = greatest((v_token >> 32) + 1,
                                   floor(extract(EPOCH FROM v_now) - 1704067200)::int8) << 32
                          | ('x' || left(gen_random_uuid()::text, 8))::bit(32)::int8,
            lease_expires_at = v_now + p_lease, attempts = k.attempts + 1
        WHERE k.scope = p_scope AND k.key = p_key
          AND k.lease_token = v_token AND k.state = 'in_progress'
        RETURNING 'resumed', k.lease_token INTO v_result.outcome, v_result.lease_token;
        IF NOT FOUND THEN
            v_result.outcome := 'in_progress';
            v_result.retry_after := p_lease;
        END IF;
    END IF;
    RETURN v_result;
END;
$$;

COMMENT ON FUNCTION proto_s.claim(text, text, bytea, interval) IS
'PROTOTYPE (bench/prototype_v3.py): design S claim, one insert into the arbiter key row.';

-- complete: a fenced HOT update of the key row (no indexed column changes) and one insert of
-- the response row (through the parent here; bench/prototype_v3.py generates complete_routed
-- with one static INSERT per partition). Same arguments as idempotency.complete_bytes.
CREATE FUNCTION proto_s.complete(
    p_scope text,
    p_key text,
    p_token bigint,
    p_status integer,
    p_body bytea,
    p_content_type text,
    p_headers jsonb DEFAULT '{}'
)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now timestamptz := clock_timestamp();
BEGIN
    IF NOT coalesce(p_status BETWEEN 100 AND 599 AND length(p_content_type) <= 255, false) THEN
        RAISE EXCEPTION 'proto_s.complete: invalid argument' USING ERRCODE = '22023';
    END IF;
    UPDATE proto_s.keys AS k
    SET state = 'completed', completed_at = v_now, response_created_at = v_now,
        lease_expires_at = NULL
    WHERE k.scope = p_scope AND k.key = p_key
      AND k.lease_token = p_token AND k.state = 'in_progress';
    IF NOT FOUND THEN
        RAISE EXCEPTION 'proto_s.complete: lease lost or key gone' USING ERRCODE = '55000';
    END IF;
    INSERT INTO proto_s.responses AS r (scope, key, created_at, status, headers, body_bytes,
                                        content_type)
    VALUES (p_scope, p_key, v_now, p_status, p_headers, p_body, p_content_type);
END;
$$;

COMMENT ON FUNCTION proto_s.complete(text, text, bigint, integer, bytea, text, jsonb) IS
'PROTOTYPE (bench/prototype_v3.py): design S complete, fenced HOT update + response insert.';

-- s_inline: claim and complete on keys_inline, the response written by the fenced update.
CREATE FUNCTION proto_s.claim_inline(
    p_scope text,
    p_key text,
    p_fingerprint bytea,
    p_lease interval DEFAULT '30 seconds'
)
RETURNS proto.claim_result
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now timestamptz := clock_timestamp();
    v_row proto_s.keys_inline;
    v_result proto.claim_result;
BEGIN
    IF NOT coalesce(length(p_scope) BETWEEN 1 AND 255 AND length(p_key) BETWEEN 1 AND 255
                    AND octet_length(p_fingerprint) = 32 AND p_lease > interval '0', false)
    THEN
        RAISE EXCEPTION 'proto_s.claim_inline: invalid argument' USING ERRCODE = '22023';
    END IF;
    INSERT INTO proto_s.keys_inline AS k (scope, key, fingerprint, state, lease_token,
                                          lease_expires_at, created_at)
    VALUES (p_scope, p_key, p_fingerprint, 'in_progress',
            (floor(extract(EPOCH FROM v_now) - 1704067200)::int8 << 32)
            | ('x' || left(gen_random_uuid()::text, 8))::bit(32)::int8,
            v_now + p_lease, v_now)
    ON CONFLICT (scope, key) DO NOTHING
    RETURNING 'claimed', k.lease_token, k.created_at INTO v_result.outcome,
              v_result.lease_token, v_result.created_at;
    IF FOUND THEN
        RETURN v_result;
    END IF;
    SELECT * INTO v_row FROM proto_s.keys_inline AS k
    WHERE k.scope = p_scope AND k.key = p_key;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'proto_s.claim_inline: key vanished, retry' USING ERRCODE = '40001';
    END IF;
    v_result.created_at := v_row.created_at;
    IF v_row.fingerprint <> p_fingerprint THEN
        v_result.outcome := 'mismatch';
    ELSIF v_row.state = 'completed' THEN
        v_result.outcome := 'replay';
        v_result.response_status := v_row.response_status;
        v_result.response_headers := v_row.response_headers;
        v_result.response_body_bytes := v_row.response_body_bytes;
        v_result.response_content_type := v_row.response_content_type;
    ELSIF v_row.lease_expires_at > v_now THEN
        v_result.outcome := 'in_progress';
        v_result.retry_after := v_row.lease_expires_at - v_now;
    ELSE
        UPDATE proto_s.keys_inline AS k
        SET lease_token = greatest((v_row.lease_token >> 32) + 1,
                                   floor(extract(EPOCH FROM v_now) - 1704067200)::int8) << 32
                          | ('x' || left(gen_random_uuid()::text, 8))::bit(32)::int8,
            lease_expires_at = v_now + p_lease, attempts = k.attempts + 1
        WHERE k.scope = p_scope AND k.key = p_key
          AND k.lease_token = v_row.lease_token AND k.state = 'in_progress'
        RETURNING 'resumed', k.lease_token INTO v_result.outcome, v_result.lease_token;
        IF NOT FOUND THEN
            v_result.outcome := 'in_progress';
            v_result.retry_after := p_lease;
        END IF;
    END IF;
    RETURN v_result;
END;
$$;

COMMENT ON FUNCTION proto_s.claim_inline(text, text, bytea, interval) IS
'PROTOTYPE (bench/prototype_v3.py): reference floor, response inline in the key row.';

CREATE FUNCTION proto_s.complete_inline(
    p_scope text,
    p_key text,
    p_token bigint,
    p_status integer,
    p_body bytea,
    p_content_type text,
    p_headers jsonb DEFAULT '{}'
)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF NOT coalesce(p_status BETWEEN 100 AND 599 AND length(p_content_type) <= 255, false) THEN
        RAISE EXCEPTION 'proto_s.complete_inline: invalid argument' USING ERRCODE = '22023';
    END IF;
    UPDATE proto_s.keys_inline AS k
    SET state = 'completed', response_status = p_status, response_headers = p_headers,
        response_body_bytes = p_body, response_content_type = p_content_type,
        completed_at = clock_timestamp(), lease_expires_at = NULL
    WHERE k.scope = p_scope AND k.key = p_key
      AND k.lease_token = p_token AND k.state = 'in_progress';
    IF NOT FOUND THEN
        RAISE EXCEPTION 'proto_s.complete_inline: lease lost or key gone' USING ERRCODE = '55000';
    END IF;
END;
$$;

COMMENT ON FUNCTION proto_s.complete_inline(text, text, bigint, integer, bytea, text, jsonb) IS
'PROTOTYPE (bench/prototype_v3.py): reference floor, response written by the fenced update.';

-- Variant s_sql: the success paths as LANGUAGE sql functions (one statement each, no PL/pgSQL),
-- the PL/pgSQL functions above as the slow path. claim_fast returns a row only when it claimed
-- the key; no row (the key exists, or an argument is invalid) sends the caller to
-- proto_s.claim, which answers replay / in_progress / mismatch or raises the argument's error.
-- complete_fast returns false when fenced out (or invalid); the caller then calls
-- proto_s.complete for the error. A sketch of a cheaper procedural layer, measured only.
CREATE FUNCTION proto_s.claim_fast(
    p_scope text,
    p_key text,
    p_fingerprint bytea,
    p_lease interval DEFAULT '30 seconds'
)
RETURNS TABLE (lease_token bigint, created_at timestamptz)
LANGUAGE sql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    INSERT INTO proto_s.keys AS k (scope, key, fingerprint, state, lease_token,
                                   lease_expires_at, created_at)
    SELECT p_scope, p_key, p_fingerprint, 'in_progress',
           (floor(extract(EPOCH FROM c.t) - 1704067200)::int8 << 32)
           | ('x' || left(gen_random_uuid()::text, 8))::bit(32)::int8,
           c.t + p_lease, c.t
    FROM (SELECT clock_timestamp() AS t) AS c
    WHERE coalesce(length(p_scope) BETWEEN 1 AND 255 AND length(p_key) BETWEEN 1 AND 255
                   AND octet_length(p_fingerprint) = 32 AND p_lease > interval '0', false)
    ON CONFLICT (scope, key) DO NOTHING
    RETURNING k.lease_token, k.created_at
$$;

COMMENT ON FUNCTION proto_s.claim_fast(text, text, bytea, interval) IS
'PROTOTYPE (bench/prototype_v3.py): design S claim of a new key as one SQL statement.';

CREATE FUNCTION proto_s.complete_fast(
    p_scope text,
    p_key text,
    p_token bigint,
    p_status integer,
    p_body bytea,
    p_content_type text,
    p_headers jsonb DEFAULT '{}'
)
RETURNS boolean
LANGUAGE sql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    WITH done AS (
        UPDATE proto_s.keys AS k
        SET state = 'completed', completed_at = c.t, response_created_at = c.t,
            lease_expires_at = NULL
        FROM (SELECT clock_timestamp() AS t) AS c
        WHERE k.scope = p_scope AND k.key = p_key
          AND k.lease_token = p_token AND k.state = 'in_progress'
          AND coalesce(p_status BETWEEN 100 AND 599 AND length(p_content_type) <= 255, false)
        RETURNING k.response_created_at
    ), ins AS (
        INSERT INTO proto_s.responses (scope, key, created_at, status, headers, body_bytes,
                                       content_type)
        SELECT p_scope, p_key, done.response_created_at, p_status, p_headers, p_body,
               p_content_type
        FROM done
        RETURNING 1
    )
    SELECT EXISTS (SELECT FROM ins)
$$;

COMMENT ON FUNCTION proto_s.complete_fast(text, text, bigint, integer, bytea, text, jsonb) IS
'PROTOTYPE (bench/prototype_v3.py): design S complete as one SQL statement; false if fenced out.';
