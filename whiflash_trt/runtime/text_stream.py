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
        """Length of the prefix of `text` that no stop string can still claim. Only the text after what was handed
        out is searched (a stop string never begins in it), so a token costs O(new text + held-back tail) per stop
        string, not O(all the text)."""
        safe, start = len(text), min(self.num_sent, len(text))
        for stop in self.stops:
            at = text.find(stop, start)
            if at >= 0:
                safe = min(safe, at)
            tail = text[max(start, len(text) - len(stop) + 1):]   # a tail that begins this stop string
            for i in range(len(tail)):
                if stop.startswith(tail[i:]):
                    safe = min(safe, len(text) - len(tail) + i)
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
