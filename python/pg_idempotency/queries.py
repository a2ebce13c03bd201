"""Every SQL statement the package sends, in one place.

Calls use named notation with explicit casts, so they keep working if the engine adds
defaulted arguments, and a reader sees which argument each value is; CLAIM_SHORT,
COMPLETE_SHORT and COMPLETE_BYTES_SHORT, what the package's own sends run, are the positional
calls (they say why). Parameters are psycopg
named placeholders; the values are always bound, never formatted into the text.

Times and intervals are settings-proof both ways: psycopg sends datetime and timedelta values
in binary (with client-side binding, as ISO 8601 text and in the form the session's
IntervalStyle reads), and every timestamptz or interval result comes back as epoch seconds
(:func:`_seconds`), or in binary (CLAIM_BINARY, TAKEOVER_BINARY: read raw by
``_wire.claim_result_of``), so any DateStyle, IntervalStyle and TimeZone work.
"""

from __future__ import annotations

from typing import Final


def _seconds(column: str) -> str:
    """A timestamptz column as its seconds since 1970-01-01 UTC, an interval as its length in
    seconds, as numeric text: ``_results.load_time`` and ``_results.load_interval`` parse it.

    psycopg's loaders parse timestamptz only in DateStyle ISO and interval only in
    IntervalStyle postgres, and a role or a database may set any style. The epoch is the same
    under every DateStyle, IntervalStyle and TimeZone, and exact to the microsecond (numeric
    from PostgreSQL 14 on). Text, so that a loader an application registered for numeric (a
    float one) cannot round it."""
    return f"extract(epoch FROM {column})::text AS {column}"


# -- the lifecycle (docs/sql-api.md) --------------------------------------------------------

# The claim_result columns, jsonb ones as text: the package parses them itself, so a loader
# an application or framework registered for jsonb (Django registers a text loader) changes
# nothing. The same for the times (_seconds).
_CLAIM_COLUMNS = f"""outcome, lease_token, {_seconds("lease_expires_at")}, recovery_point,
       attempts, response_status, response_headers::text AS response_headers,
       response_body::text AS response_body, response_body_bytes, response_content_type,
       {_seconds("retry_after")}, {_seconds("created_at")}, {_seconds("completed_at")}"""

CLAIM: Final = f"""
SELECT {_CLAIM_COLUMNS} FROM idempotency.claim(
    scope => %(scope)s::text, key => %(key)s::text, request => %(request)s::jsonb,
    lease => %(lease)s::interval, fingerprint => %(fingerprint)s::bytea,
    strict => %(strict)s::boolean, reference_time => %(reference_time)s::timestamptz)
"""

TAKEOVER: Final = f"""
SELECT {_CLAIM_COLUMNS} FROM idempotency.takeover(
    scope => %(scope)s::text, key => %(key)s::text, lease => %(lease)s::interval,
    reference_time => %(reference_time)s::timestamptz)
"""

# The same calls as the package's own drivers send them (_exec.execute): claim_result's
# columns as they are, in binary, which _wire.claim_result_of reads from the raw result, no
# loader involved. Binary timestamptz and interval are numbers whatever the DateStyle,
# IntervalStyle and TimeZone, and no loader an application registered (for text, jsonb, the
# times) sees them; the server neither converts 13 columns to text nor parses and plans the
# conversions (issue 32; docs/design.md, "Performance decisions"). Named columns, not *: a
# statement prepared by the opt-in (allow_prepared_statements) keeps its result when a
# migration widens claim_result. CLAIM and TAKEOVER above stay for drivers that read rows
# through loaders (the SQLAlchemy session's).
_BINARY_COLUMNS = """outcome, lease_token, lease_expires_at, recovery_point, attempts,
       response_status, response_headers, response_body, response_body_bytes,
       response_content_type, retry_after, created_at, completed_at"""

