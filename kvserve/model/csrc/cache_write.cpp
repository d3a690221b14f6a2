// Writing K/V into the pool: rope_and_write_kv (rotary on the fused qkv in place, then each
// token's K/V into its slot), its int8 variant with static key scales, quantize_blocks
// (whole int4 / per-block int8 blocks from full-precision rows), and copy_blocks_in (blocks
// read back from a lower store).
#include "common.h"
#include "ops.h"

// Rotary on one token's first `rotated` heads of qkv, in place (x: dim floats of scratch).
template <typename T>
static inline void rope_token(T* token, const float* c, const float* s, int64_t rotated, int64_t dim, float* x) {
  const int64_t half = dim / 2;  // s: the first half negated, rotate_half's sign folded in
  for (int64_t hd = 0; hd < rotated; ++hd) {
    T* p = token + hd * dim;
    for (int64_t d = 0; d < dim; ++d) x[d] = static_cast<float>(p[d]);
    for (int64_t d = 0; d < half; ++d) p[d] = static_cast<T>(x[d] * c[d] + x[d + half] * s[d]);
    for (int64_t d = half; d < dim; ++d) p[d] = static_cast<T>(x[d] * c[d] + x[d - half] * s[d]);
  }
}

// P: the pool's element type, T's or (a float32 model over a bf16/float16 pool) narrower: each
// element rounded as torch's cast rounds it.
template <typename T, typename P = T>
static void rope_write_kernel(T* qkv, const float* cos, const float* sin, P* kv, const int64_t* slots,
                              int64_t tokens, int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size) {
  const int64_t row = (heads + 2 * kv_heads) * dim;
  at::parallel_for(0, tokens, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> x(dim);
    for (int64_t t = begin; t < end; ++t) {
      rope_token(qkv + t * row, cos + t * dim, sin + t * dim, heads + kv_heads, dim, x.data());
      const int64_t slot = slots[t], block = slot / block_size, offset = slot % block_size;
      for (int64_t j = 0; j < 2 * kv_heads; ++j) {  // K heads then V heads, as in the block layout
        const T* src = qkv + t * row + (heads + j) * dim;
        P* dst = kv + ((block * 2 * kv_heads + j) * block_size + offset) * dim;
        if constexpr (std::is_same_v<T, P>) std::copy(src, src + dim, dst);
        else from_float(src, dst, dim);
      }
    }
  });
}

static void check_rope_call(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                            const torch::Tensor& kv_cache, const torch::Tensor& slot_mapping) {
  TORCH_CHECK(qkv.dim() == 3 && qkv.is_contiguous(), "qkv must be contiguous [tokens, heads, dim]");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat && sin.scalar_type() == torch::kFloat, "float32 cos/sin");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous(), "contiguous cos/sin");
  TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.dim() == 4, "contiguous pool [blocks, 2*kv_heads, block, row]");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kLong && slot_mapping.numel() == qkv.size(0),
              "int64 slots, one per token");
  TORCH_CHECK(cos.size(0) == qkv.size(0) && sin.size(0) == qkv.size(0), "a cos/sin row per token");
}

void rope_and_write_kv(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor kv_cache,
                       torch::Tensor slot_mapping, int64_t heads) {
  // qkv [tokens, heads + 2*kv_heads, dim] contiguous: rotary applied in place to the query and
  // key heads, then the token's K and V heads are copied into its slot of the pool.
  check_rope_call(qkv, cos, sin, kv_cache, slot_mapping);
  const bool narrowed = float32_over_16_bit(qkv.scalar_type(), kv_cache.scalar_type());
  TORCH_CHECK(kv_cache.scalar_type() == qkv.scalar_type() || narrowed,
              "pool dtype: qkv's, or bf16/float16 under float32 qkv");
  auto slots = slot_mapping.contiguous();
  const int64_t kv_heads = kv_cache.size(1) / 2;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, kv_cache.scalar_type(), "rope_and_write_kv", [&] {
    auto run = [&](auto* rows) {
      rope_write_kernel(rows, cos.data_ptr<float>(), sin.data_ptr<float>(), kv_cache.data_ptr<scalar_t>(),
                        slots.data_ptr<int64_t>(), qkv.size(0), heads, kv_heads, qkv.size(2), kv_cache.size(2));
    };
    if constexpr (kSixteenBit<scalar_t>) {  // a float32 model's K/V rounded into a bf16/float16 pool
      if (narrowed) return run(qkv.data_ptr<float>());
    }
    run(qkv.data_ptr<scalar_t>());
  });
}

