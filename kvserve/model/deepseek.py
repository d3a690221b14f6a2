"""DeepSeek-V2/V3 over a latent paged KV cache: multi-head latent attention (MLA) and MoE.

MLA caches, per token and layer, one vector shared by every head: the normalized latent c
(kv_lora_rank) and the rotary key k_pe (qk_rope_head_dim). A head's key is [W_UK_h c, k_pe]
and its value W_UV_h c, where kv_b_proj stacks W_UK and W_UV. With **weight absorption** (the
default) those up-projections are never applied to cached tokens: the query's no-rope part is
folded through W_UK (q_lat_h = W_UK_h^T q_nope_h), so q_h . k_h = [q_lat_h, q_pe_h] . [c, k_pe]
and every head attends over the cached vectors themselves, like MQA with one head of
kv_lora_rank + qk_rope_head_dim; the output stays in latent space until W_UV_h brings it to
v_head_dim. ``absorb = False`` up-projects every cached token's key and value instead (the
reference, and the baseline of benchmarks/mla.py).

MoE layers route each token to its top-k experts (softmax scores for V2; sigmoid scores with a
correction bias, group-limited choice and renormalized weights for V3) and run as a plain loop
over the experts that got tokens, plus the shared experts: correctness first.

DeepSeek lays its rotary channels out in interleaved pairs; the loader permutes those weight
rows to split halves once, so the rotary op is the one every other model uses (q . k is
unchanged by a permutation applied to both).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.cache.kv_layer import LayerKV
from kvserve.model.attention import AttentionMetadata, paged_latent_attention
from kvserve.model.llama import LlamaForCausalLM, WeightReader, add_rms_norm, silu_and_mul
from kvserve.model.loader import MLAConfig, ModelConfig, MoEConfig
from kvserve.model.rope import RotaryTables, apply_rope, yarn_factor, yarn_mscale


def deinterleave(rows: torch.Tensor, start: int, width: int, period: int) -> torch.Tensor:
    """Rows [start, start + width) of every ``period`` rows reordered from interleaved pairs
    (x0, x1, x2, x3, ...) to halves (x0, x2, ..., x1, x3, ...)."""
    out = rows.clone()
    order = torch.cat((torch.arange(0, width, 2), torch.arange(1, width, 2)))
    for base in range(0, rows.shape[0], period):
        out[base + start : base + start + width] = rows[base + start + order]
    return out


class GatedMLP(nn.Module):
    """SwiGLU MLP (dense layers and shared experts), gate and up fused."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class MoE(nn.Module):
    """Routed experts (stacked weights) and shared experts."""

    def __init__(self, hidden: int, moe: MoEConfig) -> None:
        super().__init__()
        self.moe = moe
        self.gate = nn.Parameter(torch.zeros(moe.num_experts, hidden))  # router, float32 logits
        self.score_bias = nn.Parameter(torch.zeros(moe.num_experts)) if moe.scoring == "sigmoid" else None
        self.gate_up = nn.Parameter(torch.zeros(moe.num_experts, 2 * moe.intermediate_size, hidden))
        self.down = nn.Parameter(torch.zeros(moe.num_experts, hidden, moe.intermediate_size))
        shared = moe.intermediate_size * moe.num_shared_experts
        self.shared = GatedMLP(hidden, shared) if shared else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, expert ids [T, k]) as HF's DeepSeek routers pick them."""
        moe = self.moe
        logits = F.linear(x.float(), self.gate.float())
        scores = logits.softmax(-1) if moe.scoring == "softmax" else logits.sigmoid()
        choice = scores if self.score_bias is None else scores + self.score_bias.float()
        if moe.num_groups and moe.topk_groups:
            grouped = choice.view(-1, moe.num_groups, moe.num_experts // moe.num_groups)
            # V2 ranks groups by their best expert, V3 by its two best
            group_scores = grouped.max(-1).values if moe.scoring == "softmax" else grouped.topk(2, -1)[0].sum(-1)
            keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(moe.topk_groups, -1)[1], 1)
            keep = keep.bool().unsqueeze(-1).expand_as(grouped).reshape_as(choice)
            choice = choice.masked_fill(~keep, 0.0 if moe.scoring == "softmax" else float("-inf"))
        ids = choice.topk(moe.experts_per_token, -1)[1]
        weights = scores.gather(1, ids)
        if moe.normalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * moe.routed_scaling_factor, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        out = torch.zeros_like(x)
        for expert in ids.unique().tolist():
            rows, slot = torch.where(ids == expert)
            h = silu_and_mul(F.linear(x[rows], self.gate_up[expert]))
            h = F.linear(h, self.down[expert]) * weights[rows, slot, None]
            out.index_add_(0, rows, h.to(out.dtype))
        if self.shared is not None:
            out += self.shared(x)
        return out


