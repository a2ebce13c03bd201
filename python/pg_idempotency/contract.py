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
import math
import time
from collections.abc import (
    Awaitable,
    Callable,
    Generator,
    Iterable,
    Iterator,
    Mapping,
)
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from ._answer import (  # noqa: F401  (re-exported: the contract is one module to its users)
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_MAX_RESPONSE_BYTES,
    DEFAULT_REPLAY_HEADERS,
    DEFAULT_RETRY_AFTER_MAX,
    REPLAYED_HEADER,
    Answer,
    Settings,
    problem,
)
from ._incoming import (  # noqa: F401  (re-exported: the contract is one module to its users)
    CANONICAL_GROWTH,
    READ_STEP,
    BodyReader,
    body_complete,
    chunked_without_length,
    content_too_long,
    incomplete_body,
    length_required,
    parse_key,
    read_body,
    read_key,
    repeated_key,
    request_fingerprint,
    too_large,
    too_large_answer,
    unknown_caller,
)
from ._results import ClaimResult, Outcome, StoredResponse
from ._routes import Policy, Route, Routes
from .errors import (
    ArgumentTooLarge,
    InvalidArgument,
    connection_lost,
)
from .fingerprint import _check_name

__all__ = ["CANONICAL_GROWTH", "DEFAULT_REPLAY_HEADERS", "Answer", "BodyReader", "Handling",
           "Keyed", "Policy", "Route", "Routes", "Settings", "content_too_long", "keyed_request",
           "read_body", "repeated_key", "response_too_large", "too_large", "too_large_answer",
           "aclaim_waiting", "body_complete", "chunked_without_length", "claim_answer",
           "claim_waiting", "failed_for_the_database", "guarded", "length_required",
           "handling_of", "in_progress", "incomplete_body", "no_connection", "outage", "problem",
           "parse_key", "read_key", "register_guard", "request_fingerprint", "start",
           "stored_answer", "stored_parts", "stores", "taken_over", "unavailable",
           "unknown_caller"]


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


def failed_for_the_database(settings: Settings, conn: Any) -> Answer | None:
    """What a handler's own 5xx (the framework answered it before the adapter saw the error)
    means when ``conn``, the operation's connection, failed it: 503 :func:`unavailable` when it
    was lost, 503 :func:`no_connection` when the pool had none free in time for the handler's
    first statement (an operation over a pool takes its connection there); None when the
    database had no part in it (the handler's 5xx is sent as it is)."""
    if lost(conn):
        return unavailable(settings)
    if getattr(conn, "starved", False):
        return no_connection(settings)
    return None


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
