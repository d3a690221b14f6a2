"""Sampling: filters, per-request seeds, stops and logprobs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.engine.loading import LoadedModel
from kvserve.engine.sampling import TokenHistory, filter_logits, process_logits, sample

PROMPT = [3, 14, 15, 92, 65]


@pytest.fixture(scope="module")
def llm(tiny_model_factory: Callable[..., Path]) -> LLM:
    return LLM(str(tiny_model_factory("llama")), kv_cache_memory="2MiB", max_model_len=256)


def test_filters_keep_the_right_tokens() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 4))
    params = [SamplingParams(top_k=2), SamplingParams(top_p=0.7), SamplingParams(min_p=0.5),
              SamplingParams(top_p=0.85, top_k=3)]
    kept = torch.isfinite(filter_logits(logits, params)).tolist()
    assert kept == [[True, True, False, False], [True, True, False, False],
                    [True, True, False, False], [True, True, True, False]]


def test_sampled_frequencies_follow_probabilities() -> None:
    probs = torch.tensor([0.0, 0.6, 0.3, 0.1, 0.0])  # tokens of no mass at either end are never drawn
    logits = probs.log().expand(4000, 5).contiguous()
    result = sample(logits, [SamplingParams(temperature=1.0)] * 4000, [None] * 4000)
    counts = torch.bincount(torch.tensor(result.token_ids), minlength=5).float() / 4000
    assert torch.allclose(counts, probs, atol=0.03) and counts[0] == 0 and counts[4] == 0


def test_seed_reproducible_regardless_of_batch(llm: LLM) -> None:
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([PROMPT], seeded)[0].token_ids
    noisy = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    batch = llm.generate([[7, 8, 9], PROMPT, [1] * 40], [noisy, seeded, noisy])
    assert batch[1].token_ids == alone
    other = llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=99, max_tokens=16, ignore_eos=True))
    assert other[0].token_ids != alone


def test_top_k_one_is_greedy(llm: LLM) -> None:
    greedy = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    top1 = llm.generate([PROMPT], SamplingParams(temperature=0.8, top_k=1, seed=5, max_tokens=10,
                                                 ignore_eos=True))[0]
    assert top1.token_ids == greedy.token_ids


def test_stop_token_ids_and_logprobs(llm: LLM) -> None:
    greedy = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3))[0]
    assert greedy.logprobs is not None and len(greedy.logprobs) == 10
    for chosen, top, token in zip(greedy.logprobs, greedy.top_logprobs or [], greedy.token_ids, strict=True):
        assert chosen <= 0 and len(top) == 3
        assert max(top.values()) == pytest.approx(chosen) and top[token] == pytest.approx(chosen)
    stop_at = greedy.token_ids[4]
    first = greedy.token_ids.index(stop_at)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_at]))[0]
    assert out.token_ids == greedy.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at


def test_eos_stops_unless_ignored(llm: LLM) -> None:
    greedy = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    outputs = llm.engine.outputs  # where the stop checks read the EOS ids
    eos_token_ids, outputs.eos_token_ids = outputs.eos_token_ids, {greedy.token_ids[2]}
    try:
        out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8))[0]
        assert out.token_ids == greedy.token_ids[: greedy.token_ids.index(greedy.token_ids[2]) + 1]
        assert out.finish_reason == "stop"
        kept = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
        assert kept.token_ids == greedy.token_ids and kept.finish_reason == "length"
    finally:
        outputs.eos_token_ids = eos_token_ids


@pytest.mark.slow
def test_stop_strings_on_real_model(smollm: LoadedModel) -> None:
    llm = LLM(loaded=smollm, kv_cache_memory="32MiB", max_model_len=512)
    base = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=20))[0]
    assert "Paris." in base.text
    cut = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=20, stop=["."]))[0]
    assert cut.text == base.text[: base.text.index(".")] and cut.finish_reason == "stop" and cut.stop_reason == "."
    kept = llm.generate("The capital of France is",
                        SamplingParams(temperature=0, max_tokens=20, stop=".", include_stop_str_in_output=True))[0]
    assert kept.text == cut.text + "."


def test_penalties_logit_bias_and_min_tokens_follow_vllm() -> None:
    """Each processor changes exactly the logits it should, by exactly vLLM's rule."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 1.0]])
    prompt, output = [0, 1], [2, 2, 3]
    history = [TokenHistory(prompt, output, frozenset({4}))]

    def run(**kwargs: object) -> list[float]:
        return process_logits(logits, [SamplingParams(**kwargs)], history)[0].tolist()  # type: ignore[arg-type]

    # repetition: every token seen in prompt or output; positive logits divided, negative multiplied
    assert run(repetition_penalty=2.0) == [1.0, -2.0, 0.25, 1.5, 1.0]
    # frequency: minus penalty x count in the output (the prompt does not count)
    assert run(frequency_penalty=0.5) == [2.0, -1.0, -0.5, 2.5, 1.0]
    # presence: minus penalty once per token present in the output
    assert run(presence_penalty=0.5) == [2.0, -1.0, 0.0, 2.5, 1.0]
    assert run(logit_bias={1: 10.0, 99: 5.0}) == [2.0, 9.0, 0.5, 3.0, 1.0]  # ids past the vocabulary: ignored
    # min_tokens: the stop tokens are hidden until that many tokens were generated
    assert run(min_tokens=4, max_tokens=8)[4] == float("-inf")
    assert run(min_tokens=3, max_tokens=8)[4] == 1.0
    assert run() == logits[0].tolist()
    assert process_logits(logits, [SamplingParams()], history) is logits  # nobody asks: no copy


