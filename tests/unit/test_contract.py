"""pg_idempotency.contract on its own, as a table of cases: no framework, no database. The same
rules are then run through every adapter over real HTTP in
tests/frameworks/test_http_adapters.py."""

from __future__ import annotations

import ast
import hashlib
import json
import os
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

import pg_idempotency
from pg_idempotency import contract as http
from pg_idempotency.contract import Answer, Policy, Routes, Settings
from pg_idempotency.core import ClaimResult, Outcome, StoredResponse

FRAMEWORKS = ("flask", "django", "starlette", "fastapi", "werkzeug", "anyio", "sqlalchemy")


ADAPTERS = ("pg_idempotency.asgi", "pg_idempotency.django", "pg_idempotency.flask",
            "pg_idempotency.sqlalchemy")


def loaded_by(module: str) -> list[str]:
    """The frameworks and adapter modules that importing ``module`` loads (a fresh
    interpreter)."""
    code = ("import sys, importlib; importlib.import_module(sys.argv[1]); "
            "print('\\n'.join(sorted(m for m in sys.modules "
            "if m.split('.')[0] in sys.argv[2:] or m in sys.argv[2:])))")
    out = subprocess.run([sys.executable, "-c", code, module, *FRAMEWORKS, *ADAPTERS],
                         capture_output=True, text=True, check=True,
                         env=dict(os.environ, DJANGO_SETTINGS_MODULE=""))
    return [m for m in out.stdout.split() if m != module]


def imported_names(path: Path) -> set[str]:
    """Every module an adapter's source imports, anywhere in it (lazy imports too), as
    absolute names."""
    package = "pg_idempotency.django" if path.parent.name == "django" else "pg_idempotency"
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def test_no_adapter_source_imports_another() -> None:
    """Read in the source, lazy imports included: the core imports no adapter, and no adapter
    imports another (asgi.py and sqlalchemy.py used to import each other)."""
    package = Path(pg_idempotency.__file__).parent
    # demo.py and the example it serves (_payments_example*) are applications, not the core
    sources = [p for p in [*package.glob("*.py"), *package.glob("django/*.py")]
               if p.name != "demo.py" and not p.name.startswith("_payments_example")]
    assert len(sources) > 15
    for path in sources:
        here = "pg_idempotency." + ".".join(path.relative_to(package).with_suffix("").parts)
        here = here.removesuffix(".__init__")
        own = here if here in ADAPTERS else "pg_idempotency.django" if "django" in here else ""
        others = {a for a in ADAPTERS if a != own}
        assert not imported_names(path) & others, (here, imported_names(path) & others)


def test_the_contract_imports_no_framework() -> None:
    assert loaded_by("pg_idempotency.contract") == []
    assert loaded_by("pg_idempotency") == []


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_no_adapter_imports_another(adapter: str) -> None:
    """No import circle: each adapter loads its own framework, never another adapter."""
    assert not set(loaded_by(adapter)) & set(ADAPTERS)


ROUTES = Routes({"POST /payments": Policy.REQUIRED, "post /orders/{id}/refunds": "optional"})


@pytest.mark.parametrize(("method", "path", "policy"), [
    ("POST", "/payments", Policy.REQUIRED),
    ("POST", "/payments/", Policy.IGNORED),  # exact paths: a trailing slash is another route
    ("POST", "/orders/7/refunds", Policy.OPTIONAL),
    ("POST", "/orders/7/8/refunds", Policy.IGNORED),  # {id} is one segment
    ("POST", "/unlisted", Policy.IGNORED),  # keyed routes are named: unlisted are not keyed
    ("PATCH", "/unlisted", Policy.IGNORED),
    ("GET", "/payments", Policy.IGNORED),
])
def test_route_policy(method: str, path: str, policy: Policy) -> None:
    assert ROUTES.policy(method, path) is policy


def test_route_policy_refuses_unknown_words() -> None:
    with pytest.raises(ValueError, match="'required', 'optional', 'ignored'"):
        Routes({"POST /x": "mandatory"})
    assert Routes({}, "optional").policy("POST", "/x") is Policy.OPTIONAL


S = Settings()


