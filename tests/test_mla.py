"""MLA (DeepSeek-V2/V3): the cache holds one latent + rotary-key vector per token, decode
attends in latent space (weight absorption), and the tokens equal transformers' on tiny
random checkpoints made with transformers' own DeepSeek classes."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.config import ConfigError
from kvserve.model.deepseek import MLAAttention
from kvserve.plan.planner import plan
from kvserve.plan.spec import ModelSpec
from kvserve.quant.reference import reference_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
CHECKPOINTS = [("deepseek_v2", 24), ("deepseek_v2", None), ("deepseek_v3", None), ("deepseek_v3", 24)]


@pytest.fixture(scope="module")
def references(tiny_model_factory: Callable[..., Path]) -> dict[tuple[str, int | None], Any]:
    """Per checkpoint: (folder, prompts, transformers' greedy tokens)."""
    from transformers import AutoModelForCausalLM

    rng = random.Random(0)
    shared = [rng.randrange(3, 256) for _ in range(36)]
    prompts = [shared + [rng.randrange(3, 256) for _ in range(n)] for n in (24, 21)]
    prompts.append([rng.randrange(3, 256) for _ in range(23)])
    out = {}
    for arch, q_lora in CHECKPOINTS:
        path = tiny_model_factory(arch, q_lora_rank=q_lora)
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        out[arch, q_lora] = (path, prompts, [reference_greedy(hf, p, GREEDY.max_tokens)[0] for p in prompts])
    return out


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("checkpoint", CHECKPOINTS, ids=lambda c: f"{c[0]}-q_lora_{c[1]}" if c else "")
def test_mla_matches_transformers(references: dict[tuple[str, int | None], Any], checkpoint: tuple[str, int | None],
                                  block_size: int) -> None:
    """A mixed batch in a pool too small for it (preemption), then each prompt again (from the
    prefix cache where a block is full): transformers' tokens every time; the pool holds
    latent vectors only."""
    path, prompts, want = references[checkpoint]
    latent_block = 3 * block_size * (32 + 16) * 4  # three layers of one 48-float vector per token
    llm = LLM(model=str(path), dtype="float32", block_size=block_size, max_num_batched_tokens=32,
              kv_cache_memory=latent_block * (7 if block_size == 16 else 4),
              scheduler_reserve_full_isl=False)  # admitted on a chunk: preempted mid-prefill too
    assert [tuple(layer.data.shape[1:]) for layer in llm.engine.kv_cache.layers] == [(1, block_size, 48)] * 3
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want
    assert llm.engine.num_preemptions > 0
    for prompt, tokens in zip(prompts, want, strict=True):
        assert llm.generate([prompt], GREEDY)[0].token_ids == tokens
    assert llm.kv_stats().prefix_cache.hits > 0 or block_size > 60  # (no prompt fills a 64-token block)


def test_absorbed_attention_equals_expanded(references: dict[tuple[str, int | None], Any]) -> None:
    """Folding W_UK into the query and W_UV after attention gives the very attention of
    up-projecting every cached token (the same logits to float32 rounding, the same tokens)."""
    path, prompts, want = references["deepseek_v3", 24]
    outputs, logprobs = [], []
    for absorb in (True, False):
        llm = LLM(model=str(path), dtype="float32", kv_cache_memory="4MiB")
        for layer in llm.engine.model.decoder_layers:
            assert isinstance(layer.self_attn, MLAAttention)
            layer.self_attn.absorb = absorb
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=5)
        outs = llm.generate(prompts, params)
        outputs.append([o.token_ids for o in outs])
        logprobs.append(torch.tensor([lp for o in outs for lp in o.logprobs or []]))
    assert outputs[0] == outputs[1] == want
    torch.testing.assert_close(logprobs[0], logprobs[1], atol=1e-4, rtol=1e-4)


def test_mla_bytes_equal_the_planner(references: dict[tuple[str, int | None], Any]) -> None:
    """The engine's bytes per sequence equal kvserve plan's for the same config.json, to the
    byte; a latent vector is (32 + 16) / (4 heads x (32 + 24)) = 21% of the K and V it stands
    for. A quantized latent is refused by name."""
    path, prompts, _ = references["deepseek_v2", 24]
    llm = LLM(model=str(path), dtype="float32", block_size=16, kv_cache_memory="4MiB")
    request = llm.engine.add_request(prompts[0][:33], SamplingParams(max_tokens=2))
    llm.engine.step()
    blocks = llm.kv_stats().per_request_blocks[request.request_id]
    spec = ModelSpec.from_hf_config(path).with_dtype("fp32")
    assert blocks * llm.engine.kv_block_bytes == plan(spec, context=33, device_memory="1GB").kv_bytes_per_sequence
    assert llm.engine.kv_block_bytes == 3 * 16 * 48 * 4
    assert spec.kv_layout.elements / (4 * (16 + 16 + 24)) == pytest.approx(48 / 224)
    with pytest.raises(ConfigError, match="kv_cache_dtype=int8: MLA's latent"):
        LLM(model=str(path), dtype="float32", kv_cache_dtype="int8", kv_cache_memory="4MiB")


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3", "llama"])
def test_yarn_rope_matches_transformers(tiny_model_factory: Callable[..., Path], arch: str) -> None:
    """YaRN (DeepSeek-V2/V3's rotary scaling; Qwen's too): frequencies ramped between beta_fast
    and beta_slow, cos/sin scaled by the attention factor, and DeepSeek's softmax sharpened by
    mscale_all_dim — on prompts past the original 128 positions, transformers' tokens."""
    from transformers import AutoModelForCausalLM

    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
            "mscale": 0.707, "mscale_all_dim": 0.707 if arch != "llama" else 0.5, "beta_fast": 32, "beta_slow": 1}
    path = tiny_model_factory(arch, rope_parameters=yarn)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (140, 200)]
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    want = [reference_greedy(hf, p, GREEDY.max_tokens)[0] for p in prompts]
    llm = LLM(model=str(path), dtype="float32", kv_cache_memory="16MiB")
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want
