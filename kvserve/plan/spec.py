"""ModelSpec: the numbers capacity planning needs, from a config.json, a GGUF file, the default
model alias, explicit flags, or a built-in preset."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvserve.cache.kv_format import KVLayout


class SpecError(ValueError):
    """A model description that cannot be planned for; the message names what is wrong."""


_DTYPE_NAMES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    params: int  # total parameters (all experts for MoE models)
    dtype: str = "bf16"  # weights and, with kv dtype auto, the KV cache
    hidden_size: int = 0  # 0: unknown (activation estimate uses heads x head_dim)
    intermediate_size: int = 0
    vocab_size: int = 0
    max_position_embeddings: int = 0  # 0: unknown
    kv_lora_rank: int = 0  # MLA: the cache holds kv_lora_rank + qk_rope_head_dim per layer
    qk_rope_head_dim: int = 0
    sliding_window: int = 0  # 0: none; else the window of the sliding layers
    num_sliding_layers: int = 0
    served_weight_bytes: int = 0  # a GGUF's weights as served (packed blocks + float32 rest); 0: by dtype

    def __post_init__(self) -> None:
        for field_name in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "params"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or value <= 0:
                raise SpecError(f"{field_name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise SpecError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if not 0 <= self.num_sliding_layers <= self.num_layers:
            raise SpecError(f"num_sliding_layers={self.num_sliding_layers} must lie in 0..{self.num_layers}")
        if self.num_sliding_layers and self.sliding_window <= 0:
            raise SpecError("sliding layers need a positive sliding_window")

    @property
    def attention(self) -> str:
        """mla, mha, mqa or gqa."""
        if self.kv_lora_rank:
            return "mla"
        if self.num_kv_heads == self.num_heads:
            return "mha"
        return "mqa" if self.num_kv_heads == 1 else "gqa"

    @property
    def kv_layout(self) -> KVLayout:
        if self.kv_lora_rank:
            return KVLayout.mla(self.kv_lora_rank, self.qk_rope_head_dim)
        return KVLayout.standard(self.num_kv_heads, self.head_dim)

    def with_dtype(self, dtype: str) -> ModelSpec:
        return replace(self, dtype=dtype)

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_hf_config(cls, config: str | Path | dict[str, Any], name: str | None = None,
                       params: int | None = None) -> ModelSpec:
        """From a config.json (path, folder or parsed dict). Understands GQA/MQA (num_key_value_heads),
        explicit head_dim, MLA (kv_lora_rank), sliding windows (sliding_window with layer_types,
        sliding_window_pattern or use_sliding_window/max_window_layers), nested text_config."""
        if isinstance(config, dict):
            cfg, source = config, name or "config"
        else:
            path = Path(config)
            if path.is_dir():
                path = path / "config.json"
            if not path.is_file():
                raise SpecError(f"no config.json at {str(path)!r}")
            try:
                cfg = json.loads(path.read_text())
            except json.JSONDecodeError as exc:
                raise SpecError(f"{path} is not valid JSON: {exc}") from exc
            source = str(path)
        if isinstance(cfg.get("text_config"), dict):  # multimodal wrappers (Gemma 3, Llava, ...)
            cfg = {**cfg, **cfg["text_config"]}
        missing = [k for k in ("num_hidden_layers", "num_attention_heads") if k not in cfg]
        if "head_dim" not in cfg and "hidden_size" not in cfg and "kv_lora_rank" not in cfg:
            missing.append("hidden_size (or head_dim)")
        if missing:
            raise SpecError(f"{source} lacks {', '.join(missing)}, needed to size the KV cache")
        layers, heads = int(cfg["num_hidden_layers"]), int(cfg["num_attention_heads"])
        hidden = int(cfg.get("hidden_size") or 0)
        head_dim = int(cfg.get("head_dim") or (hidden // heads if hidden else 0))
        if cfg.get("kv_lora_rank"):
            head_dim = head_dim or int(cfg.get("qk_nope_head_dim", 0)) + int(cfg.get("qk_rope_head_dim", 0))
        window, sliding = _sliding_layers(cfg, layers)
        dtype = _DTYPE_NAMES.get(str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"), "bf16")
        return cls(
            name=name or cfg.get("_name_or_path") or cfg.get("model_type") or source,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            params=params or estimate_params(cfg),
            dtype=dtype,
            hidden_size=hidden,
            intermediate_size=int(cfg.get("intermediate_size") or 0),
            vocab_size=int(cfg.get("vocab_size") or 0),
            max_position_embeddings=int(cfg.get("max_position_embeddings") or 0),
            kv_lora_rank=int(cfg.get("kv_lora_rank") or 0),
            qk_rope_head_dim=int(cfg.get("qk_rope_head_dim") or 0) if cfg.get("kv_lora_rank") else 0,
            sliding_window=window,
            num_sliding_layers=sliding,
        )

    @classmethod
    def from_model(cls, model: str) -> ModelSpec:
        """A model alias (smollm2-135m), a .gguf file, a folder or a config.json."""
        from kvserve.model.loader import ModelLoadError, load_model_config, resolve_model_path

        path = Path(model).expanduser()
        if path.suffix == ".json" or (path.is_dir() and (path / "config.json").exists()):
            return cls.from_hf_config(path)
        try:
            resolved = resolve_model_path(model)
            config = load_model_config(resolved)
        except ModelLoadError as exc:
            raise SpecError(str(exc)) from exc
        cfg: dict[str, Any] = {
            "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
            "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim,
            "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
            "vocab_size": config.vocab_size, "tie_word_embeddings": config.tie_word_embeddings,
            "max_position_embeddings": config.max_position_embeddings,
        }
        if any(config.layer_windows):
            cfg["sliding_window"] = max(config.layer_windows)
            cfg["layer_types"] = ["sliding_attention" if w else "full_attention" for w in config.layer_windows]
        spec = cls.from_hf_config(cfg, name=model)
        if resolved.suffix == ".gguf":  # served in its blocks: the planner counts those bytes
            spec = replace(spec, served_weight_bytes=gguf_served_bytes(resolved))
        return spec


def gguf_served_bytes(path: Path) -> int:
    """The bytes of a GGUF file's weights as kvserve serves them on CPU (the default: quantized
    weights in their blocks, the rest in float32), without loading them."""
    from kvserve.model.gguf_file import GGUFFile, served_bytes

    return sum(served_bytes(tensor, 4) for tensor in GGUFFile(path).tensors)


def _sliding_layers(cfg: dict[str, Any], layers: int) -> tuple[int, int]:
    """(window, number of layers that use it) from the config's sliding-window fields."""
    window = int(cfg.get("sliding_window") or 0)
    if not window or cfg.get("use_sliding_window") is False:
        return 0, 0
    if isinstance(cfg.get("layer_types"), list):
        return window, sum(1 for t in cfg["layer_types"] if t == "sliding_attention")
    pattern = cfg.get("sliding_window_pattern")
    if pattern:  # every pattern-th layer is global (Gemma 2/3)
        return window, layers - layers // int(pattern)
    if cfg.get("use_sliding_window") and cfg.get("max_window_layers") is not None:  # Qwen2-style
        return window, max(0, layers - int(cfg["max_window_layers"]))
    return window, layers  # Mistral v0.1: every layer


