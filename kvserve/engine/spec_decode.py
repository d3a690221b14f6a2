"""Speculative decoding: a proposer drafts tokens, the target verifies them in one forward pass.

A decoding request's drafts ride in its next chunk after its last real token (the scheduler
reserves their slots as lookahead). The target's logits at each of those positions decide how
many drafts stand (``verify``): greedy rows keep the longest prefix equal to the target's
argmax, sampled rows draw at each position the token that plain decoding would draw there and
keep the drafts up to the first that differs; either way one more token comes from the target
(the first differing one, or the bonus after the last draft). The rejected drafts' KV slots are
then forgotten (``KVCacheManager.rollback``). Proposals are deterministic (an n-gram lookup, or a
draft model's argmax): a draft x has q(x) = 1, so rejection sampling (Leviathan et al. 2023,
Chen et al. 2023) would accept it with probability p(x) and resample from p without x; drawing
from p and comparing accepts x with the same probability p(x) and yields a token distributed as
p either way. It also uses the request's generator exactly as plain decoding does, one uniform
per token in order, so a seeded request gives the same tokens with speculation or without,
whatever k the adaptive choice drafts.

``SpecDecoder`` decides per step and per request how many tokens to draft: none when more
requests decode than ``disable_by_batch_size``, otherwise k maximizing the expected tokens per
unit of step cost, from the measured acceptance of drafts of its class (``AcceptanceEstimate``):
for the n-gram lookup, lookups that matched as long an n-gram.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch

from kvserve.cache.kv_stats import KVCacheStats, SpecDecodeStats
from kvserve.config import SpeculativeConfig
from kvserve.engine.request import Request
from kvserve.engine.sampling import (
    SampleResult,
    SamplingParams,
    TokenHistory,
    draw,
    filter_logits,
    greedy_tokens,
    mask_by_grammars,
    process_logits,
    with_logprobs,
)
from kvserve.engine.structured import Grammar


class Proposal(NamedTuple):
    """A proposer's drafts for one request, and their class (``key``): proposals of one class
    share an acceptance estimate. The n-gram lookup's key is the length of the n-gram it matched
    (a 4-token match is right far more often than a 1-token one); a draft model's is 0."""

    tokens: list[int]
    key: int = 0


def ngram_propose(tokens: Sequence[int], k: int, n_min: int, n_max: int) -> Proposal:
    """Prompt lookup: the up to ``k`` tokens that followed an earlier occurrence of the
    sequence's last n tokens, for the longest n in [n_min, n_max] that occurs; else none. The
    occurrence is the latest one followed by k tokens (in a loop, the previous turn of it), or
    if none is, the earliest (the longest continuation there is)."""
    seq = np.asarray(tokens, dtype=np.int64)
    length = len(seq)
    n_max = min(n_max, length - 1)
    # ends: the earlier positions where the sequence's last n tokens also end, n = 1, 2, ...
    ends = np.flatnonzero(seq[: length - 1] == seq[-1]) if n_max >= 1 else seq[:0]
    found, found_n, n = seq[:0], 0, 1
    while ends.size:
        if n >= n_min:
            found, found_n = ends, n
        if n == n_max:
            break
        ends = ends[ends >= n]
        ends = ends[seq[ends - n] == seq[length - 1 - n]]
        n += 1
    if not found.size:
        return Proposal([])
    hits = found + 1  # where each continuation starts
    whole = hits[hits + k <= length]
    start = int(whole[-1] if whole.size else hits[0])
    return Proposal(seq[start : start + k].tolist(), found_n)


