"""Incremental splitting of streamed text at marker strings (``<think>``, ``<tool_call>``).

A marker may arrive split across deltas (``<thi`` | ``nk>``): text that could be the
start of the marker is held back until the next delta decides it.
"""

from __future__ import annotations


def held_back_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


class MarkerScanner:
    """Feed text; get back (text before the marker, whether the marker was seen).

    After the marker is seen, everything following it (in this delta) is in ``rest``.
    """

    def __init__(self, marker: str) -> None:
        self.marker = marker
        self._pending = ""

    def feed(self, text: str) -> tuple[str, bool, str]:
        """(safe text before any marker, marker found, text after the marker)."""
        text = self._pending + text
        self._pending = ""
        index = text.find(self.marker)
        if index >= 0:
            return text[:index], True, text[index + len(self.marker):]
        keep = held_back_suffix(text, self.marker)
        if keep:
            self._pending = text[-keep:]
            text = text[:-keep]
        return text, False, ""

    def flush(self) -> str:
        pending, self._pending = self._pending, ""
        return pending
