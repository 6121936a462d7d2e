"""One round for a batch of requests: route -> catch up -> propose -> verify -> commit.

Generation keeps the invariant of runtime.sequence: after prefill and after every round, the committed tokens are
cached and one bonus token is pending. Target-only decoding (`ar`) is the round with an empty draft. A free
drafter (no model: the suffix drafter) proposes before the route, which weighs its offer; the learned drafters are
caught up and propose after it, only when chosen (lazy) or caught up every round (eager). Each phase hands
the next an immutable record (Route, Draft, the target's output, a Verdict); only commit changes a Sequence.

One target forward verifies every running request's tree and prefills the requests that join. The target's rows do
not depend on the other sequences of the call (models/attention.py), so a request's greedy output is exactly its
output alone, and its sampling draws come from its own generator. A request whose phase raises ends alone with that
error (Request.error) and drops out of the later phases; the others go on as if it had not been there.

Timing wraps the phases from outside (PhaseClock): a phase run for several requests at once is shared among them.
"""
from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Iterator

import torch

from whiflash_trt import kernels
from whiflash_trt.models.contracts import TargetOutput
from whiflash_trt.runtime.drafters import Proposal, Proposer
from whiflash_trt.runtime.request import Request
from whiflash_trt.runtime.round_costs import LiveRoundSeconds
from whiflash_trt.runtime.stats import PHASES
from whiflash_trt.runtime.target_runner import Feed, TargetRunner
from whiflash_trt.spec.router import NO_DRAFT, Offer, RouteSignal
from whiflash_trt.spec.sampling import next_token, target_probs
from whiflash_trt.spec.tree import DraftTree
from whiflash_trt.spec.verify import Verdict, verify_greedy, verify_sampling


@dataclass(frozen=True)
class Route:
    """What route and catch-up decided for one request."""
    drafter: str                     # the proposer's name; NO_DRAFT for a target-only round
    frontiers: Mapping[str, int]     # drafter frontiers after catch-up
    prefill_tokens: int = 0          # prompt positions the drafters' KV-only prefill covered this round
    catch_up_tokens: int = 0         # generated positions caught up this round
    offer: Proposal | None = None    # the chosen drafter's proposal when it is free (made before the route)


@dataclass(frozen=True)
class Draft:
    """What propose hands to verify and commit: the tree to verify (the pending bonus alone without a drafter)."""
    route: Route
    tree: DraftTree
    frontiers: Mapping[str, int]     # the route's frontiers, with the proposer's after drafting


class PhaseClock:
    """Seconds of each phase per request; a phase run for several requests is shared among them by weight."""

    def __init__(self) -> None:
        self.seconds: dict[int, dict[str, float]] = defaultdict(lambda: dict.fromkeys(PHASES, 0.0))

    @contextmanager
    def phase(self, name: str, reqs: list[Request], weights: list[int] | None = None) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            seconds, weights = time.perf_counter() - start, weights or [1] * len(reqs)
            for req, w in zip(reqs, weights):
                self.seconds[id(req)][name] += seconds * w / sum(weights)

    def of(self, req: Request) -> dict[str, float]:
        return self.seconds[id(req)]