// The int8 write must store exactly what kv_quant.quantize stores (a fused and an unfused step
// then cache the same bytes): true float32 divisions, not -ffast-math's reciprocals.
#pragma GCC push_options
#pragma GCC optimize("no-fast-math")
// int8 code of x / scale as kv_quant.quantize makes it: float32 division, round half to even, clipped to +-127.
static inline int8_t int8_code(float x, float scale) {
  return static_cast<int8_t>(std::max(-127.f, std::min(127.f, std::nearbyint(x / scale))));
}

#if defined(__AVX2__) && defined(__F16C__) && !defined(__AVX512F__)
#define KVSERVE_INT8_WRITE8 1  // the 8-lane int8 write below (load8: common.h)
#endif

// dst[d] = int8_code(x[d], scale[d]) for d < dim (scale: a per-channel row, or one value), and the
// number of |x[d]| > 127.5 * scale[d] (counted where asked). The vector paths divide and round
// (half to even) as int8_code does, so every level stores the same bytes.
template <typename T>
static inline int64_t int8_codes(const T* x, const float* scale, bool per_channel, int64_t dim, int8_t* dst,
                                 bool count) {
  int64_t clipped = 0, d = 0;
#if defined(__AVX512F__)
  if constexpr (!std::is_same_v<T, double>) {
    const __m512 top = _mm512_set1_ps(127.f), bottom = _mm512_set1_ps(-127.f), limit = _mm512_set1_ps(127.5f);
    for (; d + 16 <= dim; d += 16) {
      const __m512 v = load16(x + d), s = per_channel ? _mm512_loadu_ps(scale + d) : _mm512_set1_ps(*scale);
      if (count) clipped += __builtin_popcount(_mm512_cmp_ps_mask(_mm512_abs_ps(v), _mm512_mul_ps(s, limit),
                                                                  _CMP_GT_OQ));
      const __m512 q = _mm512_roundscale_ps(_mm512_div_ps(v, s), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + d),
                       _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_min_ps(top, _mm512_max_ps(bottom, q)))));
    }
  }
#elif defined(KVSERVE_INT8_WRITE8)
  if constexpr (!std::is_same_v<T, double>) {
    const __m256 top = _mm256_set1_ps(127.f), bottom = _mm256_set1_ps(-127.f), limit = _mm256_set1_ps(127.5f);
    const __m256 sign = _mm256_set1_ps(-0.f);
    for (; d + 8 <= dim; d += 8) {
      const __m256 v = load8(x + d), s = per_channel ? _mm256_loadu_ps(scale + d) : _mm256_set1_ps(*scale);
      if (count)
        clipped += __builtin_popcount(_mm256_movemask_ps(
            _mm256_cmp_ps(_mm256_andnot_ps(sign, v), _mm256_mul_ps(s, limit), _CMP_GT_OQ)));
      const __m256 q = _mm256_round_ps(_mm256_div_ps(v, s), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m256i codes = _mm256_cvtps_epi32(_mm256_min_ps(top, _mm256_max_ps(bottom, q)));
      const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(codes), _mm256_extracti128_si256(codes, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(dst + d), _mm_packs_epi16(words, words));
    }
  }
#endif
  for (; d < dim; ++d) {
    const float v = static_cast<float>(x[d]), s = per_channel ? scale[d] : *scale;
    if (count) clipped += std::fabs(v) > s * 127.5f;
    dst[d] = int8_code(v, s);
  }
  return clipped;
}

// One token's value row v [dim] in int8 as kv_quant does for values: its scale max|v| / 127 (at
// least 1e-8), returned, and the codes at dst.
template <typename T>
static inline float int8_token_codes(const T* v, int64_t dim, int8_t* dst) {
  float top = 0.f;
  int64_t d = 0;
#if defined(__AVX512F__)
  if constexpr (!std::is_same_v<T, double>) {
    __m512 tops = _mm512_setzero_ps();
    for (; d + 16 <= dim; d += 16) tops = _mm512_max_ps(tops, _mm512_abs_ps(load16(v + d)));
    top = _mm512_reduce_max_ps(tops);
  }
#elif defined(KVSERVE_INT8_WRITE8)
  if constexpr (!std::is_same_v<T, double>) {
    __m256 tops = _mm256_setzero_ps();
    for (; d + 8 <= dim; d += 8) tops = _mm256_max_ps(tops, _mm256_andnot_ps(_mm256_set1_ps(-0.f), load8(v + d)));
    top = max8(tops);
  }
#endif
  for (; d < dim; ++d) top = std::max(top, std::fabs(static_cast<float>(v[d])));
  const float scale = std::max(top / 127.f, 1e-8f);
  int8_codes(v, &scale, false, dim, dst, false);
  return scale;
}

