"""The calibration scales file: per-channel key and per-head value statistics of one model.

JSON, written by ``kvserve calibrate`` and read by the engine (``--kv-scales``):

- ``model``: name, fingerprint (a hash of the architecture and of some weights, see
  model_fingerprint), num_layers, num_kv_heads, head_dim — a file from another model is refused;
- ``num_samples``, ``num_tokens``, ``lengths``: the calibration data's token-length distribution;
- ``key_absmax`` [layers][kv_heads][head_dim]: largest |K| per channel (after RoPE, as cached);
- ``key_norm_max`` [layers]: largest L2 norm of a key head (bounds fp8's rotated keys);
- ``value_absmax`` [layers][kv_heads]: largest |V| per head; ``value_token_absmax_p50``/``p99``
  [layers]: percentiles of each token's |V| max (the distribution per-token scales adapt to).

Static int8 key scales are key_absmax / 127; fp8's per-layer scales are the layer's largest key
norm (its keys are stored Hadamard-rotated, and no rotated element exceeds the norm) and V
absmax, over the format's largest value.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvserve.cache.kv_quant import QMAX
from kvserve.config import ConfigError

FORMAT = "kvserve-kv-scales"
VERSION = 1


def model_fingerprint(config: dict[str, Any], weights: dict[str, torch.Tensor]) -> str:
    """Hash of the architecture and of the first layer's key projection (float32, as loaded from
    the checkpoint), so two models of one architecture get different fingerprints."""
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    key = weights.get("model.layers.0.self_attn.k_proj.weight")
    if key is not None:
        digest.update(key.float().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def length_summary(lengths: list[int]) -> dict[str, float]:
    """min, mean, percentiles and max of token lengths."""
    if not lengths:
        return {"count": 0}
    t = torch.tensor(lengths, dtype=torch.float64)
    q = torch.quantile(t, torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)).tolist()
    return {"count": len(lengths), "min": float(t.min()), "p10": q[0], "p50": q[1], "p90": q[2],
            "max": float(t.max()), "mean": float(t.mean())}


@dataclass
class KVScales:
    model_name: str
    fingerprint: str
    key_absmax: torch.Tensor  # [layers, kv_heads, head_dim]
    value_absmax: torch.Tensor  # [layers, kv_heads]
    key_norm_max: list[float] = field(default_factory=list)
    value_token_absmax_p50: list[float] = field(default_factory=list)
    value_token_absmax_p99: list[float] = field(default_factory=list)
    num_samples: int = 0
    num_tokens: int = 0
    lengths: dict[str, float] = field(default_factory=dict)
    source: str = ""

    @property
    def shape(self) -> tuple[int, int, int]:
        layers, heads, dim = self.key_absmax.shape
        return layers, heads, dim

    def fp8_scales(self, kind: str) -> torch.Tensor:
        """[layers, 2]: each layer's static K and V scale for fp8 ``kind``."""
        k = torch.tensor(self.key_norm_max) if self.key_norm_max else self.key_absmax.norm(dim=2).amax(dim=1)
        v = self.value_absmax.amax(dim=1)
        return (torch.stack((k, v), dim=1) / QMAX[kind]).clamp_(min=1e-8)

    def check_model(self, name: str, fingerprint: str, shape: tuple[int, int, int]) -> None:
        """Refuse scales computed for another model (ConfigError naming both)."""
        if self.fingerprint != fingerprint or self.shape != shape:
            raise ConfigError(
                f"KV scales file is for model {self.model_name!r} (fingerprint {self.fingerprint}, layers/kv "
                f"heads/head_dim {self.shape}), not for {name!r} (fingerprint {fingerprint}, {shape}): "
                f"run kvserve calibrate for this model")

    def to_json(self) -> dict[str, Any]:
        layers, heads, dim = self.shape
        return {
            "format": FORMAT, "version": VERSION,
            "model": {"name": self.model_name, "fingerprint": self.fingerprint, "num_layers": layers,
                      "num_kv_heads": heads, "head_dim": dim},
            "source": self.source, "num_samples": self.num_samples, "num_tokens": self.num_tokens,
            "lengths": self.lengths,
            "key_absmax": self.key_absmax.tolist(), "key_norm_max": self.key_norm_max,
            "value_absmax": self.value_absmax.tolist(),
            "value_token_absmax_p50": self.value_token_absmax_p50,
            "value_token_absmax_p99": self.value_token_absmax_p99,
        }

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_json()))

    @classmethod
    def load(cls, path: str | Path) -> KVScales:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"KV scales file {str(p)!r} does not exist")
        try:
            obj = json.loads(p.read_text())
            if obj.get("format") != FORMAT:
                raise ConfigError(f"{str(p)!r} is not a kvserve KV scales file (no \"format\": \"{FORMAT}\")")
            model = obj["model"]
            key = torch.tensor(obj["key_absmax"], dtype=torch.float32)
            value = torch.tensor(obj["value_absmax"], dtype=torch.float32)
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"KV scales file {str(p)!r} is malformed: {exc}") from None
        expected = (model["num_layers"], model["num_kv_heads"], model["head_dim"])
        if tuple(key.shape) != expected or tuple(value.shape) != expected[:2]:
            raise ConfigError(f"KV scales file {str(p)!r}: tables do not match its model shape {expected}")
        return cls(model["name"], model["fingerprint"], key, value, obj.get("key_norm_max", []),
                   obj.get("value_token_absmax_p50", []),
                   obj.get("value_token_absmax_p99", []), obj.get("num_samples", 0), obj.get("num_tokens", 0),
                   obj.get("lengths", {}), obj.get("source", ""))
