"""HTTP/1.1 messages read off a socket as raw bytes, for a proxy that relays them byte for byte: a start line and
its header fields, and a body cut into pieces as it arrives, in whichever framing it came."""

from __future__ import annotations

from typing import BinaryIO, Iterator, NamedTuple, Optional


class Head(NamedTuple):
    """A request's or answer's start line and headers, as received (``raw``) and parsed."""

    raw: bytes
    start: str
    headers: dict[str, str]  # lower-case names; repeated fields joined with ", "

    def has(self, name: str, token: str) -> bool:
        return token in [part.strip().lower() for part in self.headers.get(name, "").split(",")]


LINE_LIMIT = 65536


def read_head(reader: BinaryIO, *, skip_blank_lines: bool = False) -> Optional[Head]:
    """A start line and its header fields; ``None`` at the end of the stream before any of it."""
    line = reader.readline(LINE_LIMIT + 1)
    while skip_blank_lines and line in (b"\r\n", b"\n"):  # stray line ends between requests are allowed
        line = reader.readline(LINE_LIMIT + 1)
    if not line:
        return None
    lines = [line]
    while lines[-1] not in (b"\r\n", b"\n"):
        line = reader.readline(LINE_LIMIT + 1)
        if not line or len(line) > LINE_LIMIT or len(lines) > 200:
            raise ConnectionError("a truncated or oversized message head")
        lines.append(line)
    headers: dict[str, str] = {}
    for field in lines[1:-1]:
        name, _, value = field.decode("latin-1").partition(":")
        name, value = name.strip().lower(), value.strip()
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    return Head(b"".join(lines), lines[0].decode("latin-1").strip(), headers)


def status_code(answer: Head) -> int:
    return int(answer.start.split(" ", 2)[1])


def request_framing(request: Head) -> tuple[str, int]:
    """How a request's body ends: ``("chunked", 0)`` or ``("length", n)``; a request with neither field has none."""
    if request.has("transfer-encoding", "chunked"):
        return "chunked", 0
    return "length", int(request.headers.get("content-length", "0"))


def answer_framing(answer: Head, *, no_body: bool) -> tuple[str, int]:
    """How an answer's body ends: ``("length", n)``, ``("chunked", 0)``, or ``("close", 0)`` with the connection."""
    if no_body:
        return "length", 0
    if answer.has("transfer-encoding", "chunked"):
        return "chunked", 0
    if "content-length" in answer.headers:
        return "length", int(answer.headers["content-length"])
    return "close", 0


def body_pieces(reader: BinaryIO, framing: str, length: int, piece: int) -> Iterator[bytes]:
    """A message body as it arrives, in raw pieces of at most ``piece`` bytes (chunked framing included, so
    that what is relayed is what was sent)."""

    def exactly(count: int) -> Iterator[bytes]:
        while count:
            data = reader.read1(min(piece, count))
            if not data:
                raise ConnectionError("the peer closed mid-body")
            count -= len(data)
            yield data

    if framing == "length":
        yield from exactly(length)
    elif framing == "chunked":
        while True:
            line = reader.readline(LINE_LIMIT + 1)
            if not line:
                raise ConnectionError("the peer closed mid-body")
            yield line
            size = int(line.split(b";")[0].strip(), 16)
            if size == 0:
                while True:  # trailer fields, then the empty line
                    trailer = reader.readline(LINE_LIMIT + 1)
                    if not trailer:
                        raise ConnectionError("the peer closed mid-body")
                    yield trailer
                    if trailer in (b"\r\n", b"\n"):
                        return
            yield from exactly(size + 2)
    else:
        while data := reader.read1(piece):
            yield data
