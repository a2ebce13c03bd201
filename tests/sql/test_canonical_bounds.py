"""The canonical form is bounded by its input (issue 49, item 1), called as the request role.

* A number outside 1e-7 <= |n| < 1e21 (and not 0) is written as its significant digits and
  exponent (docs/fingerprint.md), never expanded: ``1e131071`` is 8 characters, not 131,072
  (0.11.0's ``canonical_json('{"a": 1e100000}')`` was 100,007). Every other number keeps its
  plain decimal, and 10, 10.0 and 1e1 are still equal.
* The growth shapes (huge and tiny exponents, deep arrays of big numbers, many keys, long
  strings with escapes) through claim, fingerprint and canonical_json: each call within a time
  far below the seconds 0.11.0 took (45 s and 6.0 GB for a 72 KB claim) and the backend's peak
  memory within a small multiple of the limit.
* The canonical text is measured against settings.max_request_bytes as it is built: a value
  within the limit as jsonb whose text is over it is refused with IK018 naming the argument,
  at the first array or object over the limit, before the rest is built.
* A large value nested deep (each enclosing array and object holds a copy of it) is refused
  with IK018 once those copies pass 8 times the limit, in bounded memory; a body of nearly the
  limit in a few wrapper objects is accepted, with Python's fingerprint.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
from helpers import login_roles

from pg_idempotency.fingerprint import fingerprint, loads
from pgharness import PgServer

MIB = 1024 * 1024
# Seconds one call may take here: far below 0.11.0's (45 s for a 72 KB claim), generous for a
# loaded 2-core machine (the calls take well under a second on an idle one).
CALL_BOUND = 10.0
# Growth of a backend's peak memory (VmHWM) for one call, in kB: a few times the 1 MiB limit
# (the argument, its canonical text, the aggregate building it), against 0.11.0's 6.0 GB.
MEMORY_BOUND_KB = 64 * 1024

# (JSON text, its canonical text)
CASES = [
    ("10", "10"), ("10.0", "10"), ("1e1", "10"), ("1.0E+1", "10"), ("-0", "0"), ("0.000", "0"),
    ("0e-16383", "0"), ("1.50", "1.5"),
    # the plain range's edges: 1e-7 <= |n| < 1e21
    ("999999999999999999999", "999999999999999999999"),
    ("999999999999999999999.99", "999999999999999999999.99"),
    ("9.99e20", "999000000000000000000"), ("1e20", "100000000000000000000"),
    ("1e21", "1e21"), ("-1e21", "-1e21"), ("1500e18", "1.5e21"),
    ("1000000000000000000000.5", "1.0000000000000000000005e21"),
    ("123456789012345678901234567890", "1.2345678901234567890123456789e29"),
    ("1e-7", "0.0000001"), ("-1.5e-7", "-0.00000015"), ("0.00000009", "9e-8"),
    ("1e-8", "1e-8"), ("-123e-30", "-1.23e-28"), ("-1.5e-30", "-1.5e-30"),
    ("-0.00000001000", "-1e-8"),
    # numeric's limits: 131072 digits before the point, 16383 after
    ("1e131071", "1e131071"), ("-9.999e131071", "-9.999e131071"),
    ("1e-16383", "1e-16383"), ("1.5e-16382", "1.5e-16382"),
    ("1" + "0" * 30 + "1", "1." + "0" * 30 + "1e31"),
    ('{"b": [1e100000, 2.50], "a": 1E-9}', '{"a":1e-9,"b":[1e100000,2.5]}'),
]


def vm_hwm(pid: int) -> int:
    """A process's peak resident memory (VmHWM), in kB (the server runs as the tests' user)."""
    return int(re.search(r"^VmHWM:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(),
                         re.M).group(1))  # type: ignore[union-attr]


def measured(db: str, role: str, query: str, params: Any) -> tuple[Any, str | None, float, int]:
    """(first column or None, SQLSTATE or None, seconds, VmHWM growth in kB) of one call on a
    fresh backend, as role."""
    with psycopg.connect(db, user=role, autocommit=True) as app:
        pid = app.execute("SELECT pg_backend_pid()").fetchone()[0]
        app.execute("SELECT idempotency.canonical_json('[1]')")  # the functions compiled
        before = vm_hwm(pid)
        started = time.monotonic()
        try:
            value, code = app.execute(query, params).fetchone()[0], None
        except psycopg.Error as exc:
            value, code = exc.diag.column_name, exc.sqlstate
        elapsed = time.monotonic() - started
        return value, code, elapsed, vm_hwm(pid) - before


def test_numbers_outside_the_plain_range_have_digits_and_an_exponent(server: PgServer,
                                                                     db: str) -> None:
    with login_roles(server, db, "request") as (role,), \
            psycopg.connect(db, user=role, autocommit=True) as app:
        for text, canonical in CASES:
            got, digest = app.execute(
                "SELECT idempotency.canonical_json(%s::jsonb), "
                "idempotency.fingerprint(%s::jsonb)", (text, text)).fetchone()
            assert got == canonical, text
            assert bytes(digest) == hashlib.sha256(canonical.encode()).digest(), text
            # The canonical text is JSON of the same value: read back, it is its own form.
            assert app.execute("SELECT idempotency.canonical_json(%s::jsonb)",
                               (canonical,)).fetchone()[0] == canonical


def growth_shapes() -> dict[str, str]:
    """JSON texts that grew when canonicalized before 0.12.0, each under 1 MiB."""
    big = "1e131071"
    return {
        # the claim: 72 KB of huge exponents (45 s and 6.0 GB before)
        "huge exponents, 72 KB": "[" + ",".join([big] * 9000) + "]",
        "huge exponents, up to the limit": "[" + ",".join([big] * 60_000) + "]",
        "huge exponents, over the limit": "[" + ",".join([big] * 110_000) + "]",
        "tiny exponents": "[" + ",".join(["-9.87654321e-16375"] * 50_000) + "]",
        "digits and exponents": "[" + ",".join(["1.23456789012345678901234567e131040"] * 20_000)
        + "]",
        "deep arrays of big numbers": "[" * 128 + ",".join([big] * 2000) + "]" * 128,
        "many keys": "{" + ",".join(f'"k{i}": {big}' for i in range(40_000)) + "}",
        "many small objects": "[" + ",".join(f'{{"k": {big}, "j": [1e-16383]}}'
                                           for i in range(8_000)) + "]",
    }


@pytest.mark.parametrize("shape", list(growth_shapes()))
def test_growth_shapes_are_claimed_in_bounded_time_and_memory(server: PgServer, db: str,
                                                             shape: str) -> None:
    text = growth_shapes()[shape]
    with psycopg.connect(db, autocommit=True) as owner, \
            login_roles(server, db, "request") as (role,):
        owner.execute("SELECT idempotency._premake()")
        size = owner.execute("SELECT pg_column_size(%s::jsonb)", (text,)).fetchone()[0]
        canonical, code, seconds, grown = measured(
            db, role, "SELECT idempotency.canonical_json(%s::jsonb)", (text,))
        print(f"{shape}: jsonb {size} B, canonical_json {seconds:.3f} s, VmHWM +{grown} kB")
        if size > MIB:
            # over the limit as jsonb: refused before any canonical text is built
            assert (canonical, code) == ("value", "IK018")
        else:
            assert code is None
            # no number is longer than its digits in the text: at most the input, spaces aside
            assert len(canonical) <= len(text)
        assert seconds < CALL_BOUND and grown < MEMORY_BOUND_KB, (seconds, grown)
        outcome, code, seconds, grown = measured(
            db, role, "SELECT outcome FROM idempotency.claim('s', 'k', %s::jsonb)", (text,))
        print(f"{shape}: claim {outcome or code} {seconds:.3f} s, VmHWM +{grown} kB")
        assert (outcome, code) == (("request", "IK018") if size > MIB else ("claimed", None))
        assert seconds < CALL_BOUND and grown < MEMORY_BOUND_KB, (seconds, grown)
        # the retry (a second canonicalization, the fingerprints equal): the same bounds
        outcome, code, seconds, grown = measured(
            db, role, "SELECT outcome FROM idempotency.claim('s', 'k', %s::jsonb)", (text,))
        assert (outcome, code) == (("request", "IK018") if size > MIB
                                   else ("in_progress", None))
        assert seconds < CALL_BOUND and grown < MEMORY_BOUND_KB, (seconds, grown)


def test_the_canonical_text_is_measured_while_it_is_built(server: PgServer, db: str) -> None:
    """An escaped control character is 1 byte in jsonb and 6 in the canonical text: a value
    well within the limit as jsonb has a text over it. Refused with IK018 naming each
    function's argument, at the first array over the limit: its DETAIL names that array's
    size, not the whole text's, which is never built."""
    inner = ["\u0001" * 180_000]  # canonical: 1,080,004 bytes; jsonb: about 180 KB
    text = json.dumps([inner, inner, inner])
    with psycopg.connect(db, autocommit=True) as owner, \
            login_roles(server, db, "request") as (role,), \
            psycopg.connect(db, user=role, autocommit=True) as app:
        owner.execute("SELECT idempotency._premake()")
        assert owner.execute("SELECT pg_column_size(%s::jsonb)", (text,)).fetchone()[0] < MIB
        for query, argument in [
                ("SELECT idempotency.canonical_json(%s::jsonb)", "value"),
                ("SELECT idempotency.fingerprint(%s::jsonb)", "request"),
                ("SELECT idempotency.claim('s', 'k', %s::jsonb)", "request")]:
            with pytest.raises(psycopg.Error) as caught:
                app.execute(query, (text,))
            assert (caught.value.sqlstate, caught.value.diag.column_name) == ("IK018", argument)
            detail = caught.value.diag.message_detail or ""
            size = int(re.search(r"is at least (\d+) bytes", detail).group(1))  # type: ignore
            assert MIB < size < 1_100_000, detail  # one inner array, not the 3.2 MB whole
        assert owner.execute("SELECT count(*) FROM idempotency.keys").fetchone() == (0,)
        # The limit is the setting's: raised, the same value is claimed.
        owner.execute("UPDATE idempotency.settings SET max_request_bytes = 4 * 1048576")
        assert app.execute("SELECT outcome FROM idempotency.claim('s', 'k', %s::jsonb)",
                           (text,)).fetchone() == ("claimed",)
        assert len(app.execute("SELECT idempotency.canonical_json(%s::jsonb)",
                               (text,)).fetchone()[0]) == 3 * 1_080_004 + 4


