"""The wire format of a one-shot engine exchange (gezel_trio.engine.wire): the request's
bytes, and the answer read back from bytes that arrive in any split. h11, which this
path used before, is the reference for what a well-formed answer decodes to."""

from __future__ import annotations

import itertools

import h11
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gezel_trio.engine.wire import MAX_HEAD_BYTES, AnswerError, AnswerReader, request_bytes

CHUNKED_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)


def _chunked(parts: list[bytes]) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts if p) + b"0\r\n\r\n"


def _read(answer: bytes, splits: list[int]) -> tuple[int, list[tuple[bytes, bytes]], bytes, bool]:
    """Feed ``answer`` cut at ``splits``; (status, headers, body, done) at the end."""
    reader = AnswerReader()
    head = None
    body = []
    cuts = sorted({0, *(s for s in splits if 0 < s < len(answer)), len(answer)})
    for a, b in itertools.pairwise(cuts):
        reader.feed(answer[a:b])
        if head is None:
            head = reader.head()
        if head is not None:
            body.append(reader.body())
    assert head is not None
    return head.status, head.headers, b"".join(body), reader.done


def _h11_body(answer: bytes) -> bytes:
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="POST", target="/", headers=[("Host", "x")]))
    conn.send(h11.EndOfMessage())
    conn.receive_data(answer)
    out = []
    while True:
        event = conn.next_event()
        if isinstance(event, h11.Data):
            out.append(bytes(event.data))
        elif isinstance(event, h11.EndOfMessage):
            return b"".join(out)
        elif event is h11.NEED_DATA:
            raise AssertionError("h11 wants more")


@given(
    parts=st.lists(st.binary(min_size=0, max_size=40), max_size=6),
    splits=st.lists(st.integers(min_value=0, max_value=400), max_size=12),
)
def test_a_chunked_body_split_anywhere_is_what_h11_reads(
    parts: list[bytes], splits: list[int]
) -> None:
    answer = CHUNKED_HEAD + _chunked(parts)
    status, headers, body, done = _read(answer, splits)
    assert status == 200 and done
    assert (b"Transfer-Encoding", b"chunked") in headers
    assert body == _h11_body(answer) == b"".join(parts)


@given(body=st.binary(max_size=200), splits=st.lists(st.integers(0, 300), max_size=10))
def test_a_content_length_body_ends_at_its_length(body: bytes, splits: list[int]) -> None:
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    status, _, read, done = _read(answer + b"garbage after the end", splits)
    assert (status, read, done) == (200, body, True)
    assert read == _h11_body(answer)


def test_an_unframed_body_ends_with_the_connection() -> None:
    reader = AnswerReader()
    reader.feed(b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: text/plain\r\n\r\nboom")
    head = reader.head()
    assert head is not None and head.status == 500
    assert head.reason == b"Internal Server Error"
    assert reader.body() == b"boom" and not reader.done
    assert reader.ends_with_connection


def test_chunk_extensions_and_trailers_are_read_past() -> None:
    answer = CHUNKED_HEAD + b"3;name=value\r\nabc\r\n0\r\nX-Trailer: 1\r\n\r\n"
    assert _read(answer, [])[2:] == (b"abc", True)


def test_an_informational_head_is_skipped() -> None:
    answer = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\nX: y\r\n\r\n"
    status, headers, body, done = _read(answer, [5, 30])
    assert (status, headers, body, done) == (204, [(b"X", b"y")], b"", True)


def test_an_incomplete_head_is_not_a_head_yet() -> None:
    reader = AnswerReader()
    reader.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n")
    assert reader.head() is None and not reader.ends_with_connection
    reader.feed(b"\r\nok")
    head = reader.head()
    assert head is not None and reader.body() == b"ok" and reader.done


@pytest.mark.parametrize(
    ("answer", "complaint"),
    [
        (b"SPDY/3 200 OK\r\n\r\n", "status line"),
        (b"HTTP/1.1 2000 OK\r\n\r\n", "three digits"),
        (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "malformed header"),
        (b"HTTP/1.1 200 OK\r\nName : v\r\n\r\n", "malformed header"),
        (b"HTTP/1.1 200 OK\r\nA: b\r\n folded\r\n\r\n", "malformed header"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", "two different"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", "not a number"),
    ],
)
def test_a_malformed_head_is_refused(answer: bytes, complaint: str) -> None:
    reader = AnswerReader()
    reader.feed(answer)
    with pytest.raises(AnswerError, match=complaint):
        reader.head()


@pytest.mark.parametrize(
    ("body", "complaint"),
    [
        (b"zz\r\n", "not hexadecimal"),
        (b"0x3\r\nabc\r\n", "not hexadecimal"),
        (b"-3\r\n", "not hexadecimal"),
        (b"3\r\nabcXY", "does not end with CRLF"),
        (b"1" * 2000, "over 1024 bytes"),
    ],
)
def test_a_malformed_chunk_is_refused(body: bytes, complaint: str) -> None:
    reader = AnswerReader()
    reader.feed(CHUNKED_HEAD + body)
    assert reader.head() is not None
    with pytest.raises(AnswerError, match=complaint):
        reader.body()


def test_a_head_that_never_ends_is_refused() -> None:
    reader = AnswerReader()
    reader.feed(b"HTTP/1.1 200 OK\r\n" + b"X: y\r\n" * (MAX_HEAD_BYTES // 6 + 1))
    with pytest.raises(AnswerError, match="over"):
        reader.head()


def test_a_request_is_its_head_and_body_in_one_write() -> None:
    headers = [(b"Host", b"127.0.0.1:8080"), (b"Content-Type", b"application/json")]
    sent = request_bytes("POST", b"/completion?x=1", headers, b"{}")
    assert sent == (
        b"POST /completion?x=1 HTTP/1.1\r\nHost: 127.0.0.1:8080\r\n"
        b"Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
    )
    server = h11.Connection(h11.SERVER)
    server.receive_data(sent)
    request = server.next_event()
    assert isinstance(request, h11.Request) and request.target == b"/completion?x=1"
    data = server.next_event()
    assert isinstance(data, h11.Data) and data.data == b"{}"
    assert isinstance(server.next_event(), h11.EndOfMessage)


def test_a_chunked_request_body_goes_as_one_chunk() -> None:
    headers = [(b"Host", b"h"), (b"Transfer-Encoding", b"chunked")]
    sent = request_bytes("POST", b"/", headers, b"abc")
    assert sent.endswith(b"\r\n\r\n3\r\nabc\r\n0\r\n\r\n")
    assert b"Content-Length" not in sent


@pytest.mark.parametrize("bad", [b"a\r\nInjected: 1", b"a\nb", b"a\0b"])
def test_a_header_that_would_break_the_head_is_refused(bad: bytes) -> None:
    with pytest.raises(ValueError, match="forbidden byte"):
        request_bytes("POST", b"/", [(b"X-Key", bad)], b"")
