// The Python module: every op of this folder (declared in ops.h).
#include <torch/extension.h>

#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention_quantized", &paged_attention_quantized,
        "attention over a quantized paged pool, written into out; False where unsupported: (out, q, data, kind, "
        "key_scales, value_scales, v_scale, lut, tail, tail_slots, block_tables, seq_lens, query_len, scale)");
  m.def("rope_and_write_kv", &rope_and_write_kv,
        "rotary on the query/key heads of qkv in place, then K/V into the pool: (qkv, cos, sin, kv_cache, slots, heads)");
  m.def("quantize_blocks", &quantize_blocks,
        "whole blocks into an int4 or per-block int8 pool as the torch path: (src, rows, block_ids, kind, data, "
        "key_scales, value_scales) -> bool");
  m.def("copy_blocks_in", &copy_blocks_in,
        "blocks read from a lower store into the pool: payload i (uint8, block_store's format) holds block_ids[i]'s "
        "row of each pool tensor in order: (pools, block_ids, payloads)");
  m.def("rope_and_write_kv_int8", &rope_and_write_kv_int8,
        "rope_and_write_kv into an int8 pool: keys by static per-channel scales, values per token: (qkv, cos, sin, "
        "kv_cache, slots, heads, key_scales, value_scales, clipped)");
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention over a paged KV cache, written into out: (out, q, kv_cache, block_tables, seq_lens, scale); "
        "q in the cache's dtype, or float32 over a bf16/float16 cache");
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "causal (or, causal=False, full) attention for query_len new tokens per sequence over the paged cache, "
        "written into out (log-sum-exps into lse where given); False where unsupported: "
        "(out, q, kv_cache, block_tables, seq_lens, query_len, scale, causal, lse)",
        py::arg("out"), py::arg("q"), py::arg("kv_cache"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("query_len"), py::arg("scale"), py::arg("causal") = true, py::arg("lse") = py::none());
  m.def("cascade_attention", &cascade_attention,
        "attention over a prefix of blocks every sequence shares (read once) and each sequence's own blocks, "
        "merged by log-sum-exps, into out; False where unsupported: (out, q, kv_cache, shared_table, shared_len, "
        "own_tables, own_lens, query_len, scale)");
  m.def("set_amx", &set_amx,
        "use (or not) the AMX tile kernels for bf16 prefill where the CPU has them; returns whether they are used "
        "now: (enabled)");
  m.def("gguf_pack", &gguf_pack,
        "a GGUF tensor's blocks (rows of raw bytes) repacked for gguf_linear: (raw, ggml_type, in_features) -> "
        "(packed uint8 [tiles of 16 rows, bytes], kind)");
  m.def("gguf_rows", &gguf_rows, "rows of a packed GGUF weight in float32: (packed, kind, in_features, ids)");
  m.def("gguf_linear", &gguf_linear,
        "x @ W.T (+ bias, float32) for packed GGUF weights side by side (their outputs concatenated), x's rows "
        "quantized per 32 inputs to int8: (x, packed list, kinds, out_features list, bias) -> [m, sum out]");
  m.def("add_rms_norm", &add_rms_norm,
        "residual += delta (in place, when delta is given), returns rms_norm(residual) * weight: "
        "(residual, delta, weight, eps)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up for gate_up = [gate | up]: (gate_up)");
  m.def("argmax_rows", &argmax_rows, "first index of each float32 row's maximum: (logits) -> int64 [rows]");
  m.def("quantize_rows_int8", &quantize_rows_int8,
        "per-row symmetric int8: (x, offset) -> (codes: int8, or uint8 + 128 with offset; float32 scales = max|row| / 127)");
  m.def("scale_rows_", &scale_rows_, "x *= row_scales[:, None] (+ bias), in place: (x, row_scales, bias)");
  m.def("int8_gemm_pack", &int8_gemm_pack,
        "an int8 weight [n, k] and its channel scales packed for int8_linear; empty where unsupported: (codes, scales) "
        "-> (packed, comp, scales)");
  m.def("int8_linear", &int8_linear,
        "W8A8 linear: x's rows quantized to int8, times the packed weight in VNNI, rescaled (+ bias, float32 padded "
        "like scales), in x's dtype; rotate_block > 1 turns x's rows by that block Walsh-Hadamard matrix first: "
        "gated: the weight's 16-channel groups alternate gate and up, the result is silu(gate) * up [m, out_features / 2]: "
        "(x, packed, comp, scales, out_features, bias, rotate_block, gated)");
  m.def("int8_linear_after_norm", &int8_linear_after_norm,
        "int8_linear of add_rms_norm(residual, delta, unit weight, eps) in one call, residual += delta in place: "
        "(residual, delta, eps, packed, comp, scales, out_features, bias, gated)");
  m.def("bf16_gemm_pack", &bf16_gemm_pack,
        "a bf16 weight [n, k] packed for bf16_linear; empty where unsupported: (w) -> (packed,)");
  m.def("bf16_linear", &bf16_linear,
        "bf16 linear on AVX512-BF16 dot products, for decode-sized batches; gated as int8_linear's: (x, packed, "
        "out_features, bias: float32 padded to 16, gated) -> bf16 [m, out_features (/ 2 gated)]");
}
