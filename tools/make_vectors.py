#!/usr/bin/env python3
"""Generate tests/vectors/fingerprint.json from the database: the SQL functions are the reference.

    tools/make_vectors.py                 start a throwaway PostgreSQL 15 (harness/pgharness.py;
                                          not as root: runuser -u pgidem -- ...), install
                                          migrations/ with psql, generate, stop it
    tools/make_vectors.py --dsn DSN       use a database where the idempotency schema is
                                          installed (pg-idempotency migrate --dsn DSN)
    tools/make_vectors.py --check [...]   fail if the committed file differs from what the
                                          database gives now

Requests and defaults are stored as raw JSON *text*, so that the spelling of numbers (10.0,
1e1, -0) reaches the implementation under test unchanged; clients parse it with their exact
decimal type. "canonical" is the text that is hashed (after defaults and fields are applied),
"sha256_hex" its sha256 as returned by idempotency.fingerprint.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import psycopg

from pg_idempotency import queries

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "vectors" / "fingerprint.json"

# name, request (JSON text), defaults (JSON text or None), fields (list or None)
FINGERPRINT_CASES: list[tuple[str, str, str | None, list[str | None] | None]] = [
    # key order
    ("keys sorted", '{"b": 1, "a": 2, "c": 3}', None, None),
    ("keys sorted, same set in another order", '{"c": 3, "a": 2, "b": 1}', None, None),
    ("keys: upper case before lower case", '{"b": 1, "a": 2, "B": 3, "A": 4}', None, None),
    ("keys: prefix first", '{"aa": 1, "a": 2, "a b": 3, "ab": 4, "": 5}', None, None),
    ("keys: digits and punctuation", '{"10": 1, "9": 2, "_": 3, "-": 4, "~": 5}', None, None),
    ("duplicate keys: the last wins", '{"a": 1, "a": 2}', None, None),
    # nesting
    ("nested objects sorted at every level",
     '{"z": {"y": 1, "x": {"b": [3, {"d": 1, "c": 2}], "a": null}}, "a": []}', None, None),
    ("array order kept", '[3, 1, 2, "b", "a"]', None, None),
    ("arrays of objects", '[{"b": 1, "a": 2}, {"d": [], "c": {}}]', None, None),
    ("deeply nested", '[[[[[[[[[[{"k": [[[]]]}]]]]]]]]]]', None, None),
    # unicode keys
    ("unicode keys: code point order, not UTF-16 order",
     '{"\\ud83d\\ude00": "emoji U+1F600", "\\ufb01": "ligature U+FB01"}', None, None),
    ("unicode keys: raw UTF-8 input", '{"😀": 1, "ﬁ": 2, "é": 3, "z": 4, "Z": 5}', None, None),
    ("unicode keys: U+FFFF vs U+10000",
     '{"\\ud800\\udc00": 1, "\\uffff": 2, "\\ue000": 3, "\\u00ff": 4}', None, None),
    ("unicode keys: combining vs precomposed (no normalisation)",
     '{"e\\u0301": 1, "\\u00e9": 2}', None, None),
    # numbers
    ("number 10", "10", None, None),
    ("number 10.0", "10.0", None, None),
    ("number 1e1", "1e1", None, None),
    ("number 1E+1", "1E+1", None, None),
    ("number -0", "-0", None, None),
    ("number -0.0", "-0.0", None, None),
    ("number 0.000", "0.000", None, None),
    ("number 0e5", "0e5", None, None),
    ("number 1.50", "1.50", None, None),
    ("number 1e-7", "1e-7", None, None),
    ("number 1.0E-10", "1.0E-10", None, None),
    ("number 100 keeps integer zeros", "100", None, None),
    ("number 12.3400e2", "12.3400e2", None, None),
    ("number 123456789012345678901234567890", "123456789012345678901234567890", None, None),
    ("number -1.5E+3", "-1.5E+3", None, None),
    ("number 0.1", "0.1", None, None),
    ("number -0.000001", "-0.000001", None, None),
    ("number with many fractional digits",
     "3.14159265358979323846264338327950288419716939937510", None, None),
    ("number 1e40", "1e40", None, None),
    ("number 1e-40", "1e-40", None, None),
    # from 0.12.0, outside 1e-7 <= |n| < 1e21: significant digits and exponent, never expanded
    ("number 999999999999999999999.9, the last plain one below 1e21",
     "999999999999999999999.9", None, None),
    ("number 9.999e20 plain", "9.999e20", None, None),
    ("number 1e21 with an exponent", "1e21", None, None),
    ("number -1e21", "-1e21", None, None),
    ("number 1500e18 is 1.5e21", "1500e18", None, None),
    ("number 1e21 + 0.5 keeps every digit", "1000000000000000000000.5", None, None),
    ("number 0.0000001 is the smallest plain one", "0.0000001", None, None),
    ("number 9.9e-8 with an exponent", "9.9e-8", None, None),
    ("number 1e-8", "1e-8", None, None),
    ("number -1.5e-30", "-1.5e-30", None, None),
    ("number -123e-30 is -1.23e-28", "-123e-30", None, None),
    ("number 1e131071, numeric's largest exponent", "1e131071", None, None),
    ("number -9.999e131071", "-9.999e131071", None, None),
    ("number 1e-16383, numeric's smallest", "1e-16383", None, None),
    ("number 0e-16383 is 0", "0e-16383", None, None),
    ("numbers outside the plain range in an array",
     "[1e21, 1E+21, 10e20, 1.0e21, 1e-8, 0.1e-7, 1e100000]", None, None),
    ("numbers in an object",
     '{"a": 10, "b": 10.0, "c": 1e1, "d": -0, "e": 0.000, "f": 1.50, "g": 1e-7, '
     '"h": 123456789012345678901234567890, "i": -1.5E+3}', None, None),
    ("numbers in an array", "[10, 10.0, 1e1, -0, 0.000, 1.50, 1e-7, -1.5E+3]", None, None),
    # strings and escapes
    ("string: quote and backslash", '"say \\"hi\\" \\\\ bye"', None, None),
    ("string: short escapes", '"\\b\\f\\n\\r\\t"', None, None),
    ("string: other C0 controls as lower-case \\u00xx",
     '"' + "".join(f"\\u{c:04X}" for c in range(1, 0x20)) + '"', None, None),
    ("string: DEL and C1 controls stay raw", '"\\u007f\\u0080\\u009f"', None, None),
    ("string: solidus escape is not kept", '"a\\/b/c"', None, None),
    ("string: escaped non-ASCII becomes raw UTF-8", '"\\u00e9\\u4e2d\\ud83d\\ude00"', None, None),
    ("string: raw non-ASCII", '"é中😀"', None, None),
    ("string: line and paragraph separators stay raw", '"\\u2028\\u2029"', None, None),
    ("string: BOM and noncharacter stay raw", '"\\ufeff\\uffff"', None, None),
    ("string: empty", '""', None, None),
    ("escapes in keys", '{"a\\"b": 1, "a\\\\b": 2, "a\\nb": 3, "a\\u0001b": 4}', None, None),
    # scalars and empty containers
    ("empty object", "{}", None, None),
    ("empty array", "[]", None, None),
    ("empty containers nested", '{"a": {}, "b": [], "c": [{}, []]}', None, None),
    ("true", "true", None, None),
    ("false", "false", None, None),
    ("null", "null", None, None),
    ("literals in an object", '{"t": true, "f": false, "n": null}', None, None),
    ("whitespace is dropped", ' { "a" :\t[ 1 ,\n 2 ] ,"b" : { } }\r\n', None, None),
    # defaults
    ("defaults: omitted field takes its default",
     '{"amount": 100}', '{"currency": "EUR"}', None),
    ("defaults: sending the default gives the same",
     '{"amount": 100, "currency": "EUR"}', '{"currency": "EUR"}', None),
    ("defaults: the request wins", '{"amount": 100, "currency": "USD"}',
     '{"currency": "EUR"}', None),
    ("defaults: shallow merge, nested objects are not merged",
     '{"a": {"x": 1}}', '{"a": {"y": 2}, "b": 3}', None),
    ("defaults: request null is kept, not replaced", '{"a": null}', '{"a": 1}', None),
    ("defaults: empty object changes nothing", '{"b": 1, "a": 2}', "{}", None),
    ("defaults: empty object with a non-object request", "[1, 2]", "{}", None),
    # fields
    ("fields: only the listed fields count",
     '{"amount": 100, "trace_id": "abc", "sent_at": "2024-01-01T00:00:00Z"}', None,
     ["amount"]),
    ("fields: other values of ignored fields give the same",
     '{"amount": 100, "trace_id": "xyz"}', None, ["amount"]),
    ("fields: unknown names are ignored", '{"a": 1, "b": 2}', None, ["b", "nope"]),
    ("fields: duplicates are harmless", '{"a": 1, "b": 2}', None, ["a", "a"]),
    ("fields: empty list keeps nothing", '{"a": 1}', None, []),
    ("fields: unicode names", '{"ﬁ": 1, "😀": 2, "x": 3}', None, ["😀", "ﬁ"]),
    ("defaults and fields: defaults apply before the selection",
     '{"amount": 100, "trace_id": "abc"}', '{"currency": "EUR", "mode": "x"}',
     ["amount", "currency"]),
    ("defaults and fields: fields as given, request omits all",
     '{}', '{"currency": "EUR"}', ["currency"]),
]

# name, scope, key, step
DERIVE_KEY_CASES: list[tuple[str, str, str, str]] = [
    ("simple", "tenant-1", "order-42", "charge"),
    ("other step, other key", "tenant-1", "order-42", "email"),
    ("other scope, other key", "tenant-2", "order-42", "charge"),
    ("quotes and backslashes", 'sc"ope', "k\\e\"y", "st\\ep"),
    ("unicode", "テナント", "ключ-😀", "ﬁ"),
    ("separators cannot collide (1)", "a,b", "c", "d"),
    ("separators cannot collide (2)", "a", "b,c", "d"),
    ("DEL-free punctuation and spaces", " ", "a b", "~!@#$%^&*()_+{}|:<>?"),
    ("key of 255 characters", "s", "k" * 255, "step"),
    ("key of 255 four-byte characters", "s", "😀" * 255, "step"),
    ("U+00A0 and U+2028 are not control characters", "s", "a\u00a0b", "c\u2028d"),
]

# function, arguments as JSON-able values, expected SQLSTATE, argument named (None: jsonb input)
INVALID_CASES: list[dict] = [
    {"name": "derive_key: NULL scope", "function": "derive_key",
     "args": {"scope": None, "key": "k", "step": "s"}, "sqlstate": "IK010", "argument": "scope"},
    {"name": "derive_key: empty key", "function": "derive_key",
     "args": {"scope": "s", "key": "", "step": "s"}, "sqlstate": "IK011", "argument": "key"},
    {"name": "derive_key: 256 characters", "function": "derive_key",
     "args": {"scope": "s", "key": "k" * 256, "step": "s"}, "sqlstate": "IK012",
     "argument": "key"},
    {"name": "derive_key: newline in step", "function": "derive_key",
     "args": {"scope": "s", "key": "k", "step": "a\nb"}, "sqlstate": "IK013", "argument": "step"},
    {"name": "derive_key: DEL in key", "function": "derive_key",
     "args": {"scope": "s", "key": "a\x7fb", "step": "s"}, "sqlstate": "IK013",
     "argument": "key"},
    {"name": "derive_key: C1 control U+0085 in key", "function": "derive_key",
     "args": {"scope": "s", "key": "a\x85b", "step": "s"}, "sqlstate": "IK013",
     "argument": "key"},
    {"name": "fingerprint: array request with fields", "function": "fingerprint",
     "args": {"request": "[1]", "defaults": None, "fields": ["a"]}, "sqlstate": "IK015",
     "argument": "request"},
    {"name": "fingerprint: string request with defaults", "function": "fingerprint",
     "args": {"request": '"x"', "defaults": '{"a": 1}', "fields": None}, "sqlstate": "IK015",
     "argument": "request"},
    {"name": "fingerprint: defaults not an object", "function": "fingerprint",
     "args": {"request": '{"a": 1}', "defaults": "[1]", "fields": None}, "sqlstate": "IK015",
     "argument": "defaults"},
    {"name": "fingerprint: NULL in fields", "function": "fingerprint",
     "args": {"request": '{"a": 1}', "defaults": None, "fields": ["a", None]},
     "sqlstate": "IK010", "argument": "fields"},
    {"name": "jsonb: \\u0000 is refused", "function": "fingerprint",
     "args": {"request": '"a\\u0000b"', "defaults": None, "fields": None},
     "sqlstate": "22P05", "argument": None},
    {"name": "jsonb: unpaired surrogate is refused", "function": "fingerprint",
     "args": {"request": '"\\ud800"', "defaults": None, "fields": None},
     "sqlstate": "22P02", "argument": None},
    {"name": "jsonb: NaN is not JSON", "function": "fingerprint",
     "args": {"request": "[NaN]", "defaults": None, "fields": None},
     "sqlstate": "22P02", "argument": None},
    {"name": "jsonb: more than 16383 fractional digits", "function": "fingerprint",
     "args": {"request": "1.5e-16383", "defaults": None, "fields": None},
     "sqlstate": "22003", "argument": None},
    {"name": "jsonb: more than 131072 integer digits", "function": "fingerprint",
     "args": {"request": "1e131072", "defaults": None, "fields": None},
     "sqlstate": "22003", "argument": None},
]

FINGERPRINT_SQL = """
SELECT idempotency.canonical_json(effective) AS canonical,
       encode(idempotency.fingerprint(%(request)s::jsonb,
                                      coalesce(%(defaults)s::jsonb, '{}'),
                                      %(fields)s::text[]), 'hex') AS sha256_hex,
       encode(sha256(convert_to(idempotency.canonical_json(effective), 'UTF8')), 'hex')
           AS sha256_of_canonical
