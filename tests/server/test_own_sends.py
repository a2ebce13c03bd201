"""The statements the package binds and sends itself (_wire.bind, _wire.literal_query: claim in
binary, complete + COMMIT as one simple Query; issue 32) against what psycopg would send and
what the server reads back, on real servers.

- _bound gives byte for byte the Bind values, parameter types and formats psycopg's own
  dumpers give (PostgresQuery.convert on a cursor of the same connection), and refuses (None:
  the cursor sends it) every value it does not spell itself.
- _literal_query's literals read back as the values, under standard_conforming_strings on and
  off, in UTF8 and LATIN1, for quotes, backslashes and non-ASCII text.
- operation() and aio.operation() through both sends under those settings, with keys that need
  quoting, and with a text loader registered on the connection (the package decodes its own
  results); a value psycopg refuses (NUL, a character the client encoding lacks) is refused as
  before, by psycopg.
- The short complete (its time as the server prints it in DateStyle ISO) goes only while the
  session's DateStyle is ISO, a SET LOCAL in the business transaction included, and
  _wire.iso_time reads the server's own text of instants in zones with offsets in minutes and
  seconds.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest
from psycopg import adapt
from psycopg._queries import PostgresQuery
from psycopg.types.json import Jsonb
from psycopg.types.string import TextLoader

import pg_idempotency as idem
from pg_idempotency import _calls, _wire, aio
from pg_idempotency import queries as Q

pytestmark = pytest.mark.anyio

T0 = datetime(2026, 3, 1, 23, 30, 0, 123456, tzinfo=timezone(timedelta(hours=5, minutes=45)))
AWKWARD = ["plain", "o'brien", "back\\slash", "\\x41'\\", "é ß 漢字", "'';--", "E'\\\\'"]


def _claim_params(**changes: Any) -> dict[str, Any]:
    params = {"scope": "acct_1", "key": "k-1", "request": None, "lease": timedelta(seconds=30),
              "fingerprint": bytes(range(32)), "strict": False, "reference_time": None}
    params.update(changes)
    return params


def _psycopg_sends(conn: psycopg.Connection[Any], sql: str, params: dict[str, Any]
                   ) -> tuple[bytes, list[bytes | None], list[int], list[int]]:
    with psycopg.Cursor(conn) as cur:
        pgq = PostgresQuery(adapt.Transformer(cur))
        pgq.convert(sql, params)
        assert pgq.params is not None
        return (pgq.query, [None if v is None else bytes(v) for v in pgq.params],
                list(pgq.types), [int(f) for f in pgq.formats])


@pytest.mark.parametrize("changes", [
    {},
    {"strict": True, "lease": timedelta(days=2, seconds=5, microseconds=7)},
    {"lease": timedelta(days=-3, microseconds=999999), "reference_time": T0},
    {"reference_time": datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=timezone.utc)},
    {"reference_time": datetime(1, 1, 1, tzinfo=timezone(timedelta(hours=-3)))},
    {"scope": "é ß 漢字", "key": "o'brien\\", "lease": None, "fingerprint": None},
    {"strict": None},
], ids=["defaults", "strict-days", "negative-lease-aware-time", "max-time", "min-time",
        "text", "nulls"])
@pytest.mark.parametrize("sql", [Q.CLAIM_BINARY, Q.CLAIM_SHORT, Q.TAKEOVER_BINARY],
                         ids=["claim", "claim-short", "takeover"])
def test_bound_sends_what_psycopg_sends(db: str, sql: str, changes: dict[str, Any]) -> None:
    params = _claim_params(**changes)
    with psycopg.connect(db, autocommit=True) as conn:
        bound = _wire.bind(sql, params, conn.pgconn._encoding)
        assert bound is not None
        query, values, types, formats = bound
        assert (query, values, types, [int(f) for f in formats]) == _psycopg_sends(
            conn, sql, params)


@pytest.mark.parametrize("value", [
    "nul\x00inside", datetime(2026, 3, 1), 7, 1.5, Jsonb({}), bytearray(b"x"),
    type("Text", (str,), {})("a str subclass"),
], ids=["nul", "naive-time", "int", "float", "jsonb", "bytearray", "str-subclass"])
def test_bound_leaves_other_values_to_psycopg(value: Any) -> None:
    assert _wire.bind(Q.CLAIM_BINARY, _claim_params(key=value), "utf-8") is None


def test_bound_leaves_text_the_encoding_lacks_to_psycopg() -> None:
    assert _wire.bind(Q.CLAIM_BINARY, _claim_params(key="kжy"), "latin-1") is None
    assert _wire.bind(Q.CLAIM_BINARY, _claim_params(key="kéy"), "latin-1") is not None


def _latin1(text: str) -> bool:
    try:
        text.encode("latin-1")
    except UnicodeEncodeError:
        return False
    return True


LITERALS = "SELECT %(t)s::text AS t, %(b)s::bytea AS b, %(j)s::jsonb::text AS j, %(n)s::bigint " \
           "AS n, %(z)s::text AS z, %(t)s::text AS again"


@pytest.mark.parametrize("encoding", ["UTF8", "LATIN1"])
@pytest.mark.parametrize("conforming", ["on", "off"])
def test_literal_query_reads_back_as_the_values(db: str, conforming: str, encoding: str
                                                ) -> None:
    texts = [t for t in AWKWARD + ["clé 'é'\\"] if encoding == "UTF8" or _latin1(t)]
    with psycopg.connect(db, autocommit=True, options=f"-c client_encoding={encoding} "
                         f"-c standard_conforming_strings={conforming}") as conn:
        scs = _wire.conforming_strings(conn)
        assert scs is (conforming == "on")
        for text in texts:
            body = text.encode() + bytes(range(256))
            params = {"t": text, "b": body, "j": _calls.jsonb({"k": text, "\\": ["'"]}),
                      "n": -(2**63), "z": None}
            query = _wire.literal_query(LITERALS, params, conn.pgconn._encoding, scs)
            assert query is not None
            # text results in a binary-safe way: compare with what the server itself prints
            row = conn.pgconn.exec_(query)
            assert row.status == psycopg.pq.ExecStatus.TUPLES_OK, row.get_error_message()
            got = [None if v is None else bytes(v) for v in
                   (row.get_value(0, i) for i in range(6))]
            assert got[0] == got[5] == text.encode(conn.pgconn._encoding)
            assert got[1] == b"\\x" + body.hex().encode()
            assert got[2] is not None
            assert json.loads(got[2].decode(conn.pgconn._encoding)) == {
                "k": text, "\\": ["'"]}
            assert got[3] == str(-(2**63)).encode()
            assert got[4] is None


@pytest.mark.parametrize("value", [
    "nul\x00inside", datetime(2026, 3, 1, tzinfo=timezone.utc), True, 1.5,
    Jsonb({"a": "nul\x00"}), Jsonb({}, dumps=None),
], ids=["nul", "time", "bool", "float", "jsonb-nul", "jsonb-global-dumps"])
def test_literal_query_leaves_other_values_to_psycopg(value: Any) -> None:
    assert _wire.literal_query("SELECT %(v)s", {"v": value}, "utf-8", True) is None


def _settings(encoding: str, conforming: str) -> str:
    return f"-c client_encoding={encoding} -c standard_conforming_strings={conforming}"


def _stored_key(db: str, scope: str, key: str) -> tuple[str, int]:
    with psycopg.connect(db, autocommit=True) as conn:
        row = conn.execute("SELECT key, response_status FROM idempotency.keys "
                           "WHERE scope = %s AND key = %s", (scope, key)).fetchone()
    assert row is not None
    return row


@pytest.mark.parametrize("encoding", ["UTF8", "LATIN1"])
@pytest.mark.parametrize("conforming", ["on", "off"])
def test_operation_with_keys_that_need_quoting(db: str, conforming: str, encoding: str) -> None:
    keys = [k for k in AWKWARD + ["clé 'é'\\"] if encoding == "UTF8" or _latin1(k)]
    answer = {"id": "pay_'é'\\", "amount": 5}
    with psycopg.connect(db, autocommit=True, options=_settings(encoding, conforming)) as conn:
        for key in keys:
            request = {"key": key, "note": "o'brien\\"}
            with idem.operation(conn, "sc'o\\pe", key, request) as op:
                assert op.outcome is idem.Outcome.CLAIMED
                stored = op.complete(201, answer, headers={"X-Note": "it's \\ é"})
            assert stored.completed_at is not None
            assert _stored_key(db, "sc'o\\pe", key) == (key, 201)
            with idem.operation(conn, "sc'o\\pe", key, request) as op:
                assert op.replay is not None
                assert op.replay.json() == answer
                assert op.replay.headers == {"X-Note": "it's \\ é"}
                assert op.replay.completed_at == stored.completed_at
            with pytest.raises(idem.KeyMismatch):
                with idem.operation(conn, "sc'o\\pe", key, {"other": key}):
                    pass


async def test_aio_operation_with_keys_that_need_quoting(db: str) -> None:
    async with await psycopg.AsyncConnection.connect(
            db, autocommit=True, options=_settings("LATIN1", "off")) as conn:
        async with aio.operation(conn, "s'\\", "k'é\\", {"a": "é"}) as op:
            assert op.outcome is idem.Outcome.CLAIMED
            stored = await op.complete(201, {"b": "'\\"})
        async with aio.operation(conn, "s'\\", "k'é\\", {"a": "é"}) as op:
            assert op.replay is not None and op.replay.json() == {"b": "'\\"}
            assert op.replay.completed_at == stored.completed_at
    assert _stored_key(db, "s'\\", "k'é\\") == ("k'é\\", 201)


class _Shouting(TextLoader):
    """A text loader an application might register: not the server's text."""

    def load(self, data: Any) -> str:
        return "LOUD " + bytes(data).decode()