@pytest.mark.parametrize(("policy", "raw", "expected"), [
    (Policy.REQUIRED, "k1", "k1"),
    (Policy.REQUIRED, '  "k1" ', "k1"),  # the draft's sf-string form, spaces around
    (Policy.OPTIONAL, "k1", "k1"),
    (Policy.IGNORED, "k1", None),
    (Policy.OPTIONAL, None, None),
    (Policy.REQUIRED, None, 400),
    (Policy.REQUIRED, "", 400),
    (Policy.REQUIRED, "k" * 256, 400),
    (Policy.REQUIRED, "a\x07b", 400),
    # exactly one value: a comma outside quotes separates two (a WSGI server's join of a
    # repeated header, or a list); inside quotes it is part of the key
    (Policy.REQUIRED, "k1,k2", "More than one"),
    (Policy.REQUIRED, "k1, k1", "More than one"),
    (Policy.OPTIONAL, '"k1", "k2"', "More than one"),
    (Policy.REQUIRED, '"a\\"b", c', "More than one"),
    (Policy.REQUIRED, ["k1", "k2"], "More than one"),  # ASGI: every value apart
    (Policy.REQUIRED, [b"k1", b"k1"], "More than one"),
    (Policy.REQUIRED, [b"k1"], "k1"),
    (Policy.REQUIRED, '"k1,k2"', "k1,k2"),
    (Policy.REQUIRED, b'"a\\",b"', 'a",b'),
    (Policy.REQUIRED, '"k1', 400),  # an unclosed quote is one (bad) value
])
def test_read_key(policy: Policy, raw: Any, expected: Any) -> None:
    got = http.read_key(S, policy, raw, "POST", "/payments")
    if expected == "More than one":
        assert isinstance(got, Answer) and got.status == 400
        assert json.loads(got.body)["title"] == "More than one Idempotency-Key"
    elif isinstance(expected, int):
        assert isinstance(got, Answer) and got.status == expected
        assert dict(got.headers)["Content-Type"] == "application/problem+json"
        problem = json.loads(got.body)
        assert problem["status"] == expected and "Idempotency-Key" in problem["title"]
    else:
        assert got == expected


def test_problem_bodies() -> None:
    for answer, status in [(http.unknown_caller(), 401), (http.incomplete_body(), 400),
                           (http.taken_over(), 409), (http.no_connection(S), 503),
                           (http.in_progress(S, None), 409)]:
        headers = dict(answer.headers)
        assert answer.status == status
        assert headers["Content-Type"] == "application/problem+json"
        assert headers["Content-Length"] == str(len(answer.body))
        assert json.loads(answer.body)["status"] == status
        assert ("Retry-After" in headers) == (status in (409, 503))


@pytest.mark.parametrize(("left", "cap", "expected"), [
    (None, 2, "1"),  # unknown: a short poll
    (timedelta(seconds=0.2), 2, "1"),  # at least 1
    (timedelta(seconds=1.5), 2, "2"),  # rounded up
    (timedelta(seconds=30), 2, "2"),  # the lease left, capped
    (timedelta(seconds=30), 5, "5"),
    (timedelta(seconds=3), 5, "3"),
])
def test_retry_after(left: timedelta | None, cap: float, expected: str) -> None:
    answer = http.in_progress(Settings(retry_after_max=cap), left)
    assert answer.status == 409 and dict(answer.headers)["Retry-After"] == expected


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="retry_after_max"):
        Settings(retry_after_max=0.5)
    with pytest.raises(ValueError, match="wait"):
        Settings(wait=-1)
    assert Settings(replay_headers=frozenset({"Location"})).replay_headers == {"location"}


def fp(settings: Settings, query: str = "", body: bytes = b'{"amount": 50}',
       content_type: str = "application/json", path: str = "/payments") -> bytes:
    return http.request_fingerprint(settings, "POST", path, query, content_type, body)


def test_fingerprint_table() -> None:
    base = fp(S)
    assert fp(S, body=b'{ "amount" : 50.0 }') == base  # a JSON body by its canonical form
    assert fp(S, query="utm=x") == base  # the query string is out by default
    assert fp(S, body=b'{"amount": 51}') != base
    assert fp(S, path="/payments/2") != base
    with_query = Settings(fingerprint_query=True)
    assert fp(with_query, query="a=1") != fp(with_query, query="a=2")
    assert fp(S, body=b"abc", content_type="text/plain") != fp(S, body=b"abd",
                                                               content_type="text/plain")


NOW = datetime(2026, 1, 1, tzinfo=timezone.utc)


def claim(outcome: Outcome, response: StoredResponse | None = None,
          retry_after: timedelta | None = None) -> ClaimResult:
    return ClaimResult(outcome, 7 if outcome.owned else None, None, None, 1, retry_after, NOW,
                       response)


