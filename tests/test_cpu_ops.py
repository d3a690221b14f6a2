"""The fused C++ elementwise ops equal the torch ops they replace."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvserve.model.cpu_kernels import cpu_op

needs_ops = pytest.mark.skipif(cpu_op("add_rms_norm") is None, reason="no C++ toolchain")
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


@needs_ops
@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("tokens,hidden", [(1, 576), (33, 100), (300, 64)])  # 100: a row not a multiple of 16
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_matches_torch(dtype: torch.dtype, tokens: int, hidden: int, with_delta: bool) -> None:
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


@needs_ops
@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("tokens,inter", [(1, 1536), (40, 24), (257, 100)])
def test_silu_and_mul_matches_torch(dtype: torch.dtype, tokens: int, inter: int) -> None:
    torch.manual_seed(1)
    gate_up = (torch.randn(tokens, 2 * inter) * 4).to(dtype)
    gate, up = gate_up.float().chunk(2, dim=-1)
    expected = F.silu(gate) * up
    out = cpu_op("silu_and_mul")(gate_up)
    tol = TOLERANCE[dtype]
    assert out.shape == (tokens, inter) and out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, atol=tol * 4, rtol=tol)


@needs_ops
def test_bad_shapes_are_refused() -> None:
    with pytest.raises(RuntimeError, match="contiguous"):
        cpu_op("silu_and_mul")(torch.randn(4, 10).t())
    with pytest.raises(RuntimeError, match="delta must match"):
        cpu_op("add_rms_norm")(torch.randn(4, 8), torch.randn(4, 9), torch.ones(8), 1e-5)


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept() -> None:
    """torch would wait forever on the lock of a build that was killed; kvserve removes it."""
    import os
    import shutil
    import time

    from torch.utils.cpp_extension import _get_build_directory

    from kvserve.model.cpu_kernels import STALE_LOCK_S, _remove_stale_build_lock

    name = "kvserve_test_stale_lock"
    build = Path(_get_build_directory(name, verbose=False))
    lock = build / "lock"
    try:
        lock.touch()
        _remove_stale_build_lock(name)
        assert lock.exists()  # a build may be running
        old = time.time() - STALE_LOCK_S - 5
        os.utime(lock, (old, old))
        _remove_stale_build_lock(name)
        assert not lock.exists()
    finally:
        shutil.rmtree(build, ignore_errors=True)