def estimate_params(cfg: dict[str, Any]) -> int:
    """Parameters of a decoder from its config: embeddings, attention, (MoE) MLP, norms,
    an untied LM head. An estimate for architectures with extras; pass params to override."""
    hidden = int(cfg.get("hidden_size") or 0)
    layers, heads = int(cfg.get("num_hidden_layers") or 0), int(cfg.get("num_attention_heads") or 0)
    if not hidden or not layers or not heads:
        raise SpecError("cannot estimate the parameter count without hidden_size; pass params (--params)")
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    vocab = int(cfg.get("vocab_size") or 0)
    inter = int(cfg.get("intermediate_size") or 4 * hidden)
    if cfg.get("kv_lora_rank"):
        rank, rope = int(cfg["kv_lora_rank"]), int(cfg.get("qk_rope_head_dim", 0))
        nope, v_dim = int(cfg.get("qk_nope_head_dim", head_dim)), int(cfg.get("v_head_dim", head_dim))
        q_rank = int(cfg.get("q_lora_rank") or 0)
        q = (hidden * q_rank + q_rank * heads * (nope + rope)) if q_rank else hidden * heads * (nope + rope)
        attention = q + hidden * (rank + rope) + rank * heads * (nope + v_dim) + heads * v_dim * hidden
    else:
        attention = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
    dense_mlp = 3 * hidden * inter
    experts = int(cfg.get("n_routed_experts") or cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if experts:
        moe_inter = int(cfg.get("moe_intermediate_size") or inter)
        shared = int(cfg.get("n_shared_experts") or 0)
        moe_mlp = 3 * hidden * moe_inter * (experts + shared) + hidden * experts
        dense_layers = int(cfg.get("first_k_dense_replace") or 0)
        mlp_total = dense_layers * dense_mlp + (layers - dense_layers) * moe_mlp
    else:
        mlp_total = layers * dense_mlp
    embeddings = vocab * hidden * (1 if cfg.get("tie_word_embeddings", False) else 2)
    return layers * (attention + 2 * hidden) + mlp_total + embeddings + hidden