CLAIM_BINARY: Final = f"""
SELECT {_BINARY_COLUMNS} FROM idempotency.claim(
    scope => %(scope)s::text, key => %(key)s::text, request => %(request)s::jsonb,
    lease => %(lease)s::interval, fingerprint => %(fingerprint)s::bytea,
    strict => %(strict)s::boolean, reference_time => %(reference_time)s::timestamptz)
"""

# What the package's own sends run for CLAIM_BINARY (_wire.send_claim: unprepared, its parameters
# with the types _wire.bind gives them): the same call positionally, without casts, in the
# select list, so that claim_result comes back as one composite value (in binary: its columns
# in their order, each with its type's OID, which _wire.claim_result_of reads by position; a
# column a later migration appends comes after them). Parse, analysis and planning of this
# text cost the server less than CLAIM_BINARY's (named notation, casts, 13 named columns), and
# the select-list call less than the same call in FROM, whose function scan keeps its row in a
# tuplestore (bench/profile_sql.py --callgrind-texts measures both; docs/design.md,
# "Performance decisions"). Citus delegates it to the
# scope's worker as it does the FROM form. It relies on what CLAIM_BINARY's named notation and
# casts do not: claim keeps its first seven arguments in this order (the engine only appends
# defaulted ones) and has no overload. A prepared statement (the opt-in) and the cursor's
# fallback run CLAIM_BINARY.
CLAIM_SHORT: Final = """
SELECT idempotency.claim(
    %(scope)s, %(key)s, %(request)s, %(lease)s, %(fingerprint)s, %(strict)s, %(reference_time)s)
"""

TAKEOVER_BINARY: Final = f"""
SELECT {_BINARY_COLUMNS} FROM idempotency.takeover(
    scope => %(scope)s::text, key => %(key)s::text, lease => %(lease)s::interval,
    reference_time => %(reference_time)s::timestamptz)
"""

# The functions that return a timestamptz: as its epoch, like _seconds. The call stands in FROM,
# not inside extract(): Citus delegates "SELECT ... FROM f(...)" (and "SELECT f(...)") to the
# node that holds the scope's shard, but not a call nested in an expression.
CHECKPOINT: Final = """
SELECT extract(epoch FROM r)::text AS lease_expires_at
FROM idempotency.checkpoint(
    scope => %(scope)s::text, key => %(key)s::text, lease_token => %(lease_token)s::bigint,
    recovery_point => %(recovery_point)s::text, extend => %(extend)s::interval,
    reference_time => %(reference_time)s::timestamptz) AS r
"""

HEARTBEAT: Final = """
SELECT extract(epoch FROM r)::text AS lease_expires_at
FROM idempotency.heartbeat(
    scope => %(scope)s::text, key => %(key)s::text, lease_token => %(lease_token)s::bigint,
    lease => %(lease)s::interval,
    reference_time => %(reference_time)s::timestamptz) AS r
"""

COMPLETE: Final = """
SELECT extract(epoch FROM r)::text AS completed_at
FROM idempotency.complete(
    scope => %(scope)s::text, key => %(key)s::text, lease_token => %(lease_token)s::bigint,
    status => %(status)s::integer, body => %(body)s::jsonb, headers => %(headers)s::jsonb,
    reference_time => %(reference_time)s::timestamptz) AS r
"""

COMPLETE_BYTES: Final = """
SELECT extract(epoch FROM r)::text AS completed_at
FROM idempotency.complete_bytes(
    scope => %(scope)s::text, key => %(key)s::text, lease_token => %(lease_token)s::bigint,
    status => %(status)s::integer, body => %(body)s::bytea,
    content_type => %(content_type)s::text, headers => %(headers)s::jsonb,
    reference_time => %(reference_time)s::timestamptz) AS r
"""