def test_operation_ignores_the_connections_text_loaders(db: str) -> None:
    with psycopg.connect(db, autocommit=True) as conn:
        for oid in ("text", "numeric", "bytea"):
            conn.adapters.register_loader(oid, _Shouting)
        with idem.operation(conn, "s", "k", {"a": 1}) as op:
            conn.execute("SELECT 1")
            stored = op.complete(201, {"b": 2})
        assert stored.completed_at is not None
        with idem.operation(conn, "s", "k", {"a": 1}) as op:
            assert op.replay is not None and op.replay.completed_at == stored.completed_at
        assert conn.execute("SELECT 'x'::text").fetchone() == ("LOUD x",)


@pytest.mark.parametrize("autocommit", [True, False])
def test_refused_values_are_refused_as_psycopg_refuses_them(db: str, autocommit: bool
                                                            ) -> None:
    with psycopg.connect(db, autocommit=autocommit) as conn:
        with pytest.raises(psycopg.DataError, match="NUL"):
            with idem.operation(conn, "s", "k\x00", {"a": 1}):
                pass
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    with psycopg.connect(db, autocommit=autocommit, options=_settings("LATIN1", "on")) as conn:
        with pytest.raises(UnicodeEncodeError):
            with idem.operation(conn, "s", "kжy", {"a": 1}):
                pass
        with idem.operation(conn, "s", "ké", {"a": 1}) as op:
            op.complete(201, {"a": "ж"})  # the answer goes as bytes: any character
        with idem.operation(conn, "s", "ké", {"a": 1}) as op:
            assert op.replay is not None and op.replay.json() == {"a": "ж"}


