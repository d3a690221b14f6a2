"""Speculative decoding: proposers, verification (greedy and sampled), KV rollback."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.cache.kv_cache_manager import KVCacheManager
from kvserve.config import ConfigError, EngineConfig, SpeculativeConfig
from kvserve.engine.engine import LLMEngine
from kvserve.engine.loading import LoadedModel
from kvserve.engine.request import Request
from kvserve.engine.spec_decode import (
    PRIOR_ACCEPTANCE,
    AcceptanceEstimate,
    NgramProposer,
    Proposal,
    SpecDecoder,
    best_num_drafts,
    expected_tokens,
    ngram_propose,
    verify,
)
from tests.test_cache_invariants import check_manager

GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)


@pytest.fixture(scope="module")
def weak(tiny_model_factory: Callable[..., Path]) -> Path:
    """A tiny llama whose attention barely matters: greedy output falls into loops that an
    n-gram proposer predicts often but not always (about half its drafts stand)."""
    return tiny_model_factory("llama", o_proj_scale=0.01)


def prompts(n: int = 6, seed: int = 0) -> list[list[int]]:
    rnd = random.Random(seed)
    return [[rnd.randrange(256) for _ in range(12 + 3 * i)] for i in range(n)]


def run(model: Path, spec: dict[str, Any] | None, prompts_: list[list[int]], params: SamplingParams = GREEDY,
        check: bool = False, **kwargs: Any) -> tuple[list[list[int]], LLM]:
    """Every prompt's output tokens; ``check``: the manager's invariants after every step."""
    llm = LLM(str(model), dtype="float32", kv_cache_memory=kwargs.pop("kv_cache_memory", "4MiB"),
              speculative_config=spec, **kwargs)
    engine = llm.engine
    for p in prompts_:
        engine.add_request(p, params)
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out.token_ids
        if check:
            check_manager(engine.kv_manager)
    assert engine.kv_manager.pool.num_used_blocks == 0, "blocks leaked"
    return [outputs[f"req-{i}"] for i in range(len(prompts_))], llm


def ngram(k: int, **extra: Any) -> dict[str, Any]:
    return {"method": "ngram", "num_speculative_tokens": k, "draft_token_cost": 0.0, **extra}


# ---------------------------------------------------------------- pieces


def test_ngram_propose_takes_the_longest_latest_match() -> None:
    assert ngram_propose([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 2, 1, 3) == ([7, 8], 3)  # latest "1 2 3"
    assert ngram_propose([5, 6, 1, 2, 9, 9, 2], 3, 1, 3) == ([9, 9, 2], 1)  # only "2" occurs before: n = 1
    assert ngram_propose([1, 2, 3, 4], 3, 1, 3).tokens == []  # nothing repeats
    assert ngram_propose([4, 4, 4, 4, 4, 4], 3, 2, 2) == ([4, 4, 4], 2)  # in a loop: the latest with k to follow
    assert ngram_propose([4, 4, 4], 5, 2, 2) == ([4], 2)  # none has k: the earliest, up to the end
    assert ngram_propose([7, 1, 2, 1], 2, 2, 3).tokens == []  # "1" repeats, but n_min is 2


def test_ngram_propose_against_brute_force() -> None:
    rnd = random.Random(0)
    for _ in range(3000):
        tokens = [rnd.randrange(rnd.randint(1, 5)) for _ in range(rnd.randint(1, 30))]
        k, n_min = rnd.randint(1, 6), rnd.randint(1, 4)
        n_max = rnd.randint(n_min, 6)
        length, expected = len(tokens), ([], 0)
        for n in range(n_min, min(n_max, length - 1) + 1):  # the longest n wins
            starts = [end + 1 for end in range(n - 1, length - 1) if tokens[end - n + 1 : end + 1] == tokens[-n:]]
            whole = [s for s in starts if s + k <= length]
            if starts:
                start = whole[-1] if whole else starts[0]
                expected = (tokens[start : start + k], n)
        assert ngram_propose(tokens, k, n_min, n_max) == expected, (tokens, k, n_min, n_max)


def test_best_num_drafts() -> None:
    assert best_num_drafts([0.9] * 7, 7, 0.0) == 7
    assert best_num_drafts([0.02] * 7, 7, 0.1) == 0  # rarely accepted: drafting does not pay
    ks = [best_num_drafts([a / 10] * 7, 7, 0.1) for a in range(10)]
    assert ks == sorted(ks) and ks[-1] > 2  # more drafts as acceptance grows
    # acceptance in runs: the first draft rarely stands, the rest nearly always once it has
    runs = [0.2, 0.95, 0.95, 0.95]
    assert expected_tokens(runs, 4) == pytest.approx(1 + 0.2 * (1 + 0.95 + 0.95**2 + 0.95**3))
    assert best_num_drafts(runs, 4, 0.1) == 4  # all or nothing: the tail is nearly free once in a run
    assert best_num_drafts(runs, 4, 0.3) == 0
    assert best_num_drafts([0.44] * 4, 4, 0.3) == 1  # the same mean rate, spread evenly, drafts one


def test_acceptance_estimate_counts_each_position_given_the_ones_before() -> None:
    estimate = AcceptanceEstimate(4)
    estimate.observe(4, 1)  # draft 0 stood, draft 1 fell, drafts 2-3 never judged
    estimate.observe(2, 2)  # both stood (the bonus token is not a draft)
    assert estimate.reached == pytest.approx([0.98 + 1, 0.98 + 1, 0, 0])
    assert estimate.accepted == pytest.approx([0.98 + 1, 1, 0, 0])
    assert estimate.rates()[2:] == [PRIOR_ACCEPTANCE[1]] * 2  # no evidence: the prior
    for _ in range(1000):
        estimate.observe(4, 0)
    assert 0 < estimate.rates()[0] < 0.05  # the prior stays, faded evidence of rejections outweighs it


def test_spec_decoder_keeps_one_estimate_per_ngram_length() -> None:
    """Drafts from long n-gram matches that stood and from 1-token matches that fell: at the
    same batch, only long matches draft (the n-gram length predicts acceptance, benchmarks)."""
    decoder = SpecDecoder(SpeculativeConfig(num_speculative_tokens=4, draft_token_cost=0.3),
                          NgramProposer(1, 4), max_model_len=1024)
    params = SamplingParams(temperature=0.0, max_tokens=100)

    def decoding(tokens: list[int]) -> Request:
        request = Request(f"r{len(tokens)}-{tokens[-1]}", tokens, params, 0)
        request.num_computed_tokens = len(tokens) - 1
        return request

    long_match, short_match = decoding([5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8]), decoding([1, 2, 3, 4, 1])
    decoder.propose([long_match, short_match])
    assert long_match.spec_token_ids[:1] == [9] and short_match.spec_token_ids[:1] == [2]  # the prior drafts
    for _ in range(10):
        decoder.record(long_match.request_id, 4, 4)
        decoder.record(short_match.request_id, 4, 0)
        decoder.pending.update({long_match.request_id: decoder.estimates[4, True],
                                short_match.request_id: decoder.estimates[1, True]})
    long_match.spec_token_ids, short_match.spec_token_ids = [], []
    decoder.propose([long_match, short_match])
    assert long_match.spec_token_ids == [9, 10, 11, 5] and short_match.spec_token_ids == []
    sampled = decoding(list(long_match.prompt_token_ids))
    sampled.params = SamplingParams(temperature=1.0, max_tokens=100)
    decoder.propose([sampled])
    assert sampled.spec_token_ids[:1] == [9]  # its prior, not the greedy class's evidence
    assert (4, False) in decoder.estimates  # sampled requests keep estimates of their own


def test_bad_speculative_config_names_the_key() -> None:
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        EngineConfig.from_settings(speculative_config={"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ConfigError, match="unknown key 'n'"):
        EngineConfig.from_settings(speculative_config='{"n": 3}')
    with pytest.raises(ConfigError, match="method"):
        EngineConfig.from_settings(speculative_config={"method": "medusa"})


def test_lookahead_is_never_published_and_rollback_frees_rejected_blocks() -> None:
    kv = KVCacheManager(16, 4, enable_prefix_caching=True)
    tokens = list(range(100))

    def reader(start: int, end: int) -> list[int]:
        return tokens[start:end]

    assert kv.allocate_slots("a", 6, reader)  # 6 real tokens: block 0 is full and published
    assert kv.allocate_slots("a", 6 + 7, reader, num_lookahead_tokens=7)  # 7 drafts on 6 tokens: 4 blocks
    assert len(kv.block_ids("a")) == 4 and kv.requests["a"].num_published == 1
    check_manager(kv)
    kv.rollback("a", 7)  # one draft stood: blocks 2 and 3 held only rejected drafts
    assert len(kv.block_ids("a")) == 2 and kv.num_tokens("a") == 7
    assert kv.pool.num_free_blocks == kv.pool.num_usable_blocks - 2
    check_manager(kv)
    kv.free("a")
    assert kv.pool.num_free_blocks == kv.pool.num_usable_blocks


def test_verify_greedy_keeps_the_matching_prefix_and_one_more() -> None:
    logits = torch.full((4, 10), -5.0)
    for row, best in enumerate([3, 4, 7, 1]):
        logits[row, best] = 5.0
    params = SamplingParams(temperature=0.0)
    assert verify(logits, [3, 4, 5], params, None, None).token_ids == [3, 4, 7]  # third draft rejected
    assert verify(logits, [3, 4, 7], params, None, None).token_ids == [3, 4, 7, 1]  # all stand: bonus
    assert verify(logits, [9, 4, 7], params, None, None).token_ids == [3]


# ---------------------------------------------------------------- greedy equality


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "int4"])
def test_greedy_output_is_unchanged(weak: Path, block_size: int, kv_dtype: str) -> None:
    """For k = 1, 3 and 7, speculation changes nothing in greedy output (fp32), on every KV
    format; the quantized formats with tail blocks included. Drafts are both accepted and
    rejected, so rollback runs; the manager's invariants hold after every step."""
    base, _ = run(weak, None, prompts(), block_size=block_size, kv_cache_dtype=kv_dtype)
    for k in (1, 3, 7):
        outs, llm = run(weak, ngram(k), prompts(), block_size=block_size, kv_cache_dtype=kv_dtype, check=True)
        assert outs == base, f"k={k}"
        stats = llm.kv_stats().spec_decode
        assert stats is not None and stats.num_drafts > 10
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # both outcomes happened