# What the package's own sends run for COMPLETE and COMPLETE_BYTES + COMMIT (_wire.send_commit, a
# simple Query with literals) when the session prints dates in DateStyle ISO, as libpq last
# heard from the server: the call positionally, with untyped literals, in the select list, its
# timestamptz as the server prints it, which _wire.iso_time reads in every TimeZone. Less for
# the server to parse and plan than COMPLETE_BYTES' named, cast, epoch converting text
# (bench/profile_sql.py --callgrind-texts). Under another DateStyle the package sends
# COMPLETE_BYTES, whose epoch is the same in any. The same conditions as CLAIM_SHORT:
# arguments only appended, no overload.
COMPLETE_SHORT: Final = """
SELECT idempotency.complete(
    %(scope)s, %(key)s, %(lease_token)s, %(status)s, %(body)s, %(headers)s, %(reference_time)s
) AS completed_at"""

COMPLETE_BYTES_SHORT: Final = """
SELECT idempotency.complete_bytes(
    %(scope)s, %(key)s, %(lease_token)s, %(status)s, %(body)s, %(content_type)s, %(headers)s,
    %(reference_time)s) AS completed_at"""

ACCEPT: Final = """
SELECT extract(epoch FROM r)::text AS lease_expires_at,
    -- the body as jsonb stores it (key order, numbers): what a replay of it will send
    %(body)s::jsonb::text AS body
FROM idempotency.accept(
    scope => %(scope)s::text, key => %(key)s::text, lease_token => %(lease_token)s::bigint,
    status => %(status)s::integer, body => %(body)s::jsonb, headers => %(headers)s::jsonb,
    lease => %(lease)s::interval,
    reference_time => %(reference_time)s::timestamptz) AS r
"""

RELEASE: Final = """
SELECT idempotency.release(
    scope => %(scope)s::text, key => %(key)s::text, lease_token => %(lease_token)s::bigint)
"""

# The same three calls answering a lost lease as a value (outcome lease_lost or completed)
# instead of IK001 / IK004: on Citus an error costs the session a new worker connection
# (docs/scale-out.md). _calls.py raises the same LeaseLost from the outcome.
HEARTBEAT_OUTCOME: Final = """
SELECT outcome, extract(epoch FROM lease_expires_at)::text AS lease_expires_at
FROM idempotency.heartbeat_outcome(
    scope => %(scope)s::text, key => %(key)s::text, lease_token => %(lease_token)s::bigint,
    lease => %(lease)s::interval,
    reference_time => %(reference_time)s::timestamptz)
"""

CHECKPOINT_OUTCOME: Final = """
SELECT outcome, extract(epoch FROM lease_expires_at)::text AS lease_expires_at
FROM idempotency.checkpoint_outcome(
    scope => %(scope)s::text, key => %(key)s::text, lease_token => %(lease_token)s::bigint,
    recovery_point => %(recovery_point)s::text, extend => %(extend)s::interval,
    reference_time => %(reference_time)s::timestamptz)
"""

RELEASE_OUTCOME: Final = """
SELECT outcome FROM idempotency.release_outcome(
    scope => %(scope)s::text, key => %(key)s::text, lease_token => %(lease_token)s::bigint)
"""

LIST_ABANDONED: Final = f"""
SELECT scope, key, {_seconds("lease_expires_at")}, recovery_point, attempts,
       {_seconds("created_at")}
FROM idempotency.list_abandoned(
    max_keys => %(max_keys)s::integer, scope => %(scope)s::text,
    reference_time => %(reference_time)s::timestamptz)
"""

INBOX_ACCEPT: Final = """
SELECT idempotency.inbox_accept(
    consumer => %(consumer)s::text, message_id => %(message_id)s::text,
    reference_time => %(reference_time)s::timestamptz) AS accepted
"""

# -- the job queue of long-running operations (pgmq; pg_idempotency.jobs) ---------------------