class MLAAttention(nn.Module):
    def __init__(self, config: ModelConfig, mla: MLAConfig) -> None:
        super().__init__()
        hidden, heads = config.hidden_size, config.num_heads
        self.mla, self.num_heads, self.eps = mla, heads, config.rms_norm_eps
        qk_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        bias = config.attention_bias
        if mla.q_lora_rank is None:
            self.q_proj: nn.Linear | None = nn.Linear(hidden, heads * qk_dim, bias=False)
            self.q_a_proj = self.q_b_proj = None
            self.q_a_layernorm = None
        else:
            self.q_proj = None
            self.q_a_proj = nn.Linear(hidden, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = nn.Parameter(torch.ones(mla.q_lora_rank))
            self.q_b_proj = nn.Linear(mla.q_lora_rank, heads * qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, mla.latent_dim, bias=bias)
        self.kv_a_layernorm = nn.Parameter(torch.ones(mla.kv_lora_rank))
        # kv_b_proj split per head: W_UK [heads, nope, rank] and W_UV [heads, v, rank]
        self.w_uk = nn.Parameter(torch.zeros(heads, mla.qk_nope_head_dim, mla.kv_lora_rank))
        self.w_uv = nn.Parameter(torch.zeros(heads, mla.v_head_dim, mla.kv_lora_rank))
        self.o_proj = nn.Linear(heads * mla.v_head_dim, hidden, bias=bias)
        self.scale = qk_dim**-0.5
        scaling = config.rope_scaling or {}
        if scaling.get("rope_type", scaling.get("type")) == "yarn" and scaling.get("mscale_all_dim"):
            # DeepSeek's YaRN also sharpens the softmax (HF's yarn_get_mscale, squared)
            self.scale *= yarn_mscale(yarn_factor(scaling, config.max_position_embeddings),
                                      scaling["mscale_all_dim"]) ** 2
        self.absorb = True

    def forward(self, x: torch.Tensor, rope: RotaryTables, kv: LayerKV, meta: AttentionMetadata) -> torch.Tensor:
        mla, tokens = self.mla, x.shape[0]
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_a_proj is not None and self.q_b_proj is not None and self.q_a_layernorm is not None
            q_a = self.q_a_proj(x)
            q = self.q_b_proj(F.rms_norm(q_a, (q_a.shape[-1],), self.q_a_layernorm, self.eps))
        q = q.view(tokens, self.num_heads, -1)
        q_nope, q_pe = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        latent = F.rms_norm(latent, (mla.kv_lora_rank,), self.kv_a_layernorm, self.eps)
        q_pe = apply_rope(q_pe, rope.cos, rope.sin)
        k_pe = apply_rope(k_pe.unsqueeze(1), rope.cos, rope.sin)
        kv.write(torch.cat((latent.unsqueeze(1), k_pe), dim=-1), None, meta.write)  # type: ignore[arg-type]
        if self.absorb:
            q_lat = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)  # [T, heads, rank]
            o_lat = paged_latent_attention(torch.cat((q_lat, q_pe), dim=-1), kv, meta, self.scale, mla.kv_lora_rank)
            out = torch.bmm(o_lat.transpose(0, 1), self.w_uv.transpose(1, 2)).transpose(0, 1)  # [T, heads, v]
        else:
            out = paged_latent_attention(torch.cat((q_nope, q_pe), dim=-1), kv, meta, self.scale, mla.v_head_dim,
                                         expand=self.expand)
        return self.o_proj(out.reshape(tokens, -1))

    def expand(self, cached: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached vectors [B, L, rank + rope] up-projected to every head's key [B, H, L, nope +
        rope] and value [B, H, L, v] (the path absorption avoids)."""
        rank = self.mla.kv_lora_rank
        latent, k_pe = cached[..., :rank], cached[..., rank:]
        k_nope = torch.einsum("blr,hnr->bhln", latent, self.w_uk)
        keys = torch.cat((k_nope, k_pe.unsqueeze(1).expand(-1, self.num_heads, -1, -1)), dim=-1)
        return keys, torch.einsum("blr,hvr->bhlv", latent, self.w_uv)


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, mla: MLAConfig, dense: bool) -> None:
        super().__init__()
        self.eps = config.rms_norm_eps
        self.input_layernorm = nn.Parameter(torch.ones(config.hidden_size))
        self.ffn_norm = nn.Parameter(torch.ones(config.hidden_size))
        self.self_attn = MLAAttention(config, mla)
        self.mlp: nn.Module = (GatedMLP(config.hidden_size, config.intermediate_size) if dense or config.moe is None
                               else MoE(config.hidden_size, config.moe))

    def forward(self, hidden: torch.Tensor, delta: torch.Tensor | None, ropes: tuple[RotaryTables, RotaryTables],
                kv: LayerKV, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """As llama.DecoderLayer: the residual stream in place, this layer's MLP output returned."""
        x = add_rms_norm(hidden, delta, self.input_layernorm, self.eps)
        x = add_rms_norm(hidden, self.self_attn(x, ropes[0], kv, meta), self.ffn_norm, self.eps)
        return hidden, self.mlp(x)