FROM (
    -- The effective request as fingerprint() documents it; cross-checked below by comparing
    -- the sha256 of its canonical text with fingerprint()'s own result.
    SELECT CASE
        WHEN coalesce(%(defaults)s::jsonb, '{}') = '{}' AND %(fields)s::text[] IS NULL
            THEN %(request)s::jsonb
        WHEN %(fields)s::text[] IS NULL
            THEN coalesce(%(defaults)s::jsonb, '{}') || %(request)s::jsonb
        ELSE (SELECT coalesce(jsonb_object_agg(m.key, m.value), '{}')
              FROM jsonb_each(coalesce(%(defaults)s::jsonb, '{}') || %(request)s::jsonb) AS m
              WHERE m.key = ANY(%(fields)s::text[]))
    END AS effective
) AS e
"""
# Without defaults or fields the request may be any JSON value, and '{}' || '[1]' would not
# leave it unchanged, so the plain case is its own query.
PLAIN_SQL = """
SELECT idempotency.canonical_json(%(request)s::jsonb) AS canonical,
       encode(idempotency.fingerprint(%(request)s::jsonb), 'hex') AS sha256_hex,
       encode(sha256(convert_to(idempotency.canonical_json(%(request)s::jsonb), 'UTF8')), 'hex')
           AS sha256_of_canonical
