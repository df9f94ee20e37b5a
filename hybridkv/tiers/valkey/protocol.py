"""The Redis protocol (RESP2) pieces the Valkey tier needs beyond redis-py.

Any thread (one connection at a time). Stores send the caller's buffer
straight to the socket (header and payload as separate pieces, no joined
copy); replies are read off the socket as they arrive, each bulk value into
a caller's buffer: no bytes object per value.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from hybridkv.tiers.base import Buffer


class SplitValue(NamedTuple):
    """A value sent as two pieces: the codec header, then the caller's payload."""

    header: bytes
    payload: memoryview


class ObjectPacker:
    """RESP command packer that sends ``SplitValue`` values without joining them.

    Other arguments are encoded like redis-py does (str as UTF-8, ints as text).
    """

    def pack(self, *args: Any) -> list[bytes | memoryview]:
        if isinstance(args[0], str) and " " in args[0]:  # "CLIENT SETINFO" and the like
            args = (*args[0].split(), *args[1:])
        pieces: list[bytes | memoryview] = []
        head = b"*%d\r\n" % len(args)
        for arg in args:
            if isinstance(arg, SplitValue):
                size = len(arg.header) + arg.payload.nbytes
                pieces += [head + b"$%d\r\n" % size + arg.header, arg.payload]
                head = b"\r\n"
                continue
            data = arg if isinstance(arg, bytes) else str(arg).encode()
            head += b"$%d\r\n%b\r\n" % (len(data), data)
        pieces.append(head)
        return pieces


class ErrorReply(NamedTuple):
    """An error reply (``-OOM ...``, ``-WRONGTYPE ...``): an answer, not a broken link."""

    message: str


class Bulk(NamedTuple):
    """A bulk reply read into a caller's buffer: its length (the buffer holds it only
    when the length is exactly the buffer's)."""

    num_bytes: int


class ReplyReader:
    """RESP2 replies read straight off a connected socket.

    Bulk strings can land in a caller's buffer with ``recv_into`` (one kernel
    copy, no bytes objects on the way); everything else is small.
    """

    def __init__(self, sock: Any, *, read_bytes: int = 1 << 16) -> None:
        self._sock = sock
        self._read_bytes = read_bytes
        self._pending = bytearray()

    @property
    def num_pending_bytes(self) -> int:
        """Bytes received but not yet part of a reply."""
        return len(self._pending)

    def read(self, into: Buffer | None = None) -> Any:
        """The next reply: int, bytes (simple or bulk string), None (nil), ``ErrorReply``,
        or with ``into`` a ``Bulk`` whose bytes are in ``into`` if they fit it exactly."""
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"$":
            size = int(rest)
            if size < 0:
                return None
            if into is None:
                return bytes(self._exactly(memoryview(bytearray(size + 2)))[:size])
            if size == len(into):
                self._exactly(into.data.cast("B"))
                self._exactly(memoryview(bytearray(2)))
            else:
                self._skip(size + 2)
            return Bulk(size)
        if kind == b"_":  # RESP3's nil, should a server answer with it
            return None
        if kind == b":":
            return int(rest)
        if kind == b"+":
            return bytes(rest)
        if kind == b"-":
            return ErrorReply(rest.decode(errors="replace"))
        raise ConnectionError(f"unexpected reply {line[:40]!r}")

    def _line(self) -> bytes:
        while (end := self._pending.find(b"\r\n")) < 0:
            self._fill()
        line = bytes(self._pending[:end])
        del self._pending[: end + 2]
        return line

    def _exactly(self, out: memoryview) -> memoryview:
        taken = min(len(self._pending), len(out))
        out[:taken] = self._pending[:taken]
        del self._pending[:taken]
        while taken < len(out):
            received = self._sock.recv_into(out[taken:])
            if received == 0:
                raise ConnectionError("connection closed mid-reply")
            taken += received
        return out

    def _skip(self, num_bytes: int) -> None:
        while num_bytes > 0:
            if not self._pending:
                self._fill()
            taken = min(len(self._pending), num_bytes)
            del self._pending[:taken]
            num_bytes -= taken

    def _fill(self) -> None:
        chunk = self._sock.recv(self._read_bytes)
        if not chunk:
            raise ConnectionError("connection closed mid-reply")
        self._pending += chunk
