"""Hadamard rotations for int8 layers (QuaRot): per-token int8 activations lose most of their
precision to a few outlier channels, which set each token's scale. An orthogonal turn of the
activations, undone in the weight, spreads the outliers over every channel and leaves the
product unchanged: x W^T = (x Q)(W Q)^T for Q Q^T = I.

Two places take it. ``rotate_residual_stream`` turns the residual stream itself at load, so the
inputs of the QKV and gate/up projections and of the LM head arrive turned at no cost per call:
each RMSNorm's weight is folded into the linear layer it feeds (a gain-free RMSNorm commutes with
an orthogonal turn), the embedding and the layers that read the stream turn by Q, those that write
it by Q^T. The down projection's input (the SwiGLU output, its largest outliers) is turned at run
time (``Int8Linear``'s ``rotate_input``, fused into the C++ row quantization on VNNI CPUs).

Q is block-diagonal Walsh-Hadamard: ``hadamard_block`` is the +-1 block H (H H^T = b I, entries
exact in any dtype), and Q = H / sqrt(b) on each block.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from kvserve.cache.kv_quant import sylvester
from kvserve.model.llama import DecoderLayer, LlamaForCausalLM

MAX_ROTATION_BLOCK = 128  # beyond this the turn costs more per call without spreading outliers much further


@functools.cache
def hadamard_block(features: int) -> torch.Tensor:
    """The +-1 Walsh-Hadamard matrix [b, b] in Sylvester's order of a rotation over ``features``
    channels: b the largest power of two dividing it, up to MAX_ROTATION_BLOCK (SmolLM2: 64 for
    576, 128 for 1,536). One tensor per size, shared: read it, never write it."""
    return sylvester(min(features & -features, MAX_ROTATION_BLOCK))


def rotate_rows(x: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """x [rows, features] times the block-diagonal matrix of ``block`` ([b, b]), in float32."""
    b = block.shape[0]
    return (x.float().view(x.shape[0], -1, b) @ block).view(x.shape[0], -1)


def residual_stream_rotatable(model: nn.Module) -> bool:
    """Whether every reader of the model's residual stream is a linear layer behind a plain
    RMSNorm and every writer a linear layer: Llama-family layers. Not Gemma (norms on the layer
    outputs, applied after the writer) or MLA / MoE layers (other readers)."""
    return type(model) is LlamaForCausalLM and all(
        type(layer) is DecoderLayer and layer.attn_out_norm is None and layer.ffn_out_norm is None
        for layer in model.decoder_layers)


@torch.no_grad()
def rotate_residual_stream(model: LlamaForCausalLM) -> bool:
    """Turn ``model``'s residual stream by Q at load (see the module docstring), the RMSNorm
    weights folded into the layers they feed and set to one; the model computes the same
    function. A tied embedding and LM head part: the head becomes its own weight (diag(norm) E Q,
    as the layers it will be quantized with). Returns False, changing nothing, where
    residual_stream_rotatable is False."""
    if not residual_stream_rotatable(model):
        return False
    h = hadamard_block(model.config.hidden_size)
    scale = h.shape[0] ** -0.5

    def turn(weight: torch.Tensor, norm: torch.Tensor | None = None) -> torch.Tensor:
        """W [out, hidden] -> (W diag(norm)) Q, computed in float32, stored in W's dtype."""
        w = weight.float() if norm is None else weight.float() * norm.float()
        return (rotate_rows(w, h.to(w.device)) * scale).to(weight.dtype)

    def reader(linear: nn.Linear, norm: nn.Parameter) -> None:
        linear.weight = nn.Parameter(turn(linear.weight, norm), requires_grad=False)
        norm.fill_(1.0)

    def writer(linear: nn.Linear) -> None:  # Q^T W: its transpose read as a reader's
        linear.weight = nn.Parameter(turn(linear.weight.t()).t().contiguous(), requires_grad=False)

    for layer in model.decoder_layers:
        reader(layer.qkv_proj, layer.input_layernorm)
        reader(layer.gate_up_proj, layer.ffn_norm)
        writer(layer.o_proj)
        writer(layer.down_proj)
    model.lm_head.weight = nn.Parameter(turn(model.lm_head.weight, model.norm), requires_grad=False)
    model.norm.fill_(1.0)
    model.embed_tokens.weight = nn.Parameter(turn(model.embed_tokens.weight), requires_grad=False)
    return True


def run_time_rotations(model: LlamaForCausalLM, stream_rotated: bool) -> tuple[nn.Module, ...]:
    """The linear layers whose inputs an int8 model turns at every call: each Llama-family layer's
    down projection, and the LM head where the residual stream is not turned."""
    downs = tuple(layer.down_proj for layer in model.decoder_layers if type(layer) is DecoderLayer)
    return downs if stream_rotated else (*downs, model.lm_head)
