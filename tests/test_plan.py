"""kvserve plan: the worked examples of BRIEF.md §1, presets (MLA, sliding windows), the
cross-check against the engine's own pool, and bad input."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvserve import LLM
from kvserve.cache.kv_format import KV_DTYPES, KVLayout, kv_block_bytes
from kvserve.cli import main
from kvserve.engine.loading import LoadedModel
from kvserve.plan import ModelSpec, SpecError, plan, preset
from kvserve.plan.planner import kv_blocks_for_budget

GiB = 2**30


def explicit(layers: int, q_heads: int, kv_heads: int, head_dim: int, params: int = 8 * 10**9,
             dtype: str = "fp16") -> ModelSpec:
    return ModelSpec.from_hf_config(
        {"num_hidden_layers": layers, "num_attention_heads": q_heads, "num_key_value_heads": kv_heads,
         "head_dim": head_dim, "hidden_size": q_heads * head_dim, "torch_dtype": "float16"},
        name="explicit", params=params).with_dtype(dtype)


def test_example_a_7b_gqa_fp16() -> None:
    report = plan(explicit(32, 32, 8, 128, params=7 * 10**9), concurrency=32, context=4096,
                  device_memory=80 * 10**9)
    assert report.kv_bytes_per_token == 131072  # 128 KiB
    assert report.kv_bytes_total == 16 * GiB
    assert report.tail_waste_bytes == 0  # 4096 is a whole number of 16-token blocks


def test_example_b_8b_does_not_fit_24gb_and_int8_is_still_over() -> None:
    spec = explicit(36, 40, 8, 128)
    report = plan(spec, concurrency=16, context=8192, device_memory="24GB", gpu_memory_utilization=1.0,
                  activation_memory=4 * 10**9)
    assert report.kv_bytes_per_token == 147456  # 144 KiB
    assert report.kv_bytes_total == 18 * GiB
    assert report.weight_bytes == 16 * 10**9
    assert 39 * 10**9 < report.total_bytes < 40 * 10**9  # "~40 GB"
    assert not report.fits and report.margin_bytes < 0
    int8 = next(w for w in report.what_if if w.kv_dtype == "int8")
    assert 9 * GiB <= int8.kv_bytes_total < 9.5 * GiB  # ~9 GiB, scales included
    assert not int8.fits and 29 * 10**9 < int8.total_bytes < 31 * 10**9  # "~29 GB, still over"
    assert any(line.startswith("INT8 KV") and "still over" in line for line in report.advice)
    assert any(line.startswith("At INT8") and "13 sessions x 4096 tokens" in line for line in report.advice)
    # "or cut to 12 sessions x 4096 tokens": at INT8 they fit
    cut = plan(spec, concurrency=12, context=4096, device_memory="24GB", gpu_memory_utilization=1.0,
               activation_memory=4 * 10**9, kv_dtype="int8")
    assert cut.fits and cut.max_concurrency >= 12


def test_example_c_gqa_8x_and_mqa_64x() -> None:
    per_token = {kv: plan(explicit(80, 64, kv, 128, params=70 * 10**9), device_memory=10**12).kv_bytes_per_token
                 for kv in (64, 8, 1)}
    assert per_token[64] / per_token[8] == 8
    assert per_token[64] / per_token[1] == 64
    assert [explicit(80, 64, kv, 128).attention for kv in (64, 8, 1)] == ["mha", "gqa", "mqa"]


def test_mla_preset_caches_the_latent_only() -> None:
    spec = preset("deepseek-v3")
    assert spec.attention == "mla"
    report = plan(spec, context=131072, device_memory="1TB")
    assert report.kv_bytes_per_token == 61 * (512 + 64) * 2  # 70272 B: no factor 2, no per-head K/V
    mha_equivalent = explicit(61, 128, 128, 192).kv_layout.elements  # what full K/V heads would hold
    assert mha_equivalent / spec.kv_layout.elements > 40
    assert report.kv_bytes_total == 131072 * 70272


def test_sliding_window_layers_cap_at_the_window() -> None:
    gemma = preset("gemma-3-27b")
    assert (gemma.num_sliding_layers, gemma.sliding_window) == (52, 1024)  # every 6th of 62 layers is global
    layer_block = kv_block_bytes(gemma.kv_layout, 1, "bf16", 16)
    report = plan(gemma, context=8192, device_memory="80GB")
    # the engine's KV cache groups: 10 layers each (1 full, 6 sliding, the last holding 2 layers in
    # 10 layers' storage); a sliding group holds cdiv(1023, 16) + 1 = 65 blocks while decoding
    assert report.kv_bytes_per_sequence == (512 + 6 * 65) * 10 * layer_block
    mistral = preset("mistral-7b-v0.1")
    short, long, longer = (plan(mistral, context=c, device_memory="80GB").kv_bytes_per_sequence
                           for c in (4096, 32768, 131072))
    # every layer slides over 4096 tokens: past the window a block more at most (the window straddles one)
    assert long == longer == short + kv_block_bytes(mistral.kv_layout, 32, "bf16", 16)


def test_kv_dtypes_shrink_in_order_and_int4_keeps_a_full_precision_tail() -> None:
    spec = explicit(32, 32, 8, 128)
    sizes = {d: plan(spec, device_memory="80GB", kv_dtype=d).kv_bytes_per_token for d in KV_DTYPES}
    assert sizes["fp32"] == 2 * sizes["fp16"] == 2 * sizes["bf16"]
    assert sizes["fp8_e4m3"] == sizes["fp16"] / 2
    assert sizes["fp16"] / 2 < sizes["int8"] < sizes["fp16"] / 2 * 1.05  # scales cost < 5%
    assert sizes["fp16"] / 4 < sizes["int4"] < sizes["int8"]
    per_block = plan(spec, device_memory="80GB", kv_dtype="int8", key_scales="block").kv_bytes_per_token
    assert per_block - sizes["int8"] == 32 * 8 * 128 * 4 / 16  # a float32 scale per channel per block
    one = plan(spec, context=16, device_memory="80GB", kv_dtype="int4").kv_bytes_per_sequence
    # the fp16 tail block lives in 16 / 4 = 4 pool blocks, taken from the same budget
    assert one == (1 + 4) * kv_block_bytes(spec.kv_layout, 32, "int4", 16)
    assert 4 * kv_block_bytes(spec.kv_layout, 32, "int4", 16) > kv_block_bytes(spec.kv_layout, 32, "fp16", 16)


def test_max_concurrency_and_context_are_tight() -> None:
    spec = explicit(32, 32, 8, 128)
    r = plan(spec, concurrency=10, context=4096, device_memory="40GB", activation_memory=10**9)
    available = r.usable_bytes - r.weight_bytes - r.activation_bytes
    per_seq = r.kv_bytes_per_sequence
    assert r.max_concurrency * per_seq <= available < (r.max_concurrency + 1) * per_seq
    at = plan(spec, concurrency=10, context=r.max_context, device_memory="40GB", activation_memory=10**9)
    over = plan(spec, concurrency=10, context=r.max_context + 16, device_memory="40GB", activation_memory=10**9)
    assert at.fits and not over.fits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [1, 16, 256])
def test_plan_agrees_with_the_engine_pool(dtype: torch.dtype, block_size: int, smollm: LoadedModel,
                                          tiny_model_factory: Callable[..., Path]) -> None:
    """For the engine's own configuration, plan's bytes per token and block count equal what the
    engine allocates (every KV dtype the engine supports today: the model's own, 'auto')."""
    if dtype == torch.float32:
        llm, spec = LLM(loaded=smollm, block_size=block_size, kv_cache_memory="96MiB"), ModelSpec.from_model(
            "smollm2-135m")
    else:
        path = str(tiny_model_factory("qwen2"))
        llm, spec = LLM(path, dtype=str(dtype).removeprefix("torch."), block_size=block_size,
                        kv_cache_memory="8MiB"), ModelSpec.from_model(path)
    engine = llm.engine
    kv_dtype = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    report = plan(spec, device_memory="1TB", kv_dtype=kv_dtype, block_size=block_size)
    assert report.kv_bytes_per_token == engine.kv_bytes_per_token
    budget = int(engine.config.cache_config.kv_cache_memory)
    assert kv_blocks_for_budget(spec, kv_dtype, block_size, budget) == engine.num_blocks
    assert engine.kv_cache.nbytes == engine.num_blocks * block_size * report.kv_bytes_per_token


@pytest.mark.parametrize("kv_dtype,key_scales", [("fp8_e4m3", "static"), ("fp8_e5m2", "static"), ("int8", "block"),
                                                 ("int8", "static"), ("int4", "block"), ("fp16", "static")])
@pytest.mark.parametrize("block_size", [16, 32])
def test_plan_agrees_with_the_engine_for_every_kv_dtype(kv_dtype: str, key_scales: str, block_size: int,
                                                        smollm: LoadedModel, tmp_path: Path) -> None:
    """Quantized pools: plan's bytes per token and per sequence (int4's and per-block int8's
    full-precision tail block included) and its block count equal what the engine allocates."""
    kwargs: dict[str, Any] = {}
    if key_scales == "static" and kv_dtype == "int8":
        from kvserve.cache.kv_scales import KVScales

        cfg = smollm.config
        scales_path = tmp_path / "scales.json"
        KVScales("smollm2-135m", smollm.fingerprint, torch.ones(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim),
                 torch.ones(cfg.num_layers, cfg.num_kv_heads)).save(scales_path)
        kwargs["kv_scales"] = str(scales_path)
    engine = LLM(loaded=smollm, block_size=block_size, kv_cache_memory="64MiB", kv_cache_dtype=kv_dtype,
                 max_num_seqs=8, **kwargs).engine
    spec = ModelSpec.from_model("smollm2-135m")
    report = plan(spec, device_memory="1TB", kv_dtype=kv_dtype, block_size=block_size, key_scales=key_scales,
                  context=1000, weight_dtype="fp32")  # the engine's model dtype: the tail block's dtype
    assert report.kv_bytes_per_token == engine.kv_bytes_per_token
    assert report.kv_bytes_per_sequence == -(-1000 // block_size) * engine.kv_block_bytes + engine.kv_tail_bytes
    memory = int(engine.config.cache_config.kv_cache_memory)
    # tail blocks come out of the pool on demand: the whole budget buys blocks, max_num_seqs is not capped
    assert kv_blocks_for_budget(spec, kv_dtype, block_size, memory, key_scales) == engine.num_blocks
    assert engine.kv_cache.nbytes == engine.num_blocks * engine.kv_block_bytes
    assert engine.scheduler.max_num_seqs == 8


@pytest.mark.parametrize("kv_dtype,key_scales", [("int4", "block"), ("int8", "block"), ("bf16", "static")])
def test_engine_runs_as_many_sequences_as_the_planner_promises(kv_dtype: str, key_scales: str,
                                                               smollm: LoadedModel) -> None:
    """fp32 weights, 64 MiB of KV, 200-token contexts: on a16fa74 the int4 engine ran at most 9
    sequences (tail slots capped at a tenth of the budget) where the planner allowed 28. Now
    tails are drawn from the pool like blocks, and the engine fits what the planner promises
    (less at most one sequence: tail runs must be aligned): 25, since a tail now costs the
    blocks whose bytes it uses, per-block scale bytes included."""
    from kvserve.plan.planner import _Sizer

    engine = LLM(loaded=smollm, kv_cache_memory="64MiB", kv_cache_dtype=kv_dtype, max_num_seqs=256).engine
    spec = ModelSpec.from_model("smollm2-135m").with_dtype("fp32")  # the engine runs fp32 weights
    promised = _Sizer(spec, kv_dtype, 16, key_scales).max_concurrency(64 * 2**20, 200)
    manager = engine.kv_manager
    fitted = 0
    while manager.allocate_slots(f"r{fitted}", 200):
        fitted += 1
    assert promised - 1 <= fitted <= promised
    if kv_dtype == "int4":  # a tail takes 8 blocks (their unused scale bytes included): 21 blocks a sequence
        assert fitted == 528 // 21 and manager.stats().tail_slots_used == fitted
    stats = manager.stats()
    assert stats.tail_blocks_used == fitted * engine.tail_blocks
    assert stats.blocks_used == fitted * (13 + engine.tail_blocks)  # cdiv(200, 16) = 13 blocks each
    for i in range(fitted):
        manager.free(f"r{i}")
    assert manager.stats().blocks_used == 0


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["plan", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_json_has_stable_keys(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "--layers", "36", "--q-heads", "40", "--kv-heads", "8", "--head-dim", "128",
                        "--params", "8B", "--dtype", "fp16", "--concurrency", "16", "--context", "8192",
                        "--device-memory", "24GB", "--json")
    data: dict[str, Any] = json.loads(out)
    assert code == 0  # the verdict is data: exit 0 although it does not fit
    assert data["schema_version"] == 1 and data["fits"] is False
    assert data["kv_bytes_per_token"] == 147456 and data["kv_bytes_total"] == 18 * GiB
    expected = {"model", "concurrency", "context", "block_size", "kv_dtype", "weight_dtype", "device_memory_bytes",
                "gpu_memory_utilization", "usable_bytes", "kv_bytes_per_sequence", "tail_waste_bytes",
                "weight_bytes", "activation_bytes", "total_bytes", "margin_bytes", "max_concurrency", "max_context",
                "what_if", "advice"}
    assert expected <= set(data)
    assert {w["kv_dtype"] for w in data["what_if"]} >= {"fp16", "fp8_e4m3", "int8", "int4"}


def test_cli_table_for_the_default_model(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "--model", "smollm2-135m", "--concurrency", "64", "--context", "2048",
                        "--device-memory", "16GB")
    assert code == 0
    assert "23,040" in out  # 30 layers x 3 KV heads x 64 x 2 (K, V) x 2 bytes (bf16)
    assert "fits" in out and "what if" in out


@pytest.mark.parametrize("args,message", [
    (["--preset", "llama-3.1-8b", "--concurrency", "0"], "concurrency must be positive, got 0"),
    (["--preset", "llama-3.1-8b", "--context", "-5"], "context must be positive, got -5"),
    (["--preset", "gpt-5"], "unknown preset 'gpt-5' (known: llama-3.1-8b"),
    (["--preset", "qwen3-8b", "--kv-cache-dtype", "int3"], "unknown KV cache dtype 'int3'"),
    (["--preset", "qwen3-8b", "--device-memory", "lots"], "'lots'"),
    (["--layers", "32", "--q-heads", "32"], "need --head-dim"),
    (["--preset", "qwen3-8b", "--params", "-1"], "--params must be positive"),
    (["--preset", "qwen3-8b", "--block-size", "24"], "block_size must be a power of two, got 24"),
    (["--preset", "qwen3-8b", "--model", "smollm2-135m"], "give one model source"),
])
def test_cli_bad_input_exits_2_naming_the_value(capsys: pytest.CaptureFixture[str], args: list[str],
                                                message: str) -> None:
    code, _, err = _run(capsys, *args, "--device-memory", "24GB") if "--device-memory" not in args else _run(
        capsys, *args)
    assert code == 2 and message in err


def test_config_without_needed_fields_says_which(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": 4096}))
    code, _, err = _run(capsys, "--model", str(config), "--device-memory", "24GB")
    assert code == 2 and "num_hidden_layers" in err and "num_attention_heads" in err
    with pytest.raises(SpecError, match="num_heads=10 is not a multiple of num_kv_heads=3"):
        explicit(4, 10, 3, 64)


def test_spec_from_hf_config_file_and_gqa_layout(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
                                  "hidden_size": 1024, "head_dim": 128, "intermediate_size": 3072,
                                  "vocab_size": 151936, "tie_word_embeddings": True, "torch_dtype": "bfloat16"}))
    spec = ModelSpec.from_hf_config(config)
    assert spec.kv_layout == KVLayout.standard(8, 128) and spec.dtype == "bf16"
    assert 0.5e9 < spec.params < 0.8e9  # Qwen3-0.6B-shaped: ~0.6 B


def test_plan_counts_the_host_tier(capsys: pytest.CaptureFixture[str]) -> None:
    spec = explicit(32, 32, 8, 128)
    report = plan(spec, context=4096, device_memory="80GB", kv_dtype="int4", kv_offload_memory="8GiB")
    per_seq = 4096 // 16 * kv_block_bytes(spec.kv_layout, 32, "int4", 16)  # whole blocks, no tail
    assert report.kv_offload_memory_bytes == 8 * 2**30 and report.tier_sessions == 8 * 2**30 // per_seq
    assert any("Tier 1" in line and f"{report.tier_sessions} more sessions" in line for line in report.advice)
    assert plan(spec, device_memory="80GB").tier_sessions == 0
    disk = plan(spec, context=4096, device_memory="80GB", kv_dtype="int4", kv_offload_disk_size="100GiB")
    assert disk.disk_sessions == 100 * 2**30 // per_seq and any("Tier 2" in line for line in disk.advice)
    code, out, _ = _run(capsys, "--preset", "llama-3.1-8b", "--device-memory", "24GB", "--kv-offload-memory", "8GiB",
                        "--json")
    assert code == 0 and json.loads(out)["tier_sessions"] > 0
