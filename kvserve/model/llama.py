"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Gemma 3) over the paged KV cache.

RoPE with the config's theta and scaling, RMSNorm, GQA, SwiGLU, optional QKV bias
(Qwen2) and per-head q/k RMSNorm (Qwen3). Gemma 3 adds norms on the attention and MLP
outputs, a GELU-tanh gated MLP, scaled embeddings, norm weights applied as (1 + w) (folded in
at load), and a second rotary base for its sliding-window layers (the window itself is the
KV cache group's: see kv_groups and the runner's masks). Q/K/V and gate/up projections are
fused at load time to cut per-layer kernel launches.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.cache.kv_layer import LayerKV
from kvserve.model.attention import AttentionMetadata, paged_attention, rope_and_write_kv
from kvserve.model.cpu_kernels import cpu_op
from kvserve.model.gguf_file import GGUFWeight, rows_as_float
from kvserve.model.loader import ModelConfig, ModelLoadError
from kvserve.model.rope import RotaryTables, apply_rope, rope_attention_factor, rope_inv_freq, rope_tables


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """residual += delta in place (when given); returns rms_norm(residual) * weight.
    residual [T, hidden] contiguous. One C++ pass on CPU, torch ops elsewhere."""
    op = cpu_op("add_rms_norm") if residual.device.type == "cpu" else None
    if op is not None:
        return op(residual, delta, weight, eps)
    if delta is not None:
        residual.add_(delta)
    return F.rms_norm(residual, (residual.shape[-1],), weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation: silu(gate) * up for gate_up = [gate | up] ([T, 2 * inter])."""
    op = cpu_op("silu_and_mul") if gate_up.device.type == "cpu" else None
    if op is not None:
        return op(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU (Gemma): gelu_tanh(gate) * up for gate_up = [gate | up]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh").mul_(up)


ACTIVATIONS = {"silu": silu_and_mul, "gelu_tanh": gelu_tanh_and_mul}


def token_rows(x: torch.Tensor, features: int) -> torch.Tensor:
    """A linear layer's input [..., features] as rows [tokens, features]; the engine's 2-D
    inputs pass as they are (a reshape and the view back cost ~4.5 us of a 121-call step)."""
    return x if x.dim() == 2 else x.reshape(-1, features)


def shaped_like_input(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A linear layer's result rows [tokens, out_features] in its input's leading shape."""
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[-1])


