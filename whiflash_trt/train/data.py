"""`whiflash-train data`: self-distillation data with cached target features.

Folder layout (all written atomically, so the command can be stopped and rerun at any time):
    DATA/manifest.json          target, capture layers, sources and counts per category, shards
    DATA/prompts.{train,val,router}.jsonl   the prompt splits (val and router prompts are never trained on)
    DATA/tokens-00000.safetensors    the token level: tokens [N] int32, seq_offsets [S+1], prompt_lens [S],
                                     prompt_index [S], greedy [S] (a few bytes per token: kept, see train/kept.py)
    DATA/features-00000.safetensors  features [N, C*H] and hidden [N, H] (target dtype; ~3.5 KB per token for
                                     SmolLM2: recomputed from the tokens by `whiflash-train features`)
A sequence is prompt (chat template) + the target's own response; features are the outputs of the captured target
layers at every position, hidden the final-norm state (lm_head(hidden[t]) is the target's distribution for t+1).
Folders written before the split hold both parts in one `shard-00000.safetensors` (manifest key "file"); they still
read.
"""
from __future__ import annotations

import json
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from whiflash_trt.models.contracts import feature_columns
from whiflash_trt.train.generate import BatchedGenerator, Finished
from whiflash_trt.train.sources import PromptRecord, build_prompts, require_prompt_packages
from whiflash_trt.runtime.tokenizer_policy import chat_ids, eos_ids
from whiflash_trt.train.target import load_engine_target

MANIFEST = "manifest.json"
SPLITS = ("train", "val", "router")


@dataclass(frozen=True)
class DataOptions:
    target: str
    output: Path
    capture_layers: tuple[int, ...] | None = None   # None: EAGLE-3's (1, L/2 - 1, L - 4), shared with DFlash
    per_category: int = 600
    num_val: int = 12             # per category
    num_router: int = 24          # per category
    max_prompt_tokens: int = 512
    max_new_tokens: int = 160
    lanes: int = 64
    shard_size: int = 64
    sampled_fraction: float = 0.15
    temperature: float = 0.7
    max_sequences: int | None = None
    seed: int = 0
    dtype: str = "bf16"
    split: str = "train"          # "router": responses to the router prompts, shards in DATA/router/

    def __post_init__(self) -> None:
        if self.split not in ("train", "router"):
            raise ValueError(f"split must be train or router, got {self.split!r}")
        if self.capture_layers is not None and not self.capture_layers:
            raise ValueError("capture_layers must name at least one target layer")
        if not 0 <= self.sampled_fraction <= 1:
            raise ValueError(f"sampled_fraction must be in [0, 1], got {self.sampled_fraction}")


def default_capture_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's layers (HF hidden_states[2], [L//2], [L-3]); our DFlash drafters read the same three."""
    return (1, num_layers // 2 - 1, num_layers - 4)


def split_prompts(records: list[PromptRecord], num_val: int, num_router: int) -> dict[str, list[PromptRecord]]:
    out = {s: [] for s in SPLITS}
    seen = Counter()
    for r in records:
        i = seen[r.category]
        seen[r.category] += 1
        out["val" if i < num_val else "router" if i < num_val + num_router else "train"].append(r)
    return out


def write_jsonl(path: Path, records: list[PromptRecord]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r.to_json()) + "\n" for r in records))
    tmp.rename(path)


