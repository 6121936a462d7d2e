"""`whiflash-train router`: measure both drafters from the same states, fit the throughput router (router file v2),
calibrate its threshold and the entropy rule's two thresholds on held-out states.

Data: the target's greedy responses to held-out router prompts (whiflash-train data --split router). A drafter's
acceptance length at state N (x_0..x_{N-1} committed, x_N pending) is read off its draft against the target's own
continuation, with no verify pass: runtime.replay drives both proposers over one scratch Sequence. Both drafters
are measured at every state ("full information"), so every state labels both outputs.

Features (spec.router.FEATURES): the target's entropy and top-1/top-2 margin where it chose x_N, and the request's
history (RouterHistory: each drafter's EMA of its own accepted drafts, the previous round's choice and accepted
drafts). History depends on the routing, so training rows are the states that seeded random walks visit (each round
none / EAGLE-3 / DFlash with probability 1/3, advancing by what that choice commits), with the same RouterHistory
the engine keeps. Labels: each drafter's accepted drafts at the state. Loss: MSE on both outputs, early-stopped on
a quarter of the train sequences.

Sequences are split into train and validation (held out: never fitted). On the validation sequences a greedy walk
(start at the window, choose, advance by what the choice commits) replays what the engine would do with the round
costs measured on this machine; the throughput router's threshold and relaxation and the entropy rule's thresholds
are the grid points with the most simulated tokens per second there. The report gives held-out MSE against the
variance per drafter, routing accuracy against the three-way oracle (bench.oracle) at the states the walk visits,
and the simulated tokens/s of every policy next to the static ones and the oracle.
"""
from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from whiflash_trt.bench.oracle import optimal
from whiflash_trt.config import AR, DFLASH, EAGLE3, GenerationConfig, SpecConfig
from whiflash_trt.runtime.engine import Engine
from whiflash_trt.runtime.replay import num_accepted, replay_drafts
from whiflash_trt.runtime.round_costs import seconds_per_round_by_prompt
from whiflash_trt.spec.router import (DRAFTERS, FEATURES, NO_DRAFT, AcceptancePredictor, EntropyRouter, RouterHistory,
                                      RouteSignal, ThroughputRouter, route_signal)
from whiflash_trt.spec.router_file import save_throughput_router
from whiflash_trt.train.data import TrainingData


@dataclass
class StateRecord:
    seq: int
    position: int             # N
    al_eagle3: int
    al_dflash: int
    entropy: float
    hidden: torch.Tensor      # [H]
    margin: float = 0.0       # top-1 minus top-2 probability where entropy is measured


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
            signal = route_signal(engine.target.logits(hidden[None].to(dtype))[0], hidden)
            records.append(StateRecord(k, n, al_e, al_d, signal.entropy, hidden.float(), signal.margin))
            bar.update(1)
            if max_states is not None and len(records) >= max_states:
                return records
    bar.close()
    return records


_STATE_COLUMNS = ("seq", "position", "al_eagle3", "al_dflash", "entropy", "margin")


def save_states(records: list[StateRecord], path: Path) -> None:
    """The measured states as tensors (columns + hidden [R, H]), so a refit need not replay the drafters again."""
    torch.save({c: torch.tensor([float(getattr(r, c)) for r in records], dtype=torch.float64) for c in _STATE_COLUMNS}
               | {"hidden": torch.stack([r.hidden for r in records])}, path)


def load_states(path: Path) -> list[StateRecord]:
    t = torch.load(path, weights_only=True)
    cols = {c: t[c].tolist() for c in _STATE_COLUMNS}
    return [StateRecord(int(cols["seq"][i]), int(cols["position"][i]), int(cols["al_eagle3"][i]),
                        int(cols["al_dflash"][i]), cols["entropy"][i], t["hidden"][i], cols["margin"][i])
            for i in range(len(t["hidden"]))]


def _by_seq(records: list[StateRecord]) -> dict[int, dict[int, StateRecord]]:
    by_seq: dict[int, dict[int, StateRecord]] = {}
    for r in records:
        by_seq.setdefault(r.seq, {})[r.position] = r
    return by_seq


