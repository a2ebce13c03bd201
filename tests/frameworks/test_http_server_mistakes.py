"""What each HTTP server answers itself, before any app (so before the adapter) runs: the table
of docs/http.md ("What the server answers before the adapter"), read from the page and checked
cell by cell, so that the page stays true. Each mistake is sent over a raw socket to a bare app
under each server, with the server's default limits: a cell is either the status and content
type the server answered, or "the app" (the request reached the app: the adapter then applies
its own rules, answering problem+json)."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from helpers import ROOT
from helpers.served import sent_in_parts, serve_plain

HEAD = b"POST / HTTP/1.1\r\nHost: x\r\n"
END = b"Connection: close\r\n\r\n"

#: Each mistake of the page's table, as the parts sent (a pause between two parts).
MISTAKES: dict[str, list[bytes]] = {
    "a control byte in a header value": [HEAD + b"X-A: a\x01b\r\nContent-Length: 0\r\n" + END],
    "a space in a header name": [HEAD + b"X A: b\r\nContent-Length: 0\r\n" + END],
    "a header field of 8,200 bytes": [HEAD + b"X-A: " + b"a" * 8200 + b"\r\n"
                                      b"Content-Length: 0\r\n" + END],
    "101 header fields": [HEAD + b"".join(b"X-%d: a\r\n" % i for i in range(101))
                          + b"Content-Length: 0\r\n" + END],
    "a header block of 20 KB still arriving": [HEAD, b"X-A: " + b"a" * 20_000 + b"\r\n",
                                               b"Content-Length: 0\r\n" + END],
    "a header block of 320 KB (fields of 8,000 bytes)": [
        HEAD + b"".join(b"X-%d: %s\r\n" % (i, b"a" * 8000) for i in range(40))
        + b"Content-Length: 0\r\n" + END],
    "a request line of 4,100 bytes": [b"POST /" + b"a" * 4090 + b" HTTP/1.1\r\nHost: x\r\n"
                                      b"Content-Length: 0\r\n" + END],
    "a negative Content-Length": [HEAD + b"Content-Length: -1\r\n" + END],
    "a Content-Length that is not a number": [HEAD + b"Content-Length: abc\r\n" + END],
    "two different Content-Lengths": [HEAD + b"Content-Length: 1\r\nContent-Length: 2\r\n"
                                      + END + b"ab"],
    "Content-Length and chunked together": [HEAD + b"Content-Length: 3\r\n"
                                            b"Transfer-Encoding: chunked\r\n" + END
                                            + b"0\r\n\r\n"],
    "a chunk size that is not hexadecimal": [HEAD + b"Transfer-Encoding: chunked\r\n" + END
                                             + b"zz\r\nab\r\n0\r\n\r\n"],
}
SERVERS = {"gunicorn": "gunicorn-sync", "uvicorn": "uvicorn", "waitress": "waitress",
           "werkzeug": "werkzeug"}
#: The servers run: gunicorn's two workers share its column (one parser).
RUNS = [("gunicorn", "gunicorn-sync"), ("gunicorn", "gunicorn-gthread"), ("uvicorn", "uvicorn"),
        ("waitress", "waitress"), ("werkzeug", "werkzeug")]


def documented() -> dict[str, dict[str, str]]:
    """docs/http.md's table: {mistake: {server: cell}}."""
    text = (ROOT / "docs" / "http.md").read_text()
    section = text.split("## What the server answers before the adapter", 1)[1]
    table_text = re.search(r"^\|.*?(?=\n[^|])", section, re.M | re.S)
    assert table_text is not None, "docs/http.md: no table in the section"
    lines = table_text.group(0).splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    servers = [next(s for s in SERVERS if s in cell.lower()) for cell in header[1:]]
    table = {}
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        table[cells[0]] = dict(zip(servers, cells[1:], strict=True))
    return table


def observed(answer: bytes) -> str:
    """The cell for a raw answer: "the app", or "STATUS content/type"."""
    head = answer.split(b"\r\n\r\n", 1)[0].decode("latin-1")
    if not head:
        return "no answer"
    if answer.endswith(b"app ran"):
        return "the app"
    status = head.split(" ", 2)[1]
    found = re.search(r"^content-type:\s*([\w/+.-]+)", head, re.I | re.M)
    return f"{status} {found.group(1) if found else '(no content type)'}"


def test_the_table_names_every_mistake_and_server() -> None:
    table = documented()
    assert list(table) == list(MISTAKES)
    assert all(set(row) == set(SERVERS) for row in table.values())


@pytest.fixture(params=RUNS, ids=[run for _, run in RUNS])
def plain(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    column, server = request.param
    with serve_plain(server) as base:
        yield column, base


def test_each_mistake_is_answered_as_documented(plain: tuple[str, str]) -> None:
    server, base = plain
    table = documented()
    got = {name: observed(sent_in_parts(base, parts, 0.3 if len(parts) > 1 else 0))
           for name, parts in MISTAKES.items()}
    want = {name: re.sub(r"[`*]", "", table[name][server]).split(" (")[0].split(";")[0]
            for name in MISTAKES}
    assert got == want


#: The settings docs/http.md names, raised: each mistake it names then reaches the app.
RAISED = [
    ("gunicorn-sync", ["--limit-request-line", "8190", "--limit-request-fields", "200",
                       "--limit-request-field_size", "16380"],
     ["a request line of 4,100 bytes", "101 header fields", "a header field of 8,200 bytes"]),
    ("uvicorn", {"h11_max_incomplete_event_size": 65536},
     ["a header block of 20 KB still arriving"]),
    ("waitress", {"max_request_header_size": 1048576},
     ["a header block of 320 KB (fields of 8,000 bytes)"]),
]


@pytest.mark.parametrize(("run", "options", "mistakes"), RAISED, ids=[r for r, _, _ in RAISED])
def test_the_documented_settings_move_the_limits(run: str, options: object,
                                                 mistakes: list[str]) -> None:
    column = run.split("-")[0]
    table = documented()
    with serve_plain(run, options) as base:
        for name in mistakes:
            assert table[name][column] != "the app", name  # refused with the defaults
            parts = MISTAKES[name]
            assert observed(sent_in_parts(base, parts, 0.3 if len(parts) > 1 else 0)) == \
                "the app", name
