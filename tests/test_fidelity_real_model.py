"""The real default model on the paged engine matches Hugging Face transformers token for token."""

from __future__ import annotations

from typing import Any

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.loading import LoadedModel
from kvserve.engine.request import Request
from kvserve.quant.reference import reference_greedy
from tests.conftest import first_divergence_is_near_tie

pytestmark = pytest.mark.slow
MAX_TOKENS = 24
TEXTS = [
    "Hello",
    "The capital of France is",
    "Here is a list of the three primary colors:",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "Water boils at 100 degrees Celsius at sea level. At higher altitudes, the boiling point",
    "Q: What is 12 times 12?\nA: Let me think step by step about the multiplication.",
]


def _long_prompt(tokenizer: Any) -> list[int]:
    paragraph = (
        "The history of computing is a story of memory. Early machines stored a few words in delay "
        "lines and magnetic drums; later, core memory and then semiconductor memory made it cheap to "
        "keep more state close to the processor. Every generation of hardware has been shaped by the "
        "question of how much data can be kept at hand, and how quickly it can be reached. "
    )
    ids = tokenizer.encode(paragraph * 6 + "In summary, the key lesson is that")
    assert len(ids) > 300
    return list(ids)


@pytest.fixture(scope="module")
def workload(smollm: LoadedModel, hf_smollm: Any) -> tuple[list[list[int]], list[tuple[list[int], list[Any]]]]:
    prompts = [list(smollm.tokenizer.encode(t)) for t in TEXTS] + [_long_prompt(smollm.tokenizer)]
    assert len(prompts) >= 8 and len({len(p) for p in prompts}) == len(prompts)
    return prompts, [reference_greedy(hf_smollm, p, MAX_TOKENS) for p in prompts]


def _check(llm: LLM, workload: Any) -> None:
    prompts, refs = workload
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    for prompt, out, (ref_tokens, ref_logprobs) in zip(prompts, outs, refs, strict=True):
        ok, why = first_divergence_is_near_tie(out.token_ids, ref_tokens, ref_logprobs)
        assert ok, f"prompt of {len(prompt)} tokens: {why}"
    stats = llm.kv_stats()
    assert stats.blocks_used == 0 and stats.live_tokens == 0  # everything reclaimed


def _check_greedy(smollm: LoadedModel, workload: Any, block_size: int) -> None:
    llm = LLM(loaded=smollm, block_size=block_size, kv_cache_memory="256MiB", max_num_seqs=16,
              max_num_batched_tokens=256)  # < the long prompt: chunked prefill alongside decodes
    _check(llm, workload)
    assert llm.kv_stats().num_preemptions == 0


@pytest.mark.parametrize("block_size", [1, 256])
def test_greedy_matches_hf(smollm: LoadedModel, workload: Any, block_size: int) -> None:
    _check_greedy(smollm, workload, block_size)


def test_greedy_matches_hf_at_every_isa_level(smollm: LoadedModel, workload: Any, isa: str) -> None:
    """Each build of the C++ ops (portable, avx2, avx512, amx) gives HF's greedy tokens."""
    _check_greedy(smollm, workload, 16)


def test_greedy_matches_hf_under_preemption(smollm: LoadedModel, workload: Any) -> None:
    bytes_per_token = 2 * 30 * 3 * 64 * 4
    llm = LLM(loaded=smollm, block_size=16, kv_cache_memory=41 * 16 * bytes_per_token, max_model_len=512,
              max_num_seqs=16, scheduler_reserve_full_isl=False)  # admitted on a chunk: preempted mid-prefill too
    assert llm.engine.num_blocks - 1 == 40
    _check(llm, workload)
    assert llm.kv_stats().num_preemptions > 0


def test_stream_matches_generate_and_text(smollm: LoadedModel) -> None:
    llm = LLM(loaded=smollm, kv_cache_memory="64MiB", max_model_len=1024)
    params = SamplingParams(temperature=0, max_tokens=20)
    full = llm.generate("The capital of France is", params)[0]
    chunks = list(llm.stream("The capital of France is", params))
    assert [t for c in chunks for t in c.new_token_ids] == full.token_ids
    assert "".join(c.new_text for c in chunks) == full.text
    assert "Paris" in full.text
    assert chunks[-1].finished and not any(c.finished for c in chunks[:-1])


def test_streamed_text_is_incremental_and_exact(smollm: LoadedModel) -> None:
    """A stream decodes only its new tokens (with the last ones before them as context), and the
    pieces join to the full decode: over characters split across byte tokens, and a hot sample."""
    llm = LLM(loaded=smollm, kv_cache_memory="64MiB", max_model_len=1024)
    tokenizer = llm.tokenizer
    assert tokenizer is not None
    ids = tokenizer.encode("naïve café — 東京 🙂👍🏽 x  \n\tdone. Ünïcödé")
    assert any(tokenizer.decode(ids[:i]).endswith("\ufffd") for i in range(1, len(ids)))  # split characters
    request = Request("r", [1], SamplingParams(), 0)
    for token in ids:
        request.output_token_ids.append(token)
        llm.engine.outputs.detokenize(request)
        assert not request.output_text.endswith("\ufffd")
        assert tokenizer.decode(request.output_token_ids).startswith(request.output_text)
    assert request.output_text == tokenizer.decode(ids)
    params = SamplingParams(temperature=1.5, seed=3, max_tokens=64, ignore_eos=True)
    full = llm.generate("Write in many languages:", params)[0]
    chunks = list(llm.stream("Write in many languages:", params))
    assert [t for c in chunks for t in c.new_token_ids] == full.token_ids
    assert "".join(c.new_text for c in chunks) == full.text == tokenizer.decode(full.token_ids,
                                                                                 skip_special_tokens=True)


def test_cli_generate_end_to_end(tmp_path: Any) -> None:
    """The CLI on the real model: a JSONL file of plain and chat prompts, a pool small enough
    to preempt, the outputs and the KV statistics printed."""
    import json
    import subprocess
    import sys

    prompts = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "The capital of France is"}, {"messages": [{"role": "user", "content": "Say hi."}]}]
    rows += [{"text": f"Count from {i} to {i + 20}:"} for i in range(6)]
    prompts.write_text("\n".join(json.dumps(r) for r in rows))
    proc = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "generate", "--prompts-file", str(prompts), "--max-tokens", "40",
         "--ignore-eos", "--block-size", "16", "--kv-cache-memory", str(16 * 16 * 46080), "--max-model-len", "200",
         "--quiet"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.count("--- [") == 8 and "Paris" in out
    assert "8 requests" in out and "KV cache: usage 0.0%" in out
    assert "preemptions 0" not in out  # 15 blocks for 8 requests of ~50 tokens: someone was preempted
    assert "maximum concurrency for 200 tokens per request" in proc.stderr