def _accepted(r: StateRecord, choice: str) -> int:
    """Accepted drafts of `choice` at r (0 for a target-only round)."""
    return {NO_DRAFT: 0, EAGLE3: r.al_eagle3 - 1, DFLASH: r.al_dflash - 1}[choice]


def simulate(records: list[StateRecord], choose, cost: dict[str, float]) -> dict:
    """Replay greedy generation: from each sequence's first state, choose, jump by what the choice commits.
    `choose(record) -> "none" | "eagle3" | "dflash"`; a `choose` with `reset()` is reset per sequence and one with
    `observe(choice, accepted)` hears each round's outcome. Returns tokens, seconds (by round cost), tokens/s, tau,
    rounds per choice, and the visited (record, choice) pairs."""
    tokens, seconds, picks, visited = 0, 0.0, {NO_DRAFT: 0, EAGLE3: 0, DFLASH: 0}, []
    for states in _by_seq(records).values():
        n = min(states)
        if hasattr(choose, "reset"):
            choose.reset()
        while n in states:
            r = states[n]
            name = choose(r)
            a = _accepted(r, name)
            if hasattr(choose, "observe"):
                choose.observe(name, a)
            tokens, seconds = tokens + a + 1, seconds + cost[name]
            picks[name] += 1
            visited.append((r, name))
            n += a + 1
    rounds = sum(picks.values())
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds if seconds else 0.0,
            "tau": tokens / rounds if rounds else 0.0, "rounds": picks, "visited": visited}


class SignalChoice:
    """A runtime router driven through `simulate`: each record becomes the RouteSignal the engine would give it."""

    def __init__(self, make_router) -> None:
        self.make_router = make_router
        self.reset()

    def reset(self) -> None:
        self.router, self.prev, self.prev_accepted = self.make_router(), None, 0

    def observe(self, choice: str, accepted: int) -> None:
        self.prev, self.prev_accepted = choice, accepted

    def __call__(self, r: StateRecord) -> str:
        return self.router.choose(RouteSignal(r.entropy, r.hidden, r.margin, self.prev, self.prev_accepted))


