"""The HTTP contract of the Idempotency-Key header, written once for every framework adapter.

Pure functions and small types, no framework and no database: the ASGI middleware
(:mod:`pg_idempotency.asgi`), the Django decorator and middleware
(:mod:`pg_idempotency.django`) and the Flask/WSGI adapter (:mod:`pg_idempotency.flask`) each
only translate their request and response objects to and from these, and run the handler in
their framework's transaction. docs/http.md states the same contract in prose:

- which routes are keyed, and how (:class:`Routes`, :class:`Route`, :class:`Policy`): only the
  listed ones by default; per route, the body fields the fingerprint covers and the lease;
- the key (:func:`read_key`): an RFC 8941 sf-string of printable ASCII, 400 when missing on a
  required route or invalid, and when the request carries more than one (:func:`repeated_key`:
  the header repeated, whether the server kept the values apart or joined them with commas);
- the body (:class:`BodyReader`, :func:`read_body`): read whole before anything is
  fingerprinted, claimed or run; 400 when it ends before its Content-Length or last chunk (the
  client gone, whatever the server does then), 400 for a Content-Length that is not a number;
- the limits (:func:`too_large`, :func:`response_too_large`): 413 for a request body over
  ``max_request_bytes`` before any claim; 507 for an answer over ``max_response_bytes``, never
  stored (the handler's writes roll back, the key is released); 411 (:func:`length_required`)
  for a chunked body where the framework reads none (Django), before any claim;
- the request (:func:`keyed_request`): the caller's scope checked (400 naming it) and the
  fingerprint (400 for a body the fingerprint refuses, e.g. nested deeper than 128 levels of its
  own);
- what the fingerprint covers (:func:`request_fingerprint`): method, path, body (a JSON body by
  its canonical form), the query string only when asked (``fingerprint_query``);
- the answer to a claim (:func:`claim_answer`): run the handler, replay the stored response
  with ``Idempotent-Replayed: true``, 422 problem+json, or 409 with ``Retry-After``; and
  waiting for an attempt in progress (:func:`claim_waiting`, :func:`aclaim_waiting`);
- what is stored (:func:`stores`, :func:`stored_parts`): 2xx, 3xx and 4xx answers of a handler
  that ran; 5xx only with ``store_server_errors``; an error answer made before the handler
  started is released instead;
- an outage (:func:`unavailable`, :func:`outage`): the database cannot be reached, the
  connection was lost, the server restarts: 503 with Retry-After, never stored, never a 500.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import time
from collections.abc import (
    Awaitable,
    Callable,
    Generator,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from ._calls import DEFAULT_LEASE
from ._results import ClaimResult, Outcome, StoredResponse
from ._routes import Policy, Route, Routes
from .errors import (
    DEFAULT_UNAVAILABLE_RETRY_AFTER,
    ArgumentTooLarge,
    InvalidArgument,
    connection_lost,
)
from .fingerprint import _check_name, describe_request, described_fingerprint

__all__ = ["CANONICAL_GROWTH", "DEFAULT_REPLAY_HEADERS", "Answer", "BodyReader", "Handling",
           "Keyed", "Policy", "Route", "Routes", "Settings", "content_too_long", "keyed_request",
           "read_body", "repeated_key", "response_too_large", "too_large", "too_large_answer",
           "aclaim_waiting", "body_complete", "chunked_without_length", "claim_answer",
           "claim_waiting", "guarded", "length_required",
           "handling_of", "in_progress", "incomplete_body", "no_connection", "outage", "problem",
           "parse_key", "read_key", "register_guard", "request_fingerprint", "start",
           "stored_answer", "stored_parts", "stores", "taken_over", "unavailable",
           "unknown_caller"]

#: Headers that describe the operation's result, stored and replayed by default. Per-request
#: headers (dates, trace ids, rate-limit counters, cookies) are not.
DEFAULT_REPLAY_HEADERS = ("location", "content-location", "etag", "last-modified")
#: Retry-After never says more than this by default (seconds), whatever the lease.
DEFAULT_RETRY_AFTER_MAX = 2.0
#: The default limits (bytes), the engine's defaults (idempotency.settings.max_request_bytes and
#: max_response_bytes): a request body over the first is 413, an answer over the second 507.
DEFAULT_MAX_REQUEST_BYTES = 1048576
DEFAULT_MAX_RESPONSE_BYTES = 1048576
#: The header every replay carries.
REPLAYED_HEADER = ("Idempotent-Replayed", "true")


@dataclass(frozen=True)
class Answer:
    """An HTTP answer in no framework's types: the adapter sends it as it is."""

    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes
    #: True when this is a replay of a stored answer (it carries Idempotent-Replayed).
    replayed: bool = False


