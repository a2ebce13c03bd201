"""Results and decoding: the typed results of the SQL API (:class:`Outcome`,
:class:`ClaimResult`, :class:`StoredResponse`, :class:`AbandonedKey`), the loaders of the text
columns that queries.py sends (times and intervals as epoch seconds, json as text), and the
bytes a JSON body is stored as. No psycopg internals: the raw results of the own sends are
read in :mod:`pg_idempotency._wire`."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from enum import Enum
from typing import Any, overload

import psycopg

from .fingerprint import MAX_DEPTH, canonical_json


class Outcome(str, Enum):
    """What :func:`claim` found (docs/sql-api.md, "Outcomes")."""

    CLAIMED = "claimed"  #: new key: you own it
    RESUMED = "resumed"  #: the previous lease expired: you own it, reconcile from recovery_point
    REPLAY = "replay"  #: completed before with the same request: return the stored response
    IN_PROGRESS = "in_progress"  #: someone holds a live lease: 409, retry after retry_after
    #: a long-running operation holds a live lease and stored an interim response with
    #: accept() (e.g. 202 and a status URL): answer it again
    ACCEPTED = "accepted"
    MISMATCH = "mismatch"  #: the key was used with another request: 422
    #: the key was dropped after its retention and only a tombstone remains
    #: (settings.tombstones): never execute, nothing to replay; answer 422
    EXPIRED = "expired"

    @property
    def owned(self) -> bool:
        """True when the caller now holds the lease (claimed or resumed)."""
        return self in (Outcome.CLAIMED, Outcome.RESUMED)


@dataclass(frozen=True)
class StoredResponse:
    """A completed key's response, as :func:`complete` stored it."""

    status: int
    headers: dict[str, str] = field(default_factory=dict)
    #: The JSON body (a Python value) when it was stored as JSON, else None.
    body: Any = None
    #: The exact bytes when it was stored with ``complete(..., body=b"...")``, else None.
    body_bytes: bytes | None = None
    content_type: str | None = None
    completed_at: datetime | None = None

    @property
    def content(self) -> bytes:
        """The body as bytes: the stored bytes, or the JSON body serialized (``b""`` if none)."""
        if self.body_bytes is not None:
            return self.body_bytes
        if self.body is None:
            return b""
        return json.dumps(self.body, separators=(",", ":"), ensure_ascii=False).encode()

    def json(self) -> Any:
        """The body as a JSON value (bytes bodies are parsed)."""
        if self.body_bytes is not None:
            return json.loads(self.body_bytes)
        return self.body


@dataclass(frozen=True)
class ClaimResult:
    """One row of ``idempotency.claim_result``; ``response`` is set for a replay (the final
    response) and for accepted (the interim response)."""

    outcome: Outcome
    lease_token: int | None
    lease_expires_at: datetime | None
    recovery_point: str | None
    attempts: int | None
    retry_after: timedelta | None
    created_at: datetime | None
    response: StoredResponse | None

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> ClaimResult:
        outcome = Outcome(row["outcome"])
        response = None
        if outcome in (Outcome.REPLAY, Outcome.ACCEPTED):
            body_bytes = row["response_body_bytes"]
            body = load_json(row["response_body"])
            if body is None and body_bytes is not None:
                body = json_of_bytes(row["response_content_type"], bytes(body_bytes))
            response = StoredResponse(
                status=row["response_status"],
                headers=dict(load_json(row["response_headers"]) or {}),
                body=body,
                body_bytes=bytes(body_bytes) if body_bytes is not None else None,
                content_type=row["response_content_type"],
                completed_at=load_time(row["completed_at"]),
            )
        return cls(outcome, row["lease_token"], load_time(row["lease_expires_at"]),
                   row["recovery_point"], row["attempts"], load_interval(row["retry_after"]),
                   load_time(row["created_at"]), response)


def json_bytes(value: Any) -> bytes:
    """A JSON value as the bytes stored and replayed for it: compact, its keys in the order
    given (jsonb would sort them), a Decimal by its exact digits, a tuple as an array. Call
    :func:`~pg_idempotency.fingerprint.canonical_json` first to refuse what jsonb refuses."""
    return "".join(_json_parts(value)).encode()


def _json_parts(value: Any) -> Iterator[str]:
    if isinstance(value, Mapping):
        yield "{"
        for i, (name, item) in enumerate(value.items()):
            yield ("," if i else "") + json.dumps(name, ensure_ascii=False) + ":"
            yield from _json_parts(item)
        yield "}"
    elif isinstance(value, (list, tuple)):
        yield "["
        for i, item in enumerate(value):
            if i:
                yield ","
            yield from _json_parts(item)
        yield "]"
    elif isinstance(value, Decimal):
        yield str(value)
    else:
        yield json.dumps(value, ensure_ascii=False)