"""


def generate(conn: psycopg.Connection) -> dict:
    fingerprints = []
    for name, request, defaults, fields in FINGERPRINT_CASES:
        params = {"request": request, "defaults": defaults, "fields": fields}
        query = PLAIN_SQL if defaults is None and fields is None else FINGERPRINT_SQL
        canonical, sha256_hex, check = conn.execute(query, params).fetchone()
        if sha256_hex != check:
            sys.exit(f"make_vectors: {name!r}: fingerprint() is not sha256(canonical): the "
                     "generator's idea of defaults/fields differs from the SQL function")
        vector: dict = {"name": name, "request": request}
        if defaults is not None:
            vector["defaults"] = defaults
        if fields is not None:
            vector["fields"] = fields
        vector.update(canonical=canonical, sha256_hex=sha256_hex)
        fingerprints.append(vector)

    derived = []
    for name, scope, key, step in DERIVE_KEY_CASES:
        (value,) = conn.execute(
            "SELECT idempotency.derive_key(%s::text, %s::text, %s::text)", (scope, key, step)
        ).fetchone()
        derived.append({"name": name, "scope": scope, "key": key, "step": step,
                        "derived": value})

    invalid = []
    for case in INVALID_CASES:
        got = _sqlstate_of(conn, case)
        if got != case["sqlstate"]:
            sys.exit(f"make_vectors: {case['name']!r}: expected SQLSTATE {case['sqlstate']}, "
                     f"the database raised {got}")
        invalid.append(case)

    return {
        "description": "Test vectors for idempotency.canonical_json, fingerprint and "
        "derive_key. request/defaults are JSON text: parse them with an exact decimal type. "
        "canonical is the text hashed after defaults and fields are applied; sha256_hex is "
        "its sha256. invalid lists inputs each implementation must refuse (argument null: "
        "refused already as jsonb input).",
        "generated_by": "tools/make_vectors.py, from the SQL functions (the reference)",
        "fingerprint": fingerprints,
        "derive_key": derived,
        "invalid": invalid,
    }


def _sqlstate_of(conn: psycopg.Connection, case: dict) -> str | None:
    args = case["args"]
    try:
        with conn.transaction():
            conn.execute(queries.DERIVE_KEY if case["function"] == "derive_key"
                         else queries.FINGERPRINT, args)
    except psycopg.Error as exc:
        return exc.sqlstate
    return None


def render(data: dict) -> str:
    return json.dumps(data, ensure_ascii=False, indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", help="database with the idempotency schema installed "
                        "(default: a throwaway PostgreSQL 15 server)")
    parser.add_argument("--out", type=Path, default=OUT, help=f"default: {OUT}")
    parser.add_argument("--check", action="store_true",
                        help="compare with --out instead of writing it")
    args = parser.parse_args(argv)

    if args.dsn:
        with psycopg.connect(args.dsn, autocommit=True) as conn:
            text = render(generate(conn))
    else:
        sys.path.insert(0, str(ROOT / "harness"))
        from pgharness import PgServer, flavour_bindir

        with PgServer(flavour_bindir("pg15"), name="vectors") as srv:
            dsn = srv.dsn()
            for path in sorted((ROOT / "migrations").glob("*.sql")):
                srv.run_psql(dsn, path, args=("-X", "-q", "-1", "-v", "ON_ERROR_STOP=1"))
            with psycopg.connect(dsn, autocommit=True) as conn:
                text = render(generate(conn))

    if args.check:
        if not args.out.exists() or args.out.read_text(encoding="utf-8") != text:
            print(f"{args.out} is out of date: run tools/make_vectors.py", file=sys.stderr)
            return 1
        print(f"{args.out} is up to date")
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8")
    print(f"wrote {args.out}: {len(FINGERPRINT_CASES)} fingerprint, {len(DERIVE_KEY_CASES)} "
          f"derive_key, {len(INVALID_CASES)} invalid vectors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
