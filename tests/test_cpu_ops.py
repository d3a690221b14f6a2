"""The C++ ops build at every ISA level and load at the best one this CPU runs; the fused
elementwise ops equal the torch ops they replace, at every level."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvserve.engine.sampling import greedy_tokens
from kvserve.model import cpu_build, cpu_kernels
from kvserve.model.cpu_build import LEVEL_NAMES, CpuOpsBuildError, IsaLevel, build, level
from kvserve.model.cpu_kernels import active_isa, cpu_op, runnable_levels, selected_level


@pytest.mark.parametrize("name", LEVEL_NAMES)
def test_every_level_builds(name: str) -> None:
    """Every level compiles on any host, whether or not this CPU runs it: a compile error at any
    level fails here."""
    path = build(level(name))
    assert path.exists() and path.stat().st_size > 0


def test_the_ops_load_at_the_best_level_this_cpu_runs() -> None:
    """No silent fallback: the ops load, at the best level (or the one KVSERVE_ISA caps it at)."""
    chosen = selected_level()
    assert chosen is not None, "KVSERVE_NO_CPU_KERNEL=1 is set: the tests need the C++ ops"
    assert active_isa() == chosen.name
    assert chosen in runnable_levels()


def test_kvserve_isa_caps_the_level(monkeypatch: pytest.MonkeyPatch) -> None:
    best = runnable_levels()[-1]
    monkeypatch.setenv("KVSERVE_ISA", "portable")
    assert selected_level() == level("portable")
    monkeypatch.setenv("KVSERVE_ISA", LEVEL_NAMES[-1])  # never above what the CPU runs
    assert selected_level() == best
    monkeypatch.setenv("KVSERVE_ISA", "avx1024")
    with pytest.raises(ValueError, match=r"KVSERVE_ISA.*'avx1024'.*portable, avx2"):
        selected_level()
    monkeypatch.setenv("KVSERVE_NO_CPU_KERNEL", "1")  # torch ops, on purpose
    assert selected_level() is None


def test_a_failed_build_is_remembered_and_reported_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """A level that does not compile: the compiler's error in the exception, remembered on disk
    (the next process is told at once, no second compile), one warning, and the torch ops run."""
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    broken = IsaLevel("broken", ("-mno-such-instruction-set",), frozenset())
    with pytest.raises(CpuOpsBuildError, match=r"no-such-instruction-set"):
        build(broken)
    compiles: list[list[str]] = []
    monkeypatch.setattr(cpu_build, "_run", lambda command: compiles.append(command))
    start = time.perf_counter()
    with pytest.raises(CpuOpsBuildError, match=r"(?s)failed before.*no-such-instruction-set"):
        build(broken)
    assert compiles == [] and time.perf_counter() - start < 5
    assert cpu_build.build_state(broken) == "build failed"
    monkeypatch.setattr(cpu_kernels, "_ACTIVE", [])
    monkeypatch.setattr(cpu_kernels, "selected_level", lambda: broken)
    logger = logging.getLogger("kvserve")  # once an LLM is built it does not propagate to caplog's root
    monkeypatch.setattr(logger, "propagate", False)
    logger.addHandler(caplog.handler)
    try:
        assert cpu_op("add_rms_norm") is None and cpu_op("silu_and_mul") is None
    finally:
        logger.removeHandler(caplog.handler)
    assert active_isa() == "torch"
    warnings = [r for r in caplog.records if "C++ CPU ops are unavailable" in r.message]
    assert len(warnings) == 1 and "failed before" in warnings[0].message

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("tokens,hidden", [(1, 576), (33, 100), (300, 64)])  # 100: a row not a multiple of 16
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_matches_torch(dtype: torch.dtype, tokens: int, hidden: int, with_delta: bool, isa: str) -> None:
    torch.manual_seed(0)
    residual = torch.randn(tokens, hidden).to(dtype)
    delta = torch.randn(tokens, hidden).to(dtype) if with_delta else None
    weight = (torch.rand(hidden) + 0.5).to(dtype)
    expected_residual = residual + delta if delta is not None else residual.clone()
    expected = F.rms_norm(expected_residual, (hidden,), weight, 1e-5)
    fused_residual = residual.clone()
    out = cpu_op("add_rms_norm")(fused_residual, delta, weight, 1e-5)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(fused_residual, expected_residual, atol=0, rtol=0)  # the add rounds like torch
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("tokens,inter", [(1, 1536), (40, 24), (257, 100)])
def test_silu_and_mul_matches_torch(dtype: torch.dtype, tokens: int, inter: int, isa: str) -> None:
    torch.manual_seed(1)
    gate_up = torch.randn(tokens, 2 * inter) * 4
    gate_up[0, : min(inter, 6)] = torch.tensor([-100.0, 100.0, -90.0, 90.0, 0.0, -0.5])[: min(inter, 6)]  # exp's ends
    gate_up = gate_up.to(dtype)
    gate, up = gate_up.float().chunk(2, dim=-1)
    expected = F.silu(gate) * up
    out = cpu_op("silu_and_mul")(gate_up)
    tol = TOLERANCE[dtype]
    assert out.shape == (tokens, inter) and out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, atol=tol * 4, rtol=tol)


# the bf16 GEMM: AVX512-BF16 dot products in avx512; in amx AMX tiles from 2 rows (the dot products at 1)
bf16_gemm_levels = pytest.mark.isa_levels("avx512", "amx")


@bf16_gemm_levels
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13, 64, 301])  # 6-row tiles, every tail
@pytest.mark.parametrize("k,n", [(576, 960), (64, 40), (1536, 100)])  # n not a multiple of 16 or of 64
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_linear_is_float32_products_rounded_once(rows: int, k: int, n: int, with_bias: bool, isa: str) -> None:
    """The bf16 GEMM: exact products of the bf16 values summed in float32 (another order than
    torch's: ~1e-6 of the sums' scale), bias added in float32, one rounding to bf16 (2^-9)."""
    torch.manual_seed(rows + n)
    x, w = torch.randn(rows, k).bfloat16(), torch.randn(n, k).bfloat16()
    bias = torch.randn(n).bfloat16() if with_bias else None
    (packed,) = cpu_op("bf16_gemm_pack")(w)
    groups = -(-n // 16)
    bias32 = torch.zeros(groups * 16)
    if bias is not None:
        bias32[:n] = bias.float()
    out = cpu_op("bf16_linear")(x, packed, n, bias32 if bias is not None else None, False)
    expected = x.float() @ w.float().T + (bias.float() if bias is not None else 0)
    assert out.shape == (rows, n) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, atol=1e-3 * k**0.5, rtol=2**-8)


@bf16_gemm_levels
def test_packed_linear_takes_the_bf16_gemm_and_equals_linear(isa: str) -> None:
    from kvserve.model.llama import PackedLinear

    torch.manual_seed(3)
    linear = torch.nn.Linear(96, 50).bfloat16()
    packed = PackedLinear(linear)
    assert packed._bf16_linear is not None
    x = torch.randn(2, 9, 96).bfloat16()  # leading dims kept
    out = packed(x)
    expected = x.float() @ linear.weight.float().T + linear.bias.float()
    assert out.shape == (2, 9, 50)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2**-8)


@bf16_gemm_levels
@pytest.mark.parametrize("rows", [1, 7, 40])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fused_swiglu_is_silu_of_the_float32_sums(rows: int, with_bias: bool, isa: str) -> None:
    """PackedLinear.fuse_silu on a gate_up projection (192 outputs: 6 (gate, up) pairs of
    16-channel groups, so each of two threads runs a 4-group panel and a 2-group one): silu(gate)
    * up of the float32 sums, rounded once; a layer whose outputs are no whole pairs is refused
    and stays as it was."""
    from kvserve.model.llama import PackedLinear

    torch.manual_seed(rows)
    linear = torch.nn.Linear(64, 192, bias=with_bias).bfloat16()
    fused = PackedLinear(linear)
    assert fused.fuse_silu() and fused.gated
    x = torch.randn(rows, 64).bfloat16()
    sums = x.float() @ linear.weight.float().T + (linear.bias.float() if with_bias else 0)
    gate, up = sums.chunk(2, dim=-1)
    out = fused(x)
    assert out.shape == (rows, 96) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), torch.nn.functional.silu(gate) * up, atol=1e-3 * 64**0.5, rtol=2**-8)
    odd = PackedLinear(torch.nn.Linear(64, 48).bfloat16())
    assert not odd.fuse_silu() and odd(x).shape == (rows, 48)


def test_bad_shapes_are_refused(isa: str) -> None:
    with pytest.raises(RuntimeError, match="contiguous"):
        cpu_op("silu_and_mul")(torch.randn(4, 10).t())
    with pytest.raises(RuntimeError, match="delta must match"):
        cpu_op("add_rms_norm")(torch.randn(4, 8), torch.randn(4, 9), torch.ones(8), 1e-5)


@pytest.mark.parametrize("rows,n", [(1, 1), (3, 15), (4, 16), (5, 33), (7, 49152)])
def test_argmax_rows_matches_torch(rows: int, n: int, isa: str) -> None:
    torch.manual_seed(rows)
    wide = torch.randn(rows, n + 5)
    logits = wide[:, :n]  # rows strided, as a vocabulary slice is
    if n > 20:  # ties: the first maximum wins, wherever the copies fall among the vector lanes
        logits[0, 3] = logits[0, n - 2] = logits[0, 19] = 50.0
        logits[1, n - 1] = 60.0
    if rows > 2:
        logits[2] = float("-inf")
    torch.testing.assert_close(cpu_op("argmax_rows")(logits), logits.argmax(dim=-1), atol=0, rtol=0)
    assert greedy_tokens(logits).tolist() == logits.argmax(dim=-1).tolist()