// rope_write_kernel for an int8 pool with static key scales: each key element quantized by its
// channel's scale (elements beyond 127.5 scales counted as clipped), each value head by its own
// scale max|v| / 127 (at least 1e-8), stored in value_scales [blocks, kv_heads, block_size].
template <typename T>
static int64_t rope_write_int8_kernel(T* qkv, const float* cos, const float* sin, int8_t* kv, float* value_scales,
                                      const float* key_scales, const int64_t* slots, int64_t tokens, int64_t heads,
                                      int64_t kv_heads, int64_t dim, int64_t block_size) {
  const int64_t row = (heads + 2 * kv_heads) * dim;
  std::atomic<int64_t> clipped{0};
  at::parallel_for(0, tokens, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> x(dim);
    int64_t local = 0;
    for (int64_t t = begin; t < end; ++t) {
      rope_token(qkv + t * row, cos + t * dim, sin + t * dim, heads + kv_heads, dim, x.data());
      const int64_t slot = slots[t], block = slot / block_size, offset = slot % block_size;
      for (int64_t j = 0; j < kv_heads; ++j) {
        const T* k = qkv + t * row + (heads + j) * dim;
        local += int8_codes(k, key_scales + j * dim, true, dim,
                            kv + ((block * 2 * kv_heads + j) * block_size + offset) * dim, true);
      }
      for (int64_t j = 0; j < kv_heads; ++j)
        value_scales[(block * kv_heads + j) * block_size + offset] = int8_token_codes(
            qkv + t * row + (heads + kv_heads + j) * dim, dim,
            kv + ((block * 2 * kv_heads + kv_heads + j) * block_size + offset) * dim);
    }
    clipped += local;
  });
  return clipped.load();
}

#if defined(__AVX512F__)
// The int4 (step, minimum) of values between lo and hi as kv_quant.affine_params stores them
// (step = max((hi - lo) / 15, 1e-4), both rounded to float16; `lanes` of them stored at step_out
// and low_out), and widened back: the values codes are made with.
static inline void int4_affine(__m512 lo, __m512 hi, __mmask16 lanes, c10::Half* step_out, c10::Half* low_out,
                               __m512& step, __m512& low) {
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512 wide = _mm512_max_ps(_mm512_div_ps(_mm512_sub_ps(hi, lo), _mm512_set1_ps(15.f)), _mm512_set1_ps(1e-4f));
  const __m256i s = _mm512_cvtps_ph(wide, kNearest), l = _mm512_cvtps_ph(lo, kNearest);
  _mm256_mask_storeu_epi16(step_out, lanes, s);
  _mm256_mask_storeu_epi16(low_out, lanes, l);
  step = _mm512_cvtph_ps(s);
  low = _mm512_cvtph_ps(l);
}

// 16 int4 codes as kv_quant.int4_codes makes them: round((x - low) / step) (half to even) in [0, 15].
static inline void int4_codes16(__m512 x, __m512 step, __m512 low, uint8_t* dst) {
  const __m512 q = _mm512_roundscale_ps(_mm512_div_ps(_mm512_sub_ps(x, low), step),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 clamped = _mm512_min_ps(_mm512_set1_ps(15.f), _mm512_max_ps(_mm512_setzero_ps(), q));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(clamped)));
}