def verify(raw: torch.Tensor, drafts: list[int], params: SamplingParams, generator: torch.Generator | None,
           history: TokenHistory | None, grammar: Grammar | None = None) -> SampleResult:
    """The tokens a verify chunk yields: accepted drafts, then the target's own next token.

    ``raw``: the target's logits at the chunk's last real token and at each draft
    ([len(drafts) + 1, vocab]); row i predicts the token after drafts[:i]. ``history`` (for
    penalties, logit_bias, min_tokens) is the request's before this step; row i sees the drafts
    before it as output. ``grammar`` (structured output): each position keeps what the grammar
    allows after the tokens before it, so a draft outside the grammar never stands; it consumes
    the tokens yielded."""
    k = len(drafts)
    rows = [params] * (k + 1)
    logits = raw
    if history is not None:
        logits = process_logits(raw, rows, [TokenHistory(history.prompt, history.output + drafts[:i],
                                                         history.stop_ids) for i in range(k + 1)])
    if grammar is not None:
        tokens = []
        for i in range(k + 1):  # the mask at position i depends on the token drawn at i - 1
            row = mask_by_grammars(logits[i : i + 1], [grammar])
            token = int(greedy_tokens(row)[0]) if params.greedy else _draw(filter_logits(row, [params]).softmax(-1)[0],
                                                                            generator)
            grammar.advance(token)
            tokens.append(token)
            if i == k or token != drafts[i]:
                break
    elif params.greedy:
        target = greedy_tokens(logits).tolist()
        accepted = next((i for i, (d, t) in enumerate(zip(drafts, target, strict=False)) if d != t), k)
        tokens = [*drafts[:accepted], target[accepted]]
    else:
        probs = filter_logits(logits, rows).softmax(dim=-1)
        tokens = []
        for i in range(k + 1):  # the draft stands with probability p(draft); one uniform per token
            tokens.append(_draw(probs[i], generator))
            if i == k or tokens[-1] != drafts[i]:
                break
    return with_logprobs(raw[: len(tokens)], tokens, [params] * len(tokens))


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from (unnormalized) ``probs``."""
    return int(draw(probs[None], [generator])[0])


def expected_tokens(rates: Sequence[float], k: int) -> float:
    """Tokens a verify step of k drafts yields on average: 1 + sum over j < k of the chance that
    drafts 0..j all stand, for ``rates[j]`` = P(draft j accepted | every draft before it was)."""
    total, stand = 1.0, 1.0
    for rate in rates[:k]:
        stand *= rate
        total += stand
    return total


def best_num_drafts(rates: Sequence[float], max_drafts: int, draft_token_cost: float) -> int:
    """k in [0, max_drafts] maximizing expected tokens per step (``expected_tokens``) divided by
    the step's cost, 1 + draft_token_cost x k."""
    best, best_value = 0, 1.0
    for k in range(1, max_drafts + 1):
        value = expected_tokens(rates, k) / (1.0 + draft_token_cost * k)
        if value > best_value + 1e-9:
            best, best_value = k, value
    return best


class Proposer(ABC):
    """Drafts tokens for decoding requests. Proposals must be deterministic functions of the
    request's tokens (``verify`` treats each draft as certain)."""

    # cheap proposers draft first, at the most tokens allowed, and the proposal's class then sets
    # how many are kept; costly ones (a draft model) are asked only for what the estimate pays for
    drafts_before_deciding: bool = False

    @abstractmethod
    def propose(self, requests: list[Request], num_drafts: list[int]) -> list[Proposal]:
        """Up to num_drafts[i] tokens to follow requests[i]'s tokens (fewer, or none, is fine)."""

    @abstractmethod
    def free(self, request_id: str) -> None:
        """The request finished or was preempted: drop what the proposer keeps for it."""

    def kv_stats(self) -> KVCacheStats | None:
        """The proposer's own KV pool, if it has one."""
        return None


class NgramProposer(Proposer):
    drafts_before_deciding = True

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max

    def propose(self, requests: list[Request], num_drafts: list[int]) -> list[Proposal]:
        return [ngram_propose(r.prompt_token_ids + r.output_token_ids, k, self.n_min, self.n_max)
                for r, k in zip(requests, num_drafts, strict=True)]

    def free(self, request_id: str) -> None:
        """Nothing to drop: the lookup reads the request's own tokens."""


# verifying one more token, in decode steps of the request, per request decoding in the step, up to
# a cap (SmolLM2 bf16 on 2 cores, benchmarks/spec_decode.py: about 0.03 at batch 1, 0.3 at 4, 0.5 at 16)
VERIFY_TOKEN_COST, VERIFY_TOKEN_COST_CAP = 0.08, 0.5
# a class's first draft starts at PRIOR_ACCEPTANCE[0] and each later one (given the ones before
# stood) at PRIOR_ACCEPTANCE[1], a prior worth PRIOR_WEIGHT observations that never fades;
# observations fade by ESTIMATE_DECAY per verify step of their class, and by RETRY_DECAY per
# proposal of it left undrafted, so a class written off is tried again, but rarely: each retry
# costs the whole batch a longer step
PRIOR_ACCEPTANCE, PRIOR_WEIGHT, ESTIMATE_DECAY, RETRY_DECAY = (0.5, 0.8), 2.0, 0.98, 0.999


class AcceptanceEstimate:
    """How often each draft position of one class of proposals stands, given that the drafts
    before it did. Acceptance comes in runs (a right n-gram match stays right for a while, a
    wrong one fails at once), which one rate for every position would misjudge."""

    __slots__ = ("accepted", "reached")

    def __init__(self, positions: int) -> None:
        self.reached = [0.0] * positions  # verify steps in which draft j was judged (all before it stood)
        self.accepted = [0.0] * positions

    def rates(self) -> list[float]:
        return [(a + PRIOR_ACCEPTANCE[j > 0] * PRIOR_WEIGHT) / (r + PRIOR_WEIGHT)
                for j, (a, r) in enumerate(zip(self.accepted, self.reached, strict=True))]

    def fade(self, decay: float = RETRY_DECAY) -> None:
        self.reached = [decay * r for r in self.reached]
        self.accepted = [decay * a for a in self.accepted]

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        self.fade(ESTIMATE_DECAY)
        for j in range(min(num_drafts, num_accepted + 1)):
            self.reached[j] += 1.0
            self.accepted[j] += j < num_accepted


