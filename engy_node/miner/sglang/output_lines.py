"""The child's output, split into bounded text lines for the log and the failure tail.

Pure: bytes in, lines out, no IO. The child is a peer we do not control and may print
anything, so what it writes is read in lines of bounded length and memory stays bounded
however long a line is (a runaway tensor dump, a progress bar that never ends its line).
"""

from __future__ import annotations

import re

__all__ = ["LineBuffer"]

TRUNCATION_MARK = " …[line truncated]"


class LineBuffer:
    """Splits a child's output bytes into text lines of at most `max_line_bytes` each.

    Lines end at "\\n" or "\\r" (progress bars redraw with "\\r"); empty lines are dropped. A line
    longer than the cap is cut at the cap, marked with `TRUNCATION_MARK` and counted in
    `truncated`; the rest of it, up to its end, is discarded without being buffered, so
    memory stays bounded whatever the child writes. Bytes that are not UTF-8 are replaced.
    """

    def __init__(self, *, max_line_bytes: int) -> None:
        if max_line_bytes < 1:
            raise ValueError(f"max_line_bytes must be >= 1, got {max_line_bytes!r}")
        self.max_line_bytes = max_line_bytes
        self.truncated = 0
        self._partial = bytearray()
        self._discarding = False

    def feed(self, data: bytes | bytearray) -> list[str]:
        """The lines completed by `data`, in order."""
        *complete, rest = re.split(rb"[\r\n]", data)
        lines: list[str] = []
        for segment in complete:
            if self._discarding:
                self._discarding = False
            else:
                self._partial += segment
                self._emit(bytes(self._partial), lines)
            self._partial.clear()
        if not self._discarding:
            self._partial += rest
            if len(self._partial) > self.max_line_bytes:
                self._emit(bytes(self._partial), lines)
                self._partial.clear()
                self._discarding = True
        return lines

    def flush(self) -> list[str]:
        """The unterminated last line, once the stream has ended."""
        lines: list[str] = []
        if not self._discarding:
            self._emit(bytes(self._partial), lines)
        self._partial.clear()
        self._discarding = False
        return lines

    def _emit(self, raw: bytes, lines: list[str]) -> None:
        if len(raw) > self.max_line_bytes:
            self.truncated += 1
            text = raw[: self.max_line_bytes].decode("utf-8", "replace").rstrip() + TRUNCATION_MARK
        else:
            text = raw.decode("utf-8", "replace").rstrip()
        if text:
            lines.append(text)
