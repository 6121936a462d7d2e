"""Which per-round signals predict dAL = a_dflash(p) - a_eagle3(p) on held-out states (issue 14, item 2).

Measurement only: nothing here changes the router. For every held-out bench prompt (the built-in sets after the
first --skip of each category, which the bench runs) the target's greedy `ar` output is the output of every mode; at
each state p of it both drafters draft (runtime.replay: EAGLE-3's tree as TreeConfig(), DFlash's block) and we
record their accepted drafts a_d(p) and the candidate signals available when the round at p is routed:
    entropy, margin        the target's distribution that chose the pending (bonus) token: entropy (nats), top-1
                           minus top-2 probability (what verify already computed)
    df_prod, df_sum, df_expected   DFlash block confidence from its per-position top-1 probabilities q_1..q_{B-1}:
                           prod q, sum q, and sum_k prod_{j<=k} q_j (the chain's expected accepted drafts under the
                           product model, DDTree's free predicted tau)
    e3_top1                EAGLE-3's first-step top-1 probability (its root forward)
    hidden                 the current router input: the target's final-norm hidden state at p - 1
History signals depend on which drafter drafted before, so they come from walks: per output, --walks random routings
(each round EAGLE-3 or DFlash with probability 1/2, seeded); at each visited state: each drafter's EMA (alpha 0.5)
of its own accepted drafts, updated when it drafts (as an engine would see them), the previous round's drafter and
accepted drafts. The rows of every fit are the walks' visited states (the states a router sees).

Held-out: prompts split by prompt (every --holdout-th of each category held out). Per signal: a linear fit and an
8-bin piecewise-constant fit on the train rows; held-out MSE against the held-out variance (R^2 = 1 - MSE/var) and
Pearson r. Combinations: ridge and a small MLP; the shipped router's MLP as it is. Routing: the rule "DFlash when
the prediction exceeds theta" (theta: least regret on train rows) against the oracle over EAGLE-3 and DFlash
(bench.oracle.optimal with the measured round costs): regret (ms per state above the oracle's cost-to-go) and
accuracy against the oracle's choice at that state, on all rows and on the decisive ones (where the two choices'
costs-to-go differ). Costs: --bench-results (a whiflash-bench --oracle results.json) or --costs.

Per-prompt measurements are cached in --cache (resumable: rerun the same command after an interruption).

    python scripts/router_signals.py --bench-results OUT/results.json --num-prompts 6 --max-new-tokens 64
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import sys
import time
from pathlib import Path

import torch

from whiflash_trt.bench import environment
from whiflash_trt.bench.oracle import NO_DRAFT, optimal
from whiflash_trt.bench.prompts import load_prompts
from whiflash_trt.config import AR, DFLASH, EAGLE3, WHIFLASH, GenerationConfig, SpecConfig
from whiflash_trt.runtime.engine import Engine
from whiflash_trt.runtime.replay import capture_output, num_accepted, replay_drafts

SCALARS = ("entropy", "margin", "df_prod", "df_sum", "df_expected", "e3_top1",
           "ema_eagle3", "ema_dflash", "ema_diff", "prev_dflash", "prev_accepted")
ALPHA = 0.5


# ----- measurement (cached per prompt) --------------------------------------------------------------------------
@torch.inference_mode()
def confidences(state, e3, df) -> tuple[list[float], float]:
    """(DFlash's per-position top-1 probabilities, EAGLE-3's first-step top-1 probability) at a replay state.
    The same forwards as the proposers' (DFlashProposer.propose, Eagle3Proposer.propose's root), rerun here for
    the probabilities the Proposal does not carry."""
    seq, n, dev = state.seq, state.position, df.pool.k.device
    hidden = df.model(df.block_embeddings(seq.pending), torch.arange(n, n + df.draft_block_len, device=dev),
                      df.pool.k, df.pool.v, seq.slots(0, n).to(dev))
    q = torch.softmax(df.target.logits(hidden[1:]).float(), dim=-1).max(dim=-1).values
    return q.tolist(), e3_root_top1(state, e3)


@torch.inference_mode()
def e3_root_top1(state, e3) -> float:
    """EAGLE-3's first-step top-1 probability at a replay state: its root forward, which rewrites the K/V it
    wrote, nothing else changes."""
    seq, n, dev = state.seq, state.position, e3.pool.k.device
    m, read = e3.model, seq.slots(0, n).to(dev)
    g = m.fc(seq.features_between(n - 1, n)[:, e3.cols])
    h = m(e3.target.embed(torch.tensor([seq.pending], device=dev)), g, torch.tensor([n - 1], device=dev),
          e3.pool.k, e3.pool.v, read[n - 1:n], read, torch.ones(1, n, dtype=torch.bool, device=dev))
    return float(m.draft_logprobs(h)[0].max().exp())


@torch.inference_mode()
def measure_prompt(engine: Engine, prompt_ids: list[int], max_new_tokens: int) -> dict:
    out = engine.generate(prompt_ids, GenerationConfig(max_new_tokens=max_new_tokens), spec=SpecConfig(mode=AR))
    tokens, p = prompt_ids + out.token_ids, len(prompt_ids)
    rows = {k: [] for k in ("a_eagle3", "a_dflash", "entropy", "margin", "df_q", "e3_top1")}
    cap = capture_output(engine, tokens[:-1])
    if len(out.token_ids) < 2:
        return {"output": out.token_ids, **rows, "hidden": cap.hidden[:0].float()}
    probs = torch.softmax(cap.logits[p - 1:p + len(out.token_ids) - 2].float(), dim=-1)   # rows N-1 of every state
    top2 = probs.topk(2, dim=-1).values
    rows["entropy"] = (-(probs * probs.clamp_min(1e-30).log()).sum(-1)).tolist()
    rows["margin"] = (top2[:, 0] - top2[:, 1]).tolist()
    proposers = engine.proposers_for(SpecConfig(mode=WHIFLASH))
    for state in replay_drafts(engine, proposers, tokens, cap.captured, p, p + len(out.token_ids) - 1):
        for d in (EAGLE3, DFLASH):
            rows[f"a_{d}"].append(num_accepted(state.proposals[d].tree, tokens[state.position + 1:]))
        q, top1 = confidences(state, proposers[EAGLE3], proposers[DFLASH])
        rows["df_q"].append(q)
        rows["e3_top1"].append(top1)
    return {"output": out.token_ids, **rows, "hidden": cap.hidden[p - 1:p + len(out.token_ids) - 2].float()}


def measure(engine: Engine, prompts, ids: dict, args) -> list[dict]:
    key = hashlib.sha256(json.dumps([str(args.engine), args.max_new_tokens, args.dtype]).encode()).hexdigest()[:12]
    args.cache.mkdir(parents=True, exist_ok=True)
    out = []
    for i, pr in enumerate(prompts):
        path = args.cache / f"{key}-{pr.id.replace('/', '_')}.pt"
        if not path.exists():
            t0 = time.perf_counter()
            m = measure_prompt(engine, ids[pr.id], args.max_new_tokens)
            torch.save(m, path.with_suffix(".tmp"))
            path.with_suffix(".tmp").rename(path)
            print(f"[{i + 1}/{len(prompts)}] {pr.id}: {len(m['a_eagle3'])} states, "
                  f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
        out.append({"id": pr.id, "category": pr.category, **torch.load(path, weights_only=True)})
    return out


# ----- rows: the states random walks visit, with their history ------------------------------------------------
def walk_rows(m: dict, k: int, walks: int, seed: int, costs: dict[str, float]) -> list[dict]:
    accepted = {d: m[f"a_{d}"] for d in (EAGLE3, DFLASH)}
    value, _ = optimal(accepted, {**costs, NO_DRAFT: math.inf})
    _, three_way = optimal(accepted, costs)
    end = len(value) - 1
    togo = {d: [costs[d] + value[min(i + a + 1, end)] for i, a in enumerate(accepted[d])] for d in accepted}
    rows = []
    for w in range(walks):
        rng = random.Random(f"{seed}-{m['id']}-{w}")
        ema, prev, prev_a, i = {EAGLE3: math.nan, DFLASH: math.nan}, math.nan, math.nan, 0
        while i < len(m["a_eagle3"]):
            q = m["df_q"][i]
            cum = [math.prod(q[:j + 1]) for j in range(len(q))]
            rows.append({"prompt": k, "state": i, "y": m["a_dflash"][i] - m["a_eagle3"][i],
                         "a_eagle3": m["a_eagle3"][i], "a_dflash": m["a_dflash"][i],
                         "q_eagle3": togo[EAGLE3][i], "q_dflash": togo[DFLASH][i], "oracle3": three_way[i],
                         "entropy": m["entropy"][i], "margin": m["margin"][i], "df_prod": math.prod(q),
                         "df_sum": sum(q), "df_expected": sum(cum), "e3_top1": m["e3_top1"][i],
                         "ema_eagle3": ema[EAGLE3], "ema_dflash": ema[DFLASH],
                         "ema_diff": ema[DFLASH] - ema[EAGLE3], "prev_dflash": prev, "prev_accepted": prev_a})
            d = rng.choice((EAGLE3, DFLASH))
            a = accepted[d][i]
            ema[d] = a if math.isnan(ema[d]) else ALPHA * a + (1 - ALPHA) * ema[d]
            prev, prev_a, i = float(d == DFLASH), float(a), i + a + 1
    return rows


# ----- fits -------------------------------------------------------------------------------------------------
def _standardize(xtr: torch.Tensor, *others: torch.Tensor):
    mean = torch.nanmean(xtr, 0)
    xs = [torch.where(torch.isnan(x), mean.expand_as(x), x) for x in (xtr, *others)]   # unseen history: train mean
    std = xs[0].std(0).clamp_min(1e-6)
    return [(x - mean) / std for x in xs]


def fit_ridge(xtr, ytr, xte, lam: float = 1.0):
    xtr, xte = _standardize(xtr, xte)
    a = torch.cat([xtr, torch.ones(len(xtr), 1)], 1).double()
    reg = lam * torch.eye(a.shape[1], dtype=torch.float64)
    reg[-1, -1] = 0
    w = torch.linalg.solve(a.T @ a + reg, a.T @ ytr.double())
    pred = lambda x: (torch.cat([x, torch.ones(len(x), 1)], 1).double() @ w).float()   # noqa: E731
    return pred(xtr), pred(xte)


def fit_bins(xtr, ytr, xte, bins: int = 8):
    x0, x1 = xtr[:, 0], xte[:, 0]
    fill = float(torch.nanmean(x0))
    x0, x1 = torch.nan_to_num(x0, fill), torch.nan_to_num(x1, fill)
    edges = torch.unique(torch.quantile(x0, torch.linspace(0, 1, bins + 1)[1:-1]))
    b0, b1 = torch.bucketize(x0, edges), torch.bucketize(x1, edges)
    means = torch.tensor([float(ytr[b0 == b].mean()) if (b0 == b).any() else float(ytr.mean())
                          for b in range(len(edges) + 1)])
    return means[b0], means[b1]


def fit_mlp(xtr, ytr, xte, groups, width: int = 32, epochs: int = 300, seed: int = 0):
    """GELU MLP, AdamW, early-stopped on a quarter of the train prompts."""
    torch.manual_seed(seed)
    xtr, xte = _standardize(xtr, xte)
    held = set(random.Random(seed).sample(sorted(set(groups)), max(1, len(set(groups)) // 4)))
    inner = torch.tensor([g in held for g in groups])
    mlp = torch.nn.Sequential(torch.nn.Linear(xtr.shape[1], width), torch.nn.GELU(), torch.nn.Linear(width, 1))
    opt = torch.optim.AdamW(mlp.parameters(), lr=3e-3, weight_decay=0.1)
    best, state = math.inf, None
    for _ in range(epochs):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(mlp(xtr[~inner]).squeeze(-1), ytr[~inner])
        loss.backward()
        opt.step()
        with torch.no_grad():
            val = float(torch.nn.functional.mse_loss(mlp(xtr[inner]).squeeze(-1), ytr[inner]))
        if val < best:
            best, state = val, {k: v.clone() for k, v in mlp.state_dict().items()}
    mlp.load_state_dict(state)
    with torch.no_grad():
        return mlp(xtr).squeeze(-1), mlp(xte).squeeze(-1)


def scores(ptr, pte, ytr, yte, qtr, qte) -> dict:
    """Held-out MSE, R^2 (vs the held-out variance), Pearson r; the rule "DFlash iff pred > theta", theta the one
    with the least regret on train rows, against the two-way oracle: q [R, 2] = each choice's cost-to-go (its round
    plus the optimal rest, EAGLE-3 then DFlash). Regret: ms per state above the oracle's; accuracy: share of rows
    where the rule makes the oracle's choice (ties: EAGLE-3), on all rows and on the decisive ones (q differ)."""
    var = float(yte.var(unbiased=False))
    mse = float(((pte - yte) ** 2).mean())
    r = float(torch.corrcoef(torch.stack([pte, yte]))[0, 1]) if pte.std() > 0 else 0.0
    cands = torch.unique(torch.cat([torch.quantile(ptr, torch.linspace(0, 1, 41)), torch.tensor([-math.inf,
                                                                                                    math.inf])]))
    regrets = torch.stack([_regret(ptr > t, qtr) for t in cands])
    theta = float(cands[int(regrets.argmin())])
    pick = pte > theta
    label, decisive = qte[:, 1] < qte[:, 0], qte[:, 1] != qte[:, 0]
    return {"mse": round(mse, 4), "var": round(var, 4), "r2": round(1 - mse / var, 4) if var else None,
            "r": round(r, 4), "theta": theta, "regret_ms_train": round(1000 * float(regrets.min()), 2),
            "regret_ms": round(1000 * float(_regret(pick, qte)), 2),
            "acc": round(float((pick == label).float().mean()), 4),
            "acc_decisive": round(float((pick == label)[decisive].float().mean()), 4)}