@dataclass(frozen=True)
class Settings:
    """What every adapter lets its user choose, with the defaults a payments service wants.

    - ``header_name``: the request header carrying the key.
    - ``wait``: seconds to wait for an attempt in progress to finish (then replay) before
      answering 409; 0 answers at once.
    - ``lease``: how long a handler may run before a retry may take the key over.
    - ``retry_after_max``: the largest ``Retry-After`` of a 409 (the lease left, capped).
    - ``replay_headers``: response headers stored and replayed (case-insensitive).
    - ``store_server_errors``: store 5xx answers as the key's result (default False: a 5xx is
      rolled back and the key released, so the retry runs afresh).
    - ``fingerprint_query``: whether the query string is part of the fingerprint (default
      False: a tracking parameter added by a retrying client does not make another request).
    - ``unavailable_retry_after``: the ``Retry-After`` (seconds, rounded up, at least 1) of a
      503 answered because the database cannot be reached (:func:`unavailable`).
    - ``max_request_bytes``: the largest request body of a keyed request (413 above it, before
      any claim; nothing past it is read).
    - ``max_response_bytes``: the largest answer body stored (above it: 507, not stored, the
      handler's writes rolled back and the key released; nothing past it is buffered).
    """

    header_name: str = "Idempotency-Key"
    wait: float = 0.0
    lease: timedelta | float = DEFAULT_LEASE
    retry_after_max: float = DEFAULT_RETRY_AFTER_MAX
    replay_headers: frozenset[str] = field(
        default_factory=lambda: frozenset(DEFAULT_REPLAY_HEADERS))
    store_server_errors: bool = False
    fingerprint_query: bool = False
    unavailable_retry_after: float = DEFAULT_UNAVAILABLE_RETRY_AFTER
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES

    def __post_init__(self) -> None:
        for name in ("max_request_bytes", "max_response_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a whole number of bytes, at least 1")
        if not self.unavailable_retry_after > 0:
            raise ValueError("unavailable_retry_after must be more than 0 (seconds)")
        if self.retry_after_max < 1:
            raise ValueError("retry_after_max must be at least 1 (second)")
        if self.wait < 0:
            raise ValueError("wait must be 0 or more (seconds)")
        object.__setattr__(self, "replay_headers",
                           frozenset(h.lower() for h in self.replay_headers))

    @property
    def lease_seconds(self) -> float:
        lease = self.lease
        return lease.total_seconds() if isinstance(lease, timedelta) else float(lease)


# -- answers of the adapter's own --------------------------------------------------------------

def problem(status: int, title: str, detail: str,
            headers: Iterable[tuple[str, str]] = ()) -> Answer:
    """An RFC 9457 problem details answer."""
    content = json.dumps({"type": "about:blank", "title": title, "status": status,
                          "detail": detail}).encode()
    return Answer(status, (("Content-Type", "application/problem+json"),
                           ("Content-Length", str(len(content))), *headers), content)


