// The ops this folder exports to Python (bindings.cpp); each file says what its ops do.
#pragma once

#include <torch/types.h>  // not torch/extension.h: pybind11 and the C++ API double the parse, per file

#include <tuple>
#include <vector>

// attention.cpp
void paged_decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_tables,
                            torch::Tensor seq_lens, double scale);
bool paged_prefill_attention(torch::Tensor out, torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_tables,
                             torch::Tensor seq_lens, int64_t query_len, double scale, bool causal,
                             c10::optional<torch::Tensor> lse);
bool cascade_attention(torch::Tensor out, torch::Tensor q, torch::Tensor kv_cache, torch::Tensor shared_table,
                       torch::Tensor shared_len, torch::Tensor own_tables, torch::Tensor own_lens, int64_t query_len,
                       double scale);
bool set_amx(bool enabled);

// attention_quantized.cpp
bool paged_attention_quantized(torch::Tensor out, torch::Tensor q, torch::Tensor data, int64_t kind,
                               c10::optional<torch::Tensor> key_scales, c10::optional<torch::Tensor> value_scales,
                               double v_scale, c10::optional<torch::Tensor> lut, c10::optional<torch::Tensor> tail,
                               c10::optional<torch::Tensor> tail_slots, torch::Tensor block_tables,
                               torch::Tensor seq_lens, int64_t query_len, double scale);

// cache_write.cpp
void rope_and_write_kv(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor kv_cache,
                       torch::Tensor slot_mapping, int64_t heads);
void rope_and_write_kv_int8(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor kv_cache,
                            torch::Tensor slot_mapping, int64_t heads, torch::Tensor key_scales,
                            torch::Tensor value_scales, torch::Tensor clipped);
bool quantize_blocks(torch::Tensor src, torch::Tensor rows, torch::Tensor block_ids, int64_t kind, torch::Tensor data,
                     torch::Tensor key_scales, torch::Tensor value_scales);
void copy_blocks_in(std::vector<torch::Tensor> pools, torch::Tensor block_ids, std::vector<torch::Tensor> payloads);

// gguf_linear.cpp
std::tuple<torch::Tensor, int64_t> gguf_pack(torch::Tensor raw, int64_t ggml_type, int64_t k);
torch::Tensor gguf_rows(torch::Tensor packed, int64_t kind, int64_t k, torch::Tensor ids);
torch::Tensor gguf_linear(torch::Tensor x, std::vector<torch::Tensor> packed, std::vector<int64_t> kinds,
                          std::vector<int64_t> out_features, c10::optional<torch::Tensor> bias);

// layers.cpp
torch::Tensor add_rms_norm(torch::Tensor residual, c10::optional<torch::Tensor> delta, torch::Tensor weight,
                           double eps);
torch::Tensor silu_and_mul(torch::Tensor gate_up);
torch::Tensor argmax_rows(torch::Tensor logits);
std::vector<torch::Tensor> quantize_rows_int8(torch::Tensor x, bool offset);
void scale_rows_(torch::Tensor x, torch::Tensor row_scales, c10::optional<torch::Tensor> bias);
std::vector<torch::Tensor> int8_gemm_pack(torch::Tensor codes, torch::Tensor scales);
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor comp, torch::Tensor scales,
                          int64_t out_features, c10::optional<torch::Tensor> bias, int64_t rotate_block,
                          bool gated);
torch::Tensor int8_linear_after_norm(torch::Tensor residual, c10::optional<torch::Tensor> delta, double eps,
                                     torch::Tensor packed, torch::Tensor comp, torch::Tensor scales,
                                     int64_t out_features, c10::optional<torch::Tensor> bias, bool gated);
std::vector<torch::Tensor> bf16_gemm_pack(torch::Tensor w);
torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor packed, int64_t out_features,
                          c10::optional<torch::Tensor> bias, bool gated);