class Round:
    """The round's phases over the target's runner. `round_seconds` (the throughput router's costs) learns from a
    round a request runs alone."""

    def __init__(self, runner: TargetRunner, max_positions: int, round_seconds: LiveRoundSeconds) -> None:
        self.runner, self.max_positions, self.round_seconds = runner, max_positions, round_seconds

    def run(self, joining: list[Request], running: list[Request]) -> None:
        """Prefill `joining` and advance `running` by one round, in one target forward."""
        clock, alone = PhaseClock(), len(joining) + len(running) == 1
        drafts = self.drafts(running, clock)
        running = [req for req in running if not req.done]
        feeds = {id(req): _guarded(req, prefill_feed, req) for req in joining}
        feeds |= {id(req): _guarded(req, verify_feed, req, drafts[id(req)]) for req in running}
        live = [req for req in joining + running if not req.done]
        with clock.phase("verify", live, [len(feeds[id(req)].tokens) for req in live]):
            outs = self.forward(live, [feeds[id(req)] for req in live],
                                capture=any(learned(req) for req in joining + running))
        for req in joining:
            if not req.done:
                _guarded(req, prefilled, req, outs[id(req)])
        for req in running:
            if req.done:
                continue
            draft, out = drafts[id(req)], outs[id(req)]
            with clock.phase("verify", [req]):
                verdict = _guarded(req, judge, req, draft, out)
            with clock.phase("commit", [req]):
                if verdict is not None:
                    _guarded(req, self.commit, req, draft, out, verdict)
            record(req, draft, verdict, clock.of(req))
        if alone and running and running[0].error is None and not drafts[id(running[0])].route.prefill_tokens:
            # a steady round of a request alone (no drafter's prefill of the prompt): its seconds are its choice's cost
            self.round_seconds.observe(drafts[id(running[0])].route.drafter, sum(clock.of(running[0]).values()))

    # ----- route -> catch up -> propose ---------------------------------------------------------------------------
    def drafts(self, running: list[Request], clock: PhaseClock) -> dict[int, Draft]:
        """id(request) -> its draft. Requests whose proposers share a group_key propose together (one drafter
        forward per EAGLE-3 depth for all of them); when a group's proposal raises, each member proposes alone, so
        that only the one that raises again fails."""
        routes = {id(req): route for req in running if (route := self.route(req, clock)) is not None}
        root = {id(req): DraftTree([req.seq.pending], [-1], [0]) for req in running}
        drafts = {i: Draft(r, root[i], r.frontiers) for i, r in routes.items()}
        groups: dict[tuple, list[Request]] = defaultdict(list)
        for req in running:
            route = routes.get(id(req))
            if route is not None and route.offer is not None:
                drafts[id(req)] = Draft(route, route.offer.tree, route.frontiers)
            elif route is not None and route.drafter in req.proposers:
                groups[req.proposers[route.drafter].group_key()].append(req)
        for members in groups.values():
            with clock.phase("draft", members):
                proposed = _propose(members, [drafts[id(req)] for req in members])
            drafts.update(proposed)
        return drafts

    def route(self, req: Request, clock: PhaseClock) -> Route | None:
        """Hear the free drafters' offers, choose the round's drafter, catch up the drafters the round needs, reserve
        the round's slots."""
        with clock.phase("draft", [req]):
            offers = _guarded(req, free_offers, req)
        if offers is None:
            return None
        with clock.phase("route", [req]):
            name = _guarded(req, self.choose, req, offers)
        if name is None:
            return None
        route = Route(name, {n: p.frontier for n, p in offers.items()}, offer=offers.get(name))
        drafters, prompt = self.caught_up(req, name), len(req.seq.prompt_ids)
        if any(req.seq.frontiers.get(p.name, 0) < prompt for p in drafters):   # a drafter's first round
            with clock.phase("drafter_prefill", [req]):
                route = _guarded(req, catch_up, req, drafters, route, prompt_only=True)
            if route is None:
                return None
        with clock.phase("catch_up", [req]):
            route = _guarded(req, catch_up, req, drafters, route)
        return None if route is None else _guarded(req, reserve, req, route)

    def choose(self, req: Request, offers: Mapping[str, Proposal]) -> str:
        """The round's drafter: the router's choice (weighing the free drafters' `offers` of more than the root), or
        the mode's one drafter. A name without a proposer (the router's NO_DRAFT included), or a draft with no room
        left in the context window, is a target-only round."""
        if req.router is not None:
            name = req.router.choose(req.signal, {n: Offer(p.expected or 0.0, len(p.tree.tokens))
                                                  for n, p in offers.items() if len(p.tree.tokens) > 1})
        else:
            name = next(iter(req.proposers), NO_DRAFT)
        proposer = req.proposers.get(name)
        if proposer is None or req.seq.num_committed + proposer.max_tree_tokens() > self.max_positions:
            return NO_DRAFT
        return name

    @staticmethod
    def caught_up(req: Request, name: str) -> list[Proposer]:
        """The learned drafters a round catches up (the free ones are already): the chosen one (lazy) or every one of
        the mode (eager)."""
        learned = [p for p in req.proposers.values() if not p.free]
        return learned if req.spec.catch_up == "eager" else [p for p in learned if p.name == name]

    # ----- verify -> commit ---------------------------------------------------------------------------------------
    def forward(self, reqs: list[Request], feeds: list[Feed], capture: bool) -> dict[int, TargetOutput]:
        """id(request) -> its target output: one forward for every feed, or, when that raises, one per feed (a
        sequence's rows do not depend on the others', so each output is the same), so that only the feed that
        raises again fails."""
        if not feeds:
            return {}
        try:
            return {id(req): out for req, out in zip(reqs, self.runner.step_many(feeds, capture=capture))}
        except Exception:
            alone = {}
            for req, feed in zip(reqs, feeds):
                out = _guarded(req, self.runner.step_many, [feed], capture=capture)
                if out is not None:
                    alone[id(req)] = out[0]
            return alone

    def commit(self, req: Request, draft: Draft, out: TargetOutput, verdict: Verdict) -> None:
        """Keep the accepted path's K/V and features, set the next bonus and route signal, and hand the new tokens to
        the request."""
        seq, tree = req.seq, draft.tree
        if not tree.is_chain:
            self.runner.pool.copy_slots(*seq.compaction(verdict.path))
        features = None
        if learned(req) and out.captured is not None:   # the accepted nodes' rows (a prefix: a view)
            path, n = verdict.path, len(verdict.path)
            features = (out.captured[:n] if path[-1] == n - 1
                        else out.captured.index_select(0, torch.tensor(path, device=out.captured.device)))
        seq.commit(verdict.tokens, verdict.bonus, features, dict(draft.frontiers))
        last = verdict.path[-1]
        if req.router is not None:
            req.signal = signal_of(out.logits[last], out.hidden[last], draft.route.drafter, verdict.num_accepted)
        req.extend(verdict.tokens[1:] + [verdict.bonus])