# Growth of a backend's peak memory (VmHWM), in kB, for a value nested deep around a big one.
# Each array and object on the path holds its own copy of what it encloses while the deeper
# levels are built; before the nesting budget, 128 arrays around 880 KB took about 380 MB.
NESTING_BOUND_KB = 48 * 1024


def test_a_big_value_nested_deep_is_refused_in_bounded_memory(server: PgServer,
                                                              db: str) -> None:
    """128 arrays around 880 KB: within the limit as jsonb and as canonical text, but every
    enclosing array holds a copy of the 880 KB. Refused with IK018 naming the argument once
    the copies held pass 8 times settings.max_request_bytes, its DETAIL saying so."""
    text = "[" * 128 + json.dumps("x" * 880_000) + "]" * 128
    with psycopg.connect(db, autocommit=True) as owner, \
            login_roles(server, db, "request") as (role,):
        owner.execute("SELECT idempotency._premake()")
        assert owner.execute("SELECT pg_column_size(%s::jsonb)", (text,)).fetchone()[0] < MIB
        results = []
        for query in ["SELECT idempotency.canonical_json(%s::jsonb)",
                      "SELECT idempotency.fingerprint(%s::jsonb)",
                      "SELECT idempotency.claim('s', 'k', %s::jsonb)"]:
            got, code, seconds, grown = measured(db, role, query, (text,))
            print(f"{query}: {code} {seconds:.3f} s, VmHWM +{grown} kB")
            results.append(((code, got), seconds, grown))
        for query_result, seconds, grown in results:
            assert query_result[0] == "IK018", query_result
            assert seconds < CALL_BOUND and grown < NESTING_BOUND_KB, (seconds, grown)
        assert [r[0][1] for r in results] == ["value", "request", "request"]
        with psycopg.connect(db, user=role, autocommit=True) as app, \
                pytest.raises(psycopg.Error) as caught:
            app.execute("SELECT idempotency.canonical_json(%s::jsonb)", (text,))
        detail = caught.value.diag.message_detail or ""
        assert "nest" in detail and "8 times settings.max_request_bytes" in detail, detail
        assert owner.execute("SELECT count(*) FROM idempotency.keys").fetchone() == (0,)


