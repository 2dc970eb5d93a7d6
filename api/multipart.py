"""Reading a ``multipart/form-data`` upload as it streams in: the file part's bytes go straight on to their
destination (the artifact store, through the line checker) while the body arrives, with nothing spooled.

Starlette's form parsing writes the whole file part to a temporary file first (on the event loop's thread, then
read back by the route): for a 512 MiB upload about 3 s of the API process's CPU and 512 MiB of temporary disk
before a byte is checked; the raw parse below (python-multipart's ``MultipartParser``, the parser Starlette itself
uses) costs about 0.2 s for the same body (BENCHMARKS.md, "Abuse latency").

:class:`MultipartUpload` is driven by an iterator of body chunks (a route running in a worker thread reads them from
the event loop: :func:`request_chunks`). :meth:`MultipartUpload.open` reads up to the start of the file part's bytes
(collecting the fields before it, ``purpose`` when the client sends it first, as OpenAI's clients do);
:meth:`MultipartUpload.file_chunks` then yields the file's bytes and, once they end, reads the rest of the body
(fields after the file).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anyio.from_thread
import python_multipart
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import parse_options_header
from starlette.requests import Request

MAX_FIELD_BYTES = 1024
"""A form field other than the file (``purpose``): longer is refused."""
MAX_PARTS = 16
"""Parts in one body: more is refused (an upload has two)."""


class MultipartError(ValueError):
    """The body is not the multipart form the upload expects; ``param`` names the field at fault."""

    def __init__(self, message: str, *, param: str) -> None:
        super().__init__(message)
        self.param = param


def boundary_of(content_type: str | None) -> bytes:
    """The boundary of a ``multipart/form-data`` content type; a MultipartError when it is another type."""
    kind, options = parse_options_header(content_type or "")
    boundary = options.get(b"boundary")
    if kind != b"multipart/form-data" or not boundary:
        raise MultipartError("expected a multipart/form-data body with a 'file' part and a 'purpose'", param="file")
    return boundary


def request_chunks(request: Request) -> Iterator[bytes]:
    """The request's body chunks, read from a worker thread (a sync route) through the event loop as they arrive.
    A client that goes away raises Starlette's ClientDisconnect here."""
    stream = request.stream()
    while True:
        try:
            chunk = anyio.from_thread.run(stream.__anext__)
        except StopAsyncIteration:
            return
        if chunk:
            yield chunk


class MultipartUpload:
    """One file part (``file_field``) streamed through, every other field collected (``fields``, at most
    MAX_FIELD_BYTES each). ``filename`` is the file part's, once :meth:`open` returned."""

    def __init__(self, chunks: Iterator[bytes], boundary: bytes, *, file_field: str = "file") -> None:
        self._chunks = chunks
        self._file_field = file_field.encode()
        self.fields: dict[str, str] = {}
        self.filename: str | None = None
        self._parts = 0
        self._header_field = bytearray()
        self._header_value = bytearray()
        self._headers: dict[bytes, bytes] = {}
        self._current: bytes | None = None  # the part being read: its field name
        self._value = bytearray()  # a field's value so far
        self._in_file = self._file_done = self._ended = False
        self._file_data: list[bytes] = []  # file bytes the last write produced, not yet yielded
        callbacks: Any = {
            "on_part_begin": self._part_begin,
            "on_header_field": lambda data, start, end: self._header_field.extend(data[start:end]),
            "on_header_value": lambda data, start, end: self._header_value.extend(data[start:end]),
            "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished,
            "on_part_data": self._part_data,
            "on_part_end": self._part_end,
            "on_end": self._end,
        }
        self._parser = python_multipart.MultipartParser(boundary, callbacks)

    # -- parser callbacks -------------------------------------------------------------------------------------------

    def _part_begin(self) -> None:
        self._parts += 1
        if self._parts > MAX_PARTS:
            raise MultipartError(f"the form has more than {MAX_PARTS} parts", param="file")
        self._headers, self._current = {}, None
        self._value.clear()

    def _header_end(self) -> None:
        self._headers[bytes(self._header_field).lower()] = bytes(self._header_value)
        self._header_field.clear()
        self._header_value.clear()

    def _headers_finished(self) -> None:
        disposition, options = parse_options_header(self._headers.get(b"content-disposition", b""))
        name = options.get(b"name")
        if disposition != b"form-data" or name is None:
            raise MultipartError("a form part has no Content-Disposition naming its field", param="file")
        self._current = name
        if name == self._file_field:
            if self._file_done or self._in_file:
                raise MultipartError("the form holds more than one file", param="file")
            self._in_file = True
            self.filename = options.get(b"filename", b"").decode("utf-8", "replace")

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if self._in_file:
            self._file_data.append(data[start:end])
            return
        self._value.extend(data[start:end])
        if len(self._value) > MAX_FIELD_BYTES:
            field = (self._current or b"").decode("utf-8", "replace")
            raise MultipartError(f"the form field is longer than {MAX_FIELD_BYTES} bytes", param=field)

    def _part_end(self) -> None:
        if self._in_file:
            self._in_file, self._file_done = False, True
        elif self._current is not None:
            field = self._current.decode("utf-8", "replace")
            try:
                self.fields[field] = self._value.decode("utf-8")
            except UnicodeDecodeError:
                raise MultipartError("must be UTF-8 text", param=field) from None

    def _end(self) -> None:
        self._ended = True

    # -- reading ----------------------------------------------------------------------------------------------------

    def _feed(self) -> bool:
        """Parse the next chunk of the body; False once the body has ended."""
        chunk = next(self._chunks, None)
        if chunk is None:
            return False
        try:
            self._parser.write(chunk)
        except MultipartParseError as err:
            raise MultipartError(f"the multipart body is malformed ({err})", param="file") from None
        return True

    def open(self) -> None:
        """Read up to the file part's bytes. A MultipartError when the body has no file part."""
        while not (self._in_file or self._file_done):
            if self._ended or not self._feed():
                raise MultipartError("field required", param=self._file_field.decode())

    def file_chunks(self) -> Iterator[bytes]:
        """The file part's bytes as they arrive, then the rest of the body read (its fields collected). A
        MultipartError when the body ends before the form does."""
        while True:
            if self._file_data:
                data, self._file_data = self._file_data, []
                yield from data
            if self._ended:
                return
            if not self._feed():
                raise MultipartError("the multipart body ended before its closing boundary", param="file")