PGMQ_INSTALLED: Final = "SELECT pg_catalog.to_regnamespace('pgmq') IS NOT NULL AS installed"
PGMQ_CREATE: Final = "SELECT pgmq.create(queue_name => %(queue)s::text)"
PGMQ_SEND: Final = """
SELECT msg_id FROM pgmq.send(queue_name => %(queue)s::text, msg => %(msg)s::jsonb) AS msg_id
"""
PGMQ_READ: Final = """
SELECT msg_id, read_ct, message::text AS message FROM pgmq.read(
    queue_name => %(queue)s::text, vt => %(vt)s::integer, qty => 1)
"""
PGMQ_SET_VT: Final = """
SELECT msg_id FROM pgmq.set_vt(
    queue_name => %(queue)s::text, msg_id => %(msg_id)s::bigint, vt => %(vt)s::integer)
"""
PGMQ_DELETE: Final = """
SELECT pgmq.delete(queue_name => %(queue)s::text, msg_id => %(msg_id)s::bigint) AS deleted
"""

# -- fingerprints (docs/fingerprint.md) -----------------------------------------------------

DERIVE_KEY: Final = """
SELECT idempotency.derive_key(
    scope => %(scope)s::text, key => %(key)s::text, step => %(step)s::text) AS derived
"""

# request and defaults are JSON *text*, so the spelling of numbers reaches the server as is.
FINGERPRINT: Final = """
SELECT idempotency.fingerprint(
    request => %(request)s::jsonb, defaults => coalesce(%(defaults)s::jsonb, '{}'),
    fields => %(fields)s::text[]) AS fingerprint
"""

# -- retention (maintenance.py) ----------------------------------------------------------

MAINTAIN: Final = f"""
SELECT action, parent_table, partition_name, {_seconds("lower_bound")},
       {_seconds("upper_bound")}, row_count, reason
FROM idempotency.maintain(reference_time => coalesce(%(reference_time)s::timestamptz, now()))
"""
KEY_STATUS: Final = f"""
SELECT scope, state, keys, {_seconds("oldest_created_at")}, oldest_key, expired_leases,
       {_seconds("oldest_expired_lease")}
FROM idempotency.key_status(reference_time => %(reference_time)s::timestamptz)
"""
PARTITION_STATUS: Final = f"""
SELECT parent_table, partition_name, {_seconds("lower_bound")}, {_seconds("upper_bound")},
       row_count, total_bytes, {_seconds("drop_after")}, note
FROM idempotency.partition_status(reference_time => %(reference_time)s::timestamptz)
"""

# -- key inspection and repair (cli.py: pg-idempotency keys) --------------------------------

_KEY_INFO_COLUMNS = (
    "scope, key, state, lease_expires_at, lease_expired, recovery_point, "
    "attempts, response_status, response_content_type, response_headers, response_body_size, "
    "response_body, encode(response_body_bytes, 'base64') AS response_body_base64, created_at, "
    "completed_at, partition_name")
KEY_SHOW: Final = (
    f"SELECT {_KEY_INFO_COLUMNS} FROM idempotency.inspect_key("
    "scope => %(scope)s::text, key => %(key)s::text, body => %(body)s::boolean)")
KEY_LIST: Final = (
    f"SELECT {_KEY_INFO_COLUMNS} FROM idempotency.list_keys("
    "scope => %(scope)s::text, state => %(state)s::text, older_than => %(older_than)s::interval, "
    "expired_leases => %(expired_leases)s::boolean, max_keys => %(max_keys)s::integer)")
KEY_RELEASE: Final = (
    "SELECT idempotency.force_release(scope => %(scope)s::text, key => %(key)s::text)")

# -- the installed schema (migrate.py keeps its own statements next to its lock) -------------

SCHEMA_INSTALLED: Final = (
    "SELECT pg_catalog.to_regclass('idempotency.migrations') IS NOT NULL AS installed")
SCHEMA_VERSION: Final = "SELECT max(version) AS version FROM idempotency.migrations"

# -- transactions ---------------------------------------------------------------------------

BEGIN: Final = "BEGIN"
#: Sent as a statement in the pipeline of complete() (Connection.commit() would add a Sync).
COMMIT: Final = "COMMIT"
#: Appended to complete's call to send both in one simple Query message (_wire.send_commit).
AND_COMMIT: Final = ";\nCOMMIT"
