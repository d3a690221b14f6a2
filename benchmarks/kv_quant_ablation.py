"""Why int4 is asymmetric, fp8 keys are rotated and int8 scales are not global: fake-quantized K
or V, one choice at a time.

    python benchmarks/kv_quant_ablation.py --out docs/results/kv_quant_ablation.json

The model runs with a float32 cache; LLMEngine.observe_kv's observer rewrites each layer's new K and
V in place with a quantize-dequantize round trip before they are cached (blocks = 16 tokens, the
chunk size 512 keeps blocks aligned), so each scheme is judged alone, K or V. Perplexity on the
first 4,096 tokens of builtin:python-reference, windows of 2,048, against no quantization.

The "global scale" rows quantize K and V of every layer with one int8 scale, the largest |K| or |V|
the text itself produces (a first pass measures it: the best case for one scale), against int8 keys
scaled per block and channel and values per token, as kvserve's int8 format does.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from pathlib import Path

import torch

from kvserve.cache.kv_quant import hadamard
from kvserve.config import EngineConfig
from kvserve.engine.engine import LLMEngine
from kvserve.engine.loading import load_model
from kvserve.quant.data import python_reference
from kvserve.quant.evaluate import next_token_logprobs

Fake = Callable[[torch.Tensor], torch.Tensor]  # [tokens, heads, dim] -> same, quantized and back


def symmetric(x: torch.Tensor, dim: int, levels: int = 7) -> torch.Tensor:
    scale = x.abs().amax(dim=dim, keepdim=True).clamp(min=1e-8) / levels
    return torch.round(x / scale).clamp(-levels, levels) * scale


def asymmetric(x: torch.Tensor, dim: int) -> torch.Tensor:
    low, high = x.amin(dim=dim, keepdim=True), x.amax(dim=dim, keepdim=True)
    step = ((high - low) / 15).clamp(min=1e-8)
    return torch.round((x - low) / step).clamp(0, 15) * step + low


def per_block(f: Callable[[torch.Tensor, int], torch.Tensor]) -> Fake:
    def apply(x: torch.Tensor) -> torch.Tensor:
        out = x.clone()
        for start in range(0, x.shape[0], 16):
            out[start : start + 16] = f(x[start : start + 16], 0)
        return out
    return apply


def per_group(f: Callable[[torch.Tensor, int], torch.Tensor], group: int) -> Fake:
    def apply(x: torch.Tensor) -> torch.Tensor:
        t, h, d = x.shape
        return f(x.reshape(t, h, d // group, group), -1).reshape(t, h, d)
    return apply


def fp8(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float8_e4m3fn).float()


def rotated_fp8(x: torch.Tensor) -> torch.Tensor:
    rotation = hadamard(x.shape[-1])
    return fp8(x @ rotation) @ rotation.T


SCHEMES: dict[str, tuple[Fake | None, Fake | None]] = {
    "none": (None, None),
    "int4 K symmetric, per block x channel": (per_block(symmetric), None),
    "int4 K asymmetric, per block x channel": (per_block(asymmetric), None),
    "int4 V symmetric, per token x 32 channels": (None, per_group(symmetric, 32)),
    "int4 V asymmetric, per token x 32 channels": (None, per_group(asymmetric, 32)),
    "fp8_e4m3 K": (fp8, None),
    "fp8_e4m3 K, Hadamard-rotated": (rotated_fp8, None),
    "fp8_e4m3 V": (None, fp8),
    "int8 K per block x channel, V per token": (per_block(lambda x, dim: symmetric(x, dim, 127)),
                                                 lambda x: symmetric(x, -1, 127)),
}


def one_scale(top: float) -> Fake:
    """int8 with one scale for every element: ``top`` maps to 127."""
    scale = max(top, 1e-8) / 127
    return lambda x: torch.round(x / scale).clamp(-127, 127) * scale


def largest_kv(engine: LLMEngine, tokens: list[int]) -> float:
    """The largest |K| or |V| any layer caches for ``tokens`` (windows of 2,048)."""
    top = 0.0

    def observe(_layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        nonlocal top
        top = max(top, float(k.abs().max()), float(v.abs().max()))
    with engine.observe_kv(observe):
        for start in range(0, len(tokens), 2048):
            next_token_logprobs(engine, tokens[start : start + 2048], 512)
    return top


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-tokens", type=int, default=4096)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    loaded = load_model("smollm2-135m", torch.device("cpu"), torch.float32)
    assert loaded.tokenizer is not None
    tokens = loaded.tokenizer.encode("\n\n".join(python_reference()))[: args.num_tokens]
    engine = LLMEngine(EngineConfig.from_settings(kv_cache_memory="256MiB", enable_prefix_caching=False,
                                                  max_num_seqs=1, max_model_len=2048), loaded=loaded)
    glob = one_scale(largest_kv(engine, tokens))
    schemes = {**SCHEMES, "int8 K and V, one global scale": (glob, glob)}
    rows = []
    for name, (fake_k, fake_v) in schemes.items():
        def observe(_layer: int, k: torch.Tensor, v: torch.Tensor, fk: Fake | None = fake_k,
                    fv: Fake | None = fake_v) -> None:
            if fk is not None:
                k.copy_(fk(k.float()).to(k.dtype))
            if fv is not None:
                v.copy_(fv(v.float()).to(v.dtype))
        nll, count = 0.0, 0
        with engine.observe_kv(observe):
            for start in range(0, len(tokens), 2048):
                window = tokens[start : start + 2048]
                logprobs = next_token_logprobs(engine, window, 512)
                nll -= float(logprobs.gather(1, torch.tensor(window[1:])[:, None]).sum())
                count += len(window) - 1
        ppl = math.exp(nll / count)
        base = rows[0]["ppl"] if rows else ppl
        rows.append({"scheme": name, "ppl": ppl, "delta_ppl_pct": 100 * (ppl / base - 1)})
        print(f"{name:45s} PPL {ppl:.3f}  ΔPPL {rows[-1]['delta_ppl_pct']:+.2f}%", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"tokens": len(tokens), "results": rows}, indent=1))


if __name__ == "__main__":
    main()