def test_complete_error_and_commit_error_raise_as_before(db: str) -> None:
    """An error in complete skips the COMMIT (the writes roll back, the key is released); an
    error at COMMIT (a deferred constraint) is raised too, and nothing is stored."""
    with psycopg.connect(db, autocommit=True) as conn:
        conn.execute("CREATE TABLE ledger (id int PRIMARY KEY, parent int REFERENCES ledger "
                     "DEFERRABLE INITIALLY DEFERRED)")
        with pytest.raises(idem.LeaseLost):
            with idem.operation(conn, "s", "lost", {"a": 1}) as op:
                conn.execute("INSERT INTO ledger VALUES (1, NULL)")
                with psycopg.connect(db, autocommit=True) as other:
                    other.execute("SELECT idempotency.force_release(scope => 's', key => "
                                  "'lost')")
                op.complete(201, {"b": 2})
        with pytest.raises(psycopg.errors.ForeignKeyViolation):
            with idem.operation(conn, "s", "deferred", {"a": 1}) as op:
                conn.execute("INSERT INTO ledger VALUES (2, 99)")
                op.complete(201, {"b": 2})
        assert conn.execute("SELECT count(*) FROM ledger").fetchone() == (0,)
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        with idem.operation(conn, "s", "deferred", {"a": 1}) as op:
            assert op.replay is None and op.lease_token is not None


