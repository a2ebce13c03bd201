"""The Python twin's canonical form is bounded by its input (issue 49, item 1), without a server.

* Numbers outside 1e-7 <= |n| < 1e21 with digits and exponent, as the SQL (the vectors of
  tests/vectors/fingerprint.json hold the cases; tests/test_vectors.py compares every one):
  here the shapes that grew without bound before 0.12.0, in time and memory far below the 21 s
  and 0.8-1.0 GB one 27 KB HTTP body took, and never longer than the JSON text.
* request_fingerprint (the package's claim) measures the canonical text against
  MAX_REQUEST_BYTES as it builds it: IK018 at the first array or object over the limit.
* A request holding such a number gets a LegacyFingerprint carrying 0.11.0's fingerprint of it
  (which the package's claim tries after a mismatch), computed only when 0.11.0's text fits the
  limit, measured before it is built; every other fingerprint is plain bytes.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
import tracemalloc
from decimal import Decimal
from pathlib import Path

import pytest

from pg_idempotency.errors import ArgumentTooLarge, InvalidArgument
from pg_idempotency.fingerprint import (
    MAX_CANONICAL_BYTES,
    MAX_REQUEST_BYTES,
    LegacyFingerprint,
    _canonical,
    canonical_json,
    fingerprint,
    loads,
    request_fingerprint,
)

# CPU seconds and bytes one call may take: far below 0.11.0's (21 s, 0.8-1.0 GB for 27 KB).
# CPU time of this thread, not the clock's: on a loaded machine the clock also counts the
# other processes' turns (a make test beside other work went over 10 s of wall time).
CALL_BOUND = 10.0
MEMORY_BOUND = 64 * 1024 * 1024


def shapes() -> dict[str, str]:
    big = "1e131071"
    return {
        "huge exponents, 27 KB (the issue's HTTP body)": "[" + ",".join([big] * 3000) + "]",
        "huge exponents, 1 MB": "[" + ",".join([big] * 110_000) + "]",
        "tiny exponents": "[" + ",".join(["-9.87654321e-16375"] * 50_000) + "]",
        "digits and exponents": "[" + ",".join(["1.23456789012345678901234567e131040"] * 20_000)
        + "]",
        "deep arrays of big numbers": "[" * 128 + ",".join([big] * 20_000) + "]" * 128,
        "many keys": "{" + ",".join(f'"k{i}": {big}' for i in range(40_000)) + "}",
        "big integers": "[" + ",".join(["1" + "0" * 4000] * 200) + "]",
    }


@pytest.mark.parametrize("shape", list(shapes()))
def test_growth_shapes_canonicalize_in_bounded_time_and_memory(shape: str) -> None:
    text = shapes()[shape]
    value = loads(text)
    started = time.thread_time()
    canonical = canonical_json(value)
    digest = fingerprint(value)
    elapsed = time.thread_time() - started
    # Memory apart (tracemalloc slows every allocation down many times over).
    tracemalloc.start()
    try:
        canonical_json(value)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    print(f"{shape}: {len(text)} B of JSON, canonical {len(canonical)} B, {elapsed:.3f} s, "
          f"peak {peak // 1024} kB")
    assert len(canonical) <= len(text)
    assert bytes(digest) == hashlib.sha256(canonical.encode()).digest()
    assert isinstance(digest, LegacyFingerprint)
    # 0.11.0's text: over 1 MiB, never built; the big integers' is their JSON text
    assert (digest.legacy is None) is (shape != "big integers")
    assert elapsed < CALL_BOUND and peak < MEMORY_BOUND, (elapsed, peak)
    if len(canonical) <= MAX_REQUEST_BYTES:
        assert request_fingerprint(value) == digest
    else:
        with pytest.raises(ArgumentTooLarge):
            request_fingerprint(value)


def test_integers_from_1e21_take_the_exponent_form_on_every_path() -> None:
    """The C encoder's fast path writes an int's digits: one of 22 digits or more goes to the
    slow path, which writes it with an exponent, whatever type holds it."""
    for value, text in [(10**21, "1e21"), (-(10**25), "-1e25"), (10**21 - 1, "9" * 21),
                        (12 * 10**30, "1.2e31"), (Decimal("1E+21"), "1e21"), (1e21, "1e21"),
                        (1.5e-8, "1.5e-8"), (1e-7, "0.0000001")]:
        assert canonical_json(value) == text, value
        assert canonical_json({"a": [value, 1, "x"]}) == '{"a":[' + text + ',1,"x"]}'
        assert canonical_json({"a": [value]}) == _canonical({"a": [value]}, "f", "a")
    # 22 digits in a string only: the slow path, the same text
    assert canonical_json({"id": "1234567890123456789012"}) == '{"id":"1234567890123456789012"}'


def test_ordinary_fingerprints_are_plain_bytes_and_unchanged() -> None:
    request = {"amount": 1050, "currency": "EUR", "rate": Decimal("1.25"), "tiny": 1e-7,
               "big": 10**20}
    digest = request_fingerprint(request)
    assert type(digest) is bytes and type(fingerprint(request)) is bytes
    assert digest == hashlib.sha256(
        b'{"amount":1050,"big":100000000000000000000,"currency":"EUR","rate":1.25,'
        b'"tiny":0.0000001}').digest()
    marked = request_fingerprint({"amount": Decimal("1e21"), "x": [-1.5e-9, 10**22 + 1]})
    assert isinstance(marked, LegacyFingerprint)
    assert marked == hashlib.sha256(b'{"amount":1e21,"x":[-1.5e-9,1.0000000000000000000001e22]}'
                                    ).digest()
    assert marked.legacy == hashlib.sha256(
        b'{"amount":1000000000000000000000,"x":[-0.0000000015,10000000000000000000001]}'
    ).digest()
    # 0.11.0's text just within the limit is built; one byte more, it is not
    fits = [Decimal("1e131071")] * 7 + [Decimal("1e" + str(MAX_REQUEST_BYTES - 7 * 131073 - 3))]
    assert len(canonical_json(fits)) < 200
    old = fingerprint(fits)
    assert isinstance(old, LegacyFingerprint) and old.legacy is not None
    over = fits[:-1] + [Decimal("1e" + str(MAX_REQUEST_BYTES - 7 * 131073 - 2))]
    assert fingerprint(over).legacy is None  # type: ignore[attr-defined]


def test_request_fingerprint_measures_the_text_while_it_builds_it() -> None:
    """Escaped control characters: 1 character in the value, 6 in the text. The first inner
    array over the limit is refused, before the others are built."""
    inner = ["\u0001" * 180_000, Decimal("1.5")]  # a Decimal: the slow path, level by level
    with pytest.raises(ArgumentTooLarge) as caught:
        request_fingerprint({"a": [inner, inner, inner]})
    error = caught.value
    assert (error.sqlstate, error.argument) == ("IK018", "request")
    assert "is at least 1080008 bytes" in error.detail
    # within the limit: the same text as canonical_json
    small = {"a": ["\n" * 1000, Decimal("1e-30")]}
    assert request_fingerprint(small) == hashlib.sha256(
        canonical_json(small).encode()).digest()
    assert json.loads(canonical_json(small)) == {"a": ["\n" * 1000, 1e-30]}


def test_the_public_functions_have_a_limit() -> None:
    """canonical_json and fingerprint refuse a canonical text over max_bytes (default 1 MiB)
    with IK018, checked as the text is built: an inner array over the limit is refused before
    the next is built; max_bytes=None lifts the limit; within it, the same text."""
    assert MAX_CANONICAL_BYTES == 1048576
    inner = ["\u0001" * 180_000, Decimal("1.5")]  # 1,080,010 bytes of text, 180,000 characters
    for call, fn, argument in [(canonical_json, "idempotency.canonical_json", "value"),
                               (fingerprint, "idempotency.fingerprint", "request")]:
        with pytest.raises(ArgumentTooLarge) as caught:
            call({"a": [inner, inner, inner]})  # type: ignore[operator]
        error = caught.value
        assert (error.sqlstate, error.function, error.argument) == ("IK018", fn, argument)
        assert "is at least 1080008 bytes" in error.detail
        with pytest.raises(ArgumentTooLarge):  # the plain path (str, list): measured too
            call(["x" * 600] * 2000)  # type: ignore[operator]
        with pytest.raises(ArgumentTooLarge):
            call({"a": 1}, max_bytes=6)  # type: ignore[operator]
        call({"a": 1}, max_bytes=7)  # type: ignore[operator]
        with pytest.raises(InvalidArgument):
            call({"a": 1}, max_bytes=0)  # type: ignore[operator]
    assert len(canonical_json(["x" * 600] * 2000, max_bytes=None)) == 2000 * 603 + 1
    assert fingerprint({"a": [inner]}, max_bytes=None) == hashlib.sha256(
        canonical_json({"a": [inner]}, max_bytes=None).encode()).digest()
    # UTF-8 bytes, not characters
    assert canonical_json(["é" * 10], max_bytes=24) == '["' + "é" * 10 + '"]'
    with pytest.raises(ArgumentTooLarge):
        canonical_json(["é" * 10], max_bytes=23)


def test_the_docs_example_runs() -> None:
    """docs/fingerprint.md's example ("In Python"), run as written."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "fingerprint.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```$", text, re.M | re.S)
    assert len(blocks) == 1
    exec(compile(blocks[0], "docs/fingerprint.md", "exec"), {})  # noqa: S102