#: What a key may hold: RFC 8941's sf-string characters, printable ASCII (0x20-0x7E).
_PRINTABLE = re.compile(r"[\x20-\x7e]*")
#: The unquoted form accepted too: visible ASCII (0x21-0x7E) without a quote, a comma or a
#: semicolon (those would be structured-field syntax).
_BARE = re.compile(r'[\x21-\x7e]+')
#: The common form, a bare token of 1 to 255 visible characters other than a quote, a comma or
#: a semicolon: what parse_key and the length and character checks accept as it is, so
#: read_key takes it without them (the same key, at a fraction of the cost).
_PLAIN_KEY = re.compile(r"[\x21\x23-\x2b\x2d-\x3a\x3c-\x7e]{1,255}")
_PLAIN_KEY_BYTES = re.compile(rb"[\x21\x23-\x2b\x2d-\x3a\x3c-\x7e]{1,255}")
_KEY_RULE = ("printable ASCII (0x20 to 0x7E), 1 to 255 characters, sent as an RFC 8941 "
             'sf-string ("...", with \\" and \\\\ escapes) or bare (no spaces, quotes, commas '
             "or semicolons)")


def parse_key(raw: str | bytes) -> str:
    """The key a header value carries, after the IETF Idempotency-Key draft: an RFC 8941
    sf-string (``"k-1"``; ``\\"`` and ``\\\\`` are the only escapes) of printable ASCII,
    or, accepted as well, the same characters bare (``k-1``, no spaces, quotes, commas or
    semicolons). Raises ValueError saying what is wrong. Bytes are never decoded as
    Latin-1: a byte outside 0x20-0x7E is refused, whatever encoding the client meant."""
    if isinstance(raw, (bytes, bytearray)):
        bad = next((b for b in bytes(raw) if not 0x20 <= b <= 0x7E and b != 0x09), None)
        if bad is not None:
            raise ValueError(f"has the byte 0x{bad:02X}: a key is {_KEY_RULE}")
        raw = bytes(raw).decode("ascii")
    text = raw.strip(" \t")
    if not _PRINTABLE.fullmatch(text):
        bad_char = next(c for c in text if not " " <= c <= "~")
        raise ValueError(f"has the character U+{ord(bad_char):04X}: a key is {_KEY_RULE}")
    if text.startswith('"'):
        out: list[str] = []
        i = 1
        while i < len(text):
            ch = text[i]
            if ch == "\\":
                if i + 1 >= len(text) or text[i + 1] not in '"\\':
                    raise ValueError(f"has a backslash that escapes nothing: a key is {_KEY_RULE}")
                out.append(text[i + 1])
                i += 2
                continue
            if ch == '"':
                if i != len(text) - 1:
                    raise ValueError(f"has characters after its closing quote: a key is "
                                     f"{_KEY_RULE}")
                return "".join(out)
            out.append(ch)
            i += 1
        raise ValueError(f"has no closing quote: a key is {_KEY_RULE}")
    if text and not _BARE.fullmatch(text) or any(c in text for c in '",;'):
        raise ValueError(f"is neither an sf-string nor a bare token: a key is {_KEY_RULE}")
    return text


def _values(raw: str | bytes) -> int:
    """How many field values ``raw`` holds: commas outside a quoted string separate them (RFC
    9110 5.3: a server may join a repeated field's values with commas into one, as every WSGI
    server does in the environ). A comma inside an sf-string's quotes is part of the key."""
    text = raw.decode("latin-1") if isinstance(raw, (bytes, bytearray)) else raw
    if "," not in text:
        return 1
    count, quoted, escaped = 1, False, False
    for ch in text:
        if escaped:
            escaped = False
        elif quoted and ch == "\\":
            escaped = True
        elif ch == '"':
            quoted = not quoted
        elif ch == "," and not quoted:
            count += 1
    return count


def repeated_key(settings: Settings) -> Answer:
    """400: the request carries more than one key (the header sent twice, or one header with
    a list of values). Nothing is claimed: which one the client meant is not for the server to
    guess."""
    name = settings.header_name
    return problem(400, f"More than one {name}",
                   f"The request carries more than one {name} value (the header repeated, or "
                   "values separated by commas). Send exactly one key; a comma can be part of "
                   'a key only inside a quoted sf-string ("a,b"). Nothing was done.')


