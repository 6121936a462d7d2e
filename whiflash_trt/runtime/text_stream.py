"""Streamed text: the text of a growing list of token ids, handed out only in pieces that are final."""
from __future__ import annotations

from typing import Callable


class TextStream:
    """Holds back an incomplete UTF-8 sequence and any tail that could be the start of a stop string, so a stop
    string is never handed out; `rest(final_text)` is what remains of the request's final text (cut at its stop)."""

    def __init__(self, decode: Callable[[list[int]], str], stop_strings: tuple[str, ...] = ()) -> None:
        self.decode, self.stops = decode, tuple(s for s in stop_strings if s)
        self.ids: list[int] = []
        self.num_sent = 0   # characters handed out so far

    def _safe_length(self, text: str) -> int:
        """Length of the prefix of `text` that no stop string can still claim."""
        safe = len(text)
        for stop in self.stops:
            at = text.find(stop)
            if at >= 0:
                safe = min(safe, at)
            for k in range(min(len(stop) - 1, len(text)), 0, -1):   # a tail that begins this stop string
                if text.endswith(stop[:k]):
                    safe = min(safe, len(text) - k)
                    break
        return safe

    def add(self, new_ids: list[int]) -> str:
        """The new final text after `new_ids` arrived ("" while held back)."""
        self.ids += new_ids
        text = self.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        safe = self._safe_length(text)
        if safe <= self.num_sent:
            return ""
        delta, self.num_sent = text[self.num_sent:safe], safe
        return delta

    def rest(self, final_text: str) -> str:
        return final_text[self.num_sent:]