// One (block, KV head) of whole int4 blocks, as Int4KV.quantize_blocks: keys [bs, dim] get a
// (step, minimum) per channel over the block, values one per token and group of dim / groups
// channels; codes packed two a byte (channel d low, d + dim / 2 high).
static void int4_block_head(const float* keys, const float* values, int64_t block, int64_t h, int64_t bs,
                            int64_t kv_heads, int64_t dim, int64_t groups, uint8_t* data, c10::Half* key_affine,
                            c10::Half* value_affine) {
  const int64_t half = dim / 2, width = dim / groups;
  thread_local std::vector<uint8_t> codes;
  codes.resize(bs * dim);
  auto pack_into = [&](uint8_t* out) {  // codes [bs, dim] -> out [bs, dim / 2]
    for (int64_t t = 0; t < bs; ++t)
      for (int64_t d = 0; d < half; ++d)
        out[t * half + d] = static_cast<uint8_t>(codes[t * dim + d] | (codes[t * dim + half + d] << 4));
  };
  __m512 step, low;
  c10::Half* affine = key_affine + (block * kv_heads + h) * 2 * dim;
  for (int64_t c = 0; c < dim; c += 16) {
    __m512 lo = _mm512_set1_ps(INFINITY), hi = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < bs; ++t) {
      lo = _mm512_min_ps(lo, _mm512_loadu_ps(keys + t * dim + c));
      hi = _mm512_max_ps(hi, _mm512_loadu_ps(keys + t * dim + c));
    }
    int4_affine(lo, hi, 0xFFFF, affine + c, affine + dim + c, step, low);
    for (int64_t t = 0; t < bs; ++t) int4_codes16(_mm512_loadu_ps(keys + t * dim + c), step, low, &codes[t * dim + c]);
  }
  pack_into(data + (block * 2 * kv_heads + h) * bs * half);
  c10::Half* token_affine = value_affine + (block * kv_heads + h) * bs * groups * 2;
  for (int64_t t = 0; t < bs; ++t)
    for (int64_t g = 0; g < groups; ++g) {
      const float* v = values + t * dim + g * width;
      __m512 lo = _mm512_set1_ps(INFINITY), hi = _mm512_set1_ps(-INFINITY);
      for (int64_t c = 0; c < width; c += 16) {
        lo = _mm512_min_ps(lo, _mm512_loadu_ps(v + c));
        hi = _mm512_max_ps(hi, _mm512_loadu_ps(v + c));
      }
      c10::Half* at = token_affine + (t * groups + g) * 2;
      int4_affine(_mm512_set1_ps(_mm512_reduce_min_ps(lo)), _mm512_set1_ps(_mm512_reduce_max_ps(hi)), 1, at, at + 1,
                  step, low);
      for (int64_t c = 0; c < width; c += 16) int4_codes16(_mm512_loadu_ps(v + c), step, low, &codes[t * dim + g * width + c]);
    }
  pack_into(data + (block * 2 * kv_heads + kv_heads + h) * bs * half);
}

// One (block, KV head) of whole int8 blocks with per-block key scales, as Int8BlockKV.quantize_blocks:
// a key scale per channel, max(max |k| over the block / 127, 1e-8), and one per token for values.
static void int8_block_head(const float* keys, const float* values, int64_t block, int64_t h, int64_t bs,
                            int64_t kv_heads, int64_t dim, int8_t* data, float* key_scales, float* value_scales) {
  float* scale = key_scales + (block * kv_heads + h) * dim;
  for (int64_t c = 0; c < dim; c += 16) {
    __m512 top = _mm512_setzero_ps();
    for (int64_t t = 0; t < bs; ++t) top = _mm512_max_ps(top, _mm512_abs_ps(_mm512_loadu_ps(keys + t * dim + c)));
    _mm512_storeu_ps(scale + c, _mm512_max_ps(_mm512_div_ps(top, _mm512_set1_ps(127.f)), _mm512_set1_ps(1e-8f)));
  }
  int8_t* key_rows = data + (block * 2 * kv_heads + h) * bs * dim;
  int8_t* value_rows = data + (block * 2 * kv_heads + kv_heads + h) * bs * dim;
  for (int64_t t = 0; t < bs; ++t) {
    int8_codes(keys + t * dim, scale, true, dim, key_rows + t * dim, false);
    value_scales[(block * kv_heads + h) * bs + t] = int8_token_codes(values + t * dim, dim, value_rows + t * dim);
  }
}

