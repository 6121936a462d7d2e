"""Load an engine and serve it over HTTP with uvicorn (whiflash-serve --openai)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import uvicorn

from whiflash_trt.manifest import Manifest
from whiflash_trt.serving.openai_api.app import OpenAIServer
from whiflash_trt.serving.openai_api.limits import ServerLimits
from whiflash_trt.serving.scheduler import BatchScheduler
from whiflash_trt.runtime.device import set_threads
from whiflash_trt.runtime.engine import Engine


@dataclass(frozen=True)
class OpenAIServerOptions:
    engine_dir: Path | None   # None until the caller has built the default engine
    address: str = "127.0.0.1"
    port: int = 8000
    threads: int = 1
    kv_budget_mb: int = 256
    max_batch: int = 8         # requests stepped together (each holds its whole length's KV blocks from admission)
    dtype: str | None = None
    device: str = "cpu"
    model_name: str | None = None   # None: served_model_name(the engine's manifest)
    limits: ServerLimits = ServerLimits()

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.max_batch < 1:
            raise ValueError(f"max-batch must be >= 1, got {self.max_batch}")
        if self.kv_budget_mb <= 0:
            raise ValueError(f"kv-budget-mb must be positive, got {self.kv_budget_mb}")
        if self.model_name is not None and not self.model_name:
            raise ValueError("model name must be non-empty")


def served_model_name(manifest: Manifest) -> str:
    """The target the engine was built from: its name (smollm2-135m) or its checkpoint's folder/file name."""
    requested = str(manifest.source.get("requested") or manifest.model.architecture)
    if "/" in requested or requested.endswith(".gguf"):
        requested = Path(requested.rstrip("/")).name.removesuffix(".gguf")
    return requested


def build_server(opts: OpenAIServerOptions) -> OpenAIServer:
    set_threads(opts.threads)
    engine = Engine.load(opts.engine_dir, device=opts.device, dtype=opts.dtype,
                         kv_budget_bytes=opts.kv_budget_mb * 2**20)
    name = opts.model_name or served_model_name(engine.manifest)
    return OpenAIServer(engine, BatchScheduler(engine, opts.threads, opts.max_batch), name, opts.limits)


def run_server(opts: OpenAIServerOptions) -> None:
    server = build_server(opts)
    print(f"serving {server.model_name} ({opts.engine_dir}) at http://{opts.address}:{opts.port}/v1 "
          f"(up to {opts.max_batch} requests batched, {opts.limits.max_queue} waiting"
          f"{'; API key required' if opts.limits.api_key else ''})", flush=True)
    uvicorn.run(server.app(), host=opts.address, port=opts.port, log_level="info")