class DeepseekForCausalLM(LlamaForCausalLM):
    """DeepseekV2ForCausalLM / DeepseekV3ForCausalLM (the embedding, final norm, head, rotary
    tables and forward loop are llama.LlamaForCausalLM's)."""

    def build_layers(self, config: ModelConfig, local_rope: list[bool]) -> list[nn.Module]:
        assert config.mla is not None
        dense = config.moe.first_dense_layers if config.moe is not None else config.num_layers
        return [DeepseekDecoderLayer(config, config.mla, i < dense) for i in range(config.num_layers)]

    def load_layer_weights(self, reader: WeightReader, p: str, layer: DeepseekDecoderLayer) -> None:  # type: ignore[override]
        take, put = reader.take_tensor, reader.put
        attn, mla = layer.self_attn, self.config.mla
        assert mla is not None
        reader.put_norm(layer.input_layernorm, p + "input_layernorm.weight")
        reader.put_norm(layer.ffn_norm, p + "post_attention_layernorm.weight")
        qk_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim

        def rope_rows(tensor: torch.Tensor, start: int, period: int) -> torch.Tensor:
            return deinterleave(tensor, start, mla.qk_rope_head_dim, period) if mla.rope_interleave else tensor

        q_out = attn.q_proj if attn.q_proj is not None else attn.q_b_proj
        assert q_out is not None
        name = "q_proj" if attn.q_proj is not None else "q_b_proj"
        put(q_out.weight, rope_rows(take(p + f"self_attn.{name}.weight"), mla.qk_nope_head_dim, qk_dim))
        if attn.q_a_proj is not None and attn.q_a_layernorm is not None:
            put(attn.q_a_proj.weight, take(p + "self_attn.q_a_proj.weight"))
            reader.put_norm(attn.q_a_layernorm, p + "self_attn.q_a_layernorm.weight")
        kv_a = p + "self_attn.kv_a_proj_with_mqa."
        put(attn.kv_a_proj_with_mqa.weight, rope_rows(take(kv_a + "weight"), mla.kv_lora_rank, mla.latent_dim))
        for module, prefix in ((attn.q_a_proj, p + "self_attn.q_a_proj."), (attn.kv_a_proj_with_mqa, kv_a),
                               (attn.o_proj, p + "self_attn.o_proj.")):
            if module is not None and module.bias is not None:
                bias = take(prefix + "bias")
                put(module.bias, rope_rows(bias, mla.kv_lora_rank, mla.latent_dim) if prefix == kv_a else bias)
        reader.put_norm(attn.kv_a_layernorm, p + "self_attn.kv_a_layernorm.weight")
        kv_b = take(p + "self_attn.kv_b_proj.weight").view(self.config.num_heads, -1, mla.kv_lora_rank)
        put(attn.w_uk, kv_b[:, : mla.qk_nope_head_dim])
        put(attn.w_uv, kv_b[:, mla.qk_nope_head_dim :])
        put(attn.o_proj.weight, take(p + "self_attn.o_proj.weight"))
        mlp = layer.mlp
        if isinstance(mlp, MoE):
            e = p + "mlp.experts."
            experts = range(mlp.moe.num_experts)
            put(mlp.gate, take(p + "mlp.gate.weight"))
            if mlp.score_bias is not None:
                put(mlp.score_bias, take(p + "mlp.gate.e_score_correction_bias"))
            put(mlp.gate_up, torch.stack([torch.cat((take(f"{e}{i}.gate_proj.weight"), take(f"{e}{i}.up_proj.weight")))
                                          for i in experts]))
            put(mlp.down, torch.stack([take(f"{e}{i}.down_proj.weight") for i in experts]))
            if mlp.shared is not None:
                reader.put_gated_mlp(p + "mlp.shared_experts.", mlp.shared)
        else:
            assert isinstance(mlp, GatedMLP)
            reader.put_gated_mlp(p + "mlp.", mlp)
