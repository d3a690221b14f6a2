"""--quantization int8: W8A8 linear layers equal the int8 product they stand for, on every path,
and the real model still answers with them."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import kvserve.engine.loading as loading_module
import kvserve.model.int8_linear as int8_linear
from kvserve import LLM, SamplingParams
from kvserve.config import ConfigError, EngineConfig
from kvserve.engine.loading import LoadedModel, load_model
from kvserve.model.cpu_kernels import cpu_op
from kvserve.model.int8_linear import (
    Int8Embedding,
    Int8Linear,
    _quantize_rows_torch,
    fuse_norms_into_int8,
    quantize_linears,
    quantize_rows,
)
from kvserve.model.llama import PackedLinear
from kvserve.model.rotation import rotate_rows
from kvserve.quant.data import python_reference
from kvserve.quant.evaluate import next_token_logprobs

# the builds with kvserve's int8 GEMM: 16-bit pairs in portable and avx2, VNNI in avx512, and in amx
# VNNI below 8 rows, AMX tiles from 8 (where in_features is a multiple of 64)
kernel_levels = pytest.mark.isa_levels("portable", "avx2", "avx512", "amx")
# relative error of the output's last rounding: bf16 rounds twice (oneDNN's result, then the row scale)
ROUNDING = {torch.float32: 1e-5, torch.bfloat16: 2 * 2**-8, torch.float16: 2 * 2**-11}


def _rows(dtype: torch.dtype, m: int, k: int) -> torch.Tensor:
    torch.manual_seed(m)
    x = torch.randn(m, k) * torch.linspace(0.1, 8, k)  # channels of different ranges, as in a real model
    x[0] = 0.0  # an all-zero row: scale 1, codes 0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset", [False, True])
def test_quantize_rows_kernel_matches_torch(dtype: torch.dtype, offset: bool, isa: str) -> None:
    x = _rows(dtype, 37, 100)  # 100: a row not a multiple of 16
    codes, scales = quantize_rows(x, offset)
    ref_codes, ref_scales = _quantize_rows_torch(x, offset)
    assert codes.dtype == (torch.uint8 if offset else torch.int8) and codes.shape == x.shape
    torch.testing.assert_close(scales, ref_scales, rtol=1e-6, atol=0)
    assert scales[0] == 1.0 and (codes[0].int() == (128 if offset else 0)).all()
    diff = (codes.int() - ref_codes.int()).abs()
    # x * (1 / s) against x / s: a value within an ulp of a rounding tie may go either way
    assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-3
    signed = codes.int() - 128 if offset else codes.int()
    assert signed.abs().max() == 127  # every nonzero row spans the int8 range
    assert ((signed.float() * scales[:, None] - x.float()).abs() <= scales[:, None] / 2 * 1.0001).all()


def _reference(linear: nn.Linear, x: torch.Tensor, weight_max: int = 127) -> torch.Tensor:
    """float64 of (x_codes @ codes.T) * x_scales * weight_scales + bias from the same codes
    (weight codes in +-weight_max)."""
    codes, weight_scales = quantize_rows(linear.weight.detach(), max_code=weight_max)
    x_codes, x_scales = quantize_rows(x.reshape(-1, x.shape[-1]))
    out = (x_codes.double() @ codes.double().t()) * x_scales.double()[:, None] * weight_scales.double()
    if linear.bias is not None:
        out += linear.bias.detach().double()
    return out.view(*x.shape[:-1], -1)


def _assert_within_rounding(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, rounds: int = 1,
                         slack: float = 1e-5) -> None:
    """out within ``rounds`` roundings into ``dtype`` of the largest expected value of its row."""
    tol = ROUNDING[dtype] * rounds / 2 * expected.abs().amax(dim=-1, keepdim=True)
    assert ((out.double() - expected).abs() <= tol + slack).all(), (out.double() - expected).abs().max()


def _kernel_available() -> bool:
    return int8_linear._kernel_pack(torch.ones(16, 8, dtype=torch.int8), torch.ones(16)) is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("out_features", [72, 144])
@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("in_features", [96, 192])
@kernel_levels
def test_int8_kernel_is_the_rescaled_int8_product(dtype: torch.dtype, bias: bool, out_features: int, rotate: bool,
                                                  in_features: int, isa: str) -> None:
    """kvserve's C++ int8 GEMM (VNNI at avx512, 16-bit pairs at avx2 and portable, AMX tiles at
    amx for 40 rows of 192 inputs) computes the int8 product exactly and rounds only at the end,
    within ~2% of the float layer. 72 outputs: a partial group of 16 channels; 144: nine groups,
    so each of two threads runs a 4-group panel and a narrower one; 40 rows: tiles and a tail.
    With ``rotate`` the product is that of the rotated rows and weight (the kernel turns the rows
    in C++), and still the layer's."""
    layer = _check_int8_layer(dtype, bias, out_features, rotate, in_features=in_features, rounds_twice=False)
    assert layer.kernel_packed is not None and layer.packed is None and layer.codes is None
    assert layer.weight_max == 127


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("path", ["onednn", "onednn7", "fallback"])
@pytest.mark.parametrize("out_features", [72, 144])
@pytest.mark.parametrize("rotate", [False, True])
def test_int8_linear_without_the_kernel_is_the_rescaled_int8_product(dtype: torch.dtype, bias: bool, path: str,
                                                                     out_features: int, rotate: bool,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Without kvserve's int8 GEMM: the oneDNN path (packed weight; 8-bit weight codes where its
    sums are exact here, else 7-bit ones; onednn7: 7-bit forced) and the fallback (_int_mm or
    float sums, torch ops) compute the int8 product of their codes exactly, round only at the end
    (oneDNN twice), and stay within ~2% of the float layer; the rows are turned in torch."""
    native_max = int8_linear._onednn_weight_max()
    assert native_max in (127, 63), "this torch build has no quantized oneDNN linear"
    monkeypatch.setattr(int8_linear, "_kernel_pack", lambda codes, scales: None)
    if path == "onednn7":
        monkeypatch.setattr(int8_linear, "_onednn_weight_max", lambda: 63)
    if path == "fallback":
        monkeypatch.setattr(int8_linear, "_onednn_weight_max", lambda: None)
    layer = _check_int8_layer(dtype, bias, out_features, rotate, in_features=96, rounds_twice=path.startswith("onednn"))
    assert layer.kernel_packed is None
    assert (layer.packed is not None) == path.startswith("onednn") and (layer.codes is not None) == (path == "fallback")
    assert layer.weight_max == {"onednn": native_max, "onednn7": 63, "fallback": 127}[path]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_features", [24, 48, 96, 192, 384])
@kernel_levels
def test_int8_kernel_turns_rows_by_every_block_size(dtype: torch.dtype, in_features: int, isa: str) -> None:
    """The C++ kernel's own Hadamard turn for each block size hadamard_block picks: 8 (24
    features: the scalar path), then 16, 32, 64 and 128 (at avx512 the vector paths, one register
    block each), against the float turn of rows and weight."""
    assert _check_int8_layer(dtype, False, 40, True, in_features, rounds_twice=False).kernel_packed is not None


def _check_int8_layer(dtype: torch.dtype, bias: bool, out_features: int, rotate: bool, in_features: int,
                      rounds_twice: bool) -> Int8Linear:
    """An Int8Linear of a random layer against the exact int8 product of the (turned) rows and
    weight, for 2, 7 and 40 rows; returns the layer."""
    torch.manual_seed(0)
    linear = nn.Linear(in_features, out_features, bias=bias).to(dtype)
    layer = Int8Linear(linear, rotate_input=rotate)
    assert (layer.rotation is not None) == rotate
    # the product the layer stands for: rotated, a float32 layer of the turned weight on turned rows
    turn = layer.rotation
    ref_linear = linear if turn is None else nn.Linear(in_features, out_features, bias=bias)
    if turn is not None:
        with torch.no_grad():
            ref_linear.weight.copy_(rotate_rows(linear.weight.detach(), turn) / turn.shape[0])
            if bias:
                ref_linear.bias.copy_(linear.bias.detach())
    for m in (2, 7, 40):  # row 0 is all zeros
        x = _rows(dtype, m, in_features).view(1, m, in_features)
        out = layer(x)
        assert out.dtype == dtype and out.shape == (1, m, out_features)
        turned = x if turn is None else rotate_rows(x.view(m, in_features), turn).view(1, m, in_features)
        ref = _reference(ref_linear, turned, layer.weight_max)
        # rounding of the largest output: the C++ kernel and the fallback round once, oneDNN's path twice
        _assert_within_rounding(out, ref, dtype, rounds=2 if rounds_twice else 1, slack=1e-6)
        float_out = nn.functional.linear(x.float(), linear.weight.float(), None if linear.bias is None
                                         else linear.bias.float())
        assert ((out.float() - float_out).norm() / float_out.norm()) < 0.02
    return layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@kernel_levels
def test_fused_swiglu_is_silu_of_the_int8_products(dtype: torch.dtype, bias: bool, isa: str) -> None:
    """Int8Linear.fuse_silu (C++ kernel): silu(gate) * up of the exact rescaled int8 products
    (float32 inside), rounded once into the model dtype; rows 2, 7 and 40 (tiles and tails),
    160 outputs (5 pairs of 16-channel groups: uneven shares of pairs between two threads)."""
    torch.manual_seed(1)
    linear = nn.Linear(96, 160, bias=bias).to(dtype)
    layer = Int8Linear(linear)
    assert layer.fuse_silu() and layer.gated
    for m in (2, 7, 40):
        x = _rows(dtype, m, 96).view(1, m, 96)
        gate, up = _reference(linear, x).chunk(2, dim=-1)
        expected = nn.functional.silu(gate) * up
        out = layer(x)
        assert out.shape == (1, m, 80) and out.dtype == dtype
        _assert_within_rounding(out, expected, dtype)


@pytest.mark.parametrize("gated", [False, True])
@kernel_levels
def test_int8_kernel_over_blocks_of_rows_and_weights(gated: bool, isa: str) -> None:
    """A prefill-sized int8 layer: 200 rows (the avx2 kernel's 96-row blocks, its 6-row tiles and
    their tails) of 4,096 inputs (its weights in blocks of 4 groups of 16 channels, so 144 outputs
    or 80 gated pairs cross three blocks) are the exact rescaled int8 products, rounded once."""
    torch.manual_seed(2)
    out_features = 160 if gated else 144
    linear = nn.Linear(4096, out_features, bias=True)
    layer = Int8Linear(linear)
    assert layer.kernel_packed is not None and layer.fuse_silu() == gated
    x = _rows(torch.float32, 200, 4096).view(1, 200, 4096)
    expected = _reference(linear, x)
    if gated:
        gate, up = expected.chunk(2, dim=-1)
        expected = nn.functional.silu(gate) * up
    out = layer(x)
    assert out.shape == expected.shape
    _assert_within_rounding(out, expected, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_delta", [False, True])
@pytest.mark.parametrize("gated", [False, True])
@kernel_levels
def test_int8_layer_after_norm_is_the_layer_of_the_normed_rows(dtype: torch.dtype, with_delta: bool,
                                                               gated: bool, isa: str) -> None:
    """forward_after_norm (C++ kernel): the residual gains delta in place, rounded as
    add_rms_norm stores it; the output is the exact int8 product of the rows' RMS norms (unit
    weight), rounded once, and gated the same with silu(gate) * up."""
    torch.manual_seed(2)
    linear = nn.Linear(96, 64, bias=False).to(dtype)
    layer = Int8Linear(linear)
    assert layer.takes_residual() and (not gated or layer.fuse_silu())
    for m in (2, 7, 40):
        residual = _rows(dtype, m, 96) * 3
        delta = torch.randn(m, 96).to(dtype) if with_delta else None
        expected_residual = residual if delta is None else (residual.float() + delta.float()).to(dtype)
        out = layer.forward_after_norm(residual, delta, 1e-6)
        assert torch.equal(residual, expected_residual)
        rows = residual.double()
        normed = rows / (rows.pow(2).mean(dim=1, keepdim=True) + 1e-6).sqrt()
        expected = _reference(linear, normed)
        if gated:
            gate, up = expected.chunk(2, dim=-1)
            expected = nn.functional.silu(gate) * up
        assert out.shape == (m, 32 if gated else 64) and out.dtype == dtype
        _assert_within_rounding(out, expected, dtype)


@pytest.mark.isa_levels("amx")
@pytest.mark.parametrize("rows", [8, 17, 40, 300])
def test_amx_tiles_give_the_vector_kernels_results(rows: int, isa: str) -> None:
    """The amx build's tiles against its vector kernels (set_amx off) on the same packed weights:
    int8 layers (plain, gated, after the norm) equal to the bit, the int32 sums being exact; bf16
    layers (plain, gated) within one rounding, their float32 sums added in another order. Rows:
    a 16-row block with a tail, whole and partial 32-row blocks, several 256-row chunks; 72
    outputs: an odd number of groups, so a thread runs a group without a pair."""
    set_amx = cpu_op("set_amx")
    torch.manual_seed(rows)
    x, delta = _rows(torch.bfloat16, rows, 192), torch.randn(rows, 192).bfloat16()
    cases: list[tuple[str, Callable[[], torch.Tensor]]] = []
    for out_features in (72, 160):
        linear = nn.Linear(192, out_features).to(torch.bfloat16)
        int8, bf16 = Int8Linear(linear), PackedLinear(linear)
        cases += [("int8", lambda layer=int8: layer(x)), ("bf16", lambda layer=bf16: layer(x)),
                  ("int8", lambda layer=int8: layer.forward_after_norm(x.clone(), delta, 1e-6))]
    gate_up = nn.Linear(192, 160).to(torch.bfloat16)
    gated_int8, gated_bf16 = Int8Linear(gate_up), PackedLinear(gate_up)
    assert gated_int8.fuse_silu() and gated_bf16.fuse_silu()
    cases += [("int8", lambda: gated_int8(x)), ("bf16", lambda: gated_bf16(x))]
    try:
        results = []
        for tiles in (True, False):
            assert set_amx(tiles) == tiles, "the AMX tiles are not usable on this AMX CPU"
            results.append([run() for _, run in cases])
    finally:
        set_amx(True)
    for (kind, _), with_tiles, without in zip(cases, *results, strict=True):
        if kind == "int8":
            assert torch.equal(with_tiles, without)
        else:
            torch.testing.assert_close(with_tiles.float(), without.float(), atol=1e-3, rtol=2**-7)


@kernel_levels
def test_int8_ops_refuse_bad_arguments(isa: str) -> None:
    """The int8 ops name what is wrong: a turn block that does not divide the inputs, a gated
    layer whose outputs are no whole (gate, up) pairs, a residual that is not rows, a delta
    unlike the residual."""
    packed, comp, scales = cpu_op("int8_gemm_pack")(torch.ones(48, 64, dtype=torch.int8), torch.ones(48))
    x = torch.randn(3, 64)
    linear, after_norm = cpu_op("int8_linear"), cpu_op("int8_linear_after_norm")
    with pytest.raises(RuntimeError, match="rotate_block must be a power of two"):
        linear(x, packed, comp, scales, 48, None, 3, False)
    with pytest.raises(RuntimeError, match="gated layer needs out_features = 2 x a multiple of 16, got 48"):
        linear(x, packed, comp, scales, 48, None, 1, True)
    with pytest.raises(RuntimeError, match="residual must be contiguous"):
        after_norm(torch.randn(64), None, 1e-6, packed, comp, scales, 48, None, False)
    with pytest.raises(RuntimeError, match="delta must match"):
        after_norm(x, torch.randn(3, 32), 1e-6, packed, comp, scales, 48, None, False)


@kernel_levels
def test_norms_fuse_where_their_weights_are_one(tiny_model_factory: Callable[..., Path],
                                                 monkeypatch: pytest.MonkeyPatch, isa: str) -> None:
    """load_model's int8 path runs each decoder layer's norms inside its QKV and gate/up GEMMs
    where the turned stream left their weights at one: the same next-token log-probabilities as
    with the norms apart (float32); a layer whose norm weights are not all one keeps them apart."""
    path = str(tiny_model_factory("llama"))
    fused = load_model(path, torch.device("cpu"), torch.float32, "int8")
    assert all(layer.norms_in_projections for layer in fused.model.layers)
    monkeypatch.setattr(loading_module, "fuse_norms_into_int8", lambda model: 0)
    apart = load_model(path, torch.device("cpu"), torch.float32, "int8")
    assert not any(layer.norms_in_projections for layer in apart.model.layers)
    tokens = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    logprobs = [next_token_logprobs(LLM(loaded=loaded, quantization="int8", kv_cache_memory="4MiB",
                                        max_model_len=256).engine, tokens, 16) for loaded in (fused, apart)]
    torch.testing.assert_close(logprobs[0], logprobs[1], atol=1e-3, rtol=1e-3)
    layers = apart.model.layers
    layers[0].ffn_norm.data[3] = 2.0  # a weight not folded away: that layer keeps its norms apart
    assert fuse_norms_into_int8(apart.model) == len(layers) - 1
    assert [layer.norms_in_projections for layer in layers] == [False] + [True] * (len(layers) - 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_embedding_looks_up_its_rounded_rows(dtype: torch.dtype) -> None:
    """A lookup is the row's codes times its scale, in the embedding's dtype, within half a step
    of the original row; any shape of ids."""
    torch.manual_seed(0)
    embedding = nn.Embedding(50, 24).to(dtype)
    layer = Int8Embedding(embedding)
    ids = torch.tensor([[3, 0, 49], [7, 7, 1]])
    out = layer(ids)
    codes, scales = quantize_rows(embedding.weight.detach())
    assert out.shape == (2, 3, 24) and out.dtype == dtype
    assert torch.equal(out, (codes[ids].float() * scales[ids].unsqueeze(-1)).to(dtype))
    step = scales[ids].unsqueeze(-1)
    assert ((out.float() - embedding(ids).float()).abs() <= step / 2 * 1.001 + ROUNDING[dtype] * step * 127).all()


def test_rotation_shrinks_the_error_of_outlier_channels() -> None:
    """Activations with a few outlier channels (as SmolLM2's final norm output has: two channels
    hold a token's largest value, ~12x its RMS) lose most of their precision to per-token int8;
    the rotated layer spreads them and lands several times closer to the float product. 1,536
    inputs: blocks of 128, the down projection's."""
    torch.manual_seed(0)
    linear = nn.Linear(1536, 512, bias=False)
    x = torch.randn(32, 1536)
    x[:, [17, 199, 387, 1000]] *= 25.0
    exact = linear(x)
    errors = [((Int8Linear(linear, rotate_input=rotate)(x) - exact).norm() / exact.norm()).item()
              for rotate in (False, True)]
    assert errors[1] < errors[0] / 3, errors


@pytest.mark.parametrize("kernel", [True, False])
def test_int8_products_at_the_code_range_ends_sum_exactly(kernel: bool, isa: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Whichever path a CPU gets (with the C++ kernel allowed, and without it), at every level:
    codes at +-127 against activations at the range's ends sum exactly. oneDNN's u8 x s8 kernels
    without VNNI (AVX2) add pairs of products in int16 with saturation; that path must not be
    taken there."""
    if not kernel:
        monkeypatch.setattr(int8_linear, "_kernel_pack", lambda codes, scales: None)
    linear = nn.Linear(256, 32, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.where(torch.arange(32)[:, None] % 2 == 0, 1.0, -1.0).expand(32, 256))
    layer = Int8Linear(linear)
    x = torch.ones(4, 256)
    x[1] = -1.0
    x[2, ::2] = -1.0  # +-1 in turn: the pairs cancel
    x[3, 0] = 1e-3  # one input rounds to code 0
    ref = (x @ linear.weight.t()).double()
    assert ((layer(x).double() - ref).abs() <= 1e-5 * ref.abs().clamp(min=1)).all()


@kernel_levels
def test_kernel_pack_needs_whole_words_of_inputs(isa: str) -> None:
    """The kernels read a channel's inputs 4 (vpdpbusd) or 2 (pmaddwd) at a time: 9 inputs fall
    back (to oneDNN)."""
    assert int8_linear._kernel_pack(torch.ones(16, 8, dtype=torch.int8), torch.ones(16)) is not None
    assert int8_linear._kernel_pack(torch.ones(16, 9, dtype=torch.int8), torch.ones(16)) is None
    layer = Int8Linear(nn.Linear(9, 16))
    assert layer.kernel_packed is None and (layer.packed is not None or layer.codes is not None)


def test_quantize_linears_swaps_all_but_the_skipped() -> None:
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Sequential(nn.Linear(32, 8), nn.Linear(8, 4)))
    keep = model[2][1]
    assert quantize_linears(model, "int8", skip=(keep,)) == 2
    assert isinstance(model[0], Int8Linear) and isinstance(model[2][0], Int8Linear) and model[2][1] is keep
    with pytest.raises(ValueError, match="int4"):
        quantize_linears(model, "int4")


def test_the_slow_int8_fallback_is_announced(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Without the C++ kernel or oneDNN's quantized linear (another torch build) the layers run
    on torch's reference int8 matmul: correct but far slower than the float model, and the log
    says so."""
    monkeypatch.setattr(int8_linear, "_kernel_pack", lambda codes, scales: None)
    monkeypatch.setattr(int8_linear, "_onednn_weight_max", lambda: None)
    logger = logging.getLogger("kvserve")  # once an LLM is built it does not propagate to caplog's root
    logger.addHandler(caplog.handler)
    try:
        quantize_linears(nn.Sequential(nn.Linear(16, 32)), "int8")
    finally:
        logger.removeHandler(caplog.handler)
    assert any("no exact fast int8 GEMM" in r.message for r in caplog.records)


def test_bad_quantization_is_named() -> None:
    with pytest.raises(ConfigError, match=r"quantization must be one of gguf, int8, none .* got 'fp4'"):
        EngineConfig.from_settings(quantization="fp4")


@pytest.fixture(scope="module")
def smollm_int8() -> LoadedModel:
    return load_model("smollm2-135m", torch.device("cpu"), torch.bfloat16, "int8")


def test_real_model_answers_in_int8(smollm_int8: LoadedModel, smollm_float: LoadedModel) -> None:
    """Every linear layer is int8, the LM head too (its own copy of the tied matrix) and the
    embedding (int8 rows); the residual stream is rotated and each down projection's input turned
    at run time; with the VNNI kernel every layer's norms run inside its QKV and gate/up GEMMs and
    SwiGLU in the gate/up GEMM's store; the weights take about half the bytes, and the model
    still knows its facts."""
    model: Any = smollm_int8.model
    int8_layers = [m for m in model.modules() if isinstance(m, Int8Linear)]
    assert len(int8_layers) == 4 * smollm_int8.config.num_layers + 1 and isinstance(model.lm_head, Int8Linear)
    assert [m for m in int8_layers if m.rotation is not None] == [layer.down_proj for layer in model.layers]
    assert (model.norm == 1).all() and (model.layers[0].input_layernorm == 1).all()  # folded into the layers
    assert isinstance(model.embed_tokens, Int8Embedding)
    kernel = _kernel_available()
    assert all(layer.norms_in_projections == kernel and layer.gate_up_proj.gated == kernel for layer in model.layers)
    bf16_bytes = smollm_float.weight_bytes // 2  # the fixture is float32
    embedding = smollm_float.model.embed_tokens.weight.numel() * 2  # tied: its bf16 bytes, once
    # every weight in one byte (plus scales), the tied embedding twice: itself and the head
    assert smollm_int8.weight_bytes < (bf16_bytes + embedding) / 2 * 1.02
    llm = LLM(loaded=smollm_int8, quantization="int8", kv_cache_memory="64MiB")
    # "Answer in one word." keeps a margin: without it the first token is a near-tie between
    # "The" and "L'" (0.4 nats) that the attention kernels' rounding order can flip
    question = "What is the capital of France? Answer in one word."
    prompt = llm.apply_chat_template([{"role": "user", "content": question}])
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    assert "Paris" in out.text
    with pytest.raises(ConfigError, match="loaded with quantization='int8'"):
        LLM(loaded=smollm_int8, kv_cache_memory="64MiB")


def test_rotations_keep_the_int8_model_close_to_float(smollm: LoadedModel, isa: str) -> None:
    """At every level (each level's int8 GEMM: pairs, VNNI, oneDNN's AMX tiles), over 1,024
    tokens of held-out text, the int8 model's next-token distributions stay close to the float32
    model's: mean KL 0.008 and perplexity +0.15% measured with the rotations, against KL 0.039
    and +5.8% with none (the residual stream unturned, no run-time turns)."""
    smollm_int8 = load_model("smollm2-135m", torch.device("cpu"), torch.bfloat16, "int8")
    text = "\n".join(python_reference())
    tokens = smollm.tokenizer.encode(text)[:1024]
    logprobs = [next_token_logprobs(LLM(loaded=loaded, quantization=loaded.quantization, kv_cache_memory="128MiB",
                                        max_model_len=1024).engine, tokens, 512)
                for loaded in (smollm, smollm_int8)]
    kl = (logprobs[0].exp() * (logprobs[0] - logprobs[1])).sum(dim=1).mean().item()
    targets = torch.tensor(tokens[1:])[:, None]
    ppl = [math.exp(-lp.gather(1, targets).mean().item()) for lp in logprobs]
    assert kl < 0.015 and ppl[1] / ppl[0] < 1.01, (kl, ppl)
