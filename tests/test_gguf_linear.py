"""GGUF weights served in their own blocks: each block format repacked and multiplied at every
ISA level against gguf's own float dequantization, the models that load that way, and their
answers against transformers' float reference (the default model and Qwen2.5-Coder-0.5B)."""

from __future__ import annotations

import hashlib
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from kvserve import LLM, SamplingParams
from kvserve.config import ConfigError
from kvserve.engine.loading import LoadedModel, load_model
from kvserve.model.chunked import CHUNKED_MODELS, ChunkedModel, assemble
from kvserve.model.cpu_kernels import cpu_op
from kvserve.model.gguf_file import PACKED_TYPES, GGUFWeight
from kvserve.model.gguf_linear import GGUFEmbedding, GGUFLinear, PackedWeight, packed_weights
from kvserve.model.loader import ModelLoadError
from kvserve.quant.reference import (
    evaluation_tokens,
    fidelity_prompts,
    first_divergence,
    load_reference,
    perplexity,
    reference_logprobs,
)

Q = GGMLQuantizationType
FORMATS = sorted(PACKED_TYPES, key=lambda t: t.value)
K_QUANTS = {Q.Q4_K, Q.Q5_K, Q.Q6_K}  # 256 inputs a block; their sub-scales are rounded into float16


def random_blocks(tensor_type: GGMLQuantizationType, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random blocks of ``tensor_type`` (every code pattern; scales and minimums set to finite
    float16 values of a real model's size), uint8 [rows, bytes per row]."""
    rng = np.random.default_rng(seed)
    per_block, block_bytes = GGML_QUANT_SIZES[tensor_type]
    blocks = rng.integers(0, 256, size=(rows, cols // per_block, block_bytes), dtype=np.uint8)

    def put_half(offset: int, low: float, high: float) -> None:
        values = rng.uniform(low, high, size=(rows, cols // per_block)).astype(np.float16)
        blocks[:, :, offset:offset + 2] = values.view(np.uint8).reshape(rows, cols // per_block, 2)

    if tensor_type == Q.Q6_K:
        put_half(208, 0.001, 0.01)  # d is its last field
    else:
        put_half(0, 0.001, 0.02)
        if tensor_type in (Q.Q4_1, Q.Q5_1):
            put_half(2, -0.1, 0.1)
        elif tensor_type in (Q.Q4_K, Q.Q5_K):
            put_half(2, 0.0005, 0.005)
    return blocks.reshape(rows, -1)


def pack(raw: np.ndarray, tensor_type: GGMLQuantizationType, cols: int) -> PackedWeight:
    return PackedWeight.of(GGUFWeight(torch.from_numpy(raw), tensor_type, (raw.shape[0], cols)))


def unpacked(part: PackedWeight) -> torch.Tensor:
    return cpu_op("gguf_rows")(part.packed, part.kind, part.in_features, torch.arange(part.out_features))


def as_quantized(x: torch.Tensor) -> torch.Tensor:
    """x's rows as gguf_linear quantizes them: per 32 inputs, round(x / s) * s with s = max|x| / 32767."""
    groups = x.float().view(x.shape[0], -1, 32)
    scale = groups.abs().amax(-1, keepdim=True) / 32767
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (torch.round(groups * (1 / scale)) * scale).view_as(x)


@pytest.mark.parametrize("tensor_type", FORMATS, ids=lambda t: t.name)
def test_packed_rows_are_gguf_dequantization(isa: str, tensor_type: GGMLQuantizationType) -> None:
    """gguf_pack keeps every code: its rows equal gguf's float dequantization (K-quants' scales
    within float16's rounding), channels past a tile's end included."""
    cols = 512
    raw = random_blocks(tensor_type, 37, cols)
    reference = torch.from_numpy(gguf_dequantize(raw, tensor_type).reshape(37, cols).astype(np.float32))
    rows = unpacked(pack(raw, tensor_type, cols))
    if tensor_type in K_QUANTS:  # s * code + m, each of s and m rounded by up to 2^-11
        bound = reference.view(37, -1, 16).abs().amax(-1, keepdim=True).expand(-1, -1, 16).reshape(37, cols)
        assert bool(((rows - reference).abs() <= 2**-9 * bound).all())
        assert float((rows - reference).abs().max()) > 0  # rounded, not copied (the tolerance is needed)
    else:
        assert torch.equal(rows, reference)


@pytest.mark.parametrize("tensor_type", FORMATS, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 2, 5, 13, 66])
def test_linear_matches_float_matmul(isa: str, tensor_type: GGMLQuantizationType, rows: int) -> None:
    """gguf_linear = x (as quantized to int16 per 32) @ the packed weight, to float32 rounding, and
    within 1e-4 of the float product: odd channel counts, every row-tile tail, two row blocks."""
    cols = 768 if tensor_type in K_QUANTS else 96
    raw = random_blocks(tensor_type, 21, cols, seed=rows)
    part = pack(raw, tensor_type, cols)
    weight = unpacked(part).double()
    x = torch.randn(rows, cols)
    out = GGUFLinear([part])(x)
    want = as_quantized(x).double() @ weight.T
    scale = float(want.abs().max())
    assert float((out.double() - want).abs().max()) < 2e-5 * scale
    assert float((out.double() - x.double() @ weight.T).abs().max()) < 1e-4 * scale


def test_fused_parts_of_different_formats_and_a_bias(isa: str) -> None:
    """A fused projection whose parts are in different block formats (Qwen's QKV: Q5_0 and Q8_0)
    equals its parts run one by one, concatenated, plus the bias; bf16 inputs give bf16 results."""
    cols = 256
    parts = [pack(random_blocks(t, n, cols, seed=n), t, cols) for t, n in ((Q.Q5_0, 48), (Q.Q8_0, 20), (Q.Q4_K, 16))]
    bias = torch.randn(84)
    x = torch.randn(9, cols)
    fused = GGUFLinear(parts, bias)(x)
    alone = torch.cat([GGUFLinear([part])(x) for part in parts], dim=1) + bias
    torch.testing.assert_close(fused, alone, rtol=1e-6, atol=1e-6)
    in_bf16 = GGUFLinear(parts, bias)(x.bfloat16())
    assert in_bf16.dtype == torch.bfloat16  # the same sums, rounded once into bf16
    torch.testing.assert_close(in_bf16, GGUFLinear(parts, bias)(x.bfloat16().float()).bfloat16(), rtol=0, atol=0)


def test_embedding_reads_the_packed_rows(isa: str) -> None:
    raw = random_blocks(Q.Q5_0, 40, 64)
    part = pack(raw, Q.Q5_0, 64)
    ids = torch.tensor([[3, 39], [0, 3]])
    looked_up = GGUFEmbedding(part, torch.bfloat16)(ids)
    assert looked_up.shape == (2, 2, 64) and looked_up.dtype == torch.bfloat16
    torch.testing.assert_close(looked_up.float(), unpacked(part)[ids].bfloat16().float())


def test_bad_shapes_are_refused(isa: str) -> None:
    raw = random_blocks(Q.Q4_0, 4, 64)
    with pytest.raises(RuntimeError, match="do not hold 96 values"):
        cpu_op("gguf_pack")(torch.from_numpy(raw), int(Q.Q4_0), 96)
    with pytest.raises(RuntimeError, match="not a block format"):
        cpu_op("gguf_pack")(torch.from_numpy(raw), int(Q.F16), 64)
    part = pack(raw, Q.Q4_0, 64)
    with pytest.raises(RuntimeError, match="outside the packed weight"):
        cpu_op("gguf_rows")(part.packed, part.kind, 64, torch.tensor([16]))
    with pytest.raises(RuntimeError, match="does not match in_features"):
        GGUFLinear([part])(torch.randn(2, 96))


# --------------------------------------------------------------------------- models


def test_default_model_keeps_its_blocks(smollm: LoadedModel) -> None:
    """SmolLM2's Q4_1 and Q8_0 weights stay packed: every linear layer and the embedding (the
    tied LM head shares its tensor), about the file's size."""
    model = smollm.model
    assert smollm.weight_format == "gguf Q4_1+Q8_0"
    assert isinstance(model.embed_tokens, GGUFEmbedding) and isinstance(model.lm_head, GGUFLinear)
    assert model.lm_head.parts[0].packed is model.embed_tokens.part.packed
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    file_bytes = smollm.path.stat().st_size
    assert 0.95 * file_bytes < smollm.weight_bytes < 1.1 * file_bytes
    assert sum(p.nbytes for p in packed_weights(model)) < smollm.weight_bytes


def test_widening_is_asked_for_by_name(smollm: LoadedModel, tiny_model_factory: Any) -> None:
    """--quantization none widens to float (nn.Linear in float32); gguf on a folder is refused."""
    widened = load_model("smollm2-135m", torch.device("cpu"), torch.float32, "none")
    assert widened.weight_format == "float32" and not packed_weights(widened.model)
    assert widened.weight_bytes > 4 * smollm.weight_bytes
    with pytest.raises(ConfigError, match="not a GGUF file"):
        load_model(str(tiny_model_factory("llama")), torch.device("cpu"), torch.float32, "gguf")


def check_against_reference(loaded: LoadedModel, reference: Any) -> tuple[int, list[Any], float, float]:
    """40 prompts' 32-token greedy continuations checked token by token against the reference's
    greedy choices, and both perplexities over 1,024 tokens of held-out text."""
    tokenizer = loaded.tokenizer
    prompts = fidelity_prompts(tokenizer, 40)
    llm = LLM(loaded=loaded, quantization=loaded.quantization, kv_cache_memory="256MiB", max_num_seqs=40)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    divergences = [first_divergence(reference, p, o.token_ids) for p, o in zip(prompts, outs, strict=True)]
    tokens = evaluation_tokens(tokenizer, 1024)
    ours = torch.cat([rows for _, rows in llm.engine.score(tokens, 256)])[:-1]
    theirs = reference_logprobs(reference, tokens)
    return sum(d is None for d in divergences), [d for d in divergences if d], perplexity(ours, tokens), \
        perplexity(theirs, tokens)


@pytest.mark.slow
def test_default_model_answers_as_the_float_reference(smollm: LoadedModel, hf_smollm: Any) -> None:
    identical, divergences, ours, theirs = check_against_reference(smollm, hf_smollm)
    assert identical >= 38, divergences  # 95% of 40
    assert all(d.gap < 1e-3 for d in divergences), divergences  # the rest part at numerical ties
    assert abs(ours / theirs - 1) < 0.005


@pytest.fixture(scope="session")
def qwen05() -> LoadedModel:
    try:
        return load_model("qwen2.5-coder-0.5b", torch.device("cpu"), torch.float32)
    except ModelLoadError as exc:
        pytest.fail(f"the qwen05b extra is part of the test install: {exc}")


@pytest.mark.slow
def test_qwen_05b_answers_as_the_float_reference(qwen05: LoadedModel) -> None:
    """Qwen2.5-Coder-0.5B Q4_K_M (Q5_0, Q8_0, Q4_K and Q6_K weights, QKV biases) against
    transformers' float32 model of the same file."""
    assert qwen05.weight_format == "gguf Q5_0+Q8_0+Q6_K+Q4_K"
    identical, divergences, ours, theirs = check_against_reference(qwen05, load_reference(qwen05.path))
    assert identical >= 38, divergences
    assert abs(ours / theirs - 1) < 0.005


@pytest.mark.skipif(os.environ.get("KVSERVE_TEST_1_5B") != "1",
                    reason="opt-in (KVSERVE_TEST_1_5B=1 with the qwen15b extra): a 1.1 GB model")
@pytest.mark.slow
def test_qwen_15b_answers_as_the_float_reference() -> None:
    loaded = load_model("qwen2.5-coder-1.5b", torch.device("cpu"), torch.float32)
    identical, divergences, ours, theirs = check_against_reference(loaded, load_reference(loaded.path))
    assert identical >= 38, divergences
    assert abs(ours / theirs - 1) < 0.005


# --------------------------------------------------------------------------- chunk packages


def test_chunked_model_is_joined_checked_and_refused_when_wrong(tmp_path: Path, monkeypatch: Any) -> None:
    """Parts are joined in order into the cache once and trusted again by their record; a
    join whose hash differs is refused and leaves no file; missing parts are named."""
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    parts = []
    for i, data in enumerate((b"GGUF" + b"a" * 100, b"b" * 50), start=1):
        folder = tmp_path / "site" / f"fake_model_part{i}" / "data"
        folder.mkdir(parents=True)
        (folder.parent / "__init__.py").write_text("")
        (folder / f"part{i:02d}.bin").write_bytes(data)
        parts.append(data)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    joined = b"".join(parts)
    good = ChunkedModel("fake", "fake.gguf", "fake-model-part", "1.0", 2, len(joined),
                        hashlib.sha256(joined).hexdigest(), "fake")
    path = assemble(good, progress=False)
    assert path.read_bytes() == joined and path.parent == tmp_path / "cache" / "models"
    assert assemble(good, progress=False) == path  # the record is trusted
    bad = replace(good, filename="bad.gguf", sha256="0" * 64)
    with pytest.raises(ValueError, match="refusing them"):
        assemble(bad, progress=False)
    assert not (tmp_path / "cache" / "models" / "bad.gguf").exists()
    missing = replace(good, filename="missing.gguf", parts=3)
    with pytest.raises(ValueError, match=r"fake-model-part3==1\.0"):
        assemble(missing, progress=False)
    assert set(CHUNKED_MODELS) == {"qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"}


def test_planner_counts_the_weights_as_served(smollm: LoadedModel, qwen05: LoadedModel) -> None:
    """kvserve plan reads a GGUF's served bytes from its tensor table, without loading it: the
    same figure the engine reports once the model is loaded, and what the KV budget is cut from."""
    from kvserve.plan.planner import plan
    from kvserve.plan.spec import ModelSpec

    for name, loaded in (("smollm2-135m", smollm), ("qwen2.5-coder-0.5b", qwen05)):
        spec = ModelSpec.from_model(name)
        assert spec.served_weight_bytes == loaded.weight_bytes
        report = plan(spec, device_memory="8GB", weight_dtype="fp32")
        assert report.weight_dtype == "gguf" and report.weight_bytes == loaded.weight_bytes
        assert plan(spec, device_memory="8GB", weight_dtype="int8").weight_bytes == spec.params


@pytest.mark.slow
def test_qwen_chat_template_through_the_server(qwen05: LoadedModel) -> None:
    """The chat template the GGUF carries (ChatML) formats /v1/chat/completions: the prompt the
    server ran is the template's, token for token, and the answer ends its turn (<|im_end|>)."""
    import openai

    from kvserve.config import EngineConfig
    from kvserve.model.tokenizer import chat_token_ids
    from kvserve.server.app import ServerConfig
    from kvserve.server.serve import build
    from tests.conftest import serve_in_thread

    name = "qwen2.5-coder-0.5b"
    config = EngineConfig.from_settings(model=name, kv_cache_memory="64MiB", max_num_seqs=4)
    engine, app = build(config, ServerConfig(model_name=name), loaded=qwen05)
    base, stop = serve_in_thread(app)
    try:
        messages = [{"role": "system", "content": "You are a helpful coding assistant."},
                    {"role": "user", "content": "Write a Python function that returns the square of x."}]
        reply = openai.OpenAI(base_url=base + "/v1", api_key="none").chat.completions.create(
            model=name, messages=messages, temperature=0, max_tokens=256)
    finally:
        stop()
        engine.shutdown()
    tokenizer = qwen05.tokenizer  # the same renderings as transformers': test_tokenizer
    prompt = chat_token_ids(tokenizer, messages)
    assert "<|im_start|>system" in tokenizer.decode(prompt) and reply.usage is not None
    assert reply.usage.prompt_tokens == len(prompt)
    answer = reply.choices[0].message.content or ""
    assert "def " in answer and "x" in answer and reply.choices[0].finish_reason == "stop", answer
    assert "<|im_end|>" not in answer
