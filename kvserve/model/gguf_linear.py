"""GGUF's quantized weights kept in their own bits (``--quantization gguf``, the default for a
quantized GGUF file on CPU).

Each quantized tensor (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) is read from the file's
memory map and repacked once by the C++ ``gguf_pack`` into tiles of 16 output channels that keep
every code's bits (csrc/gguf_linear.cpp says the layout), one tensor at a time, so no float copy
of a weight ever exists. ``GGUFLinear`` runs ``gguf_linear``: each row of activations quantized
per 32 inputs to int16 (llama.cpp's 8-bit q8_0 parted SmolLM2's answers from float32's), exact
int32 sums of code products per weight group, scales applied in float32; ``GGUFEmbedding``
reads its rows from the same packed tensor, which a tied LM head shares. Widening to float is ``--quantization none``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from kvserve.model.cpu_kernels import cpu_op
from kvserve.model.gguf_file import GGUFWeight
from kvserve.model.llama import shaped_like_input, token_rows


class PackedWeight(NamedTuple):
    """One GGUF tensor repacked for gguf_linear: ``packed`` uint8 [tiles of 16 rows, bytes]."""

    packed: torch.Tensor
    kind: int
    out_features: int
    in_features: int
    source_type: str  # the GGUF block format it came from (Q4_K, ...)

    @staticmethod
    def of(weight: GGUFWeight) -> PackedWeight:
        op = cpu_op("gguf_pack")
        if op is None:
            raise RuntimeError("GGUF weights kept quantized need kvserve's C++ CPU ops")
        packed, kind = op(weight.raw.contiguous(), int(weight.tensor_type), weight.shape[1])
        if weight.source is not None:
            weight.source[0].drop_pages(weight.source[1])
        return PackedWeight(packed, kind, weight.shape[0], weight.shape[1], weight.tensor_type.name)

    @property
    def nbytes(self) -> int:
        return self.packed.numel()


class GGUFLinear(nn.Module):
    """nn.Linear's forward over one or more packed GGUF weights side by side (a fused QKV or
    gate/up projection whose parts may be in different block formats); output in the input's
    dtype. The bias stays float32."""

    def __init__(self, parts: list[PackedWeight], bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.parts = parts
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        if any(p.in_features != self.in_features for p in parts):
            raise ValueError("fused GGUF weights must share in_features")
        # plain attributes, not buffers: Module.to(dtype) must not touch the codes or the bias
        self.bias32 = None if bias is None else bias.detach().float().contiguous()
        self._linear: Any = cpu_op("gguf_linear")
        self._args = ([p.packed for p in parts], [p.kind for p in parts], [p.out_features for p in parts], self.bias32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = token_rows(x, self.in_features)
        return shaped_like_input(self._linear(rows.contiguous(), *self._args), x)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"formats={'+'.join(p.source_type for p in self.parts)}")


class GGUFEmbedding(nn.Module):
    """nn.Embedding over a packed GGUF weight: a lookup dequantizes the rows it reads."""

    def __init__(self, part: PackedWeight, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.part = part
        self.dtype = dtype  # set to the model's dtype once it is known (load_model)
        self._rows: Any = cpu_op("gguf_rows")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).to(torch.long)
        rows = self._rows(self.part.packed, self.part.kind, self.part.in_features, flat)
        return rows.to(self.dtype).view(*ids.shape, self.part.in_features)


def packed_weights(model: nn.Module) -> list[PackedWeight]:
    """Every packed GGUF weight of ``model``, each once (a tied LM head shares the embedding's)."""
    seen: dict[int, PackedWeight] = {}
    for module in model.modules():
        parts = module.parts if isinstance(module, GGUFLinear) else [module.part] if isinstance(
            module, GGUFEmbedding) else []
        for part in parts:
            seen.setdefault(part.packed.data_ptr(), part)
    return list(seen.values())


def packed_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s packed GGUF weights and of their layers' float32 biases."""
    biases = sum(m.bias32.numel() * 4 for m in model.modules() if isinstance(m, GGUFLinear) and m.bias32 is not None)
    return sum(p.nbytes for p in packed_weights(model)) + biases


def packed_formats(model: nn.Module) -> list[str]:
    """The GGUF block formats ``model``'s packed weights came from, most bytes first."""
    totals: dict[str, int] = {}
    for part in packed_weights(model):
        totals[part.source_type] = totals.get(part.source_type, 0) + part.nbytes
    return sorted(totals, key=lambda name: -totals[name])
