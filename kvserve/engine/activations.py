"""Transient memory of a forward pass: one estimate for the engine (CPU, where there is no
allocator to profile) and the planner."""

from __future__ import annotations


def estimate_activation_bytes(*, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                              intermediate_size: int, vocab_size: int, num_tokens: int, max_num_seqs: int,
                              max_model_len: int, elem_bytes: int) -> int:
    """Upper estimate: a few residual-stream copies, the fused projections and the MLP for
    ``num_tokens`` (one max-size step), one prefill's float32 attention scores, and float32
    logits (twice, for sampling) for every sequence."""
    per_token = 4 * hidden_size + (num_heads + 2 * num_kv_heads) * head_dim + 3 * intermediate_size
    scores = num_heads * num_tokens * min(max_model_len, num_tokens + max_model_len) * 4
    logits = 2 * max_num_seqs * vocab_size * 4
    return per_token * num_tokens * elem_bytes + scores + logits