// Whole blocks from full-precision rows: block b's token t is row rows[b * bs + t] of src
// ([*, 2 * kv_heads, dim], K heads then V heads); quantize(block, h, keys, values) gets head h's
// keys and values [bs, dim] in float32. One job per (block, head).
template <typename T, typename Quantize>
static void tail_blocks_driver(const T* src, const int64_t* rows, const int64_t* block_ids, int64_t num, int64_t bs,
                               int64_t kv_heads, int64_t dim, const Quantize& quantize) {
  const int64_t token = 2 * kv_heads * dim;
  at::parallel_for(0, num * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> keys(bs * dim), values(bs * dim);
    for (int64_t job = begin; job < end; ++job) {
      const int64_t b = job / kv_heads, h = job % kv_heads;
      for (int64_t t = 0; t < bs; ++t) {
        const T* row = src + rows[b * bs + t] * token;
        to_float(row + h * dim, keys.data() + t * dim, dim);
        to_float(row + (kv_heads + h) * dim, values.data() + t * dim, dim);
      }
      quantize(block_ids[b], h, keys.data(), values.data());
    }
  });
}
#endif
#pragma GCC pop_options

bool quantize_blocks(torch::Tensor src, torch::Tensor rows, torch::Tensor block_ids, int64_t kind, torch::Tensor data,
                     torch::Tensor key_scales, torch::Tensor value_scales) {
  // Quantizes whole blocks into an int4 pool, or an int8 one with per-block key scales, bit for
  // bit as the torch path (Int4KV / Int8BlockKV.quantize_blocks): src [*, 2 * kv_heads, dim]
  // full-precision rows, rows int64 [blocks * block_size] (each block's tokens in order),
  // block_ids int64 [blocks]; data uint8 [pool blocks, 2 * kv_heads, block_size, row bytes];
  // int4: key_scales (step, minimum) float16 [pool blocks, kv_heads, 2, dim], value_scales
  // float16 [pool blocks, kv_heads, block_size, groups, 2]; int8: float32 [pool blocks,
  // kv_heads, dim] and [pool blocks, kv_heads, block_size, 1]. False, touching nothing, without
  // AVX-512 or where channels (an int4 value group) are not whole 16-lane vectors.
  const int64_t kv_heads = data.size(1) / 2, bs = data.size(2), dim = src.size(2);
  TORCH_CHECK(kind == kI4 || kind == kI8, "int4 or int8 pools");
  TORCH_CHECK(src.is_contiguous() && src.size(1) == 2 * kv_heads, "src [rows, 2 * kv_heads, head_dim], contiguous");
  TORCH_CHECK(rows.scalar_type() == torch::kLong && block_ids.scalar_type() == torch::kLong &&
              rows.numel() == block_ids.numel() * bs, "int64 rows, block_size per block id");
  TORCH_CHECK(data.scalar_type() == torch::kByte && data.is_contiguous() &&
              data.size(3) == (kind == kI4 ? dim / 2 : dim), "uint8 pool rows of the kind's row bytes");
  TORCH_CHECK(key_scales.scalar_type() == (kind == kI4 ? torch::kHalf : torch::kFloat) && key_scales.is_contiguous() &&
              value_scales.scalar_type() == key_scales.scalar_type() && value_scales.is_contiguous(),
              "contiguous scales: float16 affines for int4, float32 scales for int8");
#if defined(__AVX512F__)
  const int64_t groups = kind == kI4 ? value_scales.size(3) : 1;
  if (dim % 16 != 0 || groups < 1 || dim % groups != 0 || (dim / groups) % 16 != 0) return false;
  auto row_ids = rows.contiguous(), ids = block_ids.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, src.scalar_type(), "quantize_blocks", [&] {
    const scalar_t* from = src.data_ptr<scalar_t>();
    const int64_t *row_ptr = row_ids.data_ptr<int64_t>(), *id_ptr = ids.data_ptr<int64_t>(), num = ids.numel();
    uint8_t* codes = data.data_ptr<uint8_t>();
    if (kind == kI4) {
      c10::Half *key_affine = key_scales.data_ptr<c10::Half>(), *value_affine = value_scales.data_ptr<c10::Half>();
      tail_blocks_driver(from, row_ptr, id_ptr, num, bs, kv_heads, dim, [&](int64_t block, int64_t h, const float* k,
                                                                             const float* v) {
        int4_block_head(k, v, block, h, bs, kv_heads, dim, groups, codes, key_affine, value_affine);
      });
    } else {
      float *ks = key_scales.data_ptr<float>(), *vs = value_scales.data_ptr<float>();
      tail_blocks_driver(from, row_ptr, id_ptr, num, bs, kv_heads, dim, [&](int64_t block, int64_t h, const float* k,
                                                                             const float* v) {
        int8_block_head(k, v, block, h, bs, kv_heads, dim, reinterpret_cast<int8_t*>(codes), ks, vs);
      });
    }
  });
  return true;
