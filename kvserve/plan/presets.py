"""Built-in specs of well-known public architectures: the fields of their published config.json
files (text part), with their published parameter counts (rounded)."""

from __future__ import annotations

from typing import Any

from kvserve.plan.spec import ModelSpec, SpecError

_LLAMA31 = {"vocab_size": 128256, "max_position_embeddings": 131072, "torch_dtype": "bfloat16"}
_QWEN3 = {"vocab_size": 151936, "max_position_embeddings": 40960, "torch_dtype": "bfloat16", "head_dim": 128}

PRESETS: dict[str, tuple[dict[str, Any], int]] = {
    "llama-3.1-8b": ({**_LLAMA31, "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
                      "num_key_value_heads": 8, "intermediate_size": 14336}, 8_030_000_000),
    "llama-3.1-70b": ({**_LLAMA31, "num_hidden_layers": 80, "hidden_size": 8192, "num_attention_heads": 64,
                       "num_key_value_heads": 8, "intermediate_size": 28672}, 70_600_000_000),
    "llama-3.1-405b": ({**_LLAMA31, "num_hidden_layers": 126, "hidden_size": 16384, "num_attention_heads": 128,
                        "num_key_value_heads": 8, "intermediate_size": 53248}, 405_900_000_000),
    "qwen3-8b": ({**_QWEN3, "num_hidden_layers": 36, "hidden_size": 4096, "num_attention_heads": 32,
                  "num_key_value_heads": 8, "intermediate_size": 12288}, 8_190_000_000),
    "qwen3-32b": ({**_QWEN3, "num_hidden_layers": 64, "hidden_size": 5120, "num_attention_heads": 64,
                   "num_key_value_heads": 8, "intermediate_size": 25600}, 32_800_000_000),
    "mistral-7b-v0.1": ({"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
                         "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32000,
                         "max_position_embeddings": 32768, "sliding_window": 4096, "torch_dtype": "bfloat16"},
                        7_240_000_000),
    "deepseek-v2": ({"num_hidden_layers": 60, "hidden_size": 5120, "num_attention_heads": 128,
                     "num_key_value_heads": 128, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
                     "qk_nope_head_dim": 128, "v_head_dim": 128, "intermediate_size": 12288,
                     "moe_intermediate_size": 1536, "n_routed_experts": 160, "n_shared_experts": 2,
                     "first_k_dense_replace": 1, "vocab_size": 102400, "max_position_embeddings": 163840,
                     "torch_dtype": "bfloat16"}, 236_000_000_000),
    "deepseek-v2-lite": ({"num_hidden_layers": 27, "hidden_size": 2048, "num_attention_heads": 16,
                          "num_key_value_heads": 16, "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64,
                          "qk_nope_head_dim": 128, "v_head_dim": 128, "intermediate_size": 10944,
                          "moe_intermediate_size": 1408, "n_routed_experts": 64, "n_shared_experts": 2,
                          "first_k_dense_replace": 1, "vocab_size": 102400, "max_position_embeddings": 163840,
                          "torch_dtype": "bfloat16"}, 15_700_000_000),
    "deepseek-v3": ({"num_hidden_layers": 61, "hidden_size": 7168, "num_attention_heads": 128,
                     "num_key_value_heads": 128, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
                     "qk_nope_head_dim": 128, "v_head_dim": 128, "intermediate_size": 18432,
                     "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
                     "first_k_dense_replace": 3, "vocab_size": 129280, "max_position_embeddings": 163840,
                     "torch_dtype": "bfloat16"}, 671_000_000_000),
    "gemma-3-27b": ({"num_hidden_layers": 62, "hidden_size": 5376, "num_attention_heads": 32,
                     "num_key_value_heads": 16, "head_dim": 128, "intermediate_size": 21504, "vocab_size": 262208,
                     "max_position_embeddings": 131072, "sliding_window": 1024, "sliding_window_pattern": 6,
                     "torch_dtype": "bfloat16"}, 27_400_000_000),
}


def preset(name: str) -> ModelSpec:
    key = name.strip().lower()
    if key not in PRESETS:
        raise SpecError(f"unknown preset {name!r} (known: {', '.join(PRESETS)})")
    config, params = PRESETS[key]
    return ModelSpec.from_hf_config(config, name=key, params=params)