def interleave_gate_up(per_group: torch.Tensor, out_features: int) -> torch.Tensor:
    """A gate_up projection's packed weight, or a per-channel tensor of it, regrouped in
    16-channel groups as (gate 0, up 0, gate 1, up 1, ...): the layout of the C++ GEMMs' gated
    form (``gated``), which then writes silu(gate) * up. out_features = [gate | up], 32 | it."""
    groups = out_features // 16
    order = torch.arange(groups, device=per_group.device).view(2, groups // 2).t().reshape(-1)
    return per_group.reshape(groups, -1)[order].reshape(per_group.shape)


class PackedLinear(nn.Module):
    """A linear layer whose weight is pre-packed once for the CPU's GEMM. bf16 weights on CPUs
    with AVX512-BF16: packed for kvserve's own GEMM (the ``bf16_linear`` C++ op: dot products,
    measured 1.2-1.7x oneDNN's speed at 16-64 rows on this model's shapes, 1.17x at 2,048; with
    AMX, tiles on the same packed weight from 2 rows, 30 layers at 1 / 32 / 1,024 rows in 0.74x /
    0.75x / 1.09x oneDNN's time); otherwise oneDNN's blocked layout (measured at decode batch
    sizes ~30% faster than F.linear in bf16, ~40% in fp32)."""

    packed_weight: torch.Tensor
    bias32: torch.Tensor | None

    def __init__(self, linear: nn.Linear, batch_hint: int = 32) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias
        self.gated = False  # fuse_silu: the output is silu(gate) * up [.., out_features / 2]
        weight = linear.weight.detach()
        pack = cpu_op("bf16_gemm_pack") if weight.dtype == torch.bfloat16 and weight.device.type == "cpu" else None
        packed = pack(weight) if pack is not None else []
        self._bf16_linear: Any = cpu_op("bf16_linear") if packed else None
        if packed:
            self.register_buffer("packed_weight", packed[0], persistent=False)
            # its bias in float32, padded to the packed groups (as Int8Linear's): once here, not per call
            self.register_buffer("bias32", None if linear.bias is None else F.pad(
                linear.bias.detach().float(), (0, 16 * packed[0].shape[0] - self.out_features)), persistent=False)
            self.bind_weights()
        else:
            packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
            self.register_buffer("packed_weight", packed_weight, persistent=False)

    def movable_weights(self) -> tuple[str, ...]:
        """The weight buffers huge_pages.weights_on_huge_pages may move: kvserve's packed form
        (oneDNN's is its own)."""
        return ("packed_weight",) if self._bf16_linear is not None else ()

    def bind_weights(self) -> None:
        """Read the op's weight arguments once (each buffer read through nn.Module costs ~0.5 us a
        call); the packed forms are CPU-only and built after the model is placed, never moved to
        another device (only within memory, by weights_on_huge_pages, which calls this again)."""
        self._bf16_args = (self.packed_weight, self.out_features, self.bias32, self.gated)

    def fuse_silu(self) -> bool:
        """Make this gate_up projection ([gate | up] outputs) return silu(gate) * up, computed in
        the GEMM from its float32 sums; False (nothing changed) without the C++ bf16 kernel or
        with out_features not a multiple of 32."""
        if self._bf16_linear is None or self.out_features % 32 != 0:
            return False
        self.packed_weight = interleave_gate_up(self.packed_weight, self.out_features)
        if self.bias32 is not None:
            self.bias32 = interleave_gate_up(self.bias32, self.out_features)
        self.gated = True
        self.bind_weights()
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._bf16_linear is not None:
            rows = token_rows(x, self.in_features)
            if rows.dtype != torch.bfloat16:  # a no-op .to() still costs ~0.8 us
                rows = rows.to(torch.bfloat16)
            out = self._bf16_linear(rows.contiguous(), *self._bf16_args)
            return shaped_like_input(out, x)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


@contextlib.contextmanager
def weights_uninitialized() -> Iterator[None]:
    """Build modules whose weights a checkpoint will overwrite (every one, or WeightReader
    raises) without drawing random ones first: kaiming_uniform_ costs ~1 s on the default model."""
    saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
    nn.Linear.reset_parameters = nn.Embedding.reset_parameters = _leave_uninitialized  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved  # type: ignore[method-assign]


def _leave_uninitialized(module: nn.Module) -> None:
    pass


def fuse_swiglu(model: nn.Module) -> int:
    """SwiGLU's activation into each decoder layer's gate_up GEMM wherever its layer type can
    (``fuse_silu``: the C++ bf16 and int8 kernels): one op and one pass over the [T, 2 x
    intermediate] products fewer per layer. Returns the number of layers fused."""
    fused = 0
    for layer in model.modules():
        if isinstance(layer, DecoderLayer) and layer.act_and_mul is silu_and_mul:
            fuse = getattr(layer.gate_up_proj, "fuse_silu", None)
            if fuse is not None and fuse():
                layer.act_and_mul = activation_applied
                fused += 1
    return fused


def activation_applied(x: torch.Tensor) -> torch.Tensor:
    """A fused layer's act_and_mul: its gate_up projection has already applied it."""
    return x


def pack_linears_for_cpu(model: nn.Module) -> bool:
    """Swap every nn.Linear for a PackedLinear when oneDNN supports the weights' dtype here.
    Returns False (and changes nothing) where it does not."""
    linears = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, nn.Linear)]
    if not linears or linears[0][2].weight.device.type != "cpu" or linears[0][2].weight.dtype not in (
        torch.float32, torch.bfloat16, torch.float16
    ) or not torch.backends.mkldnn.is_available():
        return False
    try:
        probe = PackedLinear(linears[0][2])
        x = torch.randn(3, probe.in_features, dtype=linears[0][2].weight.dtype)
        # a sanity check (torch.allclose: torch.testing would import torch.distributed, ~1 s)
        if not torch.allclose(probe(x).float(), linears[0][2](x).float(), atol=1e-2, rtol=1e-2):
            return False
    except (RuntimeError, AttributeError):
        return False
    for parent, name, child in linears:
        setattr(parent, name, PackedLinear(child))
    return True


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, local_rope: bool = False) -> None:
        """``local_rope``: a sliding-window layer of a model with a second rotary base (Gemma 3)."""
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.eps = config.rms_norm_eps
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_size, self.kv_size = q_size, kv_size
        self.local_rope = local_rope
        self.input_layernorm = nn.Parameter(torch.ones(config.hidden_size))
        self.ffn_norm = nn.Parameter(torch.ones(config.hidden_size))  # before the MLP (HF Llama's post_attention)
        # Gemma: norms on the attention output and on the MLP output, before each residual add
        self.attn_out_norm = nn.Parameter(torch.ones(config.hidden_size)) if config.sandwich_norms else None
        self.ffn_out_norm = nn.Parameter(torch.ones(config.hidden_size)) if config.sandwich_norms else None
        self.act_and_mul: Callable[[torch.Tensor], torch.Tensor] = ACTIVATIONS[config.hidden_act]
        # int8_linear.fuse_norms_into_int8: the QKV and gate/up projections take the residual
        # stream and normalize it themselves (norm weights of one)
        self.norms_in_projections = False
        self.qkv_proj = nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=False)
        self.q_norm = nn.Parameter(torch.ones(self.head_dim)) if config.qk_norm else None
        self.k_norm = nn.Parameter(torch.ones(self.head_dim)) if config.qk_norm else None
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.scale = (config.query_pre_attn_scalar or self.head_dim) ** -0.5

    def forward(
        self,
        hidden: torch.Tensor,
        delta: torch.Tensor | None,
        ropes: tuple[RotaryTables, RotaryTables],
        kv: LayerKV,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden is the residual stream, owned by the forward pass and updated in place; delta
        is the previous layer's MLP output, not yet added (the add is fused into the norm).
        Returns (hidden, this layer's MLP output). ``ropes``: (global, local) rotary tables."""
        num_tokens = hidden.shape[0]
        rope = ropes[self.local_rope]
        heads, kv_heads = self.num_heads, self.num_kv_heads
        qkv = self.normed_projection(self.qkv_proj, hidden, delta, self.input_layernorm)
        qkv = qkv.view(num_tokens, heads + 2 * kv_heads, self.head_dim)
        v = qkv[:, heads + kv_heads :]
        rewrite = meta.query_observer is None  # an observed recompute reads the K/V already cached
        if meta.fused_rope_write and self.q_norm is None and meta.kv_observer is None and rewrite \
                and rope_and_write_kv(qkv, rope.cos32, rope.sin32, kv, meta, heads):
            q = qkv[:, :heads]
        elif self.q_norm is not None and self.k_norm is not None:
            q = apply_rope(F.rms_norm(qkv[:, :heads], (self.head_dim,), self.q_norm, self.eps), rope.cos, rope.sin)
            k = apply_rope(F.rms_norm(qkv[:, heads : heads + kv_heads], (self.head_dim,), self.k_norm, self.eps),
                           rope.cos, rope.sin)
            if meta.kv_observer is not None:
                meta.kv_observer(kv, k, v)
            if rewrite:
                kv.write(k, v, meta.write)
        else:  # one rotary call for the query and key heads together
            qk = apply_rope(qkv[:, : heads + kv_heads], rope.cos, rope.sin)
            q = qk[:, :heads]
            if meta.kv_observer is not None:
                meta.kv_observer(kv, qk[:, heads:], v)
            if rewrite:
                kv.write(qk[:, heads:], v, meta.write)
        if meta.query_observer is not None:
            meta.query_observer(kv, q)
        attn = self.o_proj(paged_attention(q, kv, meta, self.scale).view(num_tokens, self.q_size))
        if self.attn_out_norm is not None:
            attn = F.rms_norm(attn, (attn.shape[-1],), self.attn_out_norm, self.eps)
        mlp = self.down_proj(self.act_and_mul(self.normed_projection(self.gate_up_proj, hidden, attn, self.ffn_norm)))
        if self.ffn_out_norm is not None:
            mlp = F.rms_norm(mlp, (mlp.shape[-1],), self.ffn_out_norm, self.eps)
        return hidden, mlp

    def normed_projection(self, projection: nn.Module, hidden: torch.Tensor, delta: torch.Tensor | None,
                          norm: torch.Tensor) -> torch.Tensor:
        """projection(rms_norm(hidden += delta) * norm), hidden updated in place: in one op where
        the projection normalizes its own input (norms_in_projections)."""
        if self.norms_in_projections:
            return cast(Any, projection).forward_after_norm(hidden, delta, self.eps)
        return projection(add_rms_norm(hidden, delta, norm, self.eps))


class LlamaForCausalLM(nn.Module):
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor
    local_rope_cos: torch.Tensor
    local_rope_sin: torch.Tensor

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        local = [bool(config.local_rope_theta) and bool(w) for w in config.layer_windows or [0] * config.num_layers]
        layers = self.build_layers(config, local)
        self.layers = nn.ModuleList(layers)
        self.decoder_layers: list[Any] = layers  # the same modules, each called as a DecoderLayer is
        self.uses_local_rope = any(local)
        self.norm = nn.Parameter(torch.ones(config.hidden_size))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.embed_scale = config.hidden_size**0.5 if config.embed_scale else None
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        self.register_buffer("local_rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("local_rope_sin", torch.empty(0), persistent=False)
        self.extend_rope(max_positions)

    def extend_rope(self, max_positions: int) -> None:
        """Rotary tables for positions below ``max_positions`` (at least). Streaming eviction
        lets a sequence outgrow the model's context while its attention spans stay within it."""
        if max_positions <= self.rope_cos.shape[0]:
            return
        config, device = self.config, self.rope_cos.device
        size = max(max_positions, 2 * self.rope_cos.shape[0])
        cos, sin = rope_tables(rope_inv_freq(config), size)
        self.rope_cos = (cos * rope_attention_factor(config)).to(device)
        self.rope_sin = (sin * rope_attention_factor(config)).to(device)
        local = rope_tables(rope_inv_freq(config, local=True), size) if self.uses_local_rope else None
        self.local_rope_cos = self.rope_cos if local is None else local[0].to(device)
        self.local_rope_sin = self.rope_sin if local is None else local[1].to(device)

    def build_layers(self, config: ModelConfig, local_rope: list[bool]) -> list[nn.Module]:
        """The decoder layers: each is called (hidden, delta, ropes, kv, meta) -> (hidden, delta)."""
        return [DecoderLayer(config, local_rope[i]) for i in range(config.num_layers)]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[LayerKV],
        metas: list[AttentionMetadata],
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm, for the flat batch of tokens.
        ``metas[i]``: layer i's attention metadata (its KV cache group's)."""
        hidden = self.embed_tokens(input_ids)
        if self.embed_scale is not None:  # in the model dtype, as HF rounds it
            hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)

        def tables(cos_table: torch.Tensor, sin_table: torch.Tensor) -> RotaryTables:
            cos32, sin32 = cos_table[positions], sin_table[positions]
            return RotaryTables(cos32, sin32, cos32.to(hidden.dtype).unsqueeze(1),
                                sin32.to(hidden.dtype).unsqueeze(1))

        rope = tables(self.rope_cos, self.rope_sin)
        ropes = (rope, tables(self.local_rope_cos, self.local_rope_sin) if self.uses_local_rope else rope)
        delta: torch.Tensor | None = None
        for layer, kv_cache, meta in zip(self.decoder_layers, kv_caches, metas, strict=True):
            hidden, delta = layer(hidden, delta, ropes, kv_cache, meta)
        return add_rms_norm(hidden, delta, self.norm, self.config.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    @torch.no_grad()
    def load_weights(self, weights: dict[str, Any]) -> None:
        """Copy HF-named float32 weights in (each layer by load_layer_weights; a GGUFWeight's layer
        becomes a packed one instead); every weight must be used."""
        reader = WeightReader(weights, self.config.norm_offset)
        reader.put_embedding(self, "embed_tokens", reader.take("model.embed_tokens.weight"))
        reader.put_norm(self.norm, "model.norm.weight")
        lm_head = reader.weights.pop("lm_head.weight", None)
        if lm_head is not None:
            reader.put_linear(self, "lm_head", [lm_head])
        elif isinstance(self.embed_tokens, nn.Embedding):  # tied embeddings share one tensor
            self.lm_head.weight = self.embed_tokens.weight
        else:
            self.lm_head = reader.tied_head(self.embed_tokens)
        for i, layer in enumerate(self.decoder_layers):
            self.load_layer_weights(reader, f"model.layers.{i}.", layer)
        leftovers = [k for k in reader.weights if "rotary_emb" not in k]
        if leftovers:
            raise ModelLoadError(f"checkpoint has weights the model does not use: {leftovers[:5]}")

    def load_layer_weights(self, reader: WeightReader, p: str, layer: DecoderLayer) -> None:
        """One layer's weights (names prefixed ``p``), fusing q/k/v and gate/up."""
        take, put_norm = reader.take, reader.put_norm
        put_norm(layer.input_layernorm, p + "input_layernorm.weight")
        if layer.attn_out_norm is not None and layer.ffn_out_norm is not None:  # Gemma's four norms
            put_norm(layer.attn_out_norm, p + "post_attention_layernorm.weight")
            put_norm(layer.ffn_norm, p + "pre_feedforward_layernorm.weight")
            put_norm(layer.ffn_out_norm, p + "post_feedforward_layernorm.weight")
        else:
            put_norm(layer.ffn_norm, p + "post_attention_layernorm.weight")
        qkv_bias = None
        if layer.qkv_proj.bias is not None:
            qkv_bias = torch.cat([reader.take_tensor(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
        reader.put_linear(layer, "qkv_proj", [take(p + f"self_attn.{n}_proj.weight") for n in "qkv"], qkv_bias)
        reader.put_linear(layer, "o_proj", [take(p + "self_attn.o_proj.weight")])
        if layer.q_norm is not None and layer.k_norm is not None:
            put_norm(layer.q_norm, p + "self_attn.q_norm.weight")
            put_norm(layer.k_norm, p + "self_attn.k_norm.weight")
        reader.put_gated_mlp(p + "mlp.", layer)


class WeightReader:
    """Hands out a checkpoint's HF-named weights once each; what is left over was not used. A GGUF
    loaded with its blocks kept (loader.load_checkpoint_blocks) gives its quantized weights as
    GGUFWeight: the linear layers and the embedding they fill are swapped for packed ones
    (kvserve.model.gguf_linear) instead of being copied into."""

    def __init__(self, weights: dict[str, Any], norm_offset: bool = False) -> None:
        self.weights = dict(weights)
        self.norm_offset = norm_offset  # Gemma: norm weights w are applied as (1 + w)

    def take(self, name: str) -> torch.Tensor | GGUFWeight:
        if name not in self.weights:
            raise ModelLoadError(f"checkpoint is missing weight {name!r}")
        return self.weights.pop(name)

    def take_tensor(self, name: str) -> torch.Tensor:
        """A weight in float (a norm, a bias: never kept in blocks)."""
        return rows_as_float(self.take(name))

    @staticmethod
    def check_shape(got: tuple[int, ...], want: tuple[int, ...]) -> None:
        if tuple(got) != tuple(want):
            raise ModelLoadError(f"weight shape {tuple(got)} does not match {tuple(want)}")

    def put(self, param: Any, tensor: torch.Tensor) -> None:
        self.check_shape(tensor.shape, param.shape)
        param.copy_(tensor)

    def put_norm(self, param: Any, name: str) -> None:
        tensor = self.take_tensor(name)
        self.put(param, tensor + 1.0 if self.norm_offset else tensor)

    def put_linear(self, owner: nn.Module, name: str, parts: list[torch.Tensor | GGUFWeight],
                   bias: torch.Tensor | None = None) -> None:
        """owner.<name>, an nn.Linear, from its weight's parts stacked by rows (a fused QKV or
        gate/up projection has several): a GGUFLinear on the packed blocks where every part is a
        GGUFWeight, else the parts in float copied in."""
        linear = getattr(owner, name)
        if all(isinstance(part, GGUFWeight) for part in parts):
            shapes = [part.shape for part in parts]
            if sum(rows for rows, _ in shapes) != linear.out_features or any(
                    cols != linear.in_features for _, cols in shapes):
                raise ModelLoadError(f"weight shapes {shapes} do not make {tuple(linear.weight.shape)}")
            from kvserve.model.gguf_linear import GGUFLinear, PackedWeight  # it imports this module

            setattr(owner, name, GGUFLinear([PackedWeight.of(cast(GGUFWeight, part)) for part in parts], bias))
            return
        floats = [rows_as_float(part) for part in parts]
        self.put(linear.weight, floats[0] if len(floats) == 1 else torch.cat(floats))
        if bias is not None:
            self.put(linear.bias, bias)

    def put_embedding(self, owner: nn.Module, name: str, weight: torch.Tensor | GGUFWeight) -> None:
        """owner.<name>, an nn.Embedding: a GGUFEmbedding on the packed blocks of a GGUFWeight."""
        embedding = getattr(owner, name)
        if not isinstance(weight, GGUFWeight):
            self.put(embedding.weight, weight)
            return
        self.check_shape(weight.shape, embedding.weight.shape)
        from kvserve.model.gguf_linear import GGUFEmbedding, PackedWeight

        setattr(owner, name, GGUFEmbedding(PackedWeight.of(weight)))

    @staticmethod
    def tied_head(embedding: nn.Module) -> nn.Module:
        """An LM head tied to a GGUFEmbedding: a GGUFLinear on the same packed weight."""
        from kvserve.model.gguf_linear import GGUFLinear

        return GGUFLinear([cast(Any, embedding).part])

    def put_gated_mlp(self, p: str, mlp: nn.Module) -> None:
        """A gated MLP's gate_proj and up_proj fused into ``mlp.gate_up_proj``, and its down_proj."""
        self.put_linear(mlp, "gate_up_proj", [self.take(p + "gate_proj.weight"), self.take(p + "up_proj.weight")])
        self.put_linear(mlp, "down_proj", [self.take(p + "down_proj.weight")])
