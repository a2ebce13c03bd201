"""Every adapter under every server a user would run it under (gunicorn's sync and gthread
workers, waitress, werkzeug's server for the WSGI ones; uvicorn for the ASGI middleware, and for
Django's through Django's ASGI handler), over raw sockets:

- the body rule (contract.BodyReader): a body shorter than its Content-Length, or a chunked body
  cut short, the client gone, is never fingerprinted, claimed or executed: no key row, no ledger
  row, the handler never called (its ``calls`` row, written on a connection of its own, would
  say so); whatever the server answers is a 4xx, or nothing. The retry with the whole body is
  the first attempt: 201, run once, then replayed. (Before, the Flask decorator under gunicorn
  ran the short body and stored it; the retry got 422.)
- one rule for a repeated Idempotency-Key: 400 problem+json naming the header, nothing claimed,
  whether the server keeps the values apart (ASGI) or joins them with commas (every WSGI
  server); a comma inside a quoted key is part of the key.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from helpers.served import (
    MATRIX,
    headers_block,
    raw_exchange,
    rows,
    serve,
    status_of,
)

from pgharness import WAIT_BOUND

WHOLE = b'{"intent": "%s"}' + b" " * 64  # the short body below is valid JSON on its own


@pytest.fixture(params=MATRIX, ids=[f"{s}-{a}" for s, a in MATRIX])
def served(request: pytest.FixtureRequest, db: str) -> Iterator[tuple[str, str, str]]:
    server, adapter = request.param
    with serve(server, db) as base:
        yield adapter, base, db


def _refused_or_silent(answer: bytes, *statuses: int) -> None:
    status = status_of(answer)
    assert status is None or status in statuses, answer[:300]
    if status is not None and status == 400:
        assert b"application/problem+json" in answer, answer[:300]


def test_an_aborted_upload_is_never_run_and_its_retry_is_the_first(
        served: tuple[str, str, str]) -> None:
    adapter, base, dsn = served
    path = f"/{adapter}/pay"
    whole = WHOLE % b"a1"
    short = whole.rstrip(b" ")
    # Content-Length N, fewer bytes, then the client is gone
    answer = raw_exchange(base, headers_block(path, "k1", f"Content-Length: {len(whole)}\r\n")
                          + short)
    _refused_or_silent(answer, 400)
    assert rows(dsn, adapter, "k1", "a1") == (0, 0, 0)
    # a chunked body without its last chunk (Django refuses any chunked body: 411)
    chunk = b"%x\r\n%s\r\n" % (len(short), short)
    answer = raw_exchange(base, headers_block(path, "k1", "Transfer-Encoding: chunked\r\n")
                          + chunk)
    _refused_or_silent(answer, 400, 411)
    assert rows(dsn, adapter, "k1", "a1") == (0, 0, 0)
    # the retry with the whole body: the first attempt, run once, then replayed
    headers = {"Content-Type": "application/json", "Idempotency-Key": "k1"}
    first = httpx.post(base + path, headers=headers, content=whole, timeout=WAIT_BOUND)
    assert first.status_code == 201, first.text
    assert "idempotent-replayed" not in first.headers
    assert rows(dsn, adapter, "k1", "a1") == (1, 1, 1)
    again = httpx.post(base + path, headers=headers, content=whole, timeout=WAIT_BOUND)
    assert (again.status_code, again.content) == (201, first.content)
    assert again.headers["idempotent-replayed"] == "true"
    assert rows(dsn, adapter, "k1", "a1") == (1, 1, 1)


def test_a_repeated_key_is_400_and_claims_nothing(served: tuple[str, str, str]) -> None:
    adapter, base, dsn = served
    path = f"/{adapter}/pay"
    for i, values in enumerate([["r1", "r2"], ["r1", "r1"], ["r1, r2"], ['"r1", "r2"'],
                                ['"r1"', "r2"]]):
        headers = [("Content-Type", "application/json")] + [
            ("Idempotency-Key", v) for v in values]
        r = httpx.post(base + path, headers=headers, content=json.dumps({"intent": f"r{i}"}),
                       timeout=WAIT_BOUND)
        assert r.status_code == 400, (values, r.text)
        assert r.headers["content-type"] == "application/problem+json"
        assert r.json()["title"] == "More than one Idempotency-Key", (values, r.text)
        assert rows(dsn, adapter, "r1", f"r{i}") == (0, 0, 0)
        assert rows(dsn, adapter, "r2", f"r{i}") == (0, 0, 0)
    # a comma inside a quoted key is part of that one key
    headers = [("Content-Type", "application/json"), ("Idempotency-Key", '"r1,r2"')]
    r = httpx.post(base + path, headers=headers, content=json.dumps({"intent": "q"}),
                   timeout=WAIT_BOUND)
    assert r.status_code == 201, r.text
    assert rows(dsn, adapter, "r1,r2", "q") == (1, 1, 1)


#: Mistakes the server lets through to the app (docs/http.md, "What the server answers before
#: the adapter"), with what every adapter answers for them.
THROUGH = [("werkzeug", "Content-Length: abc\r\n", b"", "Invalid Content-Length"),
           ("werkzeug", "Content-Length: -1\r\n", b"", "Invalid Content-Length"),
           ("gunicorn-sync", "Transfer-Encoding: chunked\r\n", b"zz\r\nab\r\n0\r\n\r\n",
            "Incomplete body")]


@pytest.mark.parametrize(("http_server", "adapter"), [(s, a) for s, a in MATRIX if s in
                                                      ("werkzeug", "gunicorn-sync")])
def test_what_the_server_lets_through_is_problem_json(http_server: str, adapter: str,
                                                      db: str) -> None:
    with serve(http_server, db) as base:
        for i, (run, header, body, title) in enumerate(THROUGH):
            if run != http_server:
                continue
            answer = raw_exchange(base, headers_block(f"/{adapter}/pay", f"t{i}", header) + body)
            if adapter.startswith("django") and "chunked" in header:
                title = "Length Required"  # Django reads no chunked body (docs/django.md)
            assert b"application/problem+json" in answer, answer[:300]
            assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["title"] == title, answer
            assert rows(db, adapter, f"t{i}", "") == (0, 0, 0)


def test_a_whole_chunked_body(served: tuple[str, str, str]) -> None:
    """A keyed chunked body sent whole: run once, replayed; except where Django would read it
    as empty (the server passes the chunks on without a Content-Length): 411, nothing claimed.
    waitress decodes the chunks before the app and gives their length, so Django reads them."""
    adapter, base, dsn = served
    body = b'{"intent": "c1"}'
    request = (headers_block(f"/{adapter}/pay", "c1", "Transfer-Encoding: chunked\r\n")
               + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
    first = raw_exchange(base, request, half_close=False)  # Connection: close ends it
    again = raw_exchange(base, request, half_close=False)
    if adapter.startswith("django") and b"Server: waitress" not in first:
        assert status_of(first) == 411 and b"application/problem+json" in first, first[:300]
        assert rows(dsn, adapter, "c1", "c1") == (0, 0, 0)
        return
    assert status_of(first) == 201, first[:300]
    assert status_of(again) == 201 and b"dempotent-Replayed: true" in again.replace(
        b"idempotent-replayed", b"Idempotent-Replayed"), again[:300]
    assert rows(dsn, adapter, "c1", "c1") == (1, 1, 1)
