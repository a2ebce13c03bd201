"""What the HTTP contract (:mod:`pg_idempotency.contract`, which re-exports it) reads of a
request before anything is claimed: the key header (one, an sf-string), the body (whole,
as long as its Content-Length, within max_request_bytes) and the fingerprint of both."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from ._answer import Answer, Settings, problem
from ._routes import Policy, Route
from .errors import InvalidArgument
from .fingerprint import _check_name, describe_request, described_fingerprint

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
