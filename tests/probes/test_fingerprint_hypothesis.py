"""Generated JSON text (hypothesis): the Python twin and the database agree on every one.
Both accept with the same canonical text and fingerprint, or both refuse with the same
SQLSTATE. Bounded (derandomized, 300 examples per flavour); PG_IDEM_PROBES=long runs 5,000."""

from __future__ import annotations

import json
import os
from typing import Any

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


# -- the package's fast paths (issue 32): the C encoder where it provably spells the same -----

py_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-10**40, 10**40),
    st.floats(allow_nan=True, allow_infinity=True), st.decimals(places=3, allow_nan=False),
    st.text(max_size=6),
    st.sampled_from(["\x00", "\ud800", "a\\u0000", "\u2028", "\x7f", "\x1f\b", "é\"\\"]),
)
py_keys = st.one_of(st.text(max_size=4), st.integers(-3, 3), st.booleans(), st.none(),
                    st.sampled_from(["\x00", "\ud800", "b"]))
py_values = st.recursive(
    py_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.tuples(inner, inner),
                            st.dictionaries(py_keys, inner, max_size=4)),
    max_leaves=10,
)


def _outcome(fn: Any, value: Any) -> Any:
    try:
        return fn(value)
    except Exception as exc:  # noqa: BLE001 - compared: the same class and SQLSTATE
        return ("raised", type(exc).__name__, getattr(exc, "sqlstate", None))


@settings(max_examples=EXAMPLES * 3, deadline=None, derandomize=True, database=None)
@given(value=py_values)
def test_fast_paths_give_the_slow_paths_answer(value: Any) -> None:
    """canonical_json and complete()'s body (_results.json_body) take the C encoder when they can
    vouch for it; every Python value gives what the pure-Python walk gives, text or error."""
    from pg_idempotency._results import json_body, json_bytes
    from pg_idempotency.fingerprint import _canonical

    slow = _outcome(lambda v: _canonical(v, "idempotency.canonical_json", "value"), value)
    assert _outcome(canonical_json, value) == slow, value

    def body_slow(v: Any) -> Any:
        _canonical(v, "idempotency.canonical_json", "value")
        data = json_bytes(v)
        return data, json.loads(data)

    assert _outcome(json_body, value) == _outcome(body_slow, value), value


def test_fast_paths_nesting_and_wide_values() -> None:
    """At the nesting limit and past it, and a value with more brackets than the limit but
    shallow: the same answers as the slow walk."""
    from pg_idempotency._results import json_body
    from pg_idempotency.fingerprint import MAX_DEPTH, _canonical

    deep: Any = 1
    for _ in range(MAX_DEPTH):
        deep = [deep]
    for value in (deep, [deep], {"items": [{"n": i} for i in range(300)]}):
        slow = _outcome(lambda v: _canonical(v, "idempotency.canonical_json", "value"), value)
        assert _outcome(canonical_json, value) == slow
        assert _outcome(lambda v: json_body(v)[1], value) == _outcome(
            lambda v: (_canonical(v, "idempotency.canonical_json", "value"),
                       json.loads(json.dumps(v)))[1], value)