def test_processors_steer_generation(llm: LLM) -> None:
    greedy = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].token_ids
    forced = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                   logit_bias={7: 100.0}))[0].token_ids
    assert forced == [7, 7, 7, 7]
    # the bias applies to sampled rows too, and the logprobs stay those of the raw model
    out = llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=3, max_tokens=3, ignore_eos=True,
                                                logit_bias={7: 100.0}, logprobs=0))[0]
    assert out.token_ids == [7, 7, 7] and out.logprobs is not None and max(out.logprobs) < -1e-3
    # a repetition penalty that large never picks a token it has seen (the vocabulary is big enough)
    fresh = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                  repetition_penalty=1e6))[0].token_ids
    assert len(set(fresh)) == len(fresh) and not set(fresh) & set(PROMPT)
    assert fresh != greedy or len(set(greedy)) == len(greedy)
    # min_tokens: the stop token the greedy run emits first is held back until then
    stop = greedy[1]
    stopped = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop]))[0]
    assert stopped.token_ids[-1] == stop and len(stopped.token_ids) <= 2
    held = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop],
                                                 min_tokens=5))[0]
    assert len(held.token_ids) >= 5 and stop not in held.token_ids[:5]


def test_new_sampling_fields_are_validated() -> None:
    for kwargs, match in [({"presence_penalty": 2.5}, "presence_penalty"), ({"repetition_penalty": 0.0}, "> 0"),
                          ({"temperature": float("nan")}, "finite"), ({"min_tokens": 9, "max_tokens": 4}, "exceed"),
                          ({"logit_bias": {3: 101.0}}, "logit_bias")]:
        with pytest.raises(ValueError, match=match):
            SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_seed_survives_prefix_hits_and_preemption(tiny_model_factory: Callable[..., Path]) -> None:
    """A seeded request's tokens are its own: the same when its prompt comes from the prefix
    cache, and when it is preempted (recomputed) in a pool too small for its batch."""
    path = str(tiny_model_factory("llama"))
    seeded = SamplingParams(temperature=1.0, seed=77, max_tokens=40, ignore_eos=True)
    prompt = [3 + (i * 7) % 200 for i in range(40)]
    roomy = LLM(path, kv_cache_memory="2MiB", max_model_len=256)
    alone = roomy.generate([prompt], seeded)[0]
    again = roomy.generate([prompt], seeded)[0]
    assert again.num_cached_tokens == 32 and again.token_ids == alone.token_ids  # 2 blocks from the cache
    noisy = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True)
    tight = LLM(path, kv_cache_memory=14 * roomy.engine.kv_block_bytes, max_model_len=128)  # 13 usable blocks
    mates = [[5 + i] * 40 for i in range(2)]
    outs = tight.generate([*mates, prompt], [noisy, noisy, seeded])  # the newest is preempted first
    assert outs[-1].num_preemptions > 0, "the pool should have preempted the seeded request"
    assert outs[-1].token_ids == alone.token_ids

