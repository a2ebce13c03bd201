"""The Python twin's loads() refuses exactly the JSON text jsonb refuses, at numeric's limits
and under duplicate keys (issue 13 fix 3), with the SQLSTATE PostgreSQL gives; where both
accept, canonical_json gives the same text."""

from __future__ import annotations

import psycopg
import pytest

from pg_idempotency import canonical_json
from pg_idempotency.errors import InvalidArgument
from pg_idempotency.fingerprint import loads

CASES = [
    "0e-16384", "0e-16383", "0e16384", "-0", "0.0e5", "1e131071", "1e131072", "1e-16383",
    "1e-16384", "1.0e-16382", "1.0e-16383", "1e1001", "-1e-1001",
    '{"a":1e131072,"a":1}', '{"a":0e-16384,"a":1}', '{"a":[1e-16384],"a":1}',
    '{"a":"x\\u0000","a":1}', '{"a":"\\ud800","a":1}', '[{"b":1,"b":1e131072}]',
    '{"a":1,"a":2}', '{"\\u0000":1}', '"\\udc00"', '["\\ud83d\\ude00"]',
]


@pytest.mark.parametrize("text", CASES)
def test_loads_refuses_what_jsonb_refuses(db: str, text: str) -> None:
    with psycopg.connect(db, autocommit=True) as conn:
        try:
            expected = conn.execute("SELECT idempotency.canonical_json(%s::text::jsonb)",
                                    (text,)).fetchone()[0]
            refused = None
        except psycopg.Error as exc:
            expected, refused = None, exc.sqlstate
    if refused is None:
        assert canonical_json(loads(text)) == expected
    else:
        with pytest.raises(InvalidArgument) as err:
            loads(text)
        assert err.value.sqlstate == refused, (text, refused, err.value)
