"""Generated JSON text (hypothesis): the Python twin and the database agree on every one.
Both accept with the same canonical text and fingerprint, or both refuse with the same
SQLSTATE. Bounded (derandomized, 300 examples per flavour); PG_IDEM_PROBES=long runs 5,000."""

from __future__ import annotations

import json
import os

import psycopg
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pg_idempotency import canonical_json, fingerprint
from pg_idempotency.errors import InvalidArgument
from pg_idempotency.fingerprint import loads

EXAMPLES = 5000 if os.environ.get("PG_IDEM_PROBES") == "long" else 300

numbers = st.one_of(
    st.integers(-10**20, 10**20).map(str),
    st.tuples(st.sampled_from(["0", "-0", "1", "1.0", "12.50", "-3.25", "9"]),
              st.sampled_from(["", "e5", "E-3", "e+2", "e-16383", "e-16384", "e-16382",
                               "e131071", "e131072", "e1001", "e-1001", "e16384"]))
    .map("".join),
)
strings = st.one_of(
    st.text(max_size=6).map(lambda s: json.dumps(s, ensure_ascii=False)),
    st.sampled_from(['"\\u0000"', '"\\ud800"', '"\\udc00x"', '"\\ud83d\\ude00"', '"a\\nb"',
                     '"\\u001f"', '"\\u007f"', '"\\/"']),
)
scalars = st.one_of(numbers, strings, st.sampled_from(["true", "false", "null"]))
keys = st.one_of(st.sampled_from(['"a"', '"b"', '"\\u0000"', '"\\ud800"', '"é"']), strings)
json_text = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4).map(lambda xs: "[" + ",".join(xs) + "]"),
        st.lists(st.tuples(keys, inner), max_size=4).map(
            lambda kv: "{" + ",".join(f"{k}:{v}" for k, v in kv) + "}"),
    ),
    max_leaves=8,
)


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(text=json_text)
def test_twin_and_database_agree_on_generated_json(db: str, text: str) -> None:
    with psycopg.connect(db, autocommit=True) as conn:
        try:
            row = conn.execute("SELECT idempotency.canonical_json(%s::text::jsonb), "
                               "idempotency.fingerprint(%s::text::jsonb)", (text, text)).fetchone()
            refused = None
        except psycopg.Error as exc:
            row, refused = None, exc.sqlstate
    if refused is None:
        value = loads(text)
        assert (canonical_json(value), fingerprint(value)) == (row[0], row[1]), text
    else:
        try:
            loads(text)
        except InvalidArgument as err:
            assert err.sqlstate == refused, (text, refused, err)
        else:
            raise AssertionError(f"the database refuses {text!r} ({refused}), the twin accepts")