def catch_up(req: Request, proposers: list[Proposer], route: Route, prompt_only: bool = False) -> Route:
    """`route` with each drafter's backlog prefilled KV-only: with `prompt_only`, the prompt's positions (a drafter's
    prefill, in the first round it drafts); else from the route's frontiers to the last committed position."""
    seq, prompt = req.seq, len(req.seq.prompt_ids)
    frontiers, tokens = dict(route.frontiers), 0
    for p in proposers:
        start = frontiers.get(p.name, seq.frontiers.get(p.name, 0))
        if prompt_only and start >= prompt:
            frontiers[p.name] = start
            continue
        frontiers[p.name] = p.catch_up(seq, end=prompt) if prompt_only else p.catch_up(seq, start=start)
        tokens += frontiers[p.name] - start
    if prompt_only:
        return replace(route, frontiers=frontiers, prefill_tokens=tokens)
    return replace(route, frontiers=frontiers, catch_up_tokens=tokens)


def free_offers(req: Request) -> dict[str, Proposal]:
    """Each free drafter's proposal for this round, after it caught up with the committed tokens."""
    offers = {}
    for name, p in req.proposers.items():
        if p.free:
            p.catch_up(req.seq)
            offers[name] = p.propose(req.seq)
    return offers


def learned(req: Request) -> bool:
    """Whether `req` runs a learned drafter: only those read the target's features."""
    return any(not p.free for p in req.proposers.values())


def reserve(req: Request, route: Route) -> Route:
    """`route` once the slots for the round's writes past the committed tokens are reserved (within the blocks the
    request holds)."""
    proposer = req.proposers.get(route.drafter)
    req.seq.reserve(req.seq.num_committed + (slots_per_round(proposer) if proposer else 1))
    return route


def _propose(members: list[Request], drafts: list[Draft]) -> dict[int, Draft]:
    """Drafts of one group's members with their proposals; each alone when the group's call raises."""
    proposer = members[0].proposers[drafts[0].route.drafter]
    try:
        proposals = proposer.propose_many([req.seq for req in members])
    except Exception:
        proposals = [_guarded(req, lambda r: r.proposers[d.route.drafter].propose(r.seq), req)
                     for req, d in zip(members, drafts)]
    return {id(req): Draft(d.route, p.tree, {**d.frontiers, proposer.name: p.frontier})
            for req, d, p in zip(members, drafts, proposals) if p is not None}


def prefill_feed(req: Request) -> Feed:
    prompt = req.seq.prompt_ids
    req.seq.reserve(len(prompt))
    return Feed(req.seq, prompt, logits_rows=[len(prompt) - 1])


def prefilled(req: Request, out: TargetOutput) -> None:
    """Commit the prompt. Every drafter of the mode starts at frontier 0 with the whole prompt as backlog (its KV-only
    prefill runs when it is first chosen, or every round with eager catch-up)."""
    seq = req.seq
    bonus = next_token(out.logits[-1], req.gen.sampling, req.generator)
    seq.commit(seq.prompt_ids, bonus, out.captured if learned(req) else None, {name: 0 for name in req.proposers})
    if req.router is not None:   # only a router reads the signal
        req.signal = signal_of(out.logits[-1], out.hidden[-1])
    req.extend([bonus])


def verify_feed(req: Request, draft: Draft) -> Feed:
    chain = draft.tree.is_chain
    return Feed(req.seq, draft.tree.tokens, None if chain else draft.tree.depths,
                None if chain else draft.tree.mask())


def judge(req: Request, draft: Draft, out: TargetOutput) -> Verdict:
    """Walk the target's choices through the tree (spec.verify; greedy: the argmax of every node from
    kernels.argmax_rows)."""
    sampling = req.gen.sampling
    if sampling.greedy:
        return verify_greedy(draft.tree, out.logits, kernels.argmax_rows(out.logits).tolist())
    return verify_sampling(draft.tree, target_probs(out.logits, sampling), req.generator)


def record(req: Request, draft: Draft, verdict: Verdict | None, seconds: dict[str, float]) -> None:
    """Book a committed round in the request's statistics (a failed one is not)."""
    if verdict is None or req.error is not None:
        return
    req.stats.drafter_prefill_tokens += draft.route.prefill_tokens
    req.stats.catch_up_tokens += draft.route.catch_up_tokens
    req.stats.record(draft.route.drafter, verdict.num_accepted, seconds)


def signal_of(logits: torch.Tensor, hidden: torch.Tensor, drafter: str | None = None, accepted: int = 0) -> RouteSignal:
    """spec.router.route_signal, its entropy and margin from the engine's kernel where it is loaded."""
    entropy, margin = kernels.entropy_margin(logits)
    return RouteSignal(entropy, hidden, margin, drafter, accepted)


def slots_per_round(proposer: Proposer) -> int:
    """Slots past the committed ones a round of `proposer` writes: the verified tree, or its scratch plus the root."""
    return max(proposer.max_tree_tokens(), proposer.scratch_slots() + 1)


def _guarded(req: Request, phase, *args, **kwargs):
    """phase(*args, **kwargs), or None with the exception set as `req`'s error (the request then ends)."""
    try:
        return phase(*args, **kwargs)
    except Exception as e:
        req.error = req.error or e
        return None