class _NotPlain(Exception):
    """:func:`json_body`'s fast path cannot vouch for a value."""


def _not_plain(value: Any) -> Any:
    raise _NotPlain


#: The C encoder of the standard library, spelled as :func:`json_bytes` spells a value made of
#: dict, list, str, int, float, bool and None (compact, keys in the order given, floats by
#: repr); anything else raises (_not_plain), and so do NaN and the infinities.
_DUMPS = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"),
                          default=_not_plain).encode


def json_body(value: Any) -> tuple[bytes, Any]:
    """What complete() stores for a JSON answer: ``json_bytes(value)``, refusing what
    ``canonical_json(value)`` refuses, and the value every replay reads back from those bytes
    (``json.loads``). One pass of the C encoder and one of the parser when that provably gives
    the same (issue 32: the answer was walked four times in Python): the text read back equals
    the value (so every key is a string and nothing is a tuple or a Decimal), holds no
    ``\\u0000``, encodes as UTF-8 (no unpaired surrogate) and has at most MAX_DEPTH brackets;
    anything else takes the slow path, which also says what is wrong."""
    try:
        text = _DUMPS(value)
        if "\\u0000" not in text and text.count("{") + text.count("[") <= MAX_DEPTH:
            back = json.loads(text)
            if back == value:
                return text.encode("utf-8"), back
    except (_NotPlain, TypeError, ValueError, RecursionError):
        pass  # (UnicodeEncodeError is a ValueError)
    canonical_json(value)  # refuses what jsonb would refuse (NaN, lone surrogates, ...)
    data = json_bytes(value)
    return data, json.loads(data)


def json_of_bytes(content_type: str | None, body: bytes) -> Any:
    """The JSON value of a stored JSON body (None for any other body, or one that does not
    parse)."""
    if content_type is None or "json" not in content_type:
        return None
    try:
        return json.loads(body)
    except ValueError:
        return None


def load_json(text: str | None) -> Any:
    """A json/jsonb column that queries.py casts to text, parsed here: whatever loaders the
    connection has registered (Django registers a text loader for jsonb), the result is the
    same."""
    return None if text is None else json.loads(text)


_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def _microseconds(text: str) -> int:
    seconds = Decimal(text)  # exact: numeric text with 6 decimals
    if not seconds.is_finite():
        raise OverflowError(text)
    return int(seconds.scaleb(6))


def _delta(text: str) -> timedelta:
    """``timedelta(microseconds=_microseconds(text))``; what extract(epoch ...)::text gives from
    PostgreSQL 14 on, ``[-]digits.dddddd``, read with integer arithmetic (the same value; any
    other spelling takes the Decimal path). OverflowError when out of range."""
    whole, dot, frac = text.partition(".")
    digits = whole[1:] if whole[:1] == "-" else whole
    if (dot and len(frac) == 6 and frac.isdigit() and digits.isdigit()
            and frac.isascii() and digits.isascii()):
        delta = timedelta(0, int(digits), int(frac))
        return -delta if digits is not whole else delta
    return timedelta(microseconds=_microseconds(text))


@overload
def load_time(text: str | datetime) -> datetime: ...
@overload
def load_time(text: None) -> None: ...
def load_time(text: str | datetime | None) -> datetime | None:
    """A timestamptz column that queries.py sends as seconds since 1970-01-01 UTC (numeric
    text), as an aware datetime in UTC: the same instant, to the microsecond, under every
    DateStyle and TimeZone. A datetime (the own sends' short complete reads its time itself)
    is returned as it is."""
    if text is None:
        return None
    if isinstance(text, datetime):
        return text
    try:
        return _EPOCH + _delta(text)
    except OverflowError:
        raise psycopg.DataError("timestamp out of the range of datetime (years 1 to 9999): "
                                f"{text} s since 1970") from None


@overload
def load_interval(text: str) -> timedelta: ...
@overload
def load_interval(text: None) -> None: ...
def load_interval(text: str | None) -> timedelta | None:
    """An interval column that queries.py sends as its length in seconds (numeric text), as a
    timedelta: the same under every IntervalStyle."""
    if text is None:
        return None
    try:
        return _delta(text)
    except OverflowError:
        raise psycopg.DataError(f"interval out of the range of timedelta: {text} s") from None


@dataclass(frozen=True)
class AbandonedKey:
    """One row of ``idempotency.list_abandoned``."""

    scope: str
    key: str
    lease_expires_at: datetime
    recovery_point: str | None
    attempts: int
    created_at: datetime

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> AbandonedKey:
        return cls(row["scope"], row["key"], load_time(row["lease_expires_at"]),
                   row["recovery_point"], row["attempts"], load_time(row["created_at"]))
