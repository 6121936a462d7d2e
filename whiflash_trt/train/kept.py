"""A data folder's token level, kept; its features recomputed from it.

The features of a data folder (~3.5 KB per token for SmolLM2) are large, and recomputing them takes one forward per
sequence; its tokens (the target's own responses, 4 bytes per token, less once compressed) took one forward per
token: hours of decoding. So the token level is what is kept: `whiflash-train keep` copies it (the manifest, the
prompt splits and the tokens-*.safetensors of a folder and of its router/ split) to a small folder that can be
committed (data/smollm2-135m/ here), and
`whiflash-train features` recomputes the features a folder lacks, after copying a kept token level into it
(--tokens-from). A kept folder can also be grown again by `whiflash-train data`.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch
from tqdm import tqdm

from whiflash_trt.train.data import MANIFEST, SPLITS, load_shard, read_manifest, save_atomic, write_manifest
from whiflash_trt.train.generate import BatchedGenerator
from whiflash_trt.train.target import load_engine_target

SUBSPLITS = ("router",)   # split folders inside a data folder, each with its own manifest and shards


def data_folders(root: Path) -> list[Path]:
    """The folder and its split folders that hold a manifest."""
    return [f for f in (root, *(root / s for s in SUBSPLITS)) if (f / MANIFEST).is_file()]


def token_level(folder: Path) -> list[Path]:
    """The files of one data folder that are not recomputable: manifest, prompt splits, token shards."""
    manifest = read_manifest(folder)
    files = [folder / MANIFEST] + [folder / f"prompts.{s}.jsonl" for s in SPLITS
                                   if (folder / f"prompts.{s}.jsonl").is_file()]
    for entry in manifest["shards"]:
        if "tokens" not in entry:
            raise ValueError(f"{folder} was written before the token level had its own files (shard "
                             f"{entry['file']}): regenerate it to keep its tokens")
        files.append(folder / entry["tokens"])
    return files


def copy_token_level(source: Path, dest: Path) -> int:
    """Copy `source`'s token level (and its split folders') into `dest`; returns the number of files copied."""
    source, dest = Path(source), Path(dest)
    folders = data_folders(source)
    if not folders:
        raise ValueError(f"{source} is not a data folder (no {MANIFEST})")
    if dest.resolve() == source.resolve():
        return 0
    copied = 0
    for folder in folders:
        target = dest / folder.relative_to(source)
        target.mkdir(parents=True, exist_ok=True)
        for path in token_level(folder):
            if path.name != MANIFEST:
                shutil.copyfile(path, target / path.name)
                copied += 1
        shutil.copyfile(folder / MANIFEST, target / MANIFEST)   # last: it lists the shards copied before it
        copied += 1
    return copied


def recompute_features(root: Path, target: str | None = None, batch_tokens: int = 4096,
                       capture_layers: tuple[int, ...] | None = None) -> int:
    """Write every features file the folder's manifests list and it lacks; returns how many were written.
    `capture_layers`: capture these target layers instead of the manifest's (a folder without features yet: the
    feature-layer ablation of a drafter recipe, on the same tokens)."""
    folders = data_folders(Path(root))
    if not folders:
        raise ValueError(f"{root} is not a data folder (no {MANIFEST})")
    for folder in folders if capture_layers is not None else ():
        manifest = read_manifest(folder)
        if manifest["capture_layers"] != list(capture_layers):
            if any((folder / e["features"]).is_file() for e in manifest["shards"] if "features" in e):
                raise ValueError(f"{folder} holds features of layers {manifest['capture_layers']}: recompute other "
                                 f"layers into a new folder (--tokens-from {folder})")
            write_manifest(folder, manifest | {"capture_layers": list(capture_layers)})
    todo = [(f, e) for f in folders for e in read_manifest(f)["shards"]
            if "features" in e and not (f / e["features"]).is_file()]
    if not todo:
        return 0
    manifest = read_manifest(folders[0])
    for folder in dict.fromkeys(f for f, _ in todo):
        if read_manifest(folder)["capture_layers"] != manifest["capture_layers"]:
            raise ValueError(f"{folder} captures other layers than {folders[0]}")
    shards = [(f, e, load_shard(f, e, features=False)) for f, e in todo]   # the token level: a few MB
    longest = max(int(shard["seq_offsets"].diff().max()) for _, _, shard in shards)
    model, _ = load_engine_target(target or manifest["target"], manifest["dtype"])
    lanes = 16   # sequences per forward at most (and --batch-tokens tokens)
    gen = BatchedGenerator(model, tuple(manifest["capture_layers"]), lanes, longest, eos_ids=())
    for folder, entry, shard in tqdm(shards, desc="feature shards", unit="shard"):
        offsets = shard["seq_offsets"].tolist()
        outs, group = [], []
        for ids in (shard["tokens"][a:b].tolist() for a, b in zip(offsets, offsets[1:])):
            if group and (len(group) == lanes or sum(map(len, group)) + len(ids) > batch_tokens):
                outs += gen.features_of(group)
                group = []
            group.append(ids)
        outs += gen.features_of(group)
        save_atomic({"features": torch.cat([f for f, _ in outs]).contiguous(),
                     "hidden": torch.cat([h for _, h in outs]).contiguous()}, folder / entry["features"])
    return len(todo)
