"""When a request ends: EOS, stop strings, the token limit, the context limit."""
from __future__ import annotations

from dataclasses import dataclass

from whiflash_trt.config import GenerationConfig


@dataclass(frozen=True)
class StopDecision:
    keep: int                 # how many of the output tokens to keep
    reason: str | None        # "eos" | "stop" | "length" | "context" | None (go on)


class StopChecker:
    def __init__(self, gen: GenerationConfig, eos_ids: tuple[int, ...], decode, max_output_tokens: int) -> None:
        self.gen = gen
        self.eos_ids = () if gen.ignore_eos else tuple(eos_ids)
        self.decode = decode
        self.max_output_tokens = max_output_tokens  # room left in the context window

    def check(self, output: list[int], num_new: int) -> StopDecision:
        """Look at the `num_new` tokens the last round appended to `output`."""
        first_new = len(output) - num_new
        for i in range(first_new, len(output)):
            if output[i] in self.eos_ids:
                return self._limit(i + 1, "eos")
            if output[i] in self.gen.stop_token_ids:
                return self._limit(i + 1, "stop")
        if self.gen.stop_strings and self._may_complete_stop(output, first_new):
            # The earliest token whose arrival completes a stop string (tokens may hold several characters).
            for i in range(first_new, len(output)):
                text = self.decode(output[: i + 1])
                if any(s in text for s in self.gen.stop_strings):
                    return self._limit(i + 1, "stop")
        return self._limit(len(output), None)

    def _may_complete_stop(self, output: list[int], first_new: int) -> bool:
        """Whether a stop string can end in the new tokens' text, from the text of a window that ends with them, so a
        round costs one decode of a few tokens, not one of the whole output per new token. A stop string of L
        characters ending there began at most 4L tokens before them (a byte-level token holds at least a quarter of
        a character); 8 more absorb how a window's first tokens decode (a cut character, a dropped leading space)."""
        reach = 4 * max(len(s) for s in self.gen.stop_strings) + 8
        text = self.decode(output[max(0, first_new - reach):])
        return any(s in text for s in self.gen.stop_strings)

    def _limit(self, keep: int, reason: str | None) -> StopDecision:
        if keep >= self.gen.max_new_tokens and (reason is None or keep > self.gen.max_new_tokens):
            return StopDecision(self.gen.max_new_tokens, "length")
        if keep >= self.max_output_tokens and (reason is None or keep > self.max_output_tokens):
            return StopDecision(self.max_output_tokens, "context")
        return StopDecision(keep, reason)

    def final_text(self, output: list[int], reason: str | None) -> str:
        text = self.decode(output)
        if reason == "stop":
            cut = min((text.find(s) for s in self.gen.stop_strings if s in text), default=len(text))
            text = text[:cut]
        return text