STORED = StoredResponse(201, {"Location": "/p/1"}, None, b'{"zeta":1,"a":2}', "application/json",
                        NOW)


@pytest.mark.parametrize(("result", "status", "headers"), [
    (claim(Outcome.CLAIMED), None, {}),
    (claim(Outcome.RESUMED), None, {}),
    (claim(Outcome.MISMATCH), 422, {"Content-Type": "application/problem+json"}),
    (claim(Outcome.EXPIRED), 422, {"Content-Type": "application/problem+json"}),
    (claim(Outcome.IN_PROGRESS, retry_after=timedelta(seconds=9)), 409, {"Retry-After": "2"}),
    (claim(Outcome.REPLAY, STORED), 201, {"Location": "/p/1", "Idempotent-Replayed": "true",
                                          "Content-Type": "application/json",
                                          "Content-Length": "16"}),
    (claim(Outcome.ACCEPTED, STORED), 201, {"Idempotent-Replayed": "true"}),
])
def test_claim_answer(result: ClaimResult, status: int | None, headers: dict[str, str]) -> None:
    answer = http.claim_answer(S, result)
    if status is None:
        assert answer is None
        return
    assert answer is not None and answer.status == status
    assert headers.items() <= dict(answer.headers).items()
    if result.outcome is Outcome.REPLAY:
        assert answer.body == b'{"zeta":1,"a":2}' and answer.replayed  # the stored bytes


@pytest.mark.parametrize(("status", "started", "store_5xx", "stored"), [
    (201, True, False, True),
    (302, True, False, True),
    (402, True, False, True),  # a 4xx of the handler is its result
    (422, False, False, False),  # a 4xx before it started (validation): released
    (401, False, True, False),
    (201, False, False, True),  # success without asking for the operation: stored
    (500, True, False, False),
    (503, True, True, True),
    (500, False, True, True),  # store_server_errors needs no call to get_operation()
    (500, False, False, False),
])
def test_what_is_stored(status: int, started: bool, store_5xx: bool, stored: bool) -> None:
    assert http.stores(Settings(store_server_errors=store_5xx), status,
                       started=started) is stored


def test_stored_parts() -> None:
    stored, content_type = http.stored_parts(S, [
        ("Content-Type", "application/json"), ("Location", "/p/1"), ("ETag", '"v1"'),
        ("X-Request-Id", "r1"), ("Set-Cookie", "a=b"), ("Content-Length", "16")])
    assert stored == {"Location": "/p/1", "ETag": '"v1"'} and content_type == "application/json"
    assert http.stored_parts(S, [])[1] == "application/octet-stream"


@pytest.mark.parametrize(("length", "body", "complete"), [
    (None, b"", True), ("", b"x", True), ("3", b"abc", True), ("10", b"abc", False),
    ("x", b"abc", True),
])
def test_body_complete(length: str | None, body: bytes, complete: bool) -> None:
    assert http.body_complete(length, body) is complete


def test_waiting_for_an_attempt_in_progress() -> None:
    """In progress, in progress, then replay: two sleeps, the replay answered; with wait=0 the
    first in-progress claim answers 409 at once."""
    results = [claim(Outcome.IN_PROGRESS, retry_after=timedelta(seconds=1)),
               claim(Outcome.IN_PROGRESS, retry_after=timedelta(seconds=1)),
               claim(Outcome.REPLAY, STORED)]
    sleeps: list[float] = []
    got = http.claim_waiting(Settings(wait=5), lambda: results.pop(0), sleeps.append)
    assert isinstance(got, Answer) and got.status == 201 and got.replayed
    assert sleeps == [0.02, 0.04]
    got = http.claim_waiting(S, lambda: claim(Outcome.IN_PROGRESS), sleeps.append)
    assert isinstance(got, Answer) and got.status == 409 and len(sleeps) == 2
    owned = claim(Outcome.CLAIMED)
    assert http.claim_waiting(S, lambda: owned) is owned


@pytest.mark.anyio
async def test_waiting_async() -> None:
    results = [claim(Outcome.IN_PROGRESS), claim(Outcome.CLAIMED)]
    sleeps: list[float] = []

    async def one() -> ClaimResult:
        return results.pop(0)

    async def sleep(seconds: float) -> None:
        sleeps.append(seconds)

    got = await http.aclaim_waiting(Settings(wait=1), one, sleep)
    assert isinstance(got, ClaimResult) and got.outcome is Outcome.CLAIMED and sleeps == [0.02]