def test_prefix_hits_never_see_rejected_drafts(weak: Path) -> None:
    """Second-round prompts extend first-round prompts by their outputs, so they hit blocks
    that held rejected drafts' K/V before; their outputs equal a run without speculation."""
    first = prompts(4)
    base_first, _ = run(weak, None, first)
    second = [p + out for p, out in zip(first, base_first, strict=True)]
    llm = LLM(str(weak), dtype="float32", kv_cache_memory="4MiB", speculative_config=ngram(3), block_size=4)
    plain = LLM(str(weak), dtype="float32", kv_cache_memory="4MiB", block_size=4)
    for engine_llm in (llm, plain):
        assert [o.token_ids for o in engine_llm.generate(first, GREEDY)] == base_first
    got = [o.token_ids for o in llm.generate(second, GREEDY)]
    assert got == [o.token_ids for o in plain.generate(second, GREEDY)]
    assert llm.kv_stats().prefix_cache.hits > 0 and llm.kv_stats().spec_decode.num_accepted_tokens > 0


@pytest.mark.parametrize("spec", [ngram(4), {"method": "layer_skip", "num_draft_layers": 1, "draft_token_cost": 0.0}])
def test_preemption_mid_speculation_loses_nothing(weak: Path, spec: dict[str, Any]) -> None:
    """A pool too small for the batch: requests are preempted while they speculate (and with a
    draft model, its pool runs short too: those requests decode without drafts)."""
    many = prompts(8)
    base, _ = run(weak, None, many, kv_cache_memory="4MiB")
    block_bytes = 2 * 2 * 2 * 16 * 4 * 16  # layers x (K, V) x KV heads x head_dim x fp32 x block_size
    blocks = 36 if "num_draft_layers" in spec else 24  # a draft model takes a third of the budget
    outs, llm = run(weak, spec, many, check=True, kv_cache_memory=blocks * block_bytes)
    stats = llm.kv_stats()
    assert outs == base
    assert stats.num_preemptions > 0 and stats.spec_decode is not None and stats.spec_decode.num_accepted_tokens > 0


