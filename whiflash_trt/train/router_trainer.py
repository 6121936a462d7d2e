"""`whiflash-train router`: measure both drafters from the same states, fit the neural router, pick thresholds.

Data: the target's greedy responses to held-out router prompts (whiflash-train data --split router). A drafter's
acceptance length at state N (x_0..x_{N-1} committed, x_N pending) is read off its draft against the target's own
continuation, with no verify pass: runtime.replay drives both proposers over one scratch Sequence.
The router's input is what the engine gives it after a verify that left x_N pending: the target's final-norm hidden
state at N-1 (RouteSignal.hidden) and the entropy of its logits there.

Thresholds: a greedy walk through each held-out response (start at the prompt, choose a drafter, advance by its
acceptance length) replays what the engine would do; its tokens per second uses the measured seconds of one round
of each drafter on this machine. The threshold maximising that is the default.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from whiflash_trt.config import DFLASH, EAGLE3, SpecConfig
from whiflash_trt.runtime.engine import Engine
from whiflash_trt.runtime.replay import num_accepted, replay_drafts
from whiflash_trt.spec.router import EntropyRouter, RouteSignal, RouterMLP, entropy_of
from whiflash_trt.spec.router_file import save_router
from whiflash_trt.train.data import TrainingData


@dataclass
class StateRecord:
    seq: int
    position: int             # N
    al_eagle3: int
    al_dflash: int
    entropy: float
    hidden: torch.Tensor      # [H]


@torch.inference_mode()
def measure_states(engine: Engine, data: TrainingData, spec: SpecConfig, max_states: int | None = None,
                   progress: bool = True) -> list[StateRecord]:
    """Acceptance length of both drafters at the response positions of every router sequence: all of them, or,
    under `max_states`, one contiguous window per sequence (at a seeded random offset) so the states spread over
    every sequence and `simulate` can still walk each window position by position."""
    e3, df = engine.proposers[EAGLE3].for_spec(spec), engine.proposers[DFLASH].for_spec(spec)
    horizon = max(df.draft_block_len - 1, spec.tree.depth)
    records: list[StateRecord] = []
    spans = {k: (s.prompt_len, len(s.tokens) - 1 - horizon) for k, s in ((k, data[k]) for k in range(len(data)))}
    spans = {k: (first, last) for k, (first, last) in spans.items() if last > first}
    total = sum(last - first for first, last in spans.values())
    if max_states and total > max_states:
        width, rng = math.ceil(max_states / len(spans)), random.Random(0)
        for k, (first, last) in spans.items():
            start = first + rng.randint(0, max(0, last - first - width))
            spans[k] = (start, min(last, start + width))
    bar = tqdm(total=min(total, max_states or total), desc="router states", disable=not progress, mininterval=10)
    dtype = engine.target.dtype
    proposers = {EAGLE3: e3, DFLASH: df}
    for k, (first, last) in spans.items():
        s = data[k]
        tokens = s.tokens.tolist()
        for state in replay_drafts(engine, proposers, tokens, s.features, first, last):
            n = state.position
            cont = tokens[n + 1:n + 1 + horizon]
            al_e, al_d = (num_accepted(state.proposals[d].tree, cont) + 1 for d in (EAGLE3, DFLASH))
            hidden = s.hidden[n - 1]
            entropy = entropy_of(engine.target.logits(hidden[None].to(dtype))[0])
            records.append(StateRecord(k, n, al_e, al_d, entropy, hidden.float()))
            bar.update(1)
            if max_states is not None and len(records) >= max_states:
                return records
    bar.close()
    return records


def fit_router(records: list[StateRecord], width: int = 64, epochs: int = 400, lr: float = 3e-3,
               seed: int = 0, holdout: float = 0.25) -> tuple[RouterMLP, dict]:
    """MSE on dAL = AL(DFlash) - AL(EAGLE-3); full-batch AdamW with weight decay, early-stopped on held-out
    sequences (a few thousand states overfit a 576-wide input within tens of epochs)."""
    torch.manual_seed(seed)
    seqs = sorted({r.seq for r in records})
    random.Random(seed + 1).shuffle(seqs)
    held = set(seqs[:max(1, int(len(seqs) * holdout))])
    fit = [r for r in records if r.seq not in held] or records
    hold = [r for r in records if r.seq in held] or records

    def tensors(rs):
        return torch.stack([r.hidden for r in rs]), torch.tensor([float(r.al_dflash - r.al_eagle3) for r in rs])

    (x, y), (xh, yh) = tensors(fit), tensors(hold)
    mlp = RouterMLP(x.shape[1], width)
    with torch.no_grad():
        mlp.fc2.bias.fill_(float(y.mean()))
    opt = torch.optim.AdamW(mlp.parameters(), lr=lr, weight_decay=0.1)
    best, best_state, best_epoch = float("inf"), None, 0
    for epoch in range(epochs):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(mlp(x), y)
        loss.backward()
        opt.step()
        with torch.no_grad():
            held_mse = float(torch.nn.functional.mse_loss(mlp(xh), yh))
        if held_mse < best:
            best, best_epoch = held_mse, epoch
            best_state = {k: v.clone() for k, v in mlp.state_dict().items()}
    mlp.load_state_dict(best_state)
    with torch.no_grad():
        train_mse = float(torch.nn.functional.mse_loss(mlp(x), y))
    return mlp, {"train_mse": train_mse, "holdout_mse": best, "best_epoch": best_epoch, "var_dal": float(y.var()),
                 "holdout_var_dal": float(yh.var())}


def simulate(records: list[StateRecord], choose, cost: dict[str, float]) -> dict:
    """Replay greedy generation: from each sequence's first state, choose a drafter, jump by its acceptance
    length. `choose(record) -> "eagle3" | "dflash"`; returns tokens, seconds (by round cost), tokens/s, tau."""
    by_seq: dict[int, dict[int, StateRecord]] = {}
    for r in records:
        by_seq.setdefault(r.seq, {})[r.position] = r
    tokens, seconds, rounds, picks = 0, 0.0, 0, {"eagle3": 0, "dflash": 0}
    for states in by_seq.values():
        n = min(states)
        reset = getattr(choose, "reset", None)
        if reset:
            reset()
        while n in states:
            r = states[n]
            name = choose(r)
            al = r.al_dflash if name == "dflash" else r.al_eagle3
            tokens, seconds, rounds = tokens + al, seconds + cost[name], rounds + 1
            picks[name] += 1
            n += al
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds if seconds else 0.0,
            "tau": tokens / rounds if rounds else 0.0, "rounds": picks}


class _EntropyChoice:
    def __init__(self, threshold: float) -> None:
        self.router = EntropyRouter(threshold)

    def reset(self) -> None:
        self.router.reset()

    def __call__(self, r: StateRecord) -> str:
        return self.router.choose(RouteSignal(r.entropy, r.hidden))


def pick_thresholds(mlp: RouterMLP, records: list[StateRecord], cost: dict[str, float]) -> dict:
    """Grid over thresholds; returns the best neural and entropy thresholds and the static baselines."""
    with torch.no_grad():
        preds = {id(r): float(p) for r, p in zip(records, mlp(torch.stack([r.hidden for r in records])))}
    result = {"eagle3": simulate(records, lambda r: "eagle3", cost),
              "dflash": simulate(records, lambda r: "dflash", cost)}
    neural = [(simulate(records, lambda r, th=th: "dflash" if preds[id(r)] > th else "eagle3", cost), th)
              for th in [x / 4 for x in range(-12, 13)]]
    best_n = max(neural, key=lambda p: p[0]["tokens_per_s"])
    entropy = [(simulate(records, _EntropyChoice(th), cost), th) for th in [x / 4 for x in range(1, 25)]]
    best_e = max(entropy, key=lambda p: p[0]["tokens_per_s"])
    result.update({"neural": best_n[0] | {"threshold": best_n[1]}, "entropy": best_e[0] | {"threshold": best_e[1]}})
    return result


@torch.inference_mode()
def round_costs(engine: Engine, prompt_ids: list[list[int]], spec: SpecConfig, max_new_tokens: int = 48) -> dict:
    """Mean seconds per round of each single-drafter mode on this machine (draft + verify + commit)."""
    from whiflash_trt.config import GenerationConfig

    gen = GenerationConfig(max_new_tokens=max_new_tokens)
    out = {}
    for name in (EAGLE3, DFLASH):
        secs, rounds = 0.0, 0
        for ids in prompt_ids:
            st = engine.generate(ids, gen, spec=SpecConfig(mode=name, tree=spec.tree)).stats
            secs += sum(st["phase_seconds"].values())
            rounds += st["rounds"]
        out[name] = secs / max(1, rounds)
    return out


def train_router(engine: Engine, data: TrainingData, out_path: Path, spec: SpecConfig, cost: dict[str, float],
                 val_fraction: float = 0.3, width: int = 64, max_states: int | None = None, seed: int = 0) -> dict:
    records = measure_states(engine, data, spec, max_states)
    seqs = sorted({r.seq for r in records})
    random.Random(seed).shuffle(seqs)
    val_seqs = set(seqs[:max(1, math.ceil(len(seqs) * val_fraction))])
    train = [r for r in records if r.seq not in val_seqs]
    val = [r for r in records if r.seq in val_seqs]
    mlp, fit = fit_router(train, width=width, seed=seed)
    with torch.no_grad():
        y = torch.tensor([float(r.al_dflash - r.al_eagle3) for r in val])
        val_mse = float(torch.nn.functional.mse_loss(mlp(torch.stack([r.hidden for r in val])), y))
    chosen = pick_thresholds(mlp, val, cost)
    save_router(mlp, out_path, chosen["neural"]["threshold"], chosen["entropy"]["threshold"])
    return {"num_states": len(records), "num_train": len(train), "num_val": len(val), **fit, "val_mse": val_mse,
            "val_var_dal": float(y.var()) if len(y) > 1 else None, "round_seconds": cost, "selection": chosen,
            "mean_al": {"eagle3": sum(r.al_eagle3 for r in records) / len(records),
                        "dflash": sum(r.al_dflash for r in records) / len(records)}}
