"""The "compiled" backend: the target step runs the AOTInductor package whiflash-build made
(builder/compile_target.py), and so do EAGLE-3's draft step and DFlash's block forward where the engine carries them
(builder/compile_eagle3.py, compile_dflash.py); embeddings, the LM heads of drafted rows, fc and the KV-only
prefills stay the torch modules and the kernels. The package's rows are row-invariant like the eager step's but may
differ from them in the last place, so every step of an engine runs the package: the engine only asks for the
captures it was compiled with (another capture, for a tool, runs the eager module)."""
from __future__ import annotations

from pathlib import Path

import torch

from whiflash_trt.models.attention import row_keys
from whiflash_trt.models.contracts import DFlash, Eagle3, Segment, Target, TargetOutput, feature_columns
from whiflash_trt.models.dflash import DFlashDrafter, block_keys
from whiflash_trt.models.eagle3 import Eagle3Drafter
from whiflash_trt.models.target import TargetModel
from whiflash_trt.runtime.target_runner import joined


class Package:
    """A loaded AOTInductor package, called on its flat tensor inputs. The package's own __call__ parses its pytree
    specs on every call (~70 us under cProfile; one call per EAGLE-3 draft step); every package here takes
    positional tensors and gives a tensor or a tuple of tensors, so the flat list of outputs is what the callers
    unpack."""

    def __init__(self, path: Path) -> None:
        self.loader = torch._inductor.aoti_load_package(str(path)).loader

    def __call__(self, inputs: tuple[torch.Tensor, ...], pools: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        """The package over `inputs`, which it reads as the contiguous tensors it was traced with; it writes the KV
        `pools` (two of the inputs) in place, so they must be contiguous already."""
        if not all(pool.is_contiguous() for pool in pools):
            raise ValueError("a compiled step writes the KV pools in place: they must be contiguous")
        return self.loader.boxed_run([t.contiguous() for t in inputs])


class CompiledTarget(Target):
    def __init__(self, eager: TargetModel, package: Path, capture_layers: tuple[int, ...]) -> None:
        self.eager, self.capture_layers = eager, capture_layers
        self.config = eager.config
        self.step = Package(package)

    @property
    def dtype(self) -> torch.dtype:
        return self.eager.dtype

    @property
    def native(self) -> bool:
        return self.eager.native

    def streamed_weight_bytes(self) -> int:
        """The eager target's (TargetModel.streamed_weight_bytes): the package computes from the same weights."""
        return self.eager.streamed_weight_bytes()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.eager.embed(input_ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.eager.logits(hidden)

    def head_weight(self) -> torch.Tensor:
        return self.eager.head_weight()

    def __call__(self, input_ids, positions, k_cache, v_cache, write_slots, read_slots, attn_mask,
                 capture_layers=(), logits_indices=None) -> TargetOutput:
        return self.forward_segments(input_ids, positions, k_cache, v_cache, write_slots,
                                     [Segment(read_slots, attn_mask)], capture_layers, logits_indices)

    def forward_segments(self, input_ids, positions, k_cache, v_cache, write_slots, segments: list[Segment],
                         capture_layers: tuple[int, ...] = (), logits_indices=None) -> TargetOutput:
        if any(i not in self.capture_layers for i in capture_layers):
            return self.eager.forward_segments(input_ids, positions, k_cache, v_cache, write_slots, segments,
                                               capture_layers, logits_indices)
        keys = row_keys(segments)
        rows = torch.arange(input_ids.shape[0]) if logits_indices is None else logits_indices
        # the package reads its inputs as the contiguous tensors it was traced with (it does not check strides)
        inputs = (input_ids, positions, k_cache, v_cache, write_slots, keys.slots, keys.lengths, rows)
        logits, hidden, *captured = self.step(inputs, (k_cache, v_cache))
        feats = None
        if capture_layers:
            feats = captured[0] if tuple(capture_layers) == self.capture_layers else captured[0][
                :, feature_columns(tuple(capture_layers), self.capture_layers, self.config.hidden_size)]
        return TargetOutput(logits, hidden, feats)


class _CompiledDrafter:
    """A fused drafter (on the kernels) whose step runs an AOTInductor package; the rest is the module."""

    def __init__(self, eager: Eagle3Drafter | DFlashDrafter, package: Path) -> None:
        self.eager, self.config = eager, eager.config
        self.step = Package(package)

    def __getattr__(self, name: str):   # what tools read of the module itself (fc, t2d, midlayer, layers, ...)
        return getattr(self.eager, name)

    def __call__(self, *args) -> torch.Tensor:
        return self.eager(*args)

    def kv_only(self, *args):
        return self.eager.kv_only(*args)

    def write_kv_only(self, *args) -> None:
        self.eager.write_kv_only(*args)


class CompiledEagle3(_CompiledDrafter, Eagle3):
    """An engine's EAGLE-3 whose draft_step runs the package."""

    def forward_segments(self, *args) -> torch.Tensor:
        return self.eager.forward_segments(*args)

    def draft_logprobs(self, out_hidden: torch.Tensor) -> torch.Tensor:
        return self.eager.draft_logprobs(out_hidden)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.eager.to_target_ids(draft_ids)

    def draft_step(self, embeds, hidden, positions, k_cache, v_cache, write_slots, segments: list[Segment]):
        keys = row_keys(segments)
        inputs = (embeds, hidden, positions, k_cache, v_cache, write_slots, keys.slots, keys.lengths)
        out, logprobs = self.step(inputs, (k_cache, v_cache))
        return out, logprobs


class CompiledDFlash(_CompiledDrafter, DFlash):
    """An engine's DFlash whose block forward runs the package where the proposer gives the blocks' scratch slots."""

    def forward_many(self, block_embeds, positions, k_cache, v_cache, reads, writes=None) -> torch.Tensor:
        if writes is None:
            return self.eager.forward_many(block_embeds, positions, k_cache, v_cache, reads)
        keys = block_keys(reads, writes)
        inputs = (block_embeds, positions, k_cache, v_cache, joined(writes), keys.slots, keys.lengths)
        hidden, = self.step(inputs, (k_cache, v_cache))
        return hidden

    def draft_vocab(self) -> torch.Tensor | None:
        return self.eager.draft_vocab()