def test_verify_prefill_and_decode_chunks_share_steps(weak: Path) -> None:
    """Requests arrive while others decode, prefill in chunks of a small token budget: steps mix
    prefill chunks, plain decodes and verify chunks, and the output is the output alone."""

    def staggered(spec: dict[str, Any] | None) -> tuple[dict[str, list[int]], set[str]]:
        llm = LLM(str(weak), dtype="float32", kv_cache_memory="4MiB", max_num_batched_tokens=24,
                  speculative_config=spec)
        engine = llm.engine
        kinds_seen: set[str] = set()
        execute = engine.runner.execute

        def recording(chunks: list[Any]) -> Any:
            kinds = {"verify" if c.draft_token_ids else "decode" if c.num_tokens == 1 else "prefill" for c in chunks}
            if len(kinds) == 3:
                kinds_seen.add("all three")
            return execute(chunks)

        engine.runner.execute = recording  # type: ignore[method-assign]
        pending, outputs, step = prompts(6), {}, 0
        while pending or engine.has_unfinished_requests():
            if pending and step % 5 == 0:
                engine.add_request(pending.pop(0), GREEDY)
            outputs.update({o.request_id: o.token_ids for o in engine.step()})
            step += 1
        return outputs, kinds_seen

    with_spec, kinds = staggered(ngram(3, disable_by_batch_size=0))
    assert with_spec == staggered(None)[0] and kinds == {"all three"}


