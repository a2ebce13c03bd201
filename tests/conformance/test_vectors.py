"""tests/vectors/fingerprint.json: the SQL functions and the Python twins give every vector.

The vectors were generated from the database by tools/make_vectors.py; here both servers must
still give them, and pg_idempotency.fingerprint must give them byte for byte. Java, Go and Ruby
check them too (tests/conformance/{java/Vectors.java,go/vectors,ruby/vectors.rb}): SHA-256 of
each canonical text computed in the language, the database's fingerprint, canonical_json and
derive_key through the language's driver. (Every runner of tests/conformance also runs the
vectors as scenarios/fingerprint_vectors.json, with the invalid inputs.)
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
from decimal import Decimal
from pathlib import Path

import psycopg
import pytest

from conformance import HERE, langs
from pg_idempotency import queries
from pg_idempotency.fingerprint import (
    InvalidArgument,
    canonical_json,
    derive_key,
    fingerprint,
    loads,
)
from pgharness import WAIT_BOUND

VECTORS_FILE = Path(__file__).resolve().parents[1] / "vectors" / "fingerprint.json"
VECTORS = json.loads(VECTORS_FILE.read_text(encoding="utf-8"))
FP = VECTORS["fingerprint"]
DK = VECTORS["derive_key"]
INVALID = VECTORS["invalid"]


def _ids(vectors: list[dict]) -> list[str]:
    return [v["name"] for v in vectors]


def _effective_request(v: dict) -> tuple[object, dict | None]:
    return loads(v["request"]), (loads(v["defaults"]) if "defaults" in v else None)


# -- the database ---------------------------------------------------------------------------

def test_sql_matches_vectors(db: str) -> None:
    with psycopg.connect(db, autocommit=True) as conn:
        for v in FP:
            plain = "defaults" not in v and "fields" not in v
            if plain:
                canonical, digest = conn.execute(
                    "SELECT idempotency.canonical_json(%(r)s::jsonb),"
                    " encode(idempotency.fingerprint(%(r)s::jsonb), 'hex')",
                    {"r": v["request"]},
                ).fetchone()
                assert canonical == v["canonical"], v["name"]
            else:
                (digest,) = conn.execute(
                    "SELECT encode(idempotency.fingerprint(request => %(r)s::jsonb,"
                    " defaults => coalesce(%(d)s::jsonb, '{}'), fields => %(f)s::text[]), 'hex')",
                    {"r": v["request"], "d": v.get("defaults"), "f": v.get("fields")},
                ).fetchone()
            assert digest == v["sha256_hex"], v["name"]
            # canonical_json is a fixed point: the canonical text canonicalizes to itself.
            (again,) = conn.execute(
                "SELECT idempotency.canonical_json(%s::jsonb)", (v["canonical"],)
            ).fetchone()
            assert again == v["canonical"], v["name"]
        for v in DK:
            (derived,) = conn.execute(
                "SELECT idempotency.derive_key(scope => %s::text, key => %s::text,"
                " step => %s::text)",
                (v["scope"], v["key"], v["step"]),
            ).fetchone()
            assert derived == v["derived"], v["name"]


def test_sql_refuses_invalid_vectors(db: str) -> None:
    with psycopg.connect(db, autocommit=True) as conn:
        for v in INVALID:
            a = v["args"]
            with pytest.raises(psycopg.Error) as info:
                conn.execute(queries.DERIVE_KEY if v["function"] == "derive_key"
                             else queries.FINGERPRINT, a)
            assert info.value.sqlstate == v["sqlstate"], v["name"]
            if v["argument"] is not None:
                assert info.value.diag.column_name == v["argument"], v["name"]


# -- from Java, Go and Ruby ------------------------------------------------------------------

def _vectors_command(lang: str) -> list[str]:
    if lang == "go":
        return [str(langs.go_binary("vectors", [HERE / "go" / "vectors" / "vectors.go"]))]
    if lang == "java":
        return langs.java_command("Vectors", [HERE / "java" / "Vectors.java",
                                              HERE / "java" / "Run.java"])
    return [langs.need("ruby", "ruby"), str(HERE / "ruby" / "vectors.rb")]


@pytest.mark.parametrize("lang", langs.LANGS)
def test_vectors_from_other_languages(db: str, lang: str, tmp_path: Path) -> None:
    proc = subprocess.run([*_vectors_command(lang), str(VECTORS_FILE), db], capture_output=True,
                          text=True, timeout=WAIT_BOUND)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines() == [f"vectors: {len(FP)} fingerprint, {len(DK)} derive_key,"
                                        " 0 failed"]
    # The same program fails on one changed vector.
    changed = json.loads(VECTORS_FILE.read_text(encoding="utf-8"))
    changed["fingerprint"][-1]["sha256_hex"] = "00" * 32
    changed["derive_key"][0]["derived"] = re.sub("^.", "0", changed["derive_key"][0]["derived"])
    if changed["derive_key"][0]["derived"] == DK[0]["derived"]:
        changed["derive_key"][0]["derived"] = "1" + DK[0]["derived"][1:]
    bad = tmp_path / "fingerprint.json"
    bad.write_text(json.dumps(changed), encoding="utf-8")
    proc = subprocess.run([*_vectors_command(lang), str(bad), db], capture_output=True,
                          text=True, timeout=WAIT_BOUND)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout.splitlines() == [f"vectors: {len(FP)} fingerprint, {len(DK)} derive_key,"
                                        " 3 failed"], proc.stderr


# -- the Python twins -----------------------------------------------------------------------

def test_vectors_cover_the_brief() -> None:
    requests = {v["request"] for v in FP}
    for spelling in ["10", "10.0", "1e1", "-0", "0.000", "1.50", "1e-7",
                     "123456789012345678901234567890", "-1.5E+3", "{}", "[]"]:
        assert spelling in requests
    assert any("defaults" in v for v in FP) and any("fields" in v for v in FP)
    assert len(DK) >= 5 and len(INVALID) >= 5


@pytest.mark.parametrize("v", FP, ids=_ids(FP))
def test_python_fingerprint(v: dict) -> None:
    request, defaults = _effective_request(v)
    digest = fingerprint(request, defaults=defaults, fields=v.get("fields"))
    assert digest.hex() == v["sha256_hex"]
    assert hashlib.sha256(v["canonical"].encode("utf-8")).hexdigest() == v["sha256_hex"]
    if "defaults" not in v and "fields" not in v:
        assert canonical_json(request) == v["canonical"]
    assert canonical_json(loads(v["canonical"])) == v["canonical"]


@pytest.mark.parametrize("v", DK, ids=_ids(DK))
def test_python_derive_key(v: dict) -> None:
    assert derive_key(v["scope"], v["key"], v["step"]) == v["derived"]


@pytest.mark.parametrize("v", INVALID, ids=_ids(INVALID))
def test_python_refuses_invalid_vectors(v: dict) -> None:
    a = v["args"]
    with pytest.raises(ValueError) as info:
        if v["function"] == "derive_key":
            derive_key(a["scope"], a["key"], a["step"])
        else:
            request = loads(a["request"])
            defaults = loads(a["defaults"]) if a["defaults"] is not None else None
            fingerprint(request, defaults=defaults, fields=a["fields"])
    if v["argument"] is not None:
        assert isinstance(info.value, InvalidArgument)
        assert info.value.argument == v["argument"]
        assert info.value.sqlstate == v["sqlstate"]
        assert f'argument "{v["argument"]}"' in str(info.value)


def test_python_values_not_from_text() -> None:
    """Floats, ints, tuples and bools as psycopg's Jsonb would send them."""
    assert canonical_json({"b": 1.5, "a": (1, 2.0, True, None), "c": 10**30}) == (
        '{"a":[1,2,true,null],"b":1.5,"c":1e30}'
    )
    assert canonical_json(1e-7) == "0.0000001"
    assert canonical_json(-0.0) == "0"
    assert canonical_json(Decimal("-1.5E+3")) == "-1500"
    for bad in [float("nan"), float("inf"), Decimal("NaN"), {1: "x"}, object(), "a\x00b"]:
        with pytest.raises(ValueError):
            canonical_json(bad)
    with pytest.raises(InvalidArgument, match='"fields"'):
        fingerprint({"a": 1}, fields="a")


