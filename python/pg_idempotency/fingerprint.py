"""Pure-Python twins of ``idempotency.canonical_json``, ``fingerprint`` and ``derive_key``.

They give byte-identical results to the SQL functions, so a client can compute a request
fingerprint or a downstream key without a round trip (tests/vectors/fingerprint.json holds the
shared test vectors, generated from the database by tools/make_vectors.py).

Values are Python JSON values: ``dict`` (string keys), ``list``/``tuple``, ``str``, ``int``,
:class:`decimal.Decimal`, ``float``, ``bool``, ``None`` (JSON null). To keep a number's exact
decimal value, parse JSON text with :func:`loads` (numbers become ``Decimal``); a ``float`` is
taken as ``Decimal(repr(f))``, which is what the database receives when the same value is sent
through ``psycopg.types.json.Jsonb``.

Bad arguments raise :class:`~pg_idempotency.errors.InvalidArgument` (a ``ValueError``; the
subclass for the SQLSTATE, e.g. ``ArgumentEmpty`` for IK011) whose ``argument`` names the
argument and whose ``sqlstate`` is the code the SQL function raises for the same input (IK01x),
or the one PostgreSQL raises when it cannot take the value as jsonb at all.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterable, Mapping
from decimal import Decimal
from typing import Any

from .errors import InvalidArgument, invalid_argument

__all__ = ["MAX_CANONICAL_BYTES", "MAX_REQUEST_BYTES", "InvalidArgument", "LegacyFingerprint",
           "canonical_json", "described_fingerprint",
           "derive_key", "describe_request", "fingerprint", "key_hash", "loads",
           "request_fingerprint"]

# numeric's limits (PostgreSQL src/backend/utils/adt/numeric.c): at most 131072 digits before
# the decimal point and a display scale of at most 16383 digits after it. jsonb input beyond
# them fails with 22003 "value overflows numeric format".
_NUMERIC_MAX_INT_DIGITS = 131072
_NUMERIC_MAX_DSCALE = 16383
#: ints strictly between -this and this are far inside numeric's limits
_PLAIN_INT = 10**18

# What PostgreSQL's escape_json() writes for the characters it escapes.
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r",
            "\t": "\\t"}
_ESCAPES.update({chr(c): f"\\u{c:04x}" for c in range(0x20) if chr(c) not in _ESCAPES})
_ESCAPE_TABLE = str.maketrans(_ESCAPES)


_TOKENS = re.compile(r'("(?:[^"\\]|\\.)*")|(-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)')


def describe_request(method: str, path: str, query: str | None, content_type: str,
                     body: bytes) -> dict[str, Any]:
    """What every HTTP adapter (:mod:`pg_idempotency.contract`) fingerprints for a request: the
    method, the path, the query string (``None``: it does not count) and the body, a JSON body
    by its parsed value (so its canonical form counts, not its spacing or key order) and any
    other by its sha256. One definition, so a key means the same behind either adapter."""
    described: dict[str, Any] = {"method": method, "path": path}
    if query is not None:
        described["query"] = query
    if body and "json" in content_type:
        try:
            described["json"] = loads(body)
            return described
        except (ValueError, UnicodeDecodeError):
            pass
    described["body_sha256"] = hashlib.sha256(body).hexdigest()
    return described


class _NotPlain(Exception):
    """:func:`_loads_plain` cannot vouch for this text: :func:`loads` takes the full path."""


def _plain_number(literal: str) -> Decimal:
    # Without an exponent and this short, a number is within numeric's limits (at most 100
    # digits either side of the point); anything else goes to the full path, which checks it.
    if len(literal) > 100 or "e" in literal or "E" in literal:
        raise _NotPlain
    return Decimal(literal)


def _loads_plain(text: str | bytes) -> Any:
    """:func:`loads` for the common text: no ``\\u`` escape and no NUL in it (so no string can
    hold U+0000 or an unpaired surrogate, the only strings jsonb refuses), valid Unicode, and
    numbers short and without an exponent. Same value as the full path; raises for anything
    else (the full path then decides, and reports the first problem in text order)."""
    src = text.decode("utf-8") if type(text) is bytes else text
    if type(src) is not str or "\\u" in src or "\x00" in src:
        raise _NotPlain
    if type(text) is str:
        src.encode("utf-8")  # a str may hold surrogates itself: UnicodeEncodeError
    return json.loads(text, parse_float=_plain_number, parse_int=_plain_number,
                      parse_constant=_refuse_constant)


def _refuse_constant(name: str) -> Any:
    raise _NotPlain


def loads(text: str | bytes) -> Any:
    """Parse JSON text as ``jsonb`` would: numbers as exact ``Decimal``, the last of duplicate
    keys wins; NaN/Infinity, ``\\u0000`` and unpaired surrogates are refused (ValueError)."""
    try:
        return _loads_plain(text)
    except Exception:  # noqa: BLE001 - whatever it was, the full path below says it right
        pass
    return _loads_checked(text)


def _loads_checked(text: str | bytes) -> Any:
    """:func:`loads`, every string and number checked, the first bad one in text order."""

    def no_constant(name: str) -> Any:
        raise ValueError(f"invalid JSON: {name} is not a JSON value")

    def number(literal: str) -> Decimal:
        # Checked as parsed, so a value under a duplicate key that a later one overwrites is
        # refused too: jsonb parses every value before it keeps the last.
        value = Decimal(literal)
        _number(value, "loads", "text")
        return value

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        for k, v in items:
            _check_string(k, "loads", "text")
            _check_value(v, "loads", "text")
        return dict(items)

    # jsonb reports the first bad string or number in text order; json.loads builds objects
    # inside out, so check the tokens in order first.
    src = text.decode("utf-8") if isinstance(text, bytes) else text
    for m in _TOKENS.finditer(src):
        if m.group(1) is not None:
            try:
                token = json.loads(m.group(1))
            except ValueError:
                break  # a syntax error: json.loads below says where
            _check_string(token, "loads", "text")
        else:
            _number(Decimal(m.group(2)), "loads", "text")
    value = json.loads(text, parse_float=number, parse_int=number, parse_constant=no_constant,
                       object_pairs_hook=pairs)
    _check_value(value, "loads", "text")
    return value


#: The default limit of :func:`canonical_json` and :func:`fingerprint`, in bytes of canonical
#: text: the engine's default ``settings.max_request_bytes``.
MAX_CANONICAL_BYTES = 1048576


def canonical_json(value: Any, *, max_bytes: int | None = MAX_CANONICAL_BYTES) -> str:
    """The canonical text of a JSON value, equal to ``idempotency.canonical_json(value)``.

    Object members sorted by key in code point order; plain decimal numbers without exponent or
    trailing fractional zeros; strings escaped only where JSON requires; no whitespace.

    ``max_bytes`` (default :data:`MAX_CANONICAL_BYTES`, 1 MiB, the engine's default
    ``settings.max_request_bytes``; None: no limit): a text longer than that, in UTF-8 bytes,
    raises :class:`~pg_idempotency.errors.ArgumentTooLarge` (IK018, ``argument`` "value"),
    checked as the text is built (after each array and object), as the SQL function does.
    """
    fn = "idempotency.canonical_json"
    limit = _limit(max_bytes, fn)
    build = _Build(fn, "value", limit)
    text = _canonical_text(value, fn, "value", build)
    if limit is not None and len(text) * 4 > limit and len(text.encode("utf-8")) > limit:
        raise _too_large(fn, "value", len(text.encode("utf-8")), limit)
    return text


def _limit(max_bytes: int | None, fn: str) -> int | None:
    if max_bytes is None:
        return None
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
        raise invalid_argument(fn, "max_bytes", "IK015",
                               "must be a whole number of bytes, at least 1")
    return max_bytes


def fingerprint(request: Any, defaults: Mapping[str, Any] | None = None,
                fields: Iterable[str] | None = None, *,
                max_bytes: int | None = MAX_CANONICAL_BYTES) -> bytes:
    """sha256 (32 bytes) of the canonical request, equal to ``idempotency.fingerprint``.

    ``defaults`` (an object) is merged under the request first, shallowly: a top-level field
    the request omits takes its default. With ``fields``, only those top-level fields count.
    ``defaults=None`` is the SQL default (``'{}'``), ``fields=None`` the SQL ``NULL``.

    ``max_bytes`` (default :data:`MAX_CANONICAL_BYTES`, 1 MiB): the canonical text of the
    (merged) request longer than that raises
    :class:`~pg_idempotency.errors.ArgumentTooLarge` (IK018, ``argument`` "request"), checked
    as it is built, as :func:`canonical_json`.
    """
    fn = "idempotency.fingerprint"
    limit = _limit(max_bytes, fn)
    if fields is not None:
        if isinstance(fields, (str, bytes)):
            raise invalid_argument(fn, "fields", "IK015",
                                  "must be a list of field names, not a single string")
        fields = list(fields)
    if (defaults is not None and defaults != {}) or fields is not None:
        if not isinstance(request, Mapping):
            raise invalid_argument(fn, "request", "IK015",
                                  "must be a JSON object when defaults or fields are given "
                                  f"(it is a JSON {_json_type(request)})")
        if not isinstance(defaults, Mapping) and defaults is not None:
            raise invalid_argument(fn, "defaults", "IK015",
                                  f"must be a JSON object (it is a JSON {_json_type(defaults)})")
        if fields is not None:
            for name in fields:
                if name is None:
                    raise invalid_argument(fn, "fields", "IK010", "must not contain NULL")
                if not isinstance(name, str):
                    raise invalid_argument(fn, "fields", "IK015",
                                          f"must contain strings, found {type(name).__name__}")
        merged = {**(defaults or {}), **request}
        if fields is not None:
            wanted = set(fields)
            merged = {k: v for k, v in merged.items() if k in wanted}
        request = merged
    return _measured(request, fn, "request", limit)


def _measured(request: Any, fn: str, argument: str, limit: int | None, depth: int = 1) -> bytes:
    """The fingerprint of ``request``, its canonical text built within ``limit`` bytes (IK018
    beyond it), its outermost array or object at nesting level ``depth``."""
    build = _Build(fn, argument, limit)
    data = _canonical_text(request, fn, argument, build, depth).encode("utf-8")
    if limit is not None and len(data) > limit:
        raise _too_large(fn, argument, len(data), limit)
    return _fingerprint(hashlib.sha256(data).digest(), len(data), request, build, depth)


def described_fingerprint(described: Mapping[str, Any], max_bytes: int | None) -> bytes:
    """The fingerprint of a request as :func:`describe_request` describes it (the HTTP
    adapters'): :func:`fingerprint` of that object, the same bytes, but its ``json`` member
    (the body the client sent) nested up to 128 deep counted from the body's own top level, as
    the engine counts a request: the describing object around it is no level of the client's.
    ``max_bytes``: the canonical text's limit (None: none)."""
    return _measured(described, "idempotency.fingerprint", "request", max_bytes, 0)


class LegacyFingerprint(bytes):
    """A fingerprint (the 32 bytes, as any other) of a request holding a number outside
    1e-7 <= |n| < 1e21, which the canonical text writes with an exponent since 0.12.0: before,
    it was written in plain decimal, so a key claimed with the same request before the upgrade
    holds another sha256. ``legacy`` is that one (None when 0.11.0's text is longer than
    :data:`MAX_REQUEST_BYTES`: measured before it is built, and never built). The package's
    claim, given such a fingerprint and answered ``mismatch``, claims again with ``legacy``
    (docs/fingerprint.md, "Before 0.12.0"). Every other fingerprint is plain ``bytes``."""

    legacy: bytes | None


def _fingerprint(digest: bytes, size: int, request: Any, build: _Build, depth: int = 1) -> bytes:
    if not build.exponent_form:
        return digest
    marked = LegacyFingerprint(digest)
    marked.legacy = None
    if size + build.extra <= MAX_REQUEST_BYTES:
        old = _canonical(request, build.fn, build.argument, depth,
                         _Build(build.fn, build.argument, None, legacy=True))
        marked.legacy = hashlib.sha256(old.encode("utf-8")).digest()
    return marked


#: The largest request, in bytes of its canonical text, that :func:`request_fingerprint`
#: takes: the default of the server's ``settings.max_request_bytes`` (IK018 beyond it).
MAX_REQUEST_BYTES = 1048576


def request_fingerprint(request: Any, fn: str = "idempotency.claim",
                        argument: str = "request") -> bytes:
    """What ``idempotency.claim(request => ...)`` computes from a request, computed here: the
    sha256 of its canonical text (:func:`fingerprint` without defaults or fields). The package
    sends it as ``claim(request => NULL, fingerprint => ...)``, so the database does not
    canonicalize the request (issue 32: work the application's machines can do does not run on
    the one database). Refuses what claim refuses, with the same SQLSTATEs naming ``fn`` and
    ``argument``: nesting deeper than 128 (IK014), a canonical text longer than
    :data:`MAX_REQUEST_BYTES` (IK018: checked after each array and object as the text is
    built, and on its bytes at the end), and anything jsonb cannot hold. A request holding a
    number written with an exponent gives a :class:`LegacyFingerprint`."""
    return _measured(request, fn, argument, MAX_REQUEST_BYTES)


def key_hash(scope: str, key: str) -> str:
    """The first 12 hex digits of sha256(scope NUL key): names a key in a log line or a span
    without revealing it (scope and key cannot contain NUL, IK013). Also
    ``pg_idempotency.core.key_hash``; docs/python.md ("OpenTelemetry") says why this hash."""
    return hashlib.sha256(f"{scope}\0{key}".encode()).hexdigest()[:12]


def derive_key(scope: str, key: str, step: str) -> str:
    """``idempotency.derive_key``: hex(sha256(canonical_json([scope, key, step]))).

    Each argument must be a non-empty string of at most 255 characters without control
    characters (U+0000..U+001F, U+007F..U+009F), as for every name in the SQL API.
    """
    fn = "idempotency.derive_key"
    for argument, value in (("scope", scope), ("key", key), ("step", step)):
        _check_name(fn, argument, value)
    text = _canonical([scope, key, step], fn, "key")
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# -- internals ------------------------------------------------------------------------------

def _check_name(fn: str, argument: str, value: Any) -> None:
    """idempotency._check_name: same rules, same SQLSTATEs."""
    if value is None:
        raise invalid_argument(fn, argument, "IK010", "must not be NULL")
    if not isinstance(value, str):
        raise invalid_argument(fn, argument, "IK015",
                              f"must be a string, not {type(value).__name__}")
    if value == "":
        raise invalid_argument(fn, argument, "IK011", "must not be empty")
    if len(value) > 255:
        raise invalid_argument(fn, argument, "IK012",
                              f"must be at most 255 characters long (it is {len(value)})")
    for pos, ch in enumerate(value, 1):
        # PostgreSQL's regex class [[:cntrl:]] is exactly these, whatever the locale
        # (src/backend/regex/regc_locale.c).
        if ch <= "\x1f" or "\x7f" <= ch <= "\x9f":
            raise invalid_argument(fn, argument, "IK013",
                                  f"must not contain control characters (found U+{ord(ch):04X} "
                                  f"at character {pos})")
    _check_string(value, fn, argument)


def _json_type(value: Any) -> str:
    """jsonb_typeof's name for a Python JSON value."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float, Decimal)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, Mapping):
        return "object"
    if isinstance(value, (list, tuple)):
        return "array"
    return type(value).__name__


def _check_string(s: str, fn: str, argument: str) -> None:
    if "\x00" in s:
        # PostgreSQL text cannot hold NUL; jsonb refuses \u0000 with 22P05.
        raise invalid_argument(fn, argument, "22P05",
                              "contains U+0000, which PostgreSQL text cannot hold")
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise invalid_argument(fn, argument, "22P02",
                              "contains an unpaired surrogate (not valid Unicode)") from None


def _check_value(value: Any, fn: str, argument: str) -> None:
    """Walk a parsed value for strings jsonb would refuse (json.loads lets them through)."""
    if isinstance(value, str):
        _check_string(value, fn, argument)
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_string(k, fn, argument)
            _check_value(v, fn, argument)
    elif isinstance(value, list):
        for v in value:
            _check_value(v, fn, argument)


def _number(value: int | float | Decimal, fn: str, argument: str,
            build: _Build | None = None) -> str:
    """idempotency._canonical_number(value): trim_scale(value::numeric)::text when the exponent
    of the first significant digit (``adjusted()``) is within -7..20 (1e-7 <= |value| < 1e21),
    else the significant digits and that exponent (1.5e21), never the expansion of a huge or
    tiny number. Marks ``build`` when it writes the exponent form."""
    if type(value) is int and -_PLAIN_INT < value < _PLAIN_INT:
        return str(value)  # what the Decimal path below gives for an int this small
    if isinstance(value, float):
        if not math.isfinite(value):
            raise invalid_argument(fn, argument, "22P02", f"contains {value!r}, not a JSON number")
        value = Decimal(repr(value))
    elif isinstance(value, int):
        value = Decimal(value)
    if not value.is_finite():
        raise invalid_argument(fn, argument, "22P02", f"contains {value}, not a JSON number")
    exponent = value.as_tuple().exponent
    assert isinstance(exponent, int)
    # The scale limit holds for zero too: PostgreSQL refuses 0e-16384 (22003).
    if -exponent > _NUMERIC_MAX_DSCALE or (
            not value.is_zero() and value.adjusted() >= _NUMERIC_MAX_INT_DIGITS):
        raise invalid_argument(fn, argument, "22003",
                              "contains a number outside PostgreSQL numeric's range "
                              "(131072 digits before the point, 16383 after)")
    if value.is_zero():
        return "0"  # numeric has no negative zero, and 0.000 trims to 0
    adjusted = value.adjusted()
    if -7 <= adjusted <= 20 or (build is not None and build.legacy):
        text = format(value, "f")
        if "." in text:
            text = text.rstrip("0").rstrip(".")
        return text
    sign, digits, _ = value.as_tuple()
    end = len(digits)
    while digits[end - 1] == 0:
        end -= 1  # the last digit of a non-zero value's digits that is not 0
    rest = "".join(map(str, digits[1:end]))
    text = (("-" if sign else "") + str(digits[0]) + ("." + rest if rest else "")
            + "e" + str(adjusted))
    if build is not None:
        # What 0.11.0 wrote instead (the plain decimal), measured without writing it.
        build.exponent_form = True
        build.extra += sign + (adjusted + 1 + (end - adjusted if end - 1 > adjusted else 0)
                               if adjusted >= 0 else 1 - adjusted + end) - len(text)
    return text


def _string(s: str, fn: str, argument: str) -> str:
    if s.isascii() and s.isprintable() and '"' not in s and "\\" not in s:
        # U+0020..U+007E only: nothing to check (no NUL, no surrogate), nothing to escape
        return '"' + s + '"'
    _check_string(s, fn, argument)
    return '"' + s.translate(_ESCAPE_TABLE) + '"'


# As idempotency._canonical_json: arrays and objects nested deeper than this are refused
# (IK014), so the database and this twin refuse the same requests.
MAX_DEPTH = 128


class _Build:
    """What :func:`_canonical` keeps while it builds one text: the size limit it checks the text
    against as it grows (``limit``, in characters; None: none), and whether a number was written
    in the exponent form (``exponent_form``), so that its text differs from 0.11.0's."""

    __slots__ = ("argument", "exponent_form", "extra", "fn", "legacy", "limit")

    def __init__(self, fn: str, argument: str, limit: int | None, legacy: bool = False) -> None:
        #: whether a number was written with an exponent, and how much longer 0.11.0's plain
        #: decimals of those numbers are (bytes)
        self.exponent_form, self.extra = False, 0
        #: write every number in plain decimal, as 0.11.0 did
        self.legacy = legacy
        self.fn, self.argument, self.limit = fn, argument, limit

    def check(self, text: str) -> str:
        """``text``, an array or object just built, within the limit; else IK018 at once.
        Characters are at most bytes, so a text over the limit in characters is over it in
        bytes; the caller measures the bytes of the whole text at the end."""
        if self.limit is not None and len(text) > self.limit:
            raise _too_large(self.fn, self.argument, len(text), self.limit, "at least ")
        return text


def _too_large(fn: str, argument: str, size: int, limit: int, at_least: str = "") -> Exception:
    # The server's words (idempotency._check_size with canonical => true): the canonical text the
    # fingerprint hashes, measured as it is built.
    error = invalid_argument(fn, argument, "IK018", "is too large")
    error.detail = (f"Its canonical JSON (docs/fingerprint.md) is {at_least}{size} bytes; the "
                    f"limit (settings.max_request_bytes) is {limit} bytes.")
    error.hint = ("Nothing was written. Send a smaller request. The package checks the "
                  "request's canonical JSON against the default limit; see docs/errors.md.")
    return error


def _object(value: Mapping[str, Any], fn: str, argument: str, depth: int,
            build: _Build | None = None) -> str:
    """An object whose keys are known to be strings: members sorted by key, no whitespace."""
    text = "{" + ",".join(
        _string(k, fn, argument) + ":" + _canonical(value[k], fn, argument, depth + 1, build)
        for k in sorted(value)
    ) + "}"
    return text if build is None else build.check(text)


def _not_plain(value: Any) -> Any:
    raise _NotPlain


def _no_float(literal: str) -> Any:
    raise _NotPlain


#: The C encoder of the standard library, in the canonical form's spelling: members sorted by
#: key (code point order, as sorted() does), strings escaped exactly as _string escapes them
#: (", \\, and U+0000..U+001F, the short forms \\b \\f \\n \\r \\t and \\u00xx for the
#: others), no whitespace; anything but dict, list, tuple, str, int, float, bool and None
#: raises (_not_plain), and so do NaN and the infinities.
_SORTED_DUMPS = json.JSONEncoder(ensure_ascii=False, allow_nan=False, sort_keys=True,
                                 separators=(",", ":"), default=_not_plain).encode
#: json.loads that refuses floats (made once: json.loads with an argument makes a decoder per
#: call).
_LOADS_NO_FLOAT = json.JSONDecoder(parse_float=_no_float).decode
#: 22 digits in a row: maybe an integer of 1e21 or more, which _number writes with an exponent.
_LONG_INT = re.compile("[0-9]{22}").search


def _canonical_text(value: Any, fn: str, argument: str, build: _Build | None = None,
                    depth: int = 1) -> str:
    """:func:`_canonical` of ``value``, by the C encoder when that provably gives the same text
    (the common case: a payment request), else by :func:`_canonical` itself, which also says
    what is wrong. The C encoder's text is _canonical's when it holds no float (a
    float is written by repr, _canonical writes numeric's text), every object key is a string
    (the encoder turns 1, True and None keys into strings), no string holds U+0000 or an
    unpaired surrogate, and nothing nests deeper than MAX_DEPTH. The text read back without
    floats (_no_float) and equal to ``value`` proves the first two; a text with no ``\\u0000``
    that encodes as UTF-8 the third; at most MAX_DEPTH brackets in all (inside strings too)
    the last. Integers below 1e21 are written alike by both (digits; one too long for str()
    raises and takes the slow path); a run of 22 digits anywhere in the text (an integer of
    1e21 or more, written with an exponent by _number, or only digits in a string) takes the
    slow path. Every doubt takes the slow path, which is always right. An empty dict
    (complete's headers, most of the time) is ``{}`` at once."""
    if type(value) is dict and not value:
        return "{}"
    try:
        text = _SORTED_DUMPS(value)
        if ("\\u0000" not in text and text.count("{") + text.count("[") <= MAX_DEPTH + 1 - depth
                and _LONG_INT(text) is None and _LOADS_NO_FLOAT(text) == value):
            text.encode("utf-8")  # an unpaired surrogate: UnicodeEncodeError
            return text if build is None else build.check(text)
    except (_NotPlain, TypeError, ValueError, RecursionError):
        pass  # (UnicodeEncodeError and json's errors are ValueErrors)
    return _canonical(value, fn, argument, depth, build)


def _canonical(value: Any, fn: str, argument: str, depth: int = 1,
               build: _Build | None = None) -> str:
    kind = type(value)
    if kind is str:
        return _string(value, fn, argument)
    if kind is dict and depth <= MAX_DEPTH:
        # the common case first: a dict with string keys, not too deep (as for a Mapping below)
        for k in value:
            if type(k) is not str:
                break
        else:
            return _object(value, fn, argument, depth, build)
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, str):
        return _string(value, fn, argument)
    if isinstance(value, (int, float, Decimal)):
        return _number(value, fn, argument, build)
    if isinstance(value, (Mapping, list, tuple)) and depth > MAX_DEPTH:
        raise invalid_argument(fn, argument, "IK014",
                              f"must not nest arrays and objects more than {MAX_DEPTH} deep")
    if isinstance(value, Mapping):
        for k in value:
            if not isinstance(k, str):
                raise invalid_argument(fn, argument, "22P02",
                                      f"has an object key {k!r} that is not a string")
        return _object(value, fn, argument, depth, build)
    if isinstance(value, (list, tuple)):
        text = "[" + ",".join(_canonical(v, fn, argument, depth + 1, build) for v in value) + "]"
        return text if build is None else build.check(text)
    raise invalid_argument(fn, argument, "22P02",
                          f"contains a {type(value).__name__}, which is not a JSON value")