def read_key(settings: Settings, policy: Policy,
             raw: str | bytes | Sequence[str | bytes] | None, method: str,
             path: str) -> str | Answer | None:
    """The key of a request from its header value (``raw``, None when absent; an ASGI
    adapter passes the header's bytes as they arrived, or the list of them when the header
    came more than once): the key, an answer (400) to send instead, or None when the request
    is not keyed (pass it through). The rule: exactly one value (:func:`repeated_key`: the
    header repeated, whether the server kept the values apart or joined them with commas),
    :func:`parse_key`, then 1 to 255 characters."""
    if policy is Policy.IGNORED:
        return None
    name = settings.header_name
    if isinstance(raw, (list, tuple)):
        if len(raw) > 1:
            return repeated_key(settings)
        raw = raw[0] if raw else None
    if raw is None:
        if policy is Policy.REQUIRED:
            return problem(400, f"{name} header required",
                           f"{method} {path} requires an {name} header.")
        return None
    assert isinstance(raw, (str, bytes))
    if isinstance(raw, bytes):
        if _PLAIN_KEY_BYTES.fullmatch(raw):
            return raw.decode("ascii")
    elif _PLAIN_KEY.fullmatch(raw):
        return raw
    if _values(raw) > 1:
        return repeated_key(settings)
    try:
        key = parse_key(raw)
    except ValueError as exc:
        return problem(400, f"Invalid {name}", f"The {name} header {exc}.")
    try:
        _check_name(name, "key", key)
    except InvalidArgument as exc:
        return problem(400, f"Invalid {name}", f"{exc}: a key is {_KEY_RULE}.")
    return key


def unknown_caller() -> Answer:
    """401: the adapter's scope callback could not name the caller."""
    return problem(401, "Unknown caller", "Idempotency keys belong to an identified caller.")


def incomplete_body() -> Answer:
    """400: the body ended before its end (its Content-Length, or a chunked body's last
    chunk): the client went away, or the server could not read it. Nothing is claimed, so its
    retry with the whole body is the first attempt."""
    return problem(400, "Incomplete body",
                   "The request body ended before its Content-Length or its last chunk. "
                   "Nothing was done.")


def chunked_without_length(transfer_encoding: str | None, content_length: str | None) -> bool:
    """Whether the request's body comes chunked (``Transfer-Encoding: chunked``) without a
    Content-Length: what an adapter whose framework reads a body by its Content-Length only
    (Django) cannot fingerprint (:func:`length_required`)."""
    return bool(transfer_encoding and "chunked" in transfer_encoding.lower()
                and not content_length)


def length_required() -> Answer:
    """411: a chunked body (no Content-Length) to a framework that reads a body by its
    Content-Length only (Django: the view would get an empty body, and the key would be
    claimed for it, so that another body under the same key would replay its answer).
    Nothing is claimed; the same request with a Content-Length is the first attempt."""
    return problem(411, "Length Required",
                   "Send the request body with a Content-Length header (not chunked). "
                   "Nothing was done.")


def body_complete(content_length: str | None, body: bytes) -> bool:
    """Whether ``body`` is as long as the request's Content-Length said (no header: yes)."""
    try:
        return content_length in (None, "") or len(body) >= int(content_length)
    except ValueError:
        return True


#: What :func:`read_body` asks of a stream at a time.
READ_STEP = 65536


