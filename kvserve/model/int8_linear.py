"""int8 linear layers (``--quantization int8``, W8A8): per-output-channel int8 weights, each
token's activations quantized to int8 at run time, int32 products.

weight[n, k] ~ codes[n, k] * weight_scale[n] (symmetric, scale = max|row| / 127) and
x[t, k] ~ x_codes[t, k] * x_scale[t] (the same, per token, at every call), so
x @ weight.T ~ (x_codes @ codes.T) * x_scale[t] * weight_scale[n]: one int8 GEMM with int32 sums
then one rescale. Where kvserve's C++ ops run on x86-64 (every build: portable, avx2, avx512,
amx) the whole layer is one C++ call (``int8_linear`` in csrc/layers.cpp, on a weight packed once
for it): VNNI dot products with AVX512-VNNI, AMX tiles on the same packed weight from 8 rows in
the amx build, 16-bit products added in pairs below AVX512-VNNI, all with exact int32 sums of
8-bit codes. Without the C++ ops, oneDNN's quantized linear (its own packed weight) where torch
has it, else torch's int8 matmul. oneDNN without VNNI adds pairs of
u8 x s8 products in int16 with saturation, so there its weight codes are 7-bit (+-63: 2 x 255 x
63 < 2**15) and the sums stay exact (``_onednn_weight_max``). Per-token
activation scales follow each token's own range (a per-tensor scale is set by the largest token
of the batch, e.g. the first token's outliers).

A layer built with ``rotate_input`` turns each token's activations by a block Walsh-Hadamard
matrix before quantizing them, its weight turned by the same at load, so that a few outlier
channels no longer set the token's scale (kvserve.model.rotation).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
from torch import nn

from kvserve.model.cpu_kernels import cpu_op
from kvserve.model.llama import DecoderLayer, interleave_gate_up, shaped_like_input, token_rows
from kvserve.model.rotation import hadamard_block, rotate_rows

logger = logging.getLogger("kvserve")


def _quantize_rows_torch(x: torch.Tensor, offset: bool, max_code: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
    amax = x.float().abs().amax(dim=1)
    scales = torch.where(amax > 0, amax / max_code, torch.ones_like(amax))
    codes = torch.round(x.float() / scales[:, None]).clamp_(-max_code, max_code)
    return (codes + 128).to(torch.uint8) if offset else codes.to(torch.int8), scales


def _scale_rows_torch_(x: torch.Tensor, row_scales: torch.Tensor, bias: torch.Tensor | None) -> None:
    x.copy_(x.float().mul_(row_scales[:, None]))
    if bias is not None:
        x.add_(bias)


def quantize_rows(x: torch.Tensor, offset: bool = False, max_code: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, cols] -> (codes, float32 scales [rows]) with x ~ codes * scales[:, None]; codes
    int8 in +-max_code, or with ``offset`` uint8 holding code + 128 (oneDNN's activations, zero
    point 128). C++ on CPU for the full range (one pass, AVX-512 or AVX2), torch ops elsewhere."""
    op = cpu_op("quantize_rows_int8") if x.device.type == "cpu" and max_code == 127 else None
    if op is None:
        return _quantize_rows_torch(x, offset, max_code)
    codes, scales = op(x.contiguous(), offset)
    return codes, scales


