"""Hadamard rotations for the int8 model (kvserve.model.rotation): the block matrix, and the
residual stream turned at load computing the same function on every Llama-family layout."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import kvserve.engine.loading as loading
from kvserve import LLM
from kvserve.engine.loading import LoadedModel, load_model
from kvserve.model.rotation import (
    hadamard_block,
    residual_stream_rotatable,
    rotate_residual_stream,
    rotate_rows,
    run_time_rotations,
)
from kvserve.quant.evaluate import next_token_logprobs


@pytest.mark.parametrize(("features", "block"), [(576, 64), (640, 128), (1536, 128), (100, 4), (96, 32)])
def test_hadamard_block_is_orthogonal(features: int, block: int) -> None:
    """The rotation's block: the largest power of two dividing the features, at most 128; +-1
    entries with H H^T = b I, so the turned rows keep their norm (times sqrt(b))."""
    h = hadamard_block(features)
    assert h.shape == (block, block) and set(h.unique().tolist()) == {-1.0, 1.0}
    assert torch.equal(h @ h.t(), block * torch.eye(block))
    x = torch.randn(3, features)
    torch.testing.assert_close(rotate_rows(x, h).norm(dim=1), x.norm(dim=1) * block**0.5)


def _logprobs(loaded: LoadedModel, tokens: list[int]) -> torch.Tensor:
    llm = LLM(loaded=loaded, kv_cache_memory="4MiB", max_model_len=256, block_size=16)
    return next_token_logprobs(llm.engine, tokens, 16)


@pytest.mark.parametrize(("arch", "overrides"), [("llama", {}), ("qwen2", {}), ("qwen3", {}), ("mistral", {}),
                                                 ("llama", {"hidden_size": 96})])
def test_rotated_residual_stream_computes_the_same_function(arch: str, overrides: dict[str, int],
                                                            tiny_model_factory: Callable[..., Path],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Untied (llama) and tied heads, QKV bias (qwen2), q/k norms (qwen3), one KV head (mistral),
    and a hidden size of 96 (blocks of 32): the turned model's next-token log-probabilities equal
    the original's (float32) though every norm weight is now one and every stream weight moved.
    (The models load with plain nn.Linear layers, as load_model has them when it turns an int8
    model's stream, before any packing.)"""
    monkeypatch.setattr(loading, "pack_linears_for_cpu", lambda model: False)
    path = str(tiny_model_factory(arch, **overrides))
    original = load_model(path, torch.device("cpu"), torch.float32)
    turned = load_model(path, torch.device("cpu"), torch.float32)
    embedding = turned.model.embed_tokens.weight.clone()
    assert residual_stream_rotatable(turned.model) and rotate_residual_stream(turned.model)
    model = turned.model
    assert (model.norm == 1).all() and all((layer.input_layernorm == 1).all() and (layer.ffn_norm == 1).all()
                                           for layer in model.layers)
    assert not torch.allclose(model.embed_tokens.weight, embedding)
    assert model.lm_head.weight.data_ptr() != model.embed_tokens.weight.data_ptr()
    tokens = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    torch.testing.assert_close(_logprobs(turned, tokens), _logprobs(original, tokens), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["gemma3_text", "deepseek_v2"])
def test_other_layouts_keep_their_stream(arch: str, tiny_model_factory: Callable[..., Path]) -> None:
    """Gemma's norms on the layer outputs sit between the writer and the stream, MLA and MoE read
    it elsewhere: their stream stays as it is, and where the head is a linear layer its input is
    turned at run time instead (a Llama-family layer's down projection always is)."""
    loaded = load_model(str(tiny_model_factory(arch)), torch.device("cpu"), torch.float32)
    before = {name: p.clone() for name, p in loaded.model.named_parameters()}
    assert not residual_stream_rotatable(loaded.model) and not rotate_residual_stream(loaded.model)
    assert all(torch.equal(p, before[name]) for name, p in loaded.model.named_parameters())
    turned_at_run_time = run_time_rotations(loaded.model, stream_rotated=False)
    downs = [layer.down_proj for layer in loaded.model.layers if arch == "gemma3_text"]
    assert list(turned_at_run_time) == [*downs, loaded.model.lm_head]