class BodyReader:
    """The body rule, the same behind every adapter and server: what a keyed request's body
    must be before anything is fingerprinted, claimed or run. The adapter feeds it what it
    reads (:meth:`feed`) and asks for the verdict (:meth:`finish`): the body, whole, or the
    answer to send instead, with nothing claimed:

    - a Content-Length that is not a number of bytes: 400 (nothing is read);
    - a Content-Length over ``max_request_bytes``: 413 (nothing is read);
    - more than ``max_request_bytes`` read (a chunked body): 413 at once, nothing more read;
    - fewer bytes than the Content-Length, or the client gone before the last byte (a
      disconnect, the stream ending early, a chunked body cut short: whatever the server
      does then, raising included): 400 "Incomplete body" (:func:`incomplete_body`).

    The rule holds whatever the server: some hand the app a short body and say nothing
    (gunicorn), some raise (werkzeug), some never call the app (waitress), an ASGI server
    sends ``http.disconnect``."""

    __slots__ = ("_chunks", "_size", "answer", "expected", "limit")

    def __init__(self, settings: Settings, content_length: str | int | None) -> None:
        self.limit = settings.max_request_bytes
        self._chunks: list[bytes] = []
        self._size = 0
        #: The answer to send instead of running anything (None while the body may be good).
        self.answer: Answer | None = None
        #: The body's length by its Content-Length (None: none was sent, e.g. chunked).
        self.expected: int | None = None
        if content_length is None or content_length == "":
            return
        text = str(content_length).strip()
        if not text.isdigit() or not text.isascii():
            self.answer = problem(400, "Invalid Content-Length",
                                  "The Content-Length header is not a number of bytes. "
                                  "Nothing was done.")
        elif int(text) > self.limit:
            self.answer = too_large(settings)
        else:
            self.expected = int(text)

    def wanted(self) -> int:
        """How many bytes to ask the stream for next: 0 once nothing more is to be read."""
        if self.answer is not None:
            return 0
        if self.expected is not None:
            return min(READ_STEP, self.expected - self._size)
        return min(READ_STEP, self.limit + 1 - self._size)

    def feed(self, chunk: bytes) -> bool:
        """Take ``chunk``; False once the verdict is known without reading more (over the
        limit: the rest is never read)."""
        if self.answer is not None:
            return False
        self._size += len(chunk)
        if self._size > self.limit:
            self._chunks.clear()
            self.answer = too_large_answer(self.limit)
            return False
        self._chunks.append(chunk)
        return True

    def finish(self, *, ended: bool = True) -> bytes | Answer:
        """The verdict: the body, or the answer to send instead. ``ended=False``: the client
        went away (or reading failed) before the body's end."""
        if self.answer is not None:
            return self.answer
        if not ended or (self.expected is not None and self._size < self.expected):
            return incomplete_body()
        return b"".join(self._chunks)


def read_body(settings: Settings, content_length: str | int | None,
              read: Callable[[int], bytes], *, terminated: bool) -> bytes | Answer:
    """The body rule (:class:`BodyReader`) over a blocking stream's ``read(n)`` (a WSGI
    ``wsgi.input``). Without a Content-Length the body is what the stream holds up to its end
    when the server says the stream ends there (``terminated``: ``wsgi.input_terminated``, a
    chunked body), else empty (PEP 3333: reading past a missing Content-Length may block).
    An exception while reading (the client went away, a chunked body cut short) is an
    incomplete body: 400, nothing claimed."""
    body = BodyReader(settings, content_length)
    if body.answer is None and body.expected is None and not terminated:
        return b""
    try:
        while (want := body.wanted()) > 0:
            chunk = read(want)
            if not chunk:
                break
            if not body.feed(chunk):
                break
    except Exception:  # noqa: BLE001 - whatever the server raises, the body is not whole
        return body.finish(ended=False)
    return body.finish()


def too_large_answer(limit: int, what: str = "request body") -> Answer:
    """:func:`too_large` for a limit of ``limit`` bytes."""
    return problem(413, "Request too large",
                   f"The {what} is larger than {limit} bytes, the limit of an idempotent "
                   "request. Nothing was done.")


#: How many times longer than the body its canonical text can be: a JSON number is the only
#: thing that grows (``1e20``, 4 bytes, is ``100000000000000000000``, 21 characters; a number
#: outside 1e-7 <= |n| < 1e21 keeps its exponent); strings, keys and literals never grow.
CANONICAL_GROWTH = 6


def request_fingerprint(settings: Settings, method: str, path: str, query: str,
                        content_type: str, body: bytes, route: Route | None = None) -> bytes:
    """The fingerprint of a request (:func:`~pg_idempotency.fingerprint.describe_request`,
    a JSON body narrowed to the route's fields): the same bytes behind every adapter. The
    body's nesting is counted from its own top level (128 levels, as the engine counts a
    request), and the canonical text is built within :data:`CANONICAL_GROWTH` times
    ``max_request_bytes`` plus the method, path and query. Raises
    :class:`~pg_idempotency.errors.InvalidArgument` (or RecursionError) for a body the
    fingerprint refuses (:func:`keyed_request` answers 400 for it; 413 for
    :class:`~pg_idempotency.errors.ArgumentTooLarge`)."""
    described = describe_request(method, path, query if settings.fingerprint_query else None,
                                 content_type, body)
    if route is not None and "json" in described:
        described["json"] = route.body_for_fingerprint(described["json"])
    limit = CANONICAL_GROWTH * (settings.max_request_bytes + len(method) + len(path)
                                + len(query)) + 256
    return described_fingerprint(described, limit)


