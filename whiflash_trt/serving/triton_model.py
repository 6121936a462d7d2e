"""Triton Python-backend model serving one whiflash engine (copied as model.py by builder.triton_repo).

It runs inside Triton's Python-backend stub, which provides `triton_python_backend_utils`; this file is a template
and is never imported by the package. The model is decoupled: a request gets one response (stream false) or one per
generation round plus a final one (stream true), and a bad request gets an error response while the model keeps
serving. `execute` only hands requests to the instance's BatchScheduler (serving/scheduler.py, as the OpenAI server):
its worker thread steps them together, up to the `max_batch` parameter at once, and answers through each request's
response sender.
"""
import json

import numpy as np
import triton_python_backend_utils as pb_utils

from whiflash_trt.config import GenerationConfig, SamplingConfig, SpecConfig
from whiflash_trt.runtime.device import default_threads
from whiflash_trt.runtime.engine import Engine
from whiflash_trt.runtime.plan import Plan
from whiflash_trt.serving.scheduler import BatchScheduler, Request, RequestCancelled

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _input(request, name: str, default=None):
    """The single value of an optional input (the request's tensors are [1, 1]), or `default` if absent."""
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return default
    values = tensor.as_numpy().reshape(-1)
    if values.size != 1:
        raise ValueError(f"{name} must hold exactly one value, got {values.size}")
    value = values[0]
    return value.decode("utf-8") if isinstance(value, bytes) else value.item()


def _plan(request, engine: Engine) -> Plan:
    """The request's speculation settings planned by `engine` (its own default for those it leaves out). One that the
    resolved mode would ignore, or a mode or router the engine cannot run, raises SpecError, which `execute` answers
    with an error response; SpecError's neutral names are these inputs' names."""
    given = {k: v for k, v in ((k, _input(request, k)) for k in ("mode", "router", "threshold")) if v is not None}
    return engine.plan(SpecConfig(**given), given=given)


def _generation_config(request) -> GenerationConfig:
    max_tokens = _input(request, "max_tokens")
    if max_tokens is None:
        raise ValueError("max_tokens is required")
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be a positive integer, got {max_tokens}")
    sampling = SamplingConfig(temperature=float(_input(request, "temperature", 0.0)),
                              top_p=float(_input(request, "top_p", 1.0)),
                              top_k=int(_input(request, "top_k", 0)),
                              seed=_input(request, "seed"))
    return GenerationConfig(max_new_tokens=int(max_tokens), sampling=sampling)


class TextDeltas:
    """Turns the token ids of a stream into new text, holding back an incomplete UTF-8 sequence."""

    def __init__(self, decode) -> None:
        self.decode, self.ids, self.sent = decode, [], ""

    def add(self, new_ids: list[int]) -> str:
        self.ids += new_ids
        text = self.decode(self.ids)
        if text.endswith("\ufffd") or not text.startswith(self.sent):
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta

    def rest(self, final_text: str) -> str:
        return final_text[len(self.sent):] if final_text.startswith(self.sent) else ""


def _response(text: str, num_new_tokens: int, finish_reason: str = "", stats: dict | None = None):
    """One response; `stats` (the engine's, final) only in the last one, whose finish_reason is non-empty."""
    stats = stats or {}

    def tensor(name, value, dtype):
        return pb_utils.Tensor(name, np.array([[value]], dtype=dtype))

    # Target-only decoding commits one token per target forward; the speculative runtime reports its own tau.
    tau = stats.get("tau", 1.0) if stats and num_new_tokens else 0.0
    return pb_utils.InferenceResponse(output_tensors=[
        tensor("text_output", text.encode("utf-8"), np.object_),
        tensor("finish_reason", finish_reason.encode("utf-8"), np.object_),
        tensor("num_new_tokens", num_new_tokens, np.int32),
        tensor("num_rounds", int(stats.get("rounds", 0)), np.int32),
        tensor("acceptance_length", float(tau), np.float32),
        tensor("tokens_per_s", float(stats.get("tokens_per_s", 0.0)), np.float32),
    ])


class Responses:
    """RequestSink: one request's responses through its Triton response sender."""

    def __init__(self, sender, decode, stream: bool) -> None:
        self.sender, self.stream, self.deltas = sender, stream, TextDeltas(decode)

    def tokens(self, new_ids: list[int]) -> None:
        if self.sender.is_cancelled():   # the client went away: the scheduler ends the request and frees its blocks
            raise RequestCancelled()
        if self.stream and (text := self.deltas.add(new_ids)):
            self.sender.send(_response(text, len(self.deltas.ids)))

    def finished(self, result) -> None:
        text = self.deltas.rest(result.text) if self.stream else result.text
        self.sender.send(_response(text, len(result.token_ids), result.finish_reason, result.stats), flags=FINAL)

    def failed(self, error: Exception) -> None:
        self.sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"{type(error).__name__}: {error}")),
                         flags=FINAL)

    def cancelled(self) -> None:
        self.sender.send(flags=FINAL)


class TritonPythonModel:
    def initialize(self, args) -> None:
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException("the whiflash model must be decoupled (streaming)")
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        # Several instances on one CPU share its cores: by default each gets its share of half of them.
        instances = sum(int(group.get("count", 1)) for group in config.get("instance_group", [{}]))
        threads = int(params.get("threads", "0")) or max(1, default_threads() // instances)
        self.engine = Engine.load(params["engine_dir"], device=params.get("device", "cpu"),
                                  kv_budget_bytes=int(params.get("kv_budget_mb", "256")) * 2**20)
        self.scheduler = BatchScheduler(self.engine, threads, int(params.get("max_batch", "1")))
        self.scheduler.start()

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                self.scheduler.submit(self._request(request, sender))
            except Exception as e:  # a bad request gets its error; the model goes on
                Responses(sender, self.engine.decode, False).failed(e)
        return None

    def finalize(self) -> None:
        self.scheduler.close()

    def _request(self, request, sender) -> Request:
        prompt = _input(request, "text_input")
        if prompt is None:
            raise ValueError("text_input is required")
        gen = _generation_config(request)
        sink = Responses(sender, self.engine.decode, bool(_input(request, "stream", False)))
        return Request(self.engine.encode(prompt), gen, _plan(request, self.engine), sink)