def test_a_big_body_in_a_few_wrappers_is_accepted(server: PgServer, db: str) -> None:
    """A body of nearly 1 MiB, itself an object holding an array of objects, wrapped in 3
    objects (as an adapter wraps a body with its method and path): accepted, with Python's
    fingerprint, in bounded memory."""
    items = [{"id": i, "name": f"item {i}", "tags": ["a", "b"], "price": i / 4}
             for i in range(9_000)]
    body = {"data": {"items": items}}
    value = {"outer": {"middle": {"inner": body}}}
    text = json.dumps(value)
    with psycopg.connect(db, autocommit=True) as owner, \
            login_roles(server, db, "request") as (role,):
        owner.execute("SELECT idempotency._premake()")
        size = owner.execute("SELECT pg_column_size(%s::jsonb)", (text,)).fetchone()[0]
        assert 0.8 * MIB < size < MIB, size
        expected = fingerprint(loads(text))
        digest, code, seconds, grown = measured(
            db, role, "SELECT idempotency.fingerprint(%s::jsonb)", (text,))
        print(f"fingerprint: jsonb {size} B, {seconds:.3f} s, VmHWM +{grown} kB")
        assert code is None and bytes(digest) == expected
        assert seconds < CALL_BOUND and grown < MEMORY_BOUND_KB, (seconds, grown)
        outcome, code, seconds, grown = measured(
            db, role, "SELECT outcome FROM idempotency.claim('s', 'k', %s::jsonb)", (text,))
        print(f"claim: {outcome or code} {seconds:.3f} s, VmHWM +{grown} kB")
        assert (outcome, code) == ("claimed", None)
        assert seconds < CALL_BOUND and grown < MEMORY_BOUND_KB, (seconds, grown)