ZONES = ["UTC", "Pacific/Chatham", "America/St_Johns", "Asia/Kathmandu", "Africa/Monrovia",
         "Europe/Amsterdam", "America/Los_Angeles"]
INSTANTS = [
    datetime(1970, 1, 1, tzinfo=timezone.utc),
    datetime(1971, 6, 1, 12, 0, 0, 500000, tzinfo=timezone.utc),   # Monrovia: -00:44:30
    datetime(1937, 6, 1, 12, 0, 0, 10, tzinfo=timezone.utc),       # Amsterdam: +00:19:32
    datetime(2024, 3, 31, 1, 0, 0, 120000, tzinfo=timezone.utc),   # a DST change in Europe
    datetime(2026, 12, 6, 4, 30, 0, 123456, tzinfo=timezone.utc),
    datetime(9998, 12, 31, 23, 59, 59, 999999, tzinfo=timezone.utc),
]


@pytest.mark.parametrize("datestyle", ["ISO, MDY", "ISO, DMY", "ISO, YMD"])
def test_iso_time_reads_what_the_server_prints(db: str, datestyle: str) -> None:
    """_wire.iso_time, which reads the short complete's result, against the server's own text
    of the same instants, in time zones with offsets in minutes and seconds."""
    with psycopg.connect(db, autocommit=True) as conn:
        conn.execute("SELECT set_config('DateStyle', %s, false)", (datestyle,))
        assert _wire.iso_dates(conn)
        for zone in ZONES:
            conn.execute("SELECT set_config('TimeZone', %s, false)", (zone,))
            for instant in INSTANTS:
                res = conn.pgconn.exec_(
                    f"SELECT '{instant.isoformat()}'::timestamptz".encode())
                text = res.get_value(0, 0)
                assert text is not None
                assert _wire.iso_time(bytes(text)) == instant, (zone, bytes(text))
        conn.execute("SET DateStyle = 'SQL, DMY'")
        assert not _wire.iso_dates(conn)
        res = conn.pgconn.exec_(b"SELECT now()")
        with pytest.raises(psycopg.DataError, match="DateStyle ISO"):
            _wire.iso_time(bytes(res.get_value(0, 0) or b""))


def _stored_completed_at(db: str, scope: str, key: str) -> datetime:
    with psycopg.connect(db, autocommit=True) as conn:
        row = conn.execute("SELECT completed_at FROM idempotency.keys WHERE scope = %s "
                           "AND key = %s", (scope, key), binary=True).fetchone()
    assert row is not None
    return row[0]


@pytest.mark.parametrize("local", [None, "ISO, DMY", "SQL, DMY", "German"])
@pytest.mark.parametrize("session", ["ISO, MDY", "Postgres, MDY"])
def test_complete_short_form_follows_the_datestyle(db: str, session: str, local: str | None
                                                   ) -> None:
    """The short complete (the server's text of completed_at) goes only when the session
    prints DateStyle ISO at that moment, a SET LOCAL in the business transaction included;
    otherwise the epoch form. completed_at is the stored instant either way, in a zone whose
    offset has minutes."""
    scope, key = "dates", f"{session}/{local}"
    with psycopg.connect(db, autocommit=True, options=f"-c DateStyle={session.replace(' ', '')}"
                         " -c TimeZone=Pacific/Chatham") as conn:
        with idem.operation(conn, scope, key, {"a": 1}) as op:
            if local is not None:
                conn.execute(f"SET LOCAL DateStyle = '{local}'")
            iso = (local or session).startswith("ISO")
            assert _wire.iso_dates(conn) is iso
            q, _ = _calls.complete_parts(scope, key, 1, 201, b"{}", None, None, None, True)
            text, short = _wire.commit_text(conn, q, conn.pgconn._encoding)
            assert short is iso and text is not None
            assert text.lstrip().startswith(
                b"SELECT idempotency.complete_bytes(" if iso else b"SELECT extract(epoch")
            stored = op.complete(201, {"b": 2})
        assert stored.completed_at == _stored_completed_at(db, scope, key)
        assert stored.completed_at is not None and stored.completed_at.tzinfo is not None
        with idem.operation(conn, scope, key, {"a": 1}) as op:
            assert op.replay is not None and op.replay.completed_at == stored.completed_at