@pytest.mark.parametrize("hybrid", [True, False])
def test_sliding_window_model(tiny_model_factory: Callable[..., Path], hybrid: bool) -> None:
    """Gemma 3's shape in small (window 8, two sliding layers per full one): verify chunks over
    sliding-window KV cache groups (blocks released out of the window while drafts come and go),
    or one table for every layer; greedy output is unchanged. This random model repeats one
    token, so ngram drafts always stand; a draft model of other weights has its drafts rejected."""
    model = tiny_model_factory("gemma3_text")
    other = tiny_model_factory("llama", o_proj_scale=0.01)
    kwargs = {"block_size": 4, "disable_hybrid_kv_cache_manager": not hybrid}
    base, _ = run(model, None, prompts(4), **kwargs)
    for spec in (ngram(3), {"method": "draft_model", "model": str(other), "num_speculative_tokens": 3,
                            "draft_token_cost": 0.0}):
        outs, llm = run(model, spec, prompts(4), check=True, **kwargs)
        assert outs == base
        stats = llm.kv_stats().spec_decode
        assert stats is not None and stats.num_draft_tokens > 50
        if spec["method"] == "ngram":
            assert stats.num_accepted_tokens > 50
        else:
            assert stats.num_accepted_tokens < stats.num_draft_tokens