def too_large(settings: Settings, what: str = "request body") -> Answer:
    """413: the request body is over ``max_request_bytes`` (by its Content-Length, or counted
    while reading; nothing past the limit is read). Nothing is claimed."""
    return too_large_answer(settings.max_request_bytes, what)


def content_too_long(settings: Settings, content_length: str | int | None) -> bool:
    """Whether a Content-Length says the body is over ``max_request_bytes``."""
    try:
        return int(content_length or 0) > settings.max_request_bytes
    except ValueError:
        return False


def response_too_large(settings: Settings) -> Answer:
    """507: the handler's answer is over ``max_response_bytes``, so it cannot be stored. Its
    writes are rolled back and the key released; the same request will fail the same way, so
    the retrying client does not resend it."""
    return problem(507, "Response too large to store",
                   f"The answer is larger than {settings.max_response_bytes} bytes, the limit "
                   "of a stored answer. Nothing was done; the key is free again.")


@dataclass(frozen=True)
class Keyed:
    """A keyed request ready to claim: whose key (scope), its fingerprint, its lease."""

    scope: str
    fingerprint: bytes
    lease: timedelta | float


def keyed_request(settings: Settings, route: Route, caller: Any, method: str, path: str,
                  query: str, content_type: str, body: bytes) -> Keyed | Answer:
    """What every adapter checks between reading the body and claiming: the scope the
    app's callback gave (None or empty: 401; not a valid scope, e.g. over 255 characters:
    400 naming it) and the body (one the fingerprint refuses, e.g. a JSON body nested deeper
    than 128 or with a number PostgreSQL cannot hold: 400 naming what is wrong)."""
    if not caller:
        return unknown_caller()
    scope = str(caller)
    try:
        _check_name("scope", "scope", scope)
    except InvalidArgument as exc:
        return problem(400, "Invalid caller scope",
                       f"The scope this request belongs to is not valid ({exc}). A scope is 1 to "
                       "255 characters without control characters.")
    try:
        digest = request_fingerprint(settings, method, path, query, content_type, body, route)
    except ArgumentTooLarge:
        return too_large(settings)
    except InvalidArgument as exc:
        if exc.sqlstate == "IK014":
            return problem(400, "Invalid request body",
                           "The body cannot be fingerprinted: it nests arrays and objects more "
                           "than 128 deep (the limit is 128 levels, the outermost counts).")
        return problem(400, "Invalid request body",
                       f"The body cannot be fingerprinted: {exc}.")
    except RecursionError:
        return problem(400, "Invalid request body",
                       "The body cannot be fingerprinted: JSON nested too deep (the limit is "
                       "128 levels).")
    return Keyed(scope, digest, route.lease_of(settings))


def _retry_after(settings: Settings, left: timedelta | None) -> str:
    seconds = left.total_seconds() if left is not None else 1.0
    return str(max(1, math.ceil(min(seconds, settings.retry_after_max))))


def in_progress(settings: Settings, left: timedelta | None) -> Answer:
    """409 with Retry-After: the lease left (``left``), at most ``retry_after_max``, at least
    1; without a lease left (unknown), 1 second: a short poll."""
    return problem(409, "Request in progress",
                   "A request with this key is being processed. Retry later.",
                   [("Retry-After", _retry_after(settings, left))])


def taken_over() -> Answer:
    """409: this attempt's lease expired and another attempt took the key over while the
    handler ran; its writes were rolled back and the other attempt's answer counts."""
    return problem(409, "Request in progress",
                   "The lease on this key expired and another attempt took it over.",
                   [("Retry-After", "1")])