class _Stream:
    """A WSGI input: ``parts`` one per read, then b"" (or ``error`` raised)."""

    def __init__(self, *parts: bytes, error: Exception | None = None) -> None:
        self.parts, self.error, self.calls, self.got = list(parts), error, 0, 0

    def read(self, n: int) -> bytes:
        self.calls += 1
        if self.parts:
            part = self.parts.pop(0)
            assert len(part) <= n
            self.got += len(part)
            return part
        if self.error is not None:
            raise self.error
        return b""


SMALL = Settings(max_request_bytes=10)


@pytest.mark.parametrize(("length", "stream", "terminated", "expected"), [
    ("5", _Stream(b"ab", b"cde"), False, b"abcde"),
    ("0", _Stream(b"x"), False, b""),
    (None, _Stream(b"abc"), False, b""),  # no length, no end the server vouches for: empty
    (None, _Stream(b"abc", b"de"), True, b"abcde"),  # chunked, ended
    ("", _Stream(b"abc"), True, b"abc"),
    ("10", _Stream(b"abc"), False, "Incomplete body"),  # shorter than its Content-Length
    ("5", _Stream(b"ab", error=OSError("gone")), False, "Incomplete body"),
    (None, _Stream(b"ab", error=ValueError("bad chunk")), True, "Incomplete body"),
    ("11", _Stream(b"x" * 11), False, "Request too large"),  # nothing read
    (None, _Stream(b"x" * 6, b"x" * 5, b"x"), True, "Request too large"),  # limit + 1 read
    (None, _Stream(b"x" * 10), True, b"x" * 10),  # at the limit
    ("-1", _Stream(b"x"), False, "Invalid Content-Length"),
    ("1e3", _Stream(b"x"), False, "Invalid Content-Length"),
    ("\u0661", _Stream(b"x"), False, "Invalid Content-Length"),  # a digit, not ASCII
])
def test_the_body_rule(length: str | None, stream: _Stream, terminated: bool,
                       expected: bytes | str) -> None:
    got = http.read_body(SMALL, length, stream.read, terminated=terminated)
    if isinstance(expected, bytes):
        assert got == expected
    else:
        assert isinstance(got, Answer) and got.status in (400, 413)
        assert json.loads(got.body)["title"] == expected
    if expected in ("Request too large", "Invalid Content-Length") and length:
        assert stream.calls == 0
    assert stream.got <= SMALL.max_request_bytes + 1


def test_the_body_rule_fed_by_messages() -> None:
    """What the ASGI adapter feeds it: chunks, then the end or a disconnect."""
    reader = http.BodyReader(SMALL, "6")
    assert reader.feed(b"abc") and reader.feed(b"de")
    assert json.loads(reader.finish().body)["title"] == "Incomplete body"  # type: ignore[union-attr]
    reader = http.BodyReader(SMALL, None)
    assert reader.feed(b"abc")
    assert isinstance(reader.finish(ended=False), Answer)
    reader = http.BodyReader(SMALL, None)
    assert reader.feed(b"x" * 10) and not reader.feed(b"x")
    assert reader.finish().status == 413  # type: ignore[union-attr]


def _nested(levels: int) -> bytes:
    return b"[" * levels + b"1" + b"]" * levels


@pytest.mark.parametrize("route", [None, http.Route("required", fingerprint_exclude=["x"])])
def test_nesting_counts_the_body_as_sent(route: http.Route | None) -> None:
    """128 levels of the body are taken (the engine's limit for a request), 129 refused with
    400; the fingerprint is that of the describing object, as before."""
    route = route or http.Route("required")
    for levels, status in [(1, None), (127, None), (128, None), (129, 400), (300, 400)]:
        body = b'{"a": ' + _nested(levels - 1) + b"}"
        got = http.keyed_request(S, route, "acct", "POST", "/p", "", "application/json", body)
        if status is None:
            assert isinstance(got, http.Keyed), (levels, got)
        else:
            assert isinstance(got, Answer) and got.status == status, levels
            assert "128" in json.loads(got.body)["detail"]
    body = b'{"a": [1, {"b": 2.50}]}'
    got = http.keyed_request(S, http.Route("required"), "acct", "POST", "/p", "",
                             "application/json", body)
    assert isinstance(got, http.Keyed)
    assert got.fingerprint == hashlib.sha256(
        b'{"json":{"a":[1,{"b":2.5}]},"method":"POST","path":"/p"}').digest()