def test_disable_by_batch_size(weak: Path) -> None:
    outs, llm = run(weak, ngram(3, disable_by_batch_size=2), prompts(6))
    stats = llm.kv_stats().spec_decode
    assert stats is not None and stats.num_disabled_steps > 0
    assert outs == run(weak, None, prompts(6))[0]


# ---------------------------------------------------------------- sampled output keeps the target's distribution


CHI2_999 = {3: 16.27, 7: 24.32}  # chi-square quantiles at p = 0.999 by degrees of freedom


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_verify_sampling_follows_the_target() -> None:
    """One draft token over a fixed 4-token target: whatever the draft, accepted or not, the
    token that comes out follows the target distribution; the bonus after an accepted draft too."""
    target = torch.tensor([0.1, 0.2, 0.3, 0.4])
    logits = target.log().repeat(2, 1)  # the next token after the draft has the same distribution
    params = SamplingParams(temperature=1.0)
    generator = torch.Generator().manual_seed(0)
    for draft in (0, 3):
        firsts, bonuses = torch.zeros(4), torch.zeros(4)
        for _ in range(4000):
            tokens = verify(logits, [draft], params, generator, None).token_ids
            firsts[tokens[0]] += 1
            if len(tokens) == 2:
                bonuses[tokens[1]] += 1
        assert chi_square(firsts, target) < CHI2_999[3], f"draft {draft}: {firsts.tolist()}"
        assert chi_square(bonuses, target) < CHI2_999[3]
        assert abs(firsts[draft] / 4000 - target[draft]) < 0.03  # acceptance rate = p(draft)


def test_sampled_verification_keeps_the_target_distribution(tiny_model_factory: Callable[..., Path]) -> None:
    """Through the engine: the second and third sampled tokens' distributions, with and without
    speculation, against their exact marginals computed from the model (vocab 8). The prompt
    holds every token, so the n-gram proposer drafts after every first token."""
    model = tiny_model_factory("llama", vocab_size=8, o_proj_scale=0.01)
    prompt = list(range(8)) * 2
    engine = LLMEngine(EngineConfig.from_settings(model=str(model), dtype="float32", kv_cache_memory="4MiB"))
    second = torch.zeros(8, dtype=torch.float64)
    third = torch.zeros(8, dtype=torch.float64)
    first = _next_probs(engine, prompt)
    for a in range(8):
        after_a = _next_probs(engine, [*prompt, a])
        second += first[a] * after_a
        for b in range(8):
            third += first[a] * after_a[b] * _next_probs(engine, [*prompt, a, b])
    n = 3000
    for spec in (None, ngram(2, disable_by_batch_size=0)):
        llm = LLM(str(model), dtype="float32", kv_cache_memory="8MiB", max_num_seqs=256, speculative_config=spec)
        outs = llm.generate([prompt] * n, [SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seed=s)
                                           for s in range(n)])
        for index, exact in ((1, second), (2, third)):
            counts = torch.bincount(torch.tensor([o.token_ids[index] for o in outs]), minlength=8).double()
            chi2 = chi_square(counts, exact)
            assert chi2 < CHI2_999[7], f"spec={spec}, token {index}: chi-square {chi2:.1f}"
        if spec is not None:
            stats = llm.kv_stats().spec_decode
            assert stats is not None and stats.num_drafts > n // 2
            assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def _next_probs(engine: LLMEngine, tokens: list[int]) -> torch.Tensor:
    request = engine.add_request(tokens, SamplingParams(max_tokens=1, logprobs=8, temperature=0.0))
    while not request.finished:
        engine.step()
    probs = torch.zeros(8, dtype=torch.float64)
    for token, logprob in request.output_top_logprobs[0].items():
        probs[token] = float(torch.tensor(logprob, dtype=torch.float64).exp())
    return probs / probs.sum()