def _regret(dflash: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return (torch.where(dflash, q[:, 1], q[:, 0]) - q.min(1).values).mean()


# ----- the study ----------------------------------------------------------------------------------------------
def evaluate(measured: list[dict], holdout: set[int], args, costs: dict[str, float], engine: Engine) -> dict:
    rows = [r for k, m in enumerate(measured) for r in walk_rows(m, k, args.walks, args.seed, costs)]
    test = torch.tensor([r["prompt"] in holdout for r in rows])
    col = lambda name: torch.tensor([float(r[name]) for r in rows])   # noqa: E731
    y, q = col("y"), torch.stack([col("q_eagle3"), col("q_dflash")], 1)
    hidden = torch.stack([measured[r["prompt"]]["hidden"][r["state"]] for r in rows])
    cats = sorted({m["category"] for m in measured})
    category = torch.tensor([[float(measured[r["prompt"]]["category"] == c) for c in cats] for r in rows])
    groups = [r["prompt"] for r, t in zip(rows, test) if not t]
    tr, te = ~test, test

    def run(fit, x, **kw) -> dict:
        ptr, pte = fit(x[tr], y[tr], x[te], **kw)
        return scores(ptr, pte, y[tr], y[te], q[tr], q[te])

    table = {}
    for name in SCALARS:
        x = col(name)[:, None]
        table[name] = {"linear": run(fit_ridge, x, lam=1e-3), "bins": run(fit_bins, x)}
    scalars = torch.stack([col(n) for n in SCALARS], 1)
    table["all scalars"] = {"linear": run(fit_ridge, scalars), "mlp": run(fit_mlp, scalars, groups=groups)}
    table["hidden (router input)"] = {"linear": run(fit_ridge, hidden, lam=100.0),
                                      "mlp": run(fit_mlp, hidden, groups=groups)}
    both = torch.cat([scalars, hidden], 1)
    table["all scalars + hidden"] = {"linear": run(fit_ridge, both, lam=100.0),
                                     "mlp": run(fit_mlp, both, groups=groups)}
    table["category (offline label)"] = {"linear": run(fit_ridge, category)}
    if engine.router_file is not None and engine.router_file.version == 1:   # the v1 router reads `hidden`
        with torch.no_grad():
            pred = engine.router_file.mlp.float()(hidden)
        shipped = scores(pred[tr], pred[te], y[tr], y[te], q[tr], q[te])
        shipped["regret_ms_at_file_threshold"] = round(1000 * float(_regret(pred[te] > engine.router_file.threshold,
                                                                           q[te])), 2)
        table["shipped router (no refit)"] = {"as is": shipped}
    constant = {name: round(1000 * float(_regret(torch.full((int(te.sum()),), d), q[te])), 2)
                for name, d in ((EAGLE3, False), (DFLASH, True))}
    label, decisive = q[te][:, 1] < q[te][:, 0], q[te][:, 1] != q[te][:, 0]
    per_drafter = {}
    for target in ("a_eagle3", "a_dflash"):
        a = col(target)
        for name, x, fit in [(n, col(n)[:, None], fit_bins) for n in SCALARS] + [("all scalars", scalars, fit_ridge)]:
            _, pte = fit(x[tr], a[tr], x[te])
            per_drafter.setdefault(name, {})[target] = round(
                1 - float(((pte - a[te]) ** 2).mean()) / float(a[te].var(unbiased=False)), 4)
    return {"num_rows": len(rows), "num_train_rows": int(tr.sum()), "num_test_rows": int(te.sum()),
            "static_regret_ms": constant, "test_oracle_dflash_share": round(float(label.float().mean()), 4),
            "test_decisive_share": round(float(decisive.float().mean()), 4),
            "test_decisive_dflash_share": round(float(label[decisive].float().mean()), 4),
            "mean_cost_to_go_ms": round(1000 * float(q[te].min(1).values.mean()), 1),
            "signals": table, "per_drafter_r2": per_drafter, "by_category": by_category(measured, costs)}


def by_category(measured: list[dict], costs: dict[str, float]) -> dict:
    out = {}
    for m in measured:
        c = out.setdefault(m["category"], {"states": 0, "a_eagle3": 0, "a_dflash": 0, "oracle": {}})
        _, choice = optimal({d: m[f"a_{d}"] for d in (EAGLE3, DFLASH)}, costs)
        c["states"] += len(choice)
        c["a_eagle3"] += sum(m["a_eagle3"])
        c["a_dflash"] += sum(m["a_dflash"])
        for d in choice:
            c["oracle"][d] = c["oracle"].get(d, 0) + 1
    for c in out.values():
        n = max(1, c["states"])
        c.update(a_eagle3=round(c["a_eagle3"] / n, 3), a_dflash=round(c["a_dflash"] / n, 3),
                 oracle={d: round(v / n, 3) for d, v in sorted(c["oracle"].items())})
    return out


def render(result: dict) -> str:
    lines = [f"rows {result['num_rows']} (train {result['num_train_rows']}, held-out {result['num_test_rows']}); "
             f"held-out: the two-way oracle picks DFlash on {result['test_oracle_dflash_share']} of rows; the choice "
             f"is decisive (costs-to-go differ) on {result['test_decisive_share']}, DFlash on "
             f"{result['test_decisive_dflash_share']} of those; regret of always EAGLE-3 "
             f"{result['static_regret_ms'][EAGLE3]} ms/state, always DFlash {result['static_regret_ms'][DFLASH]} "
             f"ms/state (mean cost-to-go {result['mean_cost_to_go_ms']} ms)",
             "", "| signal | fit | held-out MSE | variance | R^2 | r | regret ms/state (train) | regret ms/state "
                 "| routing acc | acc (decisive) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, fits in result["signals"].items():
        for fit, s in fits.items():
            lines.append(f"| {name} | {fit} | {s['mse']} | {s['var']} | {s['r2']} | {s['r']} | "
                         f"{s['regret_ms_train']} | {s['regret_ms']} | {s['acc']} | {s['acc_decisive']} |")
    lines += ["", "Held-out R^2 of each drafter's own accepted drafts (signal: 8-bin fit; all scalars: ridge)", "",
              "| signal | a_eagle3 | a_dflash |", "|---|---|---|"]
    lines += [f"| {n} | {r['a_eagle3']} | {r['a_dflash']} |" for n, r in result["per_drafter_r2"].items()]
    lines += ["", "| category | states | mean a_eagle3 | mean a_dflash | three-way oracle choice (all states) |",
              "|---|---|---|---|---|"]
    for cat, c in result["by_category"].items():
        lines.append(f"| {cat} | {c['states']} | {c['a_eagle3']} | {c['a_dflash']} | "
                     + ", ".join(f"{d} {v}" for d, v in c["oracle"].items()) + " |")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine", type=Path, help="engine directory (default: the embedded SmolLM2-135M)")
    p.add_argument("--categories", default="code,math,json,chat")
    p.add_argument("--skip", type=int, default=10, help="first prompts of each category left to the bench")
    p.add_argument("--num-prompts", type=int, default=6, help="held-out-set prompts per category")
    p.add_argument("--holdout", type=int, default=3, help="every HOLDOUT-th prompt of a category is held out")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--walks", type=int, default=4, help="random routings per output (history signals)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--bench-results", type=Path, help="a whiflash-bench --oracle results.json: its round costs")
    p.add_argument("--costs", help="none=S,eagle3=S,dflash=S seconds per round (instead of --bench-results)")
    p.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "whiflash-trt" / "router-signals")
    p.add_argument("--out", type=Path, help="write the result as JSON here")
    return p


def setup(args) -> tuple[dict[str, float], Engine, list[str], list, dict]:
    """(round costs, engine, the categories, their held-out prompts, the prompts' chat-template ids) of parsed `args`
    (router_ceiling.py's too); sets the torch threads."""
    torch.set_num_threads(args.threads)
    if args.bench_results is not None:
        costs = json.loads(args.bench_results.read_text())["oracle"]["round_seconds"]
    elif args.costs:
        costs = {k: float(v) for k, v in (kv.split("=") for kv in args.costs.split(","))}
    else:
        raise SystemExit("give --bench-results or --costs")
    args.engine = args.engine or environment.default_engine_dir()
    engine = Engine.load(args.engine, dtype=args.dtype)
    cats = [c.strip() for c in args.categories.split(",")]
    prompts = [p for c in cats for p in load_prompts([c], args.skip + args.num_prompts)[args.skip:]]
    return costs, engine, cats, prompts, {p.id: engine.encode(p.prompt, chat=True) for p in prompts}


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    costs, engine, cats, prompts, ids = setup(args)
    start = time.perf_counter()
    measured = measure(engine, prompts, ids, args)
    index = {c: 0 for c in cats}
    holdout = set()
    for k, m in enumerate(measured):
        if index[m["category"]] % args.holdout == args.holdout - 1:
            holdout.add(k)
        index[m["category"]] += 1
    result = {"costs": costs, "args": {k: str(v) for k, v in vars(args).items()},
              "load_average": environment.load_average(), "measure_seconds": round(time.perf_counter() - start, 1),
              **evaluate(measured, holdout, args, costs, engine)}
    print(render(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