def no_connection(settings: Settings) -> Answer:
    """503 with Retry-After: no database connection was free in time."""
    return problem(503, "No database connection",
                   "No connection to the idempotency store was free in time. Retry later.",
                   [("Retry-After", _retry_after(settings, None))])


def unavailable(settings: Settings) -> Answer:
    """503 with Retry-After: the database cannot be reached (refused, connection lost, the
    server or a Citus worker restarting: :class:`~pg_idempotency.errors.DatabaseUnavailable`).
    Nothing is stored; what the attempt wrote is rolled back. A key whose claim committed
    before the loss stays in progress until its lease expires (then a retry resumes it)."""
    seconds = max(1, math.ceil(settings.unavailable_retry_after))
    return problem(503, "Database unavailable",
                   "The idempotency store cannot be reached right now. Nothing was stored; "
                   "retry the same request with the same key later.",
                   [("Retry-After", str(seconds))])


def lost(conn: Any) -> bool:
    """Whether ``conn`` (a psycopg connection, or None) was lost: a 5xx a handler answered on
    it is an outage (a framework turned the lost connection into its 500 before the adapter
    saw the exception)."""
    return conn is not None and bool(getattr(conn, "broken", False) or
                                     getattr(conn, "closed", False))


def outage(settings: Settings, exc: BaseException | None, conn: Any = None) -> Answer | None:
    """:func:`unavailable` when ``exc`` (or what it was raised from) says the database cannot
    be reached, or ``conn`` was lost; else None (a real error: let the framework answer)."""
    if connection_lost(exc) or lost(conn):
        return unavailable(settings)
    return None


def stored_answer(stored: StoredResponse, *, replayed: bool = True) -> Answer:
    """A stored response as sent: its status, exact bytes, content type and stored headers,
    plus ``Idempotent-Replayed: true`` for a replay."""
    content = stored.content
    headers = list(stored.headers.items())
    if stored.content_type:
        headers.append(("Content-Type", stored.content_type))
    headers.append(("Content-Length", str(len(content))))
    if replayed:
        headers.append(REPLAYED_HEADER)
    return Answer(stored.status, tuple(headers), content, replayed)


def claim_answer(settings: Settings, result: ClaimResult) -> Answer | None:
    """What a claim means for the request: None when this attempt owns the key (run the
    handler), else the answer: a replay (of the final answer, or of a worker's interim one),
    422 (another request used the key, or it expired), or 409 (in progress)."""
    outcome = result.outcome
    name = settings.header_name
    if outcome.owned:
        return None
    if outcome is Outcome.MISMATCH:
        return problem(422, f"{name} reused", f"This {name} was used with a different "
                       "request. Use a new key for a new request.")
    if outcome is Outcome.EXPIRED:
        return problem(422, f"{name} expired", f"This {name} was used and has expired. Use a "
                       "new key for a new request.")
    if outcome in (Outcome.REPLAY, Outcome.ACCEPTED):
        assert result.response is not None
        return stored_answer(result.response)
    return in_progress(settings, result.retry_after)


# -- waiting for an attempt in progress -------------------------------------------------------

_Claiming = Generator[float | None, Any, "ClaimResult | Answer"]


def _claiming(settings: Settings) -> _Claiming:
    """Claim until owned or answered; while another attempt holds the key, poll (20 ms
    doubling to 250 ms) until ``wait`` runs out, then answer 409. Yields None to ask for a
    claim (sent back: the ClaimResult) and a number of seconds to ask for a sleep."""
    deadline = time.monotonic() + settings.wait
    pause = 0.02
    while True:
        result = yield None
        answer = claim_answer(settings, result)
        if answer is None:
            return result  # type: ignore[no-any-return]
        left = deadline - time.monotonic()
        if result.outcome is not Outcome.IN_PROGRESS or left <= 0:
            return answer
        yield min(pause, left)
        pause = min(pause * 2, 0.25)