def test_seeded_sampling_gives_the_same_tokens_with_speculation_or_without(weak: Path) -> None:
    """Verification draws each position's token from the request's generator as plain decoding
    does (one uniform per token, in order), so a seeded request's tokens do not depend on whether
    it speculated, how many drafts stood, or the k the adaptive choice picked."""
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=32, seed=7, ignore_eos=True)
    plain = run(weak, None, prompts(4), params)[0]
    once, llm = run(weak, ngram(3), prompts(4), params)
    assert once == plain
    assert run(weak, ngram(5, prompt_lookup_min=2), prompts(4), params)[0] == plain
    stats = llm.kv_stats().spec_decode
    assert stats is not None and 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # drafts stood, and fell


# ---------------------------------------------------------------- draft models


@pytest.mark.parametrize("block_size,kv_dtype", [(1, "auto"), (16, "auto"), (16, "int4")])
def test_draft_model_greedy_output_is_unchanged(weak: Path, tiny_model_factory: Callable[..., Path],
                                                block_size: int, kv_dtype: str) -> None:
    """Draft models on their own KV pool: another model (1 layer, its own weights: its drafts are
    all rejected), the target itself (all accepted), and the target's shallow exit (some
    accepted). Greedy output equals the target's alone, for k = 1, 3 and 7."""
    other = tiny_model_factory("llama", num_hidden_layers=1, o_proj_scale=0.01)
    base, _ = run(weak, None, prompts(), block_size=block_size, kv_cache_dtype=kv_dtype)
    for spec in ({"method": "draft_model", "model": str(other)}, {"method": "draft_model", "model": str(weak)},
                 {"method": "layer_skip", "num_draft_layers": 1}):
        for k in (1, 3, 7):
            outs, llm = run(weak, {**spec, "num_speculative_tokens": k, "draft_token_cost": 0.0}, prompts(),
                            block_size=block_size, kv_cache_dtype=kv_dtype, check=True)
            assert outs == base, f"{spec} k={k}"
            stats = llm.kv_stats().spec_decode
            assert stats is not None and stats.draft_kv is not None and stats.num_draft_tokens > 50
            if spec.get("model") == str(weak):  # the target itself (on a float pool: the same logits)
                assert stats.acceptance_rate == 1.0 if kv_dtype == "auto" else stats.acceptance_rate > 0.5
            elif spec["method"] == "layer_skip":
                assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
            assert stats.draft_kv.blocks_used == 0  # every request's draft KV was freed


def test_draft_pool_shares_the_kv_budget(weak: Path, tiny_model_factory: Callable[..., Path]) -> None:
    draft = tiny_model_factory("llama", num_hidden_layers=1, o_proj_scale=0.01)
    alone = LLM(str(weak), dtype="float32", kv_cache_memory="4MiB").engine
    both = LLM(str(weak), dtype="float32", kv_cache_memory="4MiB",
               speculative_config={"method": "draft_model", "model": str(draft)}).engine
    # the target's 2 layers and the draft's 1 split 4 MiB 2:1, so both hold the same tokens
    assert both.num_blocks * 3 == pytest.approx(alone.num_blocks * 2, abs=3)
    assert abs(both.draft_num_blocks - both.num_blocks) <= 1
    short = tiny_model_factory("llama", num_hidden_layers=1, max_position_embeddings=64)
    with pytest.raises(ConfigError, match="handles 64 positions, fewer than max_model_len=512"):
        LLM(str(weak), dtype="float32", kv_cache_memory="4MiB",
            speculative_config={"method": "draft_model", "model": str(short)})
    with pytest.raises(ConfigError, match="num_draft_layers"):
        LLM(str(weak), dtype="float32", kv_cache_memory="4MiB",
            speculative_config={"method": "layer_skip", "num_draft_layers": 2})


# ---------------------------------------------------------------- the real model, through the server

COPY_TEXT = ("The paged KV cache splits each sequence's keys and values into fixed-size blocks. A block table "
             "maps logical positions to physical blocks, so memory is allocated on demand and reclaimed as soon as "
             "a request finishes.")


