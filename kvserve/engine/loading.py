"""Loading a model for the engine: its weights in the engine's dtype and device, quantized and
packed for the CPU kernels; its KV cache groups; a draft model's share of the work."""

from __future__ import annotations

import logging
from dataclasses import asdict
from pathlib import Path
from typing import NamedTuple

import torch

from kvserve.cache.huge_pages import weights_on_huge_pages
from kvserve.cache.kv_groups import FULL_ATTENTION, KVCacheGroup, KVCacheSpec, group_layers
from kvserve.cache.kv_scales import model_fingerprint
from kvserve.config import ConfigError
from kvserve.model.cpu_kernels import cpu_kernels
from kvserve.model.deepseek import DeepseekForCausalLM
from kvserve.model.gguf_file import rows_as_float
from kvserve.model.gguf_linear import GGUFEmbedding, packed_bytes, packed_formats, packed_weights
from kvserve.model.int8_linear import Int8Embedding, fuse_norms_into_int8, quantize_linears, quantized_bytes
from kvserve.model.llama import LlamaForCausalLM, fuse_swiglu, pack_linears_for_cpu, weights_uninitialized
from kvserve.model.loader import ModelConfig, load_checkpoint_blocks, load_tokenizer, resolve_model_path
from kvserve.model.rotation import rotate_residual_stream, run_time_rotations
from kvserve.model.tokenizer import Tokenizer

logger = logging.getLogger("kvserve")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LoadedModel(NamedTuple):
    path: Path
    config: ModelConfig
    model: LlamaForCausalLM
    tokenizer: Tokenizer | None
    weight_bytes: int
    fingerprint: str  # see kvserve.cache.kv_scales.model_fingerprint
    quantization: str | None = None  # as asked (None: by the checkpoint)
    weight_format: str = "float32"  # what the linear layers hold: a dtype, "int8", or "gguf Q4_K+Q6_K"


def gguf_blocks_kept(path: Path, device: torch.device, quantization: str | None) -> bool:
    """Whether a checkpoint's quantized GGUF weights are served in their blocks: asked for
    (``gguf``) or by default for a .gguf file on CPU; a CUDA device or ``none`` widens them
    (``int8`` requantizes the widened weights). Raises ConfigError where ``gguf`` cannot be."""
    if quantization not in (None, "gguf"):
        return False
    reason = ("it is not a GGUF file" if path.suffix != ".gguf" else
              "it runs on the CPU kernels, not on " + device.type if device.type != "cpu" else
              "kvserve's C++ CPU ops are unavailable here (see the warning above)" if cpu_kernels() is None else None)
    if reason is None:
        return True
    if quantization == "gguf":
        raise ConfigError(f"quantization='gguf' cannot serve {path.name}: {reason}")
    if path.suffix == ".gguf":
        logger.warning("GGUF weights widened to float (%s): several times the memory of the file", reason)
    return False


def load_model(model: str, device: torch.device, dtype: torch.dtype, quantization: str | None = None) -> LoadedModel:
    """The model's weights in ``dtype`` on ``device``. A GGUF file's quantized weights stay in
    their blocks by default on CPU (gguf_blocks_kept; kvserve.model.gguf_linear); with
    ``quantization`` "int8" the linear layers become Int8Linear, the LM head included, behind
    Hadamard rotations (kvserve.model.rotation), and the embedding Int8Embedding; "none" widens
    every weight to ``dtype``."""
    path = resolve_model_path(model)
    keep_blocks = gguf_blocks_kept(path, device, quantization)
    model_config, weights = load_checkpoint_blocks(path, keep_quantized=keep_blocks)
    key_name = "model.layers.0.self_attn.k_proj.weight"
    fingerprint = model_fingerprint(asdict(model_config),
                                    {key_name: rows_as_float(weights[key_name])} if key_name in weights else {})
    model_class = DeepseekForCausalLM if model_config.mla is not None else LlamaForCausalLM
    with weights_uninitialized():
        module = model_class(model_config, model_config.max_position_embeddings)
    module.load_weights(weights)
    del weights
    module = module.to(device=device, dtype=dtype).eval()
    for name in ("rope_cos", "rope_sin", "local_rope_cos", "local_rope_sin"):  # rotary tables stay float32
        setattr(module, name, getattr(module, name).float())
    weight_format = str(dtype).removeprefix("torch.")
    if quantization == "int8":
        stream_rotated = rotate_residual_stream(module)
        quantize_linears(module, quantization, rotate=run_time_rotations(module, stream_rotated))
        fuse_norms_into_int8(module)
        setattr(module, "embed_tokens", Int8Embedding(module.embed_tokens))  # noqa: B010 (nn.Embedding's slot)
        weight_format = "int8"
    for embedding in module.modules():
        if isinstance(embedding, GGUFEmbedding):
            embedding.dtype = dtype
    if packed_weights(module):
        weight_format = "gguf " + "+".join(packed_formats(module))
    weight_bytes = (sum(p.numel() * p.element_size() for p in module.parameters()) + quantized_bytes(module)
                    + packed_bytes(module))
    pack_linears_for_cpu(module)
    fuse_swiglu(module)
    weights_on_huge_pages(module)
    return LoadedModel(path, model_config, module, load_tokenizer(path), weight_bytes, fingerprint, quantization,
                       weight_format)


def kv_cache_groups(config: ModelConfig, all_full: bool = False) -> list[KVCacheGroup]:
    """The model's KV cache groups (kv_groups): by each layer's window, or with ``all_full``
    one group of every layer, each keeping every block."""
    if all_full or not config.layer_windows:
        return [KVCacheGroup(FULL_ATTENTION, tuple(range(config.num_layers)))]
    return group_layers([KVCacheSpec(window) for window in config.layer_windows])


class DraftModel(NamedTuple):
    model: LlamaForCausalLM  # a model of its own, or the target's shallow exit (weights shared)
    weight_bytes: int  # what it adds to the target's weights
    relative_cost: float  # one draft token's forward pass, in target decode steps (by weights or layers)


def warn_if_matmuls_emulated(device: torch.device, dtype: torch.dtype) -> None:
    """Say so where torch has no native matmul for a 16-bit model dtype on this CPU (no AVX-512:
    an AVX2 CPU emulates bf16 and float16 products), with the way out."""
    native = {torch.bfloat16: torch.ops.mkldnn._is_mkldnn_bf16_supported,
              torch.float16: torch.ops.mkldnn._is_mkldnn_fp16_supported}.get(dtype)
    if device.type != "cpu" or native is None or native():
        return
    name = str(dtype).removeprefix("torch.")
    logger.warning("dtype %s: this CPU (%s) has no native %s matmul, so the linear layers run emulated, several "
                   "times slower than in float32 (bf16 on a Zen 3: the rest of a 32 x 4,096 decode step, mostly "
                   "linear layers, 500 ms against 126 ms; docs/benchmarks.md); --dtype float32 (the "
                   "CPU default) with --kv-cache-dtype bf16 keeps the KV memory saving at float32 speed",
                   name, torch.backends.cpu.get_cpu_capability(), name)