def claim_waiting(settings: Settings, claim: Callable[[], ClaimResult],
                  sleep: Callable[[float], Any] = time.sleep) -> ClaimResult | Answer:
    """The claim of a sync adapter: the ClaimResult of an owned key, or the answer to send."""
    gen = _claiming(settings)
    ask = next(gen)
    try:
        while True:
            ask = gen.send(claim() if ask is None else sleep(ask))
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]


async def aclaim_waiting(settings: Settings, claim: Callable[[], Awaitable[ClaimResult]],
                         sleep: Callable[[float], Awaitable[Any]]) -> ClaimResult | Answer:
    """:func:`claim_waiting` for an async adapter (``sleep``: its event loop's)."""
    gen = _claiming(settings)
    ask = next(gen)
    try:
        while True:
            ask = gen.send(await claim() if ask is None else await sleep(ask))
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]


# -- what is stored -------------------------------------------------------------------------

def stores(settings: Settings, status: int, *, started: bool = True) -> bool:
    """Whether the handler's answer is the key's result (stored with its writes, replayed to
    retries) or rolled back with the key released (a retry runs afresh):

    - an error answer (4xx) made before the handler started (``started=False``: a framework's
      request validation, an authentication check): released, it is not the endpoint's result;
    - 5xx: stored only with ``store_server_errors``, wherever it came from;
    - anything else: stored."""
    if status >= 500:
        return settings.store_server_errors
    return started or status < 400


def stored_parts(settings: Settings, headers: Iterable[tuple[str, str]]
                 ) -> tuple[dict[str, str], str]:
    """From the handler's response headers: those stored for replay (``replay_headers``) and
    the content type (application/octet-stream when it set none)."""
    stored: dict[str, str] = {}
    content_type = "application/octet-stream"
    for name, value in headers:
        lname = name.lower()
        if lname == "content-type":
            content_type = value
        elif lname in settings.replay_headers:
            stored[name] = value
    return stored, content_type


# -- while a handler runs -------------------------------------------------------------------

#: Where an adapter keeps a request's :class:`Handling` (ASGI: in ``scope["state"]``; WSGI:
#: in the environ; Django: as an attribute of the request).
HANDLING_KEY = "idempotency"


@dataclass
class Handling:
    """One keyed request while its handler runs: the operation, whether the handler started
    (asked for its operation, or began a transaction on it), and what to run once it has
    returned, before the response is stored (last first). Helpers such as
    :func:`pg_idempotency.sqlalchemy.request_session` find it here, not in an adapter."""

    op: Any
    started: bool = False
    cleanups: list[Callable[[], Any]] = field(default_factory=list)


def handling_of(state: Mapping[str, Any] | None, key: str = HANDLING_KEY) -> Handling | None:
    """The :class:`Handling` kept in ``state`` under ``key``, else None."""
    found = (state or {}).get(key)
    return found if isinstance(found, Handling) else None


def start(handling: Handling | None) -> Any:
    """What ``get_operation()`` of every adapter does: the operation (None without a key),
    and the handler marked as started (a 4xx from now on is its result, stored)."""
    if handling is None:
        return None
    handling.started = True
    return handling.op


_guards: list[Callable[[Any], contextlib.AbstractContextManager[Any]]] = []


def register_guard(guard: Callable[[Any], contextlib.AbstractContextManager[Any]]) -> None:
    """Have every adapter run its handlers inside ``guard(op.conn)``. An integration module
    registers itself when imported (:mod:`pg_idempotency.sqlalchemy` refuses commits on other
    connections while a handler runs); no adapter has to import it."""
    if guard not in _guards:
        _guards.append(guard)


#: What guarded() gives when there is nothing to guard (reusable: it holds no state).
_UNGUARDED = contextlib.nullcontext()


def guarded(conn: Any, enabled: bool = True) -> contextlib.AbstractContextManager[Any]:
    """The registered guards around a handler on ``conn`` (none when ``enabled`` is false)."""
    if not enabled or not _guards:
        return _UNGUARDED
    return _guarding(conn)


@contextlib.contextmanager
def _guarding(conn: Any) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for guard in _guards:
            stack.enter_context(guard(conn))
        yield