def int8_matmul(x_codes: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """int32 [m, n] = x_codes [m, k] @ codes[n, k].T, exactly."""
    if x_codes.device.type == "cpu":
        return torch._int_mm(x_codes, codes.t())
    # elsewhere _int_mm wants m > 16 and multiples of 8: float32 sums of int8 products are exact
    # while below 2**24 (k * 127 * 127 for k up to ~1,000), close enough beyond
    return (x_codes.float() @ codes.float().t()).round_().to(torch.int32)


PACK_BATCH_HINT = 32  # rows oneDNN tunes the packed layout for (decode batch sizes)


def _onednn_qlinear(x_codes: torch.Tensor, packed: torch.Tensor, weight_scale: torch.Tensor,
                    zero_points: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """oneDNN: u8 activations (zero point 128) times the packed weight, scaled per output channel,
    written in out_dtype (not yet scaled per row)."""
    return torch.ops.onednn.qlinear_pointwise(x_codes, 1.0, 128, packed, weight_scale, zero_points, None, 1.0, 0,
                                              out_dtype, "none", [], "")


def _onednn_sums_exact(weight_max: int) -> bool:
    """Whether oneDNN's u8 x s8 products sum exactly with weight codes in +-weight_max and
    activations over the full u8 range. Without VNNI (AVX2, AVX-512 without VNNI) its kernels add
    pairs of products in int16 with saturation (vpmaddubsw): on a Zen 3, 255 x 127 x 64 came back
    as 8,160 instead of 1,032,256, and the real model answered nonsense."""
    codes = torch.full((16, 64), weight_max, dtype=torch.int8)
    try:
        packed = torch.ops.onednn.qlinear_prepack(codes, [PACK_BATCH_HINT, 64])
        out = _onednn_qlinear(torch.full((1, 64), 255, dtype=torch.uint8), packed, torch.ones(16),
                              torch.zeros(16, dtype=torch.long), torch.float32)
    except RuntimeError:
        return False
    return bool((out == weight_max * 127 * 64).all())


@functools.cache
def _onednn_weight_max() -> int | None:
    """The widest weight code range (+-127, else the 7-bit +-63) whose sums oneDNN's quantized
    linear computes exactly on this CPU, or None where this torch build has none (or neither is
    exact). 7-bit weights measured +1.1% PPL over 8-bit ones (float32 SmolLM2, ``kvserve eval``:
    11.692 -> 11.821); 7-bit activations +6.9%, so it is the weights that lose the bit."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.onednn, "qlinear_prepack"):
        return None
    return next((weight_max for weight_max in (127, 63) if _onednn_sums_exact(weight_max)), None)


def _onednn_pack(codes: torch.Tensor) -> torch.Tensor | None:
    """The int8 weight (codes within ``_onednn_weight_max``) in oneDNN's packed layout, or None
    where oneDNN cannot take it. Unpacked, _int_mm reorders the weight at every call: measured
    here over 30 layers at batch 32, no faster than bf16; packed, 1.7x faster."""
    try:
        return torch.ops.onednn.qlinear_prepack(codes, [PACK_BATCH_HINT, codes.shape[1]])
    except RuntimeError:
        return None


def _onednn_out_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype oneDNN's quantized linear writes for a model in ``dtype``. bf16 where the CPU has
    AVX-512 (a float32 [m, n] result costs more to write than the GEMM at prefill sizes: 2048 x
    3072, 15.5 ms vs 9.5 in bf16; each row's scale then rounds a second time); float32 elsewhere:
    on an AVX2 Zen 3 oneDNN wrote bf16 through a reference loop, 2.3 s per 32 x 576 -> 3,072 call
    against 1.4 ms for float32."""
    if dtype == torch.bfloat16 and torch.backends.cpu.get_cpu_capability() == "AVX512":
        return dtype
    return torch.float32


def _kernel_pack(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """(packed weight, 128 * its channel sums, padded scales) for the C++ int8_linear, or None where
    no C++ ops run (the torch ops) or in_features does not divide into its words. The VNNI kernel
    measured at batch 32 over 30 layers of SmolLM2's shapes: 1.5x faster than oneDNN's quantized
    linear; on a Sapphire Rapids Xeon, VNNI at 1 row and the amx build's tiles at 32 rows took
    0.38x and 0.78x oneDNN's time (in AMX tiles too), the tiles at 1,024 rows 1.03x."""
    op = cpu_op("int8_gemm_pack")
    packed = op(codes, scales) if op is not None else []
    return tuple(packed) if packed else None


class Int8Linear(nn.Module):
    """nn.Linear's forward in W8A8 (see the module docstring). Output in the input's dtype."""

    kernel_packed: torch.Tensor | None  # the C++ int8 GEMM's packed weight
    kernel_comp: torch.Tensor | None
    kernel_bias: torch.Tensor | None
    packed: torch.Tensor | None  # oneDNN's packed weight (other CPUs)
    codes: torch.Tensor | None  # int8 [out, in] where neither packed form is available
    weight_scale: torch.Tensor
    zero_points: torch.Tensor | None  # oneDNN's (zeros) where its packed weight is used

    def __init__(self, linear: nn.Linear, rotate_input: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        on_cpu = weight.device.type == "cpu"
        rotation = hadamard_block(self.in_features).to(weight.device) if rotate_input else None
        if rotation is not None:
            weight = rotate_rows(weight, rotation) / rotation.shape[0]
        codes, scales = quantize_rows(weight)
        kernel = _kernel_pack(codes, scales) if on_cpu else None
        onednn_max = _onednn_weight_max() if on_cpu and kernel is None else None
        self.weight_max = 127 if onednn_max is None else onednn_max  # the weight codes' range
        if self.weight_max != 127:
            codes, scales = quantize_rows(weight, max_code=self.weight_max)
        # the C++ kernel's padded weight scales replace the per-channel ones it would not use
        self.register_buffer("kernel_packed", None if kernel is None else kernel[0])
        self.register_buffer("kernel_comp", None if kernel is None else kernel[1])
        # its bias in float32, padded like the scales: once here rather than at every call
        self.register_buffer("kernel_bias", None if kernel is None or linear.bias is None else nn.functional.pad(
            linear.bias.detach().float(), (0, kernel[2].numel() - self.out_features)))
        packed = _onednn_pack(codes) if onednn_max is not None else None
        self.register_buffer("codes", codes if kernel is None and packed is None else None)
        self.register_buffer("packed", packed)
        self.register_buffer("weight_scale", scales if kernel is None else kernel[2])
        self.register_buffer("zero_points", None if packed is None else
                             torch.zeros(self.out_features, dtype=torch.long, device=codes.device))
        self.bias = linear.bias
        self.gated = False  # fuse_silu: the output is silu(gate) * up [.., out_features / 2]
        self._out_dtype = _onednn_out_dtype(linear.weight.dtype)
        # the ops looked up once: a decode step makes ~120 of these calls, Python costs show
        self._linear = cpu_op("int8_linear") if kernel is not None else None
        self._linear_after_norm: Any = cpu_op("int8_linear_after_norm") if kernel is not None else None
        # hadamard_block's (shared, not a buffer), with rotate_input: the C++ op turns the rows
        # itself, the other paths before quantizing (rotate_rows)
        self.rotation = rotation
        self.bind_weights()
        self._quantize = (cpu_op("quantize_rows_int8") if on_cpu else None) or _quantize_rows_torch
        self._scale_ = (cpu_op("scale_rows_") if on_cpu else None) or _scale_rows_torch_

    def movable_weights(self) -> tuple[str, ...]:
        """The weight buffers huge_pages.weights_on_huge_pages may move: the C++ kernel's."""
        return ("kernel_packed",) if self._linear is not None else ()

    def bind_weights(self) -> None:
        """Read the C++ op's weight arguments once (each buffer read through nn.Module costs ~0.5
        us a call); again after weights_on_huge_pages moved them."""
        self._linear_args = (self.kernel_packed, self.kernel_comp, self.weight_scale, self.out_features,
                             self.kernel_bias, 1 if self.rotation is None else self.rotation.shape[0], self.gated)
        self._after_norm_args = (*self._linear_args[:5], self.gated)  # the same, less the turn block

    def takes_residual(self) -> bool:
        """Whether forward_after_norm can run: the C++ kernel, no run-time turn of the input."""
        return self._linear_after_norm is not None and self.rotation is None

    def forward_after_norm(self, residual: torch.Tensor, delta: torch.Tensor | None, eps: float) -> torch.Tensor:
        """self(add_rms_norm(residual, delta, unit weight, eps)) in one C++ call (residual [T,
        in_features], updated in place): the norm only scales each row, which the row's int8
        scale takes. Needs takes_residual()."""
        return self._linear_after_norm(residual, delta, eps, *self._after_norm_args)

    def fuse_silu(self) -> bool:
        """As PackedLinear.fuse_silu, in the C++ kernel (its packed groups, channel terms,
        scales and bias regrouped); False without it."""
        if self._linear is None or self.out_features % 32 != 0:
            return False
        for name in ("kernel_packed", "kernel_comp", "weight_scale", "kernel_bias"):
            if getattr(self, name) is not None:
                setattr(self, name, interleave_gate_up(getattr(self, name), self.out_features))
        self.gated = True
        self.bind_weights()
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = token_rows(x, self.in_features)
        if self._linear is not None:
            out = self._linear(rows.contiguous(), *self._linear_args)
            return shaped_like_input(out, x)
        if self.rotation is not None:
            rows = rotate_rows(rows, self.rotation)
        if self.packed is not None:
            x_codes, x_scales = self._quantize(rows.contiguous(), True)
            assert self.zero_points is not None
            out = _onednn_qlinear(x_codes, self.packed, self.weight_scale, self.zero_points, self._out_dtype)
            self._scale_(out, x_scales, None if self.bias is None else self.bias.detach().to(out.dtype))
            return shaped_like_input(out if out.dtype == x.dtype else out.to(x.dtype), x)
        assert self.codes is not None
        x_codes, x_scales = self._quantize(rows.contiguous(), False)
        # both scales in float32, rounded once into the model dtype (as the C++ kernel does):
        # rounding twice in bf16 showed in greedy outputs
        sums = int8_matmul(x_codes, self.codes).float().mul_(x_scales[:, None] * self.weight_scale)
        if self.bias is not None:
            sums.add_(self.bias.detach())
        return shaped_like_input(sums.to(x.dtype), x)


def fuse_norms_into_int8(model: nn.Module) -> int:
    """Each decoder layer's two RMSNorms into the int8 layers they feed (its QKV and gate/up
    projections: ``forward_after_norm``, the residual add and the norm in the GEMM's row
    quantization, one op less each) where the norms' weights are one (rotation folds them into
    those layers) and both layers take_residual. Returns the number of decoder layers fused."""
    fused = 0
    for layer in model.modules():
        if isinstance(layer, DecoderLayer) and all(
            isinstance(projection, Int8Linear) and projection.takes_residual() and bool((norm == 1).all())
            for projection, norm in ((layer.qkv_proj, layer.input_layernorm), (layer.gate_up_proj, layer.ffn_norm))
        ):
            layer.norms_in_projections = True
            fused += 1
    return fused


class Int8Embedding(nn.Module):
    """nn.Embedding with int8 rows (per row, scale = max / 127, as Int8Linear's weights): a lookup
    gathers the codes and rescales them into the embedding's dtype. With the LM head in int8, a
    tied embedding is the last bf16 weight of an int8 model (SmolLM2: 54 of 184 MiB); in int8 it
    measured no perplexity cost (11.377 -> 11.373, ``kvserve eval --quantization int8``)."""

    codes: torch.Tensor
    scales: torch.Tensor

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        codes, scales = quantize_rows(embedding.weight.detach())
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)
        self.dtype = embedding.weight.dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return (self.codes[ids].float() * self.scales[ids].unsqueeze(-1)).to(self.dtype)


def quantized_bytes(model: nn.Module) -> int:
    """Bytes of the int8 layers' codes and scales (buffers: not among the model's parameters)."""
    return sum(b.numel() * b.element_size() for m in model.modules() if isinstance(m, (Int8Linear, Int8Embedding))
               for b in m.buffers())


def quantize_linears(model: nn.Module, method: str, skip: tuple[nn.Module, ...] = (),
                     rotate: tuple[nn.Module, ...] = ()) -> int:
    """Swap every nn.Linear of ``model`` (but those in ``skip``) for its ``method`` version, those
    in ``rotate`` with their inputs rotated (Int8Linear's rotate_input); returns how many were
    swapped."""
    if method != "int8":
        raise ValueError(f"quantize_linears makes int8 layers, not {method!r}")
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if isinstance(child, nn.Linear) and not any(child is s for s in skip)]
    layers = [Int8Linear(child, rotate_input=any(child is r for r in rotate)) for _, _, child in swaps]
    for (parent, name, _), layer in zip(swaps, layers, strict=True):
        setattr(parent, name, layer)
    if any(layer.codes is not None and layer.codes.device.type == "cpu" for layer in layers):
        logger.warning("--quantization int8: no exact fast int8 GEMM here (no kvserve C++ int8 GEMM, and this "
                       "torch build has no oneDNN quantized linear), so the layers run on torch._int_mm, many times "
                       "slower than the float model (~25x per layer on an AVX2 Zen 3); the results are exact")
    return len(swaps)