def test_server_speculates_on_the_real_model(smollm: LoadedModel, tmp_path: Path) -> None:
    """SmolLM2 asked to repeat a text, through the official client, streamed and not, with ngram
    speculation: the same greedy text as without speculation, most drafts accepted, and the
    counters in /metrics and /v1/kv, and the load tester's report."""
    import openai
    from prometheus_client.parser import text_string_to_metric_families

    from kvserve.cli import main
    from kvserve.server.app import ServerConfig
    from kvserve.server.serve import build
    from tests.conftest import serve_in_thread

    messages = [{"role": "user", "content": "Repeat the following text exactly:\n\n" + COPY_TEXT}]
    plain = LLM("smollm2-135m", loaded=smollm, kv_cache_memory="64MiB")
    expected = plain.generate([plain.apply_chat_template(messages)], SamplingParams(temperature=0, max_tokens=60))
    config = EngineConfig.from_settings(model="smollm2-135m", kv_cache_memory="64MiB",
                          speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    engine, app = build(config, ServerConfig(model_name="smollm2-135m"), loaded=smollm)
    base, stop = serve_in_thread(app)
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none")
        whole = client.chat.completions.create(model="smollm2-135m", messages=messages,  # type: ignore[arg-type]
                                               max_tokens=60, temperature=0)
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
            model="smollm2-135m", messages=messages, max_tokens=60, temperature=0, stream=True)  # type: ignore[arg-type]
            if chunk.choices)
        assert whole.choices[0].message.content == streamed == expected[0].text
        samples = {s.name: s.value for f in text_string_to_metric_families(httpx.get(base + "/metrics").text)
                   for s in f.samples if not s.labels}
        kv = httpx.get(base + "/v1/kv").json()["spec_decode"]
        assert kv["num_accepted_tokens"] == samples["kvserve:spec_decode_num_accepted_tokens_total"] > 0
        assert kv["num_draft_tokens"] == samples["kvserve:spec_decode_num_draft_tokens_total"]
        assert kv["acceptance_rate"] > 0.5 and kv["mean_accepted_length"] > 2
        # the load tester reports acceptance per level, from the server's counters
        dataset = tmp_path / "copy.jsonl"
        dataset.write_text("\n".join(json.dumps({"messages": messages}) for _ in range(2)) + "\n")
        code = main(["bench", "serve", "--base-url", base, "--model", "smollm2-135m", "--dataset", f"jsonl:{dataset}",
                     "--output-len", "40", "--num-prompts", "2", "--concurrency", "1", "--out",
                     str(tmp_path / "run"), "--quiet"])
        assert code == 0
        level = json.loads((tmp_path / "run" / "results.json").read_text())["levels"][0]
        assert level["spec_acceptance"] > 0.5 and level["spec_accepted_length"] > 2
        assert "draft acceptance" in (tmp_path / "run" / "report.md").read_text()
    finally:
        stop()
        engine.shutdown()


def test_spec_decoder_skips_lookups_no_class_pays_for() -> None:
    """At a draft-token cost no estimate can pay for, the n-gram lookups are not even run."""
    calls = []

    class CountingProposer(NgramProposer):
        def propose(self, requests: list[Request], num_drafts: list[int]) -> list[Proposal]:
            calls.append(len(requests))
            return super().propose(requests, num_drafts)

    request = Request("r", [1, 2, 3, 1, 2], SamplingParams(temperature=0.0, max_tokens=100), 0)
    request.num_computed_tokens = 4
    for cost, expected in ((5.0, []), (0.1, [1])):
        decoder = SpecDecoder(SpeculativeConfig(num_speculative_tokens=4, draft_token_cost=cost),
                              CountingProposer(1, 4), max_model_len=1024)
        calls.clear()
        decoder.propose([request])
        assert calls == expected
    assert request.spec_token_ids == [3, 1, 2][: len(request.spec_token_ids)] and request.spec_token_ids