#else
  return false;
#endif
}

void rope_and_write_kv_int8(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor kv_cache,
                            torch::Tensor slot_mapping, int64_t heads, torch::Tensor key_scales,
                            torch::Tensor value_scales, torch::Tensor clipped) {
  // rope_and_write_kv for an int8 pool (uint8 bytes) with static key scales [kv_heads, dim]
  // (float32) and per-token value scales [blocks, kv_heads, block_size, 1] (float32); the
  // count of clipped key elements is added to clipped (an int64 scalar).
  check_rope_call(qkv, cos, sin, kv_cache, slot_mapping);
  const int64_t kv_heads = kv_cache.size(1) / 2, dim = qkv.size(2);
  TORCH_CHECK(kv_cache.scalar_type() == torch::kByte && kv_cache.size(3) == dim, "int8 pool rows of head_dim bytes");
  TORCH_CHECK(key_scales.scalar_type() == torch::kFloat && key_scales.is_contiguous() &&
              key_scales.numel() == kv_heads * dim, "static float32 key scales [kv_heads, dim]");
  TORCH_CHECK(value_scales.scalar_type() == torch::kFloat && value_scales.is_contiguous() &&
              value_scales.numel() == kv_cache.size(0) * kv_heads * kv_cache.size(2), "float32 value scales");
  TORCH_CHECK(clipped.scalar_type() == torch::kLong && clipped.numel() == 1, "int64 clip counter");
  auto slots = slot_mapping.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_and_write_kv_int8", [&] {
    clipped.add_(rope_write_int8_kernel<scalar_t>(
        qkv.data_ptr<scalar_t>(), cos.data_ptr<float>(), sin.data_ptr<float>(),
        reinterpret_cast<int8_t*>(kv_cache.data_ptr<uint8_t>()), value_scales.data_ptr<float>(),
        key_scales.data_ptr<float>(), slots.data_ptr<int64_t>(), qkv.size(0), heads, kv_heads, dim, kv_cache.size(2)));
  });
}


// Blocks read back from a lower store into the pool: payload i holds block block_ids[i]'s row of
// every pool tensor, in order (block_store's format). One memcpy per block and tensor, blocks in
// parallel, straight from the store's reply: no staging copy, and no element-wise gather.
void copy_blocks_in(std::vector<torch::Tensor> pools, torch::Tensor block_ids, std::vector<torch::Tensor> payloads) {
  TORCH_CHECK(block_ids.scalar_type() == torch::kLong && block_ids.dim() == 1 &&
                  block_ids.numel() == static_cast<int64_t>(payloads.size()),
              "int64 block ids, one per payload");
  std::vector<char*> bases;
  std::vector<int64_t> row_bytes;
  int64_t payload_bytes = 0;
  const int64_t count = block_ids.numel();
  auto ids = block_ids.contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  for (const auto& pool : pools) {
    TORCH_CHECK(pool.device().is_cpu() && pool.is_contiguous() && pool.dim() >= 1, "contiguous CPU pool tensors");
    for (int64_t i = 0; i < count; ++i)
      TORCH_CHECK(id[i] >= 0 && id[i] < pool.size(0), "block id ", id[i], " outside the pool's ", pool.size(0));
    bases.push_back(static_cast<char*>(pool.data_ptr()));
    row_bytes.push_back(pool.numel() / std::max<int64_t>(pool.size(0), 1) * pool.element_size());
    payload_bytes += row_bytes.back();
  }
  for (const auto& payload : payloads)
    TORCH_CHECK(payload.device().is_cpu() && payload.is_contiguous() && payload.scalar_type() == torch::kByte &&
                    payload.numel() == payload_bytes,
                "uint8 payloads of ", payload_bytes, " bytes (the pool's row of every tensor)");
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const char* src = static_cast<const char*>(payloads[i].data_ptr());
      for (size_t t = 0; t < bases.size(); ++t) {
        std::memcpy(bases[t] + id[i] * row_bytes[t], src, row_bytes[t]);
        src += row_bytes[t];
      }
    }
  });
}