def test_python_matches_sql_for_values_sent_as_jsonb(db: str) -> None:
    from psycopg.types.json import Jsonb

    values = [{"b": 1.5, "a": [0.1, 1e-7, 1e22, -0.0, 2**70]}, "é\x1f\x7f", [True, None]]
    with psycopg.connect(db, autocommit=True) as conn:
        for value in values:
            (canonical,) = conn.execute(
                "SELECT idempotency.canonical_json(%s)", (Jsonb(value),)
            ).fetchone()
            assert canonical_json(value) == canonical


def _nested(depth: int) -> object:
    """An array nested ``depth`` deep (the outermost counts), with a small object inside."""
    value: object = {"a": 1}
    for _ in range(depth - 1):
        value = [value]
    return value


@pytest.mark.parametrize("depth", [128, 129, 600])
def test_nesting_limit_is_the_same_in_sql_and_python(db: str, depth: int) -> None:
    """Up to 128 nested arrays and objects are fine in both; deeper is IK014 naming the
    argument in both (without the limit the database ran out of stack, 54001, at ~520)."""
    request = _nested(depth)
    text = json.dumps(request)
    with psycopg.connect(db, autocommit=True) as conn:
        calls = [("SELECT idempotency.fingerprint(%s::jsonb)", "request", fingerprint),
                 ("SELECT idempotency.canonical_json(%s::jsonb)", "value", canonical_json),
                 ("SELECT (idempotency.claim('nest', 'k', %s::jsonb)).outcome", "request", None)]
        for sql, argument, twin in calls:
            if depth <= 128:
                got = conn.execute(sql, (text,)).fetchone()[0]
                if twin is fingerprint:
                    assert got == fingerprint(request)
                elif twin is canonical_json:
                    assert got == canonical_json(request)
                else:
                    assert got == "claimed"
                continue
            with pytest.raises(psycopg.Error) as info:
                conn.execute(sql, (text,))
            assert (info.value.sqlstate, info.value.diag.column_name) == ("IK014", argument)
            if twin is not None:
                with pytest.raises(InvalidArgument) as py:
                    twin(request)
                assert (py.value.sqlstate, py.value.argument) == ("IK014", argument)
        if depth > 128:
            assert conn.execute("SELECT count(*) FROM idempotency.keys WHERE scope = 'nest'"
                                ).fetchone()[0] == 0


def test_fields_must_be_one_dimensional(db: str) -> None:
    with psycopg.connect(db, autocommit=True) as conn, pytest.raises(psycopg.Error) as info:
        conn.execute("SELECT idempotency.fingerprint('{\"a\": 1}', "
                     "fields => ARRAY[['a', 'b'], ['c', 'd']])")
    assert (info.value.sqlstate, info.value.diag.column_name) == ("IK015", "fields")
    with pytest.raises(InvalidArgument) as py:
        fingerprint({"a": 1}, fields=[["a", "b"], ["c", "d"]])
    assert (py.value.sqlstate, py.value.argument) == ("IK015", "fields")
