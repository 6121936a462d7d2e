"""OpenAI request bodies -> validated engine settings, with errors the OpenAI way (`APIError`).

A body is read field by field with exact types (JSON true is not an integer), so every bad value becomes a 400 that
names the field, before anything is queued. WhiFlash's extras are optional top-level fields: `mode`, `router`,
`threshold` (absent: the engine's default, planned by Engine.plan), `top_k` and `ignore_eos`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from whiflash_trt.config import AUTO, MODES, ROUTERS, GenerationConfig, SamplingConfig, SpecConfig
from whiflash_trt.errors import SpecError, WhiflashError
from whiflash_trt.runtime.engine import Engine
from whiflash_trt.runtime.plan import Plan
from whiflash_trt.serving.openai_api.limits import ServerLimits

COMPLETIONS_DEFAULT_MAX_TOKENS = 16   # OpenAI's default for /v1/completions; chat's is ServerLimits.chat_max_tokens
MAX_STOP_STRINGS = 4                  # OpenAI's limit
DEFAULT_TEMPERATURE = 1.0             # OpenAI's default: a request without temperature samples (0 = greedy; so is
                                      # any temperature below config.GREEDY_BELOW_TEMPERATURE)
CHAT_ROLES = ("system", "developer", "user", "assistant")
# Parameters this server does not implement: a request that sets one to anything but its default is refused,
# never silently served as if the parameter had been honoured.
UNSUPPORTED = {"n": 1, "best_of": 1, "echo": False, "logprobs": None, "top_logprobs": None, "suffix": None,
               "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None, "tools": None,
               "functions": None}


class APIError(Exception):
    """An error response: `status` with {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400,
                 type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.type = message, param, code, status, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ParsedRequest:
    """A validated /v1/completions or /v1/chat/completions body."""
    prompt_ids: list[int]
    gen: GenerationConfig
    plan: Plan                # this request's Engine.plan: the spec resolved, its drafters and router built
    stream: bool
    include_usage: bool       # stream_options.include_usage: a final chunk carrying `usage`


# ----- typed fields ------------------------------------------------------------------------------------------------
def _type_error(name: str, expected: str, value: Any) -> APIError:
    return APIError(f"{name} must be {expected}, got {value!r}", param=name, code="invalid_type")


def _integer(body: dict, name: str, default: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise _type_error(name, "an integer", value)
    return value


def _number(body: dict, name: str, default: float | None) -> float | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _type_error(name, "a finite number", value)
    return float(value)


def _boolean(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _type_error(name, "true or false", value)
    return value


def _string(body: dict, name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise _type_error(name, "a string", value)
    return value


def _stop_strings(body: dict, max_chars: int) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _type_error("stop", "a string or a list of strings", stop)
    if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
        raise APIError(f"stop takes up to {MAX_STOP_STRINGS} non-empty strings, got {len(stops)}", param="stop")
    if any(len(s) > max_chars for s in stops):
        raise APIError(f"each stop string holds at most {max_chars} characters, got "
                       f"{max(len(s) for s in stops)}", param="stop", code="stop_too_long")
    return tuple(stops)


# ----- whole requests ----------------------------------------------------------------------------------------------
def check_model(body: dict, served: str) -> None:
    model = _string(body, "model")
    if model is None:
        raise APIError("model is required", param="model", code="missing_required_parameter")
    if model != served:
        raise APIError(f"the model {model!r} does not exist; this server serves {served!r}", param="model",
                       code="model_not_found", status=404)


def _check_unsupported(body: dict) -> None:
    for name, default in UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and value != default and not (name == "logprobs" and value is False):
            raise APIError(f"{name}={value!r} is not supported by this server", param=name, code="unsupported")


def _plan(body: dict, engine: Engine) -> Plan:
    """The WhiFlash extras planned by the engine: one that its resolved mode would ignore, or a mode or router this
    engine cannot run, is a 400 naming it (SpecError's neutral names are these fields' names)."""
    given = {"mode": _string(body, "mode"), "router": _string(body, "router"),
             "threshold": _number(body, "threshold", None)}
    given = {k: v for k, v in given.items() if v is not None}
    for name, allowed in (("mode", (AUTO, *MODES)), ("router", (AUTO, *ROUTERS))):
        if name in given and given[name] not in allowed:
            raise APIError(f"unknown {name} {given[name]!r}; expected one of {', '.join(allowed)}", param=name)
    try:
        return engine.plan(SpecConfig(**given), given=given)
    except SpecError as e:
        raise APIError(str(e), param=e.param) from None


def _generation(body: dict, prompt_len: int, context: int, default_max_tokens: int,
                limits: ServerLimits) -> GenerationConfig:
    max_tokens = _integer(body, "max_tokens", None)
    name = "max_tokens"
    if max_tokens is None and "max_completion_tokens" in body:
        max_tokens, name = _integer(body, "max_completion_tokens", None), "max_completion_tokens"
    if max_tokens is None:
        max_tokens = min(default_max_tokens, context - prompt_len)
    if max_tokens <= 0:
        raise APIError(f"{name} must be a positive integer, got {max_tokens}", param=name)
    temperature = _number(body, "temperature", DEFAULT_TEMPERATURE)
    if not 0.0 <= temperature <= 2.0:
        raise APIError(f"temperature must be in [0, 2], got {temperature}", param="temperature")
    top_p = _number(body, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise APIError(f"top_p must be in (0, 1], got {top_p}", param="top_p")
    top_k = _integer(body, "top_k", 0)
    if top_k < 0:
        raise APIError(f"top_k must be >= 0 (0 disables it), got {top_k}", param="top_k")
    seed = _integer(body, "seed", None)
    if seed is not None and not 0 <= seed < 2**63:
        raise APIError(f"seed must be in [0, 2^63), got {seed}", param="seed")
    return GenerationConfig(max_new_tokens=max_tokens, stop_strings=_stop_strings(body, limits.max_stop_chars),
                            ignore_eos=_boolean(body, "ignore_eos", False),
                            sampling=SamplingConfig(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed))


def _stream_options(body: dict) -> tuple[bool, bool]:
    stream = _boolean(body, "stream", False)
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise _type_error("stream_options", "an object", options)
    if not stream:
        raise APIError("stream_options applies only with stream: true", param="stream_options")
    return stream, _boolean(options, "include_usage", False)


def _parse(body: dict, engine: Engine, prompt_ids: list[int], param: str, default_max_tokens: int,
           limits: ServerLimits) -> ParsedRequest:
    context = engine.manifest.model.max_position_embeddings
    if len(prompt_ids) >= context:
        raise APIError(f"this model's context is {context} tokens, and the prompt has {len(prompt_ids)}; shorten it",
                       param=param, code="context_length_exceeded")
    gen = _generation(body, len(prompt_ids), context, default_max_tokens, limits)
    stream, include_usage = _stream_options(body)
    return ParsedRequest(prompt_ids, gen, _plan(body, engine), stream, include_usage)


def _checked_body(body: Any, served: str) -> dict:
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object", code="invalid_body")
    check_model(body, served)
    _check_unsupported(body)
    return body


def _check_prompt_chars(num_chars: int, param: str, limits: ServerLimits) -> None:
    """Before tokenizing: a prompt's characters within the server's limit."""
    if num_chars > limits.max_prompt_chars:
        raise APIError(f"the prompt has {num_chars} characters; this server takes up to {limits.max_prompt_chars}",
                       param=param, code="prompt_too_long")


def parse_completion(body: Any, engine: Engine, served: str, limits: ServerLimits) -> ParsedRequest:
    """/v1/completions: `prompt` is a non-empty string (or a list of one), or a list of token ids."""
    body = _checked_body(body, served)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if prompt is None:
        raise APIError("prompt is required", param="prompt", code="missing_required_parameter")
    if isinstance(prompt, str):
        if not prompt:
            raise APIError("prompt is empty", param="prompt")
        _check_prompt_chars(len(prompt), "prompt", limits)
        ids = engine.encode(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        vocab = engine.manifest.model.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise APIError(f"prompt holds token ids outside the vocabulary [0, {vocab})", param="prompt")
        ids = list(prompt)
    else:
        raise _type_error("prompt", "a non-empty string or a list of token ids (one prompt per request)", prompt)
    return _parse(body, engine, ids, "prompt", COMPLETIONS_DEFAULT_MAX_TOKENS, limits)


def _message_text(i: int, message: Any) -> tuple[str, str]:
    """(role, text) of messages[i]; content is a string or a list of {"type": "text", "text": ...} parts."""
    if not isinstance(message, dict):
        raise _type_error(f"messages[{i}]", "an object with role and content", message)
    role, content = message.get("role"), message.get("content")
    if role not in CHAT_ROLES:
        raise APIError(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {role!r}",
                       param=f"messages[{i}].role")
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise _type_error(f"messages[{i}].content", "a string or a list of text parts", content)
    return ("system" if role == "developer" else role), content


def chat_prompt_ids(engine: Engine, messages: list[tuple[str, str]]) -> list[int]:
    """The chat template of the engine's tokenizer over `messages` (what whiflash-run --chat applies)."""
    return engine.encode_chat([{"role": r, "content": c} for r, c in messages])


def parse_chat(body: Any, engine: Engine, served: str, limits: ServerLimits) -> ParsedRequest:
    """/v1/chat/completions: `messages` is a non-empty list of {role, content}."""
    body = _checked_body(body, served)
    messages = body.get("messages")
    if messages is None:
        raise APIError("messages is required", param="messages", code="missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise _type_error("messages", "a non-empty list", messages)
    turns = [_message_text(i, m) for i, m in enumerate(messages)]
    _check_prompt_chars(sum(len(text) for _, text in turns), "messages", limits)
    try:
        ids = chat_prompt_ids(engine, turns)
    except WhiflashError as e:
        raise APIError(str(e), param="messages") from None
    except Exception as e:   # the template refuses these messages (jinja2's raise_exception, a role order it rejects)
        raise APIError(f"the chat template cannot render these messages: {type(e).__name__}: {e}",
                       param="messages", code="invalid_messages") from None
    return _parse(body, engine, ids, "messages", limits.chat_max_tokens, limits)
