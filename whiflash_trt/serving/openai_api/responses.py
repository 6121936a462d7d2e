"""Response bodies and stream chunks in OpenAI's formats, for completions and chat completions.

Every final response (and the stream's last choice chunk) carries `whiflash`: the engine's statistics of the request
(mode, router, threshold, tau = mean tokens per target forward, rounds, tokens_per_s, ...).
"""
from __future__ import annotations

import time
import uuid

from whiflash_trt.runtime.engine import GenerationResult

# The engine's finish reasons -> OpenAI's: an end-of-sequence token or a stop string is "stop"; running out of
# max_tokens or of the model's context is "length".
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}
WHIFLASH_STATS = ("mode", "router", "threshold", "tau", "tau_per_drafter", "rounds", "rounds_per_drafter",
                  "switches", "tokens_per_s", "seconds", "prefill_seconds")


def usage(result: GenerationResult) -> dict:
    completion = len(result.token_ids)
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": completion,
            "total_tokens": result.prompt_tokens + completion}


def whiflash_stats(result: GenerationResult) -> dict:
    return {k: result.stats.get(k) for k in WHIFLASH_STATS}


class ResponseFormat:
    """One response's id, timestamps and model; subclasses say how a choice holds text."""
    object_name = ""
    chunk_object_name = ""
    id_prefix = ""

    def __init__(self, model: str) -> None:
        self.model = model
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _envelope(self, object_name: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model,
                "choices": choices}

    def full(self, result: GenerationResult) -> dict:
        choice = {"index": 0, **self._full_choice(result.text), "logprobs": None,
                  "finish_reason": FINISH_REASONS[result.finish_reason]}
        return {**self._envelope(self.object_name, [choice]), "usage": usage(result),
                "whiflash": whiflash_stats(result)}

    def chunk(self, text: str, include_usage: bool) -> dict:
        choice = {"index": 0, **self._delta(text), "logprobs": None, "finish_reason": None}
        return self._with_usage_field(self._envelope(self.chunk_object_name, [choice]), include_usage)

    def first_chunks(self, include_usage: bool) -> list[dict]:
        return []

    def final_chunk(self, text: str, result: GenerationResult, include_usage: bool) -> dict:
        choice = {"index": 0, **self._delta(text), "logprobs": None,
                  "finish_reason": FINISH_REASONS[result.finish_reason]}
        body = self._envelope(self.chunk_object_name, [choice]) | {"whiflash": whiflash_stats(result)}
        return self._with_usage_field(body, include_usage)

    def usage_chunk(self, result: GenerationResult) -> dict:
        """The last chunk with stream_options.include_usage: no choices, the request's usage."""
        return self._envelope(self.chunk_object_name, []) | {"usage": usage(result)}

    @staticmethod
    def _with_usage_field(body: dict, include_usage: bool) -> dict:
        return body | {"usage": None} if include_usage else body

    def _full_choice(self, text: str) -> dict:
        raise NotImplementedError

    def _delta(self, text: str) -> dict:
        raise NotImplementedError


class CompletionFormat(ResponseFormat):
    object_name = chunk_object_name = "text_completion"
    id_prefix = "cmpl"

    def _full_choice(self, text: str) -> dict:
        return {"text": text}

    def _delta(self, text: str) -> dict:
        return {"text": text}


class ChatFormat(ResponseFormat):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def _full_choice(self, text: str) -> dict:
        return {"message": {"role": "assistant", "content": text}}

    def _delta(self, text: str) -> dict:
        return {"delta": {"content": text} if text else {}}

    def first_chunks(self, include_usage: bool) -> list[dict]:
        """OpenAI's chat streams open with a chunk that names the role."""
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return [self._with_usage_field(self._envelope(self.chunk_object_name, [choice]), include_usage)]
