"""kvserve calibrate / eval on the real model: the scales file and its checks, the drift watch,
the quality report, and bad input."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.cache.kv_format import KVLayout, kv_block_bytes
from kvserve.cache.kv_scales import KVScales
from kvserve.cli import main
from kvserve.config import ConfigError
from kvserve.engine.loading import LoadedModel, load_model
from kvserve.quant.calibrate import calibrate, check
from kvserve.quant.data import python_reference, stdlib_docstrings
from kvserve.quant.evaluate import evaluate, parse_variants

SHORT = [{"text": "The cat sat on the mat."}, {"messages": [{"role": "user", "content": "Hi there, how are you?"}]},
         {"text": "Water boils at one hundred degrees Celsius at sea level."}]


@pytest.fixture(scope="module")
def scales_file(smollm: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    llm = LLM(loaded=smollm, kv_cache_memory="64MiB", enable_prefix_caching=False)
    data = tmp_path_factory.mktemp("calib") / "calib.jsonl"
    data.write_text("\n".join(json.dumps(s) for s in SHORT) + "\n")
    scales = calibrate(llm, str(data), num_samples=8, max_length=64, progress=False)
    path = data.with_name("scales.json")
    scales.save(path)
    return path


def test_scales_file_has_metadata_and_is_used_as_static_int8_key_scales(scales_file: Path,
                                                                         smollm: LoadedModel) -> None:
    obj = json.loads(scales_file.read_text())
    assert obj["model"]["num_layers"] == 30 and obj["model"]["num_kv_heads"] == 3 and obj["model"]["head_dim"] == 64
    assert obj["num_samples"] == 3 and obj["lengths"]["count"] == 3 and obj["lengths"]["max"] <= 64
    scales = KVScales.load(scales_file)
    assert scales.key_absmax.shape == (30, 3, 64) and (scales.key_absmax > 0).all()
    assert len(scales.key_norm_max) == 30
    engine = LLM(loaded=smollm, kv_cache_memory="32MiB", kv_cache_dtype="int8", kv_scales=str(scales_file)).engine
    layer = engine.kv_cache.layers[0]
    assert layer.tail is None and layer.key_scales is not None and layer.key_scales.shape == (3, 64)
    torch.testing.assert_close(layer.key_scales, scales.key_absmax[0] / 127)
    # static key scales: no per-block key scales and no tail, so bytes follow the "static" formula
    assert engine.kv_block_bytes == kv_block_bytes(KVLayout.standard(3, 64), 30, "int8", 16, key_scales="static")
    assert engine.kv_tail_bytes == 0


def test_scales_from_another_model_are_rejected(scales_file: Path, tiny_model_factory: Callable[..., Path]) -> None:
    path = str(tiny_model_factory("llama"))
    with pytest.raises(ConfigError, match="run kvserve calibrate for this model"):
        LLM(path, kv_cache_memory="2MiB", kv_cache_dtype="int8", kv_scales=str(scales_file))


def test_check_warns_when_lengths_and_key_ranges_differ(scales_file: Path, smollm: LoadedModel,
                                                        tmp_path: Path) -> None:
    """Calibrated on three short chats, checked against long reference-manual text: both the
    length mismatch and keys beyond the calibrated range are reported."""
    llm = LLM(loaded=smollm, kv_cache_memory="64MiB", enable_prefix_caching=False)
    long_text = tmp_path / "long.txt"
    long_text.write_text("\n\n".join(python_reference()[:4]))
    report = check(llm, KVScales.load(scales_file), str(long_text), num_samples=2, max_length=512,
                   progress=False, pack=True)
    assert report.lengths["p50"] == 512
    assert any("token lengths differ" in w for w in report.warnings)
    assert report.key_clip_ratio > 0.001 and any("beyond the calibrated" in w for w in report.warnings)
    same = tmp_path / "same.jsonl"
    same.write_text(json.dumps(SHORT[0]) + "\n")
    assert check(llm, KVScales.load(scales_file), str(same), num_samples=8, max_length=64,
                 progress=False).warnings == []


def test_drift_watch_counts_clipped_keys_and_warns_once(scales_file: Path, smollm: LoadedModel,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    llm = LLM(loaded=smollm, kv_cache_memory="32MiB", kv_cache_dtype="int8", kv_scales=str(scales_file))
    prompts = ["\n\n".join(python_reference()[:2])[:3000], "Tell me about the history of the printing press."]
    logger = logging.getLogger("kvserve")  # it does not propagate to the root logger caplog watches
    logger.addHandler(caplog.handler)
    try:
        llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0))
        llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0))
    finally:
        logger.removeHandler(caplog.handler)
    ratio = llm.kv_stats().clip_ratio
    assert 0.001 < ratio < 0.5
    assert sum("KV scales drift" in r.message for r in caplog.records) == 1


def test_eval_chunk_1_scores_each_token_in_a_decode_step(smollm_float: LoadedModel,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """--chunk 1 runs every token as a decode step (the decode kernels): over the fp32 pool it
    scores what one prefill chunk scores, to float32 rounding; over int4 every token reads all the
    earlier ones quantized, where one prefill chunk reads its own tokens' K/V at full precision,
    so the two differ. --chunk 0 is refused, naming the value."""
    smollm = smollm_float  # float32 weights: the two paths agree to float32 rounding
    assert smollm.tokenizer is not None
    tokens = list(smollm.tokenizer.encode(" ".join(stdlib_docstrings()[:4])))[:41]
    decode, prefill = (evaluate(smollm, "smollm2-135m", tokens, parse_variants("auto,int4"), context=41, chunk=chunk,
                                kv_scales=None, kv_cache_memory="64MiB", block_size=16, progress=False)
                       for chunk in (1, 41))
    assert [r.tokens for r in decode + prefill] == [40] * 4
    assert decode[0].ppl == pytest.approx(prefill[0].ppl, rel=1e-5)
    assert decode[1].ppl != pytest.approx(prefill[1].ppl, rel=1e-3)
    assert decode[1].ppl == pytest.approx(decode[0].ppl, rel=0.1)
    assert main(["eval", "--chunk", "0"]) == 2 and "--chunk must be at least 1, got 0" in capsys.readouterr().err


def test_eval_runs_a_bf16_model(smollm: LoadedModel) -> None:
    """eval's logits come from the runner's inference tensors: with a bf16 model and a plain
    nn.Linear LM head (CPUs without AVX512-BF16) they once failed in autograd ("Inference
    tensors cannot be saved for backward"). Its perplexity is the float32 model's, near enough."""
    assert smollm.tokenizer is not None
    tokens = list(smollm.tokenizer.encode(" ".join(stdlib_docstrings()[:4])))[:41]
    bf16 = load_model("smollm2-135m", torch.device("cpu"), torch.bfloat16)
    ppl = [evaluate(loaded, "smollm2-135m", tokens, parse_variants("auto"), context=41, chunk=41, kv_scales=None,
                    kv_cache_memory="64MiB", block_size=16, progress=False)[0].ppl for loaded in (bf16, smollm)]
    assert ppl[0] == pytest.approx(ppl[1], rel=0.05)


def test_eval_reports_quality_memory_and_concurrency(tmp_path: Path, scales_file: Path,
                                                     capsys: pytest.CaptureFixture[str], isa: str) -> None:
    """The quantized-KV quality bounds hold at every ISA level (each level's kernels read the
    pools). The portable level widens the weights: its GGUF matmul is scalar code, 26x the
    AVX2 level's time on this test, and the weights' kernels are tested on their own."""
    text = tmp_path / "heldout.txt"
    text.write_text("\n\n".join(stdlib_docstrings()[:40]))
    out = tmp_path / "report"
    widened = ["--quantization", "none"] if isa == "portable" else []
    code = main(["eval", "--data", str(text), "--num-tokens", "512", "--context", "256", "--chunk", "96",
                 "--kv-cache-dtype", "auto,fp16,fp8_e4m3,int8,int8:block,int4", *widened,
                 "--kv-scales", str(scales_file), "--kv-cache-memory", "64MiB", "--out", str(out), "--quiet"])
    assert code == 0
    result = json.loads((out / "results.json").read_text())
    rows = {r["name"]: r for r in result["results"]}
    assert result["tokens"] == 512 and rows["auto"]["tokens"] == 510  # two windows of 255 predictions
    assert rows["auto"]["delta_ppl_pct"] == 0 and rows["auto"]["mean_kl"] == 0 and rows["auto"]["top1_agreement"] == 1
    for name in ("fp8_e4m3", "int8", "int4"):
        assert 0 < rows[name]["mean_kl"] < 0.2 and rows[name]["top1_agreement"] > 0.8
    assert rows["fp16"]["mean_kl"] < rows["int8"]["mean_kl"]
    assert rows["int8"]["bytes_vs_fp16"] <= 0.52 and rows["int4"]["bytes_vs_fp16"] < 0.35
    # at 256 tokens with fp32 weights, int4's full-precision tail (8 pool blocks) eats its lead over int8
    assert rows["int4"]["max_concurrency"] >= rows["int8"]["max_concurrency"] > rows["fp16"]["max_concurrency"]
    assert (out / "eval.png").stat().st_size > 1000 and "| int4 |" in (out / "report.md").read_text()
    assert "ΔPPL" in capsys.readouterr().out


def test_eval_scores_kv_eviction(tmp_path: Path) -> None:
    """SmolLM2 on 512-token windows of held-out text, chunks of 32: a streaming window as long
    as the text changes nothing; a 64-token window costs perplexity and holds 4x the sequences.
    SnapKV keeping the whole prompt (the first 256 tokens) changes nothing; keeping a quarter
    costs a little and holds 1.6x the sequences (20 blocks against 32). In an int8 pool the same
    eviction costs about what int8 alone costs, on top, and holds more sequences still."""
    text = tmp_path / "heldout.txt"
    text.write_text("\n\n".join(stdlib_docstrings()[:40]))
    out = tmp_path / "report"
    assert main(["eval", "--data", str(text), "--num-tokens", "512", "--context", "512", "--chunk", "32",
                 "--kv-cache-dtype", "auto,int8", "--kv-eviction", "none,streaming,snapkv", "--kv-window", "64,1024",
                 "--kv-compression-ratio", "1,0.25", "--kv-cache-memory", "64MiB", "--out", str(out), "--quiet"]) == 0
    rows = {r["name"]: r for r in json.loads((out / "results.json").read_text())["results"]}
    assert rows["auto streaming 1024"]["mean_kl"] == 0 and rows["auto streaming 1024"]["delta_ppl_pct"] == 0
    evicting = rows["auto streaming 64"]
    assert evicting["mean_kl"] > 0.01 and evicting["delta_ppl_pct"] > 1 and evicting["top1_agreement"] < 1
    assert evicting["max_concurrency"] >= 4 * rows["auto"]["max_concurrency"]
    assert rows["auto snapkv 1"]["mean_kl"] == 0 and rows["auto snapkv 1"]["delta_ppl_pct"] == 0
    compressed = rows["auto snapkv 0.25"]
    assert compressed["mean_kl"] > 0.001 and compressed["top1_agreement"] < 1
    assert compressed["mean_kl"] < evicting["mean_kl"]  # only the second half reads a compressed prompt
    assert compressed["max_concurrency"] >= 1.5 * rows["auto"]["max_concurrency"]
    for name in ("streaming 64", "snapkv 0.25"):
        alone, both = rows[f"auto {name}"], rows[f"int8 {name}"]
        assert both["mean_kl"] <= 1.2 * alone["mean_kl"] + rows["int8"]["mean_kl"]
        assert both["max_concurrency"] > alone["max_concurrency"]


@pytest.mark.parametrize("args,message", [
    (["eval", "--kv-eviction", "none,snap"], "--kv-eviction 'snap': expected one of none, streaming, snapkv"),
    (["eval", "--kv-eviction", "snapkv", "--kv-compression-ratio", "0.5,2"], "--kv-compression-ratio '0.5,2'"),
    (["eval", "--kv-eviction", "streaming", "--kv-window", "64,x"], "--kv-window '64,x'"),
    (["eval", "--kv-cache-dtype", "auto,int9"], "unknown KV cache dtype 'int9'"),
    (["eval", "--kv-cache-dtype", "int8:perchannel"], "key scales must be one of"),
    (["calibrate"], "give --data"),
    (["calibrate", "--data", "nope.jsonl"], "'nope.jsonl' is neither a file"),
    (["generate", "hi", "--kv-cache-dtype", "int3"], "unknown KV cache dtype 'int3'"),
    (["generate", "hi", "--kv-cache-dtype", "int8", "--kv-scales", "missing.json"], "does not exist"),
    (["generate", "hi", "--kv-cache-dtype", "int4", "--kv-key-scales", "static", "--kv-scales", "x.json"],
     "does not exist"),
])
def test_bad_quantization_input_names_the_value(args: list[str], message: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert main(args) == 2
    assert message in capsys.readouterr().err