class SpecDecoder:
    """Per step: who drafts, how many tokens, and the counters (SpecDecodeStats)."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int,
                 proposal_cost: float = 0.0, lookahead_room: Callable[[Request], int | None] | None = None) -> None:
        """``proposal_cost``: what drafting one token costs, in target decode steps (a draft
        model's size relative to the target's): with verification's, the cost of a draft token
        unless config.draft_token_cost says otherwise. ``lookahead_room``: the most drafts the KV
        cache lets a decoding request carry (KVCacheManager.lookahead_room; None: no bound)."""
        self.config = config
        self.proposal_cost = proposal_cost
        self.proposer = proposer
        self.lookahead_room = lookahead_room
        self.max_model_len = max_model_len
        # (proposal key, greedy) -> its estimate: sampled requests accept less often than greedy ones
        self.estimates: dict[tuple[int, bool], AcceptanceEstimate] = {}
        self.pending: dict[str, AcceptanceEstimate] = {}  # request id -> the class of its drafts in flight
        self.stats = SpecDecodeStats(config.method, config.num_speculative_tokens,
                                     accepted_per_position=[0] * config.num_speculative_tokens)

    def _estimate(self, key: int, request: Request) -> AcceptanceEstimate:
        estimate = self.estimates.get((key, request.params.greedy))
        if estimate is None:
            estimate = self.estimates[key, request.params.greedy] = AcceptanceEstimate(
                self.config.num_speculative_tokens)
        return estimate

    def token_cost(self, num_decoding: int) -> float:
        """A draft token's cost in decode steps, with ``num_decoding`` requests in the step: the
        larger the batch, the less idle compute a verify step fills."""
        given = self.config.draft_token_cost
        if given is not None:
            return given
        return min(VERIFY_TOKEN_COST * num_decoding, VERIFY_TOKEN_COST_CAP) + self.proposal_cost

    def draft_room(self, request: Request) -> int:
        """The most drafts the request can take now: within num_speculative_tokens, max_tokens,
        max_model_len and what its KV cache allows (lookahead_room)."""
        k = min(self.config.num_speculative_tokens, request.params.max_tokens - len(request.output_token_ids) - 1,
                self.max_model_len - request.num_tokens - 1)
        room = self.lookahead_room(request) if self.lookahead_room is not None else None
        return max(min(k, room) if room is not None else k, 0)

    def _some_class_pays(self, cost: float) -> bool:
        """Some class of proposals (one not seen yet included) is worth drafting at ``cost``."""
        positions = self.config.num_speculative_tokens
        return any(best_num_drafts(estimate.rates(), positions, cost) > 0
                   for estimate in (*self.estimates.values(), AcceptanceEstimate(positions)))

    def propose(self, running: list[Request]) -> None:
        """Set spec_token_ids of the running requests that decode next step."""
        decoding = [r for r in running if r.num_computed_tokens == r.num_tokens - 1]
        if not decoding:
            return
        limit = self.config.disable_by_batch_size
        if limit and len(decoding) > limit:
            self.stats.num_disabled_steps += 1
            return
        cost = self.token_cost(len(decoding))
        if self.proposer.drafts_before_deciding and not self._some_class_pays(cost):
            return  # whatever the lookups found would be cut to nothing: spare them
        asked: list[tuple[Request, int]] = []
        for request in decoding:
            k = self.draft_room(request)
            if k and not self.proposer.drafts_before_deciding:
                estimate = self._estimate(0, request)
                k = best_num_drafts(estimate.rates(), k, cost)
                if not k:
                    estimate.fade()
            if k:
                asked.append((request, k))
        if not asked:
            return
        proposals = self.proposer.propose([r for r, _ in asked], [k for _, k in asked])
        for (request, _), proposal in zip(asked, proposals, strict=True):
            if not proposal.tokens:
                continue
            estimate = self._estimate(proposal.key, request)
            k = best_num_drafts(estimate.rates(), len(proposal.tokens), cost)
            if k:
                request.spec_token_ids = proposal.tokens[:k]
                self.pending[request.request_id] = estimate
            else:
                estimate.fade()  # not drafted: the class drifts back towards the prior

    def record(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """Count one verify step of a request and update its class's acceptance estimate."""
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafts
        stats.num_accepted_tokens += num_accepted
        stats.num_bonus_tokens += num_accepted == num_drafts
        for position in range(num_accepted):
            stats.accepted_per_position[position] += 1
        estimate = self.pending.pop(request_id, None)
        if estimate is not None:
            estimate.observe(num_drafts, num_accepted)

    def free(self, request_id: str) -> None:
        self.pending.pop(request_id, None)
        self.proposer.free(request_id)

    def snapshot(self) -> SpecDecodeStats:
        """A copy of the counters (the live ones keep changing), with the draft pool's stats."""
        return dataclasses.replace(self.stats, accepted_per_position=list(self.stats.accepted_per_position),
                                   draft_kv=self.proposer.kv_stats())