def walk_rows(records: list[StateRecord], priors: dict[str, float], alpha: float, relax: float, walks: int = 4,
              seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """(features [R, F], labels [R, 2] accepted drafts of EAGLE-3 and DFlash, sequence of each row) at the states
    `walks` random routings per sequence visit (see the module docstring)."""
    xs, ys, groups = [], [], []
    for k, states in _by_seq(records).items():
        for w in range(walks):
            rng, history, n = random.Random(f"{seed}-{k}-{w}"), RouterHistory(priors, alpha, relax), min(states)
            history.update(None, 0)
            while n in states:
                r = states[n]
                xs.append(history.features(r.entropy, r.margin))
                ys.append([r.al_eagle3 - 1, r.al_dflash - 1])
                groups.append(k)
                choice = rng.choice((NO_DRAFT, *DRAFTERS))
                a = _accepted(r, choice)
                history.update(choice, a)
                n += a + 1
    return torch.tensor(xs), torch.tensor(ys, dtype=torch.float32), groups


def fit_predictor(x: torch.Tensor, y: torch.Tensor, groups: list[int], width: int = 16, epochs: int = 400,
                  lr: float = 1e-2, seed: int = 0) -> tuple[AcceptancePredictor, dict]:
    """MSE on both drafters' accepted drafts; full-batch AdamW, early-stopped on a quarter of the sequences."""
    torch.manual_seed(seed)
    seqs = sorted(set(groups))
    inner = set(random.Random(seed).sample(seqs, max(1, len(seqs) // 4))) if len(seqs) > 1 else set()
    mask = torch.tensor([g in inner for g in groups])
    fit_x, fit_y = (x[~mask], y[~mask]) if inner else (x, y)
    stop_x, stop_y = (x[mask], y[mask]) if inner else (x, y)
    model = AcceptancePredictor(width, x.shape[1])
    with torch.no_grad():
        model.mean.copy_(fit_x.mean(0))
        model.std.copy_(fit_x.std(0).clamp_min(1e-3))
        model.fc2.bias.copy_(fit_y.mean(0))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    best, best_state, best_epoch = math.inf, None, 0
    for epoch in range(epochs):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(fit_x), fit_y).backward()
        opt.step()
        with torch.no_grad():
            stop = float(torch.nn.functional.mse_loss(model(stop_x), stop_y))
        if stop < best:
            best, best_epoch, best_state = stop, epoch, {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(best_state)
    return model.eval(), {"early_stop_mse": best, "best_epoch": best_epoch}


def prediction_quality(model: AcceptancePredictor, x: torch.Tensor, y: torch.Tensor) -> dict:
    """Per drafter: MSE, variance of the labels, R^2 = 1 - MSE/variance."""
    with torch.no_grad():
        pred = model(x)
    out = {}
    for i, d in enumerate(DRAFTERS):
        mse, var = float(((pred[:, i] - y[:, i]) ** 2).mean()), float(y[:, i].var(unbiased=False))
        out[d] = {"mse": round(mse, 4), "var": round(var, 4), "r2": round(1 - mse / var, 4) if var else None}
    return out


def oracle_accuracy(records: list[StateRecord], visited: list[tuple[StateRecord, str]], cost: dict[str, float]) -> dict:
    """Share of the visited states where the choice equals the three-way oracle's (bench.oracle.optimal on each
    sequence's window), on all of them and on the decisive ones (the best and second-best costs-to-go differ)."""
    best, decisive = {}, {}
    for k, states in _by_seq(records).items():
        pos = sorted(states)
        accepted = {d: [_accepted(states[n], d) for n in pos] for d in DRAFTERS}
        value, choice = optimal(accepted, cost)
        end = len(value) - 1
        for i, n in enumerate(pos):
            togo = sorted(cost[d] + value[min(i + (0 if d == NO_DRAFT else accepted[d][i]) + 1, end)]
                          for d in (NO_DRAFT, *DRAFTERS))
            best[(k, n)], decisive[(k, n)] = choice[i], togo[1] - togo[0] > 1e-12
    hits = [(best[(r.seq, r.position)] == c, decisive[(r.seq, r.position)]) for r, c in visited]
    dec = [h for h, d in hits if d]
    return {"accuracy": round(sum(h for h, _ in hits) / len(hits), 4) if hits else None,
            "accuracy_decisive": round(sum(dec) / len(dec), 4) if dec else None, "states": len(hits)}


def _summary(result: dict, records: list[StateRecord], cost: dict[str, float]) -> dict:
    out = {k: v for k, v in result.items() if k != "visited"}
    return out | {"oracle_agreement": oracle_accuracy(records, result["visited"], cost)}


def calibrate(models: dict[tuple[float, float], AcceptancePredictor], records: list[StateRecord],
              cost: dict[str, float], priors: dict[str, float]) -> dict:
    """On held-out `records`: static policies, the oracle, the throughput router over a grid of (alpha, relax,
    threshold) (one predictor per (alpha, relax): they change its features) and the entropy rule over a grid of
    (threshold, none threshold); the best of each by simulated tokens/s."""
    result = {name: _summary(simulate(records, lambda r, c=c: c, cost), records, cost)
              for name, c in ((AR, NO_DRAFT), (EAGLE3, EAGLE3), (DFLASH, DFLASH))}
    seconds = tokens = 0.0
    for states in _by_seq(records).values():
        pos = sorted(states)
        value, _ = optimal({d: [_accepted(states[n], d) for n in pos] for d in DRAFTERS}, cost)
        seconds, tokens = seconds + value[0], tokens + len(pos)
    result["oracle"] = {"tokens_per_s": tokens / seconds if seconds else 0.0}
    grid = [(key, th) for key in models for th in (0.8, 0.9, 1.0, 1.05, 1.1, 1.2, 1.3, 1.5)]
    neural = [(simulate(records, SignalChoice(lambda m=models[key], th=th, key=key: ThroughputRouter(
        m, cost, th, priors, *key)), cost), key, th) for key, th in grid]
    best_n = max(neural, key=lambda t: t[0]["tokens_per_s"])
    result["throughput"] = _summary(best_n[0], records, cost) | {"alpha": best_n[1][0], "relax": best_n[1][1],
                                                                 "threshold": best_n[2]}
    result["throughput_grid"] = {f"alpha {k[0]} relax {k[1]} threshold {th}": round(r["tokens_per_s"], 3)
                                 for r, k, th in neural}
    entropies = [0.25 * i for i in range(1, 25)]
    ent = [(simulate(records, SignalChoice(lambda th=th, nt=nt: EntropyRouter(th, none_threshold=nt)), cost), th, nt)
           for th in entropies for nt in entropies + [math.inf] if nt > th]
    best_e = max(ent, key=lambda t: t[0]["tokens_per_s"])
    result["entropy"] = _summary(best_e[0], records, cost) | {"threshold": best_e[1], "none_threshold": best_e[2]}
    return result


@torch.inference_mode()
def round_costs(engine: Engine, prompt_ids: list[list[int]], spec: SpecConfig, max_new_tokens: int = 48) -> dict:
    """Seconds per round of `ar` (as "none") and each single-drafter mode on this machine, with `spec`'s trees: per
    mode the median over the prompts of its mean round time, the modes taking turns per prompt and the drafter's
    prompt prefill left out (runtime.round_costs.seconds_per_round_by_prompt)."""
    samples = seconds_per_round_by_prompt(engine, prompt_ids, GenerationConfig(max_new_tokens=max_new_tokens), spec)
    return {name: statistics.median(xs) for name, xs in samples.items()}


def train_router(engine: Engine, data: TrainingData, out_path: Path, spec: SpecConfig, cost: dict[str, float],
                 val_fraction: float = 0.3, width: int = 16, max_states: int | None = None, seed: int = 0,
                 alphas: tuple[float, ...] = (0.5, 0.25), relaxes: tuple[float, ...] = (0.0, 0.05, 0.2), walks: int = 4,
                 records: list[StateRecord] | None = None) -> dict:
    """Measure (unless `records` are given), fit one predictor per (EMA weight, relaxation), calibrate on the
    validation sequences, write the v2 router file; returns the report."""
    records = measure_states(engine, data, spec, max_states) if records is None else records
    seqs = sorted({r.seq for r in records})
    random.Random(seed).shuffle(seqs)
    val_seqs = set(seqs[:max(1, math.ceil(len(seqs) * val_fraction))]) if len(seqs) > 1 else set()
    train = [r for r in records if r.seq not in val_seqs] or records
    val = [r for r in records if r.seq in val_seqs] or records
    priors = {EAGLE3: sum(r.al_eagle3 - 1 for r in train) / len(train),
              DFLASH: sum(r.al_dflash - 1 for r in train) / len(train)}
    models, fits = {}, {}
    for key in ((alpha, relax) for alpha in alphas for relax in relaxes):
        x, y, groups = walk_rows(train, priors, *key, walks, seed)
        models[key], fit = fit_predictor(x, y, groups, width=width, seed=seed)
        xv, yv, _ = walk_rows(val, priors, *key, walks, seed)
        fits[f"alpha {key[0]} relax {key[1]}"] = fit | {"num_rows": len(x),
                                                        "train": prediction_quality(models[key], x, y),
                                                        "val": prediction_quality(models[key], xv, yv)}
    chosen = calibrate(models, val, cost, priors)
    best = chosen["throughput"]
    save_throughput_router(models[(best["alpha"], best["relax"])], out_path, best["threshold"], priors, cost,
                           best["alpha"], best["relax"], chosen["entropy"]["threshold"],
                           chosen["entropy"]["none_threshold"], trees=engine.tree_shapes(spec))
    return {"format": "whiflash-router-v2", "features": list(FEATURES), "width": width,
            "num_states": len(records), "num_train": len(train), "num_val": len(val), "priors": priors,
            "round_seconds": cost, "fits": fits, "selection": chosen,
            "file_bytes": out_path.stat().st_size,
            "mean_al": {"eagle3": sum(r.al_eagle3 for r in records) / len(records),
                        "dflash": sum(r.al_dflash for r in records) / len(records)}}