def read_prompts(path: Path) -> list[PromptRecord]:
    return [PromptRecord.from_json(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


def read_manifest(folder: Path) -> dict:
    return json.loads((Path(folder) / MANIFEST).read_text())


def write_manifest(folder: Path, manifest: dict) -> None:
    tmp = folder / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    tmp.rename(folder / MANIFEST)


def shard_names(index: int) -> dict[str, str]:
    return {"tokens": f"tokens-{index:05d}.safetensors", "features": f"features-{index:05d}.safetensors"}


def save_atomic(tensors: dict[str, torch.Tensor], path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp))
    tmp.rename(path)


def _write_shard(folder: Path, index: int, seqs: list[Finished]) -> dict:
    lengths = [len(s.tokens) for s in seqs]
    offsets = torch.tensor([0] + lengths).cumsum(0)
    names = shard_names(index)
    save_atomic({"tokens": torch.tensor([t for s in seqs for t in s.tokens], dtype=torch.int32),
                 "seq_offsets": offsets,
                 "prompt_lens": torch.tensor([s.prompt_len for s in seqs], dtype=torch.int32),
                 "prompt_index": torch.tensor([s.meta["index"] for s in seqs], dtype=torch.int64),
                 "greedy": torch.tensor([s.meta["temperature"] == 0 for s in seqs])}, folder / names["tokens"])
    save_atomic({"features": torch.cat([s.features for s in seqs]).contiguous(),
                 "hidden": torch.cat([s.hidden for s in seqs]).contiguous()}, folder / names["features"])
    return names | {"num_sequences": len(seqs), "num_tokens": int(offsets[-1]),
                    "num_response_tokens": sum(len(s.tokens) - s.prompt_len for s in seqs),
                    "prompt_index": [s.meta["index"] for s in seqs]}


def load_shard(folder: Path, entry: dict, features: bool = True) -> dict[str, torch.Tensor]:
    """One shard's tensors (the token level only unless `features`); a clear error where its features are missing
    (a folder restored from its kept token level)."""
    if "file" in entry:   # written before the token level had its own file
        return load_file(str(folder / entry["file"]))
    tensors = load_file(str(folder / entry["tokens"]))
    if features:
        path = folder / entry["features"]
        if not path.is_file():
            raise ValueError(f"{path} is missing: recompute the features with whiflash-train features --data "
                             f"{folder}")
        tensors |= load_file(str(path))
    return tensors


def _grow_prompts(root: Path, manifest: dict, per_category: int) -> None:
    """Append to the train split the prompts a larger `per_category` adds; val and router prompts stay as they are
    and are never added (every split is checked), so a grown folder keeps its held-out sets held out."""
    splits = {s: read_prompts(root / f"prompts.{s}.jsonl") for s in SPLITS}
    seen = {json.dumps(r.to_json()) for records in splits.values() for r in records}
    added = [r for r in build_prompts(per_category, manifest["seed"]) if json.dumps(r.to_json()) not in seen]
    write_jsonl(root / "prompts.train.jsonl", splits["train"] + added)
    manifest["prompts"]["train"] = dict(Counter(f"{r.category}:{r.source.split('/')[0]}"
                                                for r in splits["train"] + added))
    manifest.setdefault("growth", []).append({"from_per_category": manifest["options"]["per_category"],
                                              "to_per_category": per_category, "added_prompts": len(added)})
    manifest["options"]["per_category"] = per_category
    write_manifest(root, manifest)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _split_folder(opts: DataOptions) -> tuple[Path, Path]:
    """The data root and the folder this split writes into (the root itself for train, a subfolder otherwise),
    created; a non-train split needs the train prompts first and starts from the train manifest with no shards."""
    root = Path(opts.output)
    root.mkdir(parents=True, exist_ok=True)
    out = root if opts.split == "train" else root / opts.split
    if out != root:
        if not (root / MANIFEST).is_file():
            raise ValueError(f"{root} has no prompts yet: run whiflash-train data --split train first")
        out.mkdir(exist_ok=True)
        if not (out / MANIFEST).is_file():
            write_manifest(out, read_manifest(root) | {"shards": [], "split": opts.split})
    return root, out


def _open_manifest(opts: DataOptions, root: Path, out: Path, hidden_size: int, capture) -> dict:
    """The split's manifest: an existing one is checked against these options (so a rerun resumes the same data,
    growing the train prompts where more per category are asked for); a new folder gets its prompts drawn and split
    and a fresh manifest written."""
    if (out / MANIFEST).is_file():
        manifest = read_manifest(out)
        if manifest["capture_layers"] != list(capture) or manifest["seed"] != opts.seed:
            raise ValueError(f"{out} holds data of other options (capture layers / seed): use a new folder")
        if opts.split == "train" and opts.per_category > manifest["options"]["per_category"]:
            _grow_prompts(root, manifest, opts.per_category)
        return manifest
    splits = split_prompts(build_prompts(opts.per_category, opts.seed), opts.num_val, opts.num_router)
    for name, records in splits.items():
        write_jsonl(out / f"prompts.{name}.jsonl", records)
    manifest = {
        "target": opts.target, "dtype": opts.dtype, "capture_layers": list(capture),
        "hidden_size": hidden_size, "seed": opts.seed, "options": {
            k: (str(v) if isinstance(v, Path) else v) for k, v in opts.__dict__.items()},
        "prompts": {name: dict(Counter(f"{r.category}:{r.source.split('/')[0]}" for r in recs))
                    for name, recs in splits.items()},
        "disjointness": "reasoning-gym seeds >= 1000 (benchmark: < 1000); bfcl-eval subsets other than "
                        "simple_python and multiple; stdlib code/doc prompts, no HumanEval",
        "shards": []}
    write_manifest(out, manifest)
    return manifest


def _generate(opts: DataOptions, out: Path, manifest: dict, gen: BatchedGenerator, tokenizer, prompts: list,
              todo: list[int], temps: list[float]) -> None:
    """Generate the `todo` prompts through the batched generator, writing a shard (and the manifest that lists it)
    every `shard_size` sequences, so a stopped run (SIGTERM / Ctrl-C) keeps what it generated and a rerun resumes."""
    generator = torch.Generator().manual_seed(opts.seed)
    finished: list[Finished] = []
    bar = tqdm(total=len(todo), desc="sequences", unit="seq", mininterval=10)
    new_tokens, queue = 0, list(reversed(todo))
    start = time.perf_counter()
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        while queue or gen.active:
            while queue and gen.free:
                i = queue.pop()
                ids = chat_ids(tokenizer, prompts[i].messages)
                if len(ids) > opts.max_prompt_tokens:
                    bar.update(1)   # too long for this run's budget: skipped (a rerun skips it again)
                    continue
                gen.add(ids, {"index": i, "temperature": temps[i], "category": prompts[i].category}, generator)
            for seq in (gen.step(opts.max_new_tokens, generator) if gen.active else []):
                finished.append(seq)
                new_tokens += len(seq.tokens) - seq.prompt_len
                bar.update(1)
            bar.set_postfix(resp_tok_s=f"{new_tokens / (time.perf_counter() - start):.1f}")
            if len(finished) >= opts.shard_size or (finished and not queue and not gen.active):
                manifest["shards"].append(_write_shard(out, len(manifest["shards"]), finished))
                write_manifest(out, manifest)
                finished = []
    except KeyboardInterrupt:   # stopped (SIGTERM / Ctrl-C): keep what is generated, in-flight ones truncated
        finished += gen.drain()
        if finished:
            manifest["shards"].append(_write_shard(out, len(manifest["shards"]), finished))
            write_manifest(out, manifest)
    finally:
        signal.signal(signal.SIGTERM, previous)
    bar.close()


def generate_data(opts: DataOptions) -> Path:
    if opts.split == "train":   # checked before the target loads and anything is written
        require_prompt_packages()
    root, out = _split_folder(opts)
    model, tokenizer = load_engine_target(opts.target, opts.dtype)   # the data's bits are the runtime's
    n = model.config.num_layers
    capture = opts.capture_layers or default_capture_layers(n)
    manifest = _open_manifest(opts, root, out, model.config.hidden_size, capture)
    prompts = read_prompts(root / f"prompts.{opts.split}.jsonl")
    done = {i for shard in manifest["shards"] for i in shard["prompt_index"]}
    eos = eos_ids(model.config, tokenizer)
    max_len = min(opts.max_prompt_tokens + opts.max_new_tokens + 1, model.config.max_position_embeddings)
    gen = BatchedGenerator(model, capture, opts.lanes, max_len, eos)
    rng = random.Random(opts.seed)
    temps = [opts.temperature if rng.random() < opts.sampled_fraction else 0.0 for _ in prompts]
    todo = [i for i in range(len(prompts)) if i not in done]
    limit = opts.max_sequences if opts.max_sequences is not None else len(prompts)
    todo = todo[:max(0, limit - len(done))]
    _generate(opts, out, manifest, gen, tokenizer, prompts, todo, temps)
    return out


# ----- reading --------------------------------------------------------------------------------------------------
@dataclass
class SequenceData:
    tokens: torch.Tensor      # [T] int64
    features: torch.Tensor | None   # [T, C*H] (None: a TrainingData of the token level only)
    hidden: torch.Tensor | None     # [T, H]
    prompt_len: int
    greedy: bool


class TrainingData:
    """All shards of a data folder listed in its manifest (optionally only the first `num_shards`), in memory; with
    `features` False only their token level (the vocabulary counts: a few MB where the features are GBs)."""

    def __init__(self, folder: str | Path, num_shards: int | None = None, features: bool = True) -> None:
        self.folder = Path(folder)
        self.manifest = read_manifest(self.folder)
        shards = self.manifest["shards"][:num_shards]
        if not shards:
            raise ValueError(f"{self.folder} holds no data shards yet (run whiflash-train data)")
        self.shards = [load_shard(self.folder, s, features) for s in shards]
        self.index = [(i, j) for i, s in enumerate(self.shards) for j in range(len(s["prompt_lens"]))]
        self.capture_layers = tuple(self.manifest["capture_layers"])
        self.hidden_size = int(self.manifest["hidden_size"])

    def __len__(self) -> int:
        return len(self.index)

    def num_tokens(self) -> int:
        return sum(int(s["seq_offsets"][-1]) for s in self.shards)

    def __getitem__(self, k: int) -> SequenceData:
        i, j = self.index[k]
        s = self.shards[i]
        a, b = int(s["seq_offsets"][j]), int(s["seq_offsets"][j + 1])
        feats, hidden = (s["features"][a:b], s["hidden"][a:b]) if "features" in s else (None, None)
        return SequenceData(s["tokens"][a:b].long(), feats, hidden, int(s["prompt_lens"][j]), bool(s["greedy"][j]))

    def feature_columns(self, layers: tuple[int, ...]) -> torch.Tensor:
        return feature_columns(layers, self.capture_layers, self.hidden_size)


def token_counts(data: TrainingData, vocab_size: int, prompt_weight: int = 1) -> torch.Tensor:
    """[vocab] how often each token id occurs in the responses, plus `prompt_weight` x in the prompts (to choose
    EAGLE-3's draft vocabulary and DFlash's training-loss vocabulary)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for k in range(len(data)):
        seq = data[k]
        counts += torch.bincount(seq.tokens[seq.prompt_len:], minlength=vocab_size) * 4
        counts += torch.bincount(seq.tokens[:seq.prompt_len], minlength=vocab_size) * prompt_weight
    return counts


def choose_vocab(counts: torch.Tensor, size: int) -> torch.Tensor:
    """Sorted ids of the `size` most frequent tokens (ties broken by lower id)."""
    order = torch.argsort(-counts.double() + torch.arange(len(counts)) * 1e-9)
    return order[:size].sort().values
