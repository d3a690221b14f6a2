// Attention over quantized (or differently typed) KV pools: int8, int4, fp8. int8/int4 pools
// where the CPU has AVX512-VNNI: keys and values in integer dot products (see decode_int_vnni);
// fp8 on bf16 dot products where it has AVX512-BF16 and VBMI (see decode_fp8_bf16).
#include "attention.h"
#include "ops.h"

// ---------------------------------------------------------------------------------------------
// Quantized (or differently typed) KV pools: int8, int4, fp8, or a float dtype other than the
// query's. Attention dequantizes one block tile at a time into a small float32 buffer (keys
// times their per-channel scales, values times their per-token/group scale) and runs the same
// math as the float path on it: no full-precision copy of a sequence is made in decode.

struct QuantPool {
  const uint8_t* data;        // [blocks, 2*kv_heads, block_size, row_bytes]
  int64_t kind, kv_heads, block_size, dim, row_bytes;
  const float* key_scales;    // [kv_heads, dim] static, or [blocks, kv_heads, dim]; null: none
  bool key_per_block;
  const float* value_scales;  // [blocks, kv_heads, block_size, 1]; null: v_scale for all
  const c10::Half* key_affine;    // int4: (step, minimum) [blocks, kv_heads, 2, dim]
  const c10::Half* value_affine;  // int4: [blocks, kv_heads, block_size, groups, 2]
  int64_t groups;
  float v_scale;
  const float* lut;           // fp8 code -> float
  const uint8_t* fp8_bytes;   // fp8: bf16 bytes of the 128 magnitudes (fp8_bf16_bytes)
  const uint8_t* tail;        // [slots, block_size, 2*kv_heads, dim] in tail_kind; null: none
  int64_t tail_kind, tail_elem;
  BlockSize blocks;           // block_size's shift and mask: row_at and token_index run per row slice

  int64_t block_bytes() const { return 2 * kv_heads * block_size * row_bytes; }

  // A sequence's (table: its block ids) row of head j (K heads, then V heads) at position pos.
  const uint8_t* row_at(const int64_t* table, int64_t j, int64_t pos) const {
    return data + table[blocks.block(pos)] * block_bytes() + (j * block_size + blocks.offset(pos)) * row_bytes;
  }

  // Its token at pos in the per-token tables of KV head h (value scales, int4 value affines).
  int64_t token_index(const int64_t* table, int64_t h, int64_t pos) const {
    return (table[blocks.block(pos)] * kv_heads + h) * block_size + blocks.offset(pos);
  }

  // Row `src` (one head of one token, row_bytes) unscaled to float32.
  void decode_row(const uint8_t* src, float* dst) const {
    switch (kind) {
      case kF32: to_float(reinterpret_cast<const float*>(src), dst, dim); break;
      case kF16: to_float(reinterpret_cast<const c10::Half*>(src), dst, dim); break;
      case kBF16: to_float(reinterpret_cast<const c10::BFloat16*>(src), dst, dim); break;
      case kE4M3:
      case kE5M2: {
        int64_t d = 0;
#if defined(__AVX2__) && defined(__F16C__) && !defined(__AVX512F__)
        for (; d + 8 <= dim; d += 8)  // 8 codes at a time through float16 (widen8; e4m3 in its units)
          _mm256_storeu_ps(dst + d, kind == kE5M2 ? widen8(reinterpret_cast<const Fp8E5M2*>(src + d))
                                                  : _mm256_mul_ps(widen8(reinterpret_cast<const Fp8E4M3*>(src + d)),
                                                                  _mm256_set1_ps(kE4M3Unit)));
#endif
        for (; d < dim; ++d) dst[d] = lut[src[d]];
        break;
      }
      case kI8: {
        const int8_t* codes = reinterpret_cast<const int8_t*>(src);
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<float>(codes[d]);
        break;
      }
      default: {  // int4 codes 0..15: channel d in byte d's low nibble, channel d + dim/2 in its high one
        const int64_t half = dim / 2;
#pragma omp simd
        for (int64_t d = 0; d < half; ++d) {
          dst[d] = static_cast<float>(src[d] & 15);
          dst[d + half] = static_cast<float>(src[d] >> 4);
        }
      }
    }
  }

  // Rows [0, n) of head j of pool block `block`, unscaled (decode_row) -> dst [n, dim].
  void code_rows(int64_t block, int64_t j, int64_t n, float* dst) const {
    const uint8_t* rows = data + block * block_bytes() + j * block_size * row_bytes;
    for (int64_t t = 0; t < n; ++t) decode_row(rows + t * row_bytes, dst + t * dim);
  }

  // The per-channel key scales [dim] of KV head h in pool block `block` (static or per block); keys with scales only.
  const float* key_scale_row(int64_t block, int64_t h) const {
    return key_scales + ((key_per_block ? block * kv_heads : 0) + h) * dim;
  }

  // The scales of KV head h's value rows in pool block `block` (all but int4: one group), or
  // null where one v_scale serves all.
  const float* value_scale_row(int64_t block, int64_t h) const {
    return value_scales == nullptr ? nullptr : value_scales + (block * kv_heads + h) * block_size;
  }

  // The scale of value row t of KV head h in pool block `block`.
  float value_scale(int64_t block, int64_t h, int64_t t) const {
    return value_scales == nullptr ? v_scale : value_scale_row(block, h)[t];
  }

  // Rows [0, n) of head j (K heads 0..kv_heads-1, then V heads) of pool block `block` -> dst [n, dim].
  void block_rows(int64_t block, int64_t j, int64_t n, float* dst) const {
    code_rows(block, j, n, dst);
    if (kind == kI4) return affine_rows(block, j, n, dst);
    if (j < kv_heads) {
      if (key_scales == nullptr) return;
      const float* ks = key_scale_row(block, j);
      for (int64_t t = 0; t < n; ++t) {
        float* row = dst + t * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) row[d] *= ks[d];
      }
      return;
    }
    for (int64_t t = 0; t < n; ++t) {  // one value scale per token (groups are int4's)
      float* row = dst + t * dim;
      const float vs = value_scale(block, j - kv_heads, t);
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) row[d] *= vs;
    }
  }

  // int4 codes -> values: code * step + minimum (keys per channel of the block, values per group).
  void affine_rows(int64_t block, int64_t j, int64_t n, float* dst) const {
    if (j < kv_heads) {
      const c10::Half* affine = key_affine + (block * kv_heads + j) * 2 * dim;
      thread_local std::vector<float> step, low;
      step.resize(dim);
      low.resize(dim);
      to_float(affine, step.data(), dim);
      to_float(affine + dim, low.data(), dim);
      for (int64_t t = 0; t < n; ++t) {
        float* row = dst + t * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) row[d] = row[d] * step[d] + low[d];
      }
      return;
    }
    const int64_t width = dim / groups;
    for (int64_t t = 0; t < n; ++t) {
      float* row = dst + t * dim;
      const c10::Half* affine = value_affine + ((block * kv_heads + j - kv_heads) * block_size + t) * groups * 2;
      for (int64_t g = 0; g < groups; ++g) {
        const float step = static_cast<float>(affine[2 * g]), low = static_cast<float>(affine[2 * g + 1]);
#pragma omp simd
        for (int64_t d = g * width; d < (g + 1) * width; ++d) row[d] = row[d] * step + low;
      }
    }
  }

  // Rows [0, n) of head j from tail slot `slot` (full precision) -> dst [n, dim].
  void tail_rows(int64_t slot, int64_t j, int64_t n, float* dst) const {
    const int64_t token_elems = 2 * kv_heads * dim;
    for (int64_t t = 0; t < n; ++t) {
      const uint8_t* src = tail + ((slot * block_size + t) * token_elems + j * dim) * tail_elem;
      if (tail_kind == kF32) to_float(reinterpret_cast<const float*>(src), dst + t * dim, dim);
      else if (tail_kind == kF16) to_float(reinterpret_cast<const c10::Half*>(src), dst + t * dim, dim);
      else to_float(reinterpret_cast<const c10::BFloat16*>(src), dst + t * dim, dim);
    }
  }

  // Whether block blk of a sequence of len tokens is a partial last block kept in full precision
  // in the sequence's tail slot (where the pool keeps one).
  bool in_tail(int64_t len, int64_t blk) const { return tail != nullptr && len - blk * block_size < block_size; }

  // Block blk of a sequence of len tokens (table: its block ids), head j, as float32 rows;
  // a partial last block comes from the tail slot when the pool keeps one. Returns the rows.
  int64_t tile(const int64_t* table, int64_t blk, int64_t len, int64_t tail_slot, int64_t j, float* dst) const {
    const int64_t n = std::min(block_size, len - blk * block_size);
    if (in_tail(len, blk)) tail_rows(tail_slot, j, n, dst);
    else block_rows(table[blk], j, n, dst);
    return n;
  }
};

// A quantized decode job's software prefetch, called as the key pass starts rows [pos, pos + m)
// (within one block) of head h: those rows' values and value scales (int4: affines), for the
// value pass (which then runs from L2), and the key rows kPrefetchAheadRows further on (prefetch_slice), with their
// block's key scales (int4: affines) where those are per block. Blocks are scattered, so the
// hardware's prefetchers stop at each block's end. The AVX-512 jobs call it 16 rows at a time,
// the portable job's in-place codes kCodeSliceRows at a time; not a whole block: a
// 16-row group of int8 keys is scored faster than memory answers, so one block ahead at
// 16-token blocks measured 1.2x slower cold than 64 rows (EPYC); `end` is where the coded rows stop.
// Always inlined: called out of line, every call spills the kernel's vector registers (GCC left it
// out of line once this file stood alone: int4 decode 1.5x slower hot).
__attribute__((always_inline)) static inline void prefetch_key_pass(const QuantPool& pool, const int64_t* table,
                                                                   int64_t h, int64_t pos, int64_t m, int64_t end) {
  const int64_t bs = pool.block_size, rb = pool.row_bytes;
  auto keys_from = [&](int64_t p, int64_t) {  // up to m rows, not past p's block or end; at a block's start its key tables
    if (p >= end) return;
    const int64_t offset = pool.blocks.offset(p);
    prefetch_row(pool.row_at(table, h, p), std::min({m, bs - offset, end - p}) * rb);
    if (offset != 0) return;
    const int64_t head_block = table[pool.blocks.block(p)] * pool.kv_heads + h;
    if (pool.key_affine != nullptr) prefetch_row(pool.key_affine + head_block * 2 * pool.dim, 4 * pool.dim);
    else if (pool.key_per_block) prefetch_row(pool.key_scales + head_block * pool.dim, 4 * pool.dim);
  };
  auto values_at = [&](int64_t p, int64_t) {
    prefetch_row(pool.row_at(table, pool.kv_heads + h, p), m * rb);
    const int64_t token = pool.token_index(table, h, p);
    if (pool.value_affine != nullptr) prefetch_row(pool.value_affine + token * pool.groups * 2, m * pool.groups * 4);
    else if (pool.value_scales != nullptr) prefetch_row(pool.value_scales + token, m * 4);
  };
  prefetch_slice(pos, m, keys_from, values_at);
}

#if defined(__AVX512F__)
// Decode over a quantized pool for one (sequence, KV head), vector path for dim = 16 * NV.
// Quantized kinds are read straight from the pool's bytes, with the scales folded outside the
// per-element work: keys' per-channel scales (int4: steps) multiply the query once per block
// (int4's minimums add q·min to the block's scores), a value's per-token scale multiplies its
// probability. float kinds of another dtype, and a sequence's tail block, go through a float
// tile. fp8 widens through float16: e5m2 is float16's top byte; e4m3's magnitude bits shifted
// into float16's exponent/mantissa fields give the value / 256 (subnormals included).
template <int KIND, int NV>
static inline void load_codes(const uint8_t* row, __m512 (&out)[NV]) {
  if constexpr (KIND == kI8) {
    for (int i = 0; i < NV; ++i)
      out[i] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * i))));
  } else if constexpr (KIND == kI4) {
    for (int i = 0; i < NV / 2; ++i) {
      const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * i)));
      out[i] = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
      out[i + NV / 2] = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
    }
  } else {
    for (int i = 0; i < NV; ++i) {
      const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * i)));
      __m256i half;
      if constexpr (KIND == kE5M2) {
        half = _mm256_slli_epi16(b, 8);
      } else {
        half = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
                               _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7));
      }
      out[i] = _mm512_cvtph_ps(half);
    }
  }
}

template <int KIND>
static constexpr float kFp8Unit = KIND == kE4M3 ? kE4M3Unit : 1.f;  // what load_codes' values must be scaled by

// Block blk's rows of head j through a float32 tile (float kinds of another dtype, a tail block
// kept in full precision): keys (j < kv_heads) scored against reg, or values added into reg.
template <int NV, int G>
static void tile_rows(const QuantPool& pool, const int64_t* table, int64_t blk, int64_t len, int64_t tail_slot,
                      int64_t j, __m512 (&reg)[G][NV], float* probs, float* tile) {
  const int64_t n = pool.tile(table, blk, len, tail_slot, j, tile), first = blk * pool.block_size;
  for (int64_t t = 0; t < n; ++t) {
    __m512 row[NV];
    for (int i = 0; i < NV; ++i) row[i] = _mm512_loadu_ps(tile + (t * NV + i) * 16);
    if (j < pool.kv_heads) score_row<NV, G>(reg, row, probs, len, first + t);
    else accumulate_row<NV, G>(reg, row, probs, len, first + t);
  }
}

template <int KIND, int NV, int G>
static void decode_quant_avx512(const float* qf, const QuantPool& pool, const int64_t* table, int64_t len,
                                int64_t tail_slot, int64_t h, float* probs, float* acc, float* tile,
                                const NextKeys&) {
  constexpr int64_t dim = NV * 16;
  const int64_t bs = pool.block_size, num_blocks = (len + bs - 1) / bs;
  const int64_t kv_heads = pool.kv_heads, rb = pool.row_bytes;
  __m512 q[G][NV], qs[G][NV];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < NV; ++i) q[g][i] = _mm512_loadu_ps(qf + g * dim + 16 * i);
  auto scale_query = [&](const float* scale, float unit) {
    for (int i = 0; i < NV; ++i) {
      const __m512 s = _mm512_mul_ps(_mm512_loadu_ps(scale + 16 * i), _mm512_set1_ps(unit));
      for (int g = 0; g < G; ++g) qs[g][i] = _mm512_mul_ps(q[g][i], s);
    }
  };
  if constexpr (KIND != kI4) {
    if (!pool.key_per_block && KIND != kF32 && KIND != kF16 && KIND != kBF16) scale_query(pool.key_scales + h * dim, kFp8Unit<KIND>);
  }
  for (int64_t blk = 0; blk < num_blocks; ++blk) {
    const int64_t first = blk * bs, n = std::min(bs, len - first);
    if (KIND == kF32 || KIND == kF16 || KIND == kBF16 || pool.in_tail(len, blk)) {
      tile_rows<NV, G>(pool, table, blk, len, tail_slot, h, q, probs, tile);
      continue;
    }
    const int64_t block = table[blk];
    float bias[G] = {};
    if constexpr (KIND == kI4) {  // q·(step*code + min) = (q*step)·code + q·min
      float step[dim], low[dim];
      const c10::Half* affine = pool.key_affine + (block * kv_heads + h) * 2 * dim;
      to_float(affine, step, dim);
      to_float(affine + dim, low, dim);
      scale_query(step, 1.f);
      for (int g = 0; g < G; ++g) {
        __m512 s = _mm512_setzero_ps();
        for (int i = 0; i < NV; ++i) s = _mm512_fmadd_ps(q[g][i], _mm512_loadu_ps(low + 16 * i), s);
        bias[g] = _mm512_reduce_add_ps(s);
      }
    } else if (pool.key_per_block) {
      scale_query(pool.key_scales + (block * kv_heads + h) * dim, 1.f);
    }
    const uint8_t* rows = pool.data + block * pool.block_bytes() + h * bs * rb;
    for (int64_t t = 0; t < n; ++t) {
      __m512 k[NV];
      load_codes<KIND, NV>(rows + t * rb, k);
      score_row<NV, G>(qs, k, probs, len, first + t);
      if constexpr (KIND == kI4)
        for (int g = 0; g < G; ++g) probs[g * len + first + t] += bias[g];
    }
  }
  softmax_rows(probs, G, len);
  __m512 a[G][NV];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < NV; ++i) a[g][i] = _mm512_setzero_ps();
  for (int64_t blk = 0; blk < num_blocks; ++blk) {
    const int64_t first = blk * bs, n = std::min(bs, len - first);
    if (KIND == kF32 || KIND == kF16 || KIND == kBF16 || pool.in_tail(len, blk)) {
      tile_rows<NV, G>(pool, table, blk, len, tail_slot, kv_heads + h, a, probs, tile);
      continue;
    }
    const int64_t block = table[blk];
    const uint8_t* rows = pool.data + block * pool.block_bytes() + (kv_heads + h) * bs * rb;
    for (int64_t t = 0; t < n; ++t) {
      __m512 v[NV];
      load_codes<KIND, NV>(rows + t * rb, v);
      if constexpr (KIND == kI4) {  // per group of 32 channels: p*(step*code + min)
        const c10::Half* affine = pool.value_affine + ((block * kv_heads + h) * bs + t) * pool.groups * 2;
        const int64_t width = NV / pool.groups;  // vectors per group
        for (int g = 0; g < G; ++g) {
          const float p = probs[g * len + first + t];
          for (int i = 0; i < NV; ++i) {
            const int64_t j = i / width;
            const float step = static_cast<float>(affine[2 * j]), low = static_cast<float>(affine[2 * j + 1]);
            a[g][i] = _mm512_fmadd_ps(_mm512_set1_ps(p * step), v[i], _mm512_add_ps(a[g][i], _mm512_set1_ps(p * low)));
          }
        }
      } else {
        const float vs = (pool.value_scales == nullptr ? pool.v_scale
                          : pool.value_scales[(block * kv_heads + h) * bs + t]) * kFp8Unit<KIND>;
        for (int g = 0; g < G; ++g) {
          const __m512 p = _mm512_set1_ps(probs[g * len + first + t] * vs);
          for (int i = 0; i < NV; ++i) a[g][i] = _mm512_fmadd_ps(p, v[i], a[g][i]);
        }
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < NV; ++i) _mm512_storeu_ps(acc + g * dim + 16 * i, a[g][i]);
}

using QuantJob = void (*)(const float*, const QuantPool&, const int64_t*, int64_t, int64_t, int64_t, float*, float*,
                          float*, const NextKeys&);

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// int8 and int4 pools on CPUs with AVX512-VNNI: the dot products in integers. Keys: the query
// times the keys' per-channel scales (int4: the block's steps, its minimums adding q·min to the
// block's scores) is rounded to 16 bits in units of its largest element / 32639 (an error 2^-16 of
// it, far below the codes' own rounding) and split into two signed bytes, q = 256 hi + lo; 16 key
// rows at a time are transposed in registers as unsigned bytes (int8: code + 128, taken back out
// as 128 sum(q); int4: the nibbles), so one vpdpbusd adds 4 channels' products for 16 rows at
// once, with no horizontal sums: 2 per 4 channels, against the 16-bit path's widening, 1 per 2
// channels and a 16-lane reduction per row and query head (which measured half the kernel).
// Values: a tile's probabilities times the values' scales (per token; int4: per token and group
// of 32 channels) are rounded to int16 in units of the tile's largest / 32767 (a tile: a block,
// or 64 tokens at 16- and 32-token blocks), and two tokens' rows interleaved, so one vpdpwssd
// adds both to 16 dims. int32 sums are exact (a tile of 256 tokens stays below 2^30; the keys'
// hi sums may wrap at head_dim 256, the combined score does not, and wrapping int32 adds are
// exact modulo 2^32); each tile's are scaled back into float32.
template <int KIND, int NB>
static inline void widen_codes(const uint8_t* row, __m512i (&out)[NB]) {
  if constexpr (KIND == kI8) {
    for (int j = 0; j < NB; ++j)
      out[j] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * j)));
  } else {  // int4: channel d in byte d's low nibble, channel d + dim/2 in its high one
    for (int j = 0; j < NB / 2; ++j) {
      const __m512i both = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * j)));
      out[j] = _mm512_and_si512(both, _mm512_set1_epi16(15));
      out[j + NB / 2] = _mm512_srli_epi16(both, 4);
    }
  }
}

// x[0, 16 * n) rounded to q = round(x / u), u = max|x| / 32639 (returned), as two signed bytes
// each, q = 256 hi + lo (hi = (q + 128) >> 8 in [-127, 127], lo in [-128, 127]): hi and lo [16 * n]
// in channel order; *sum = the sum of the q.
static inline float round_to_byte_pairs(const float* x, int64_t n, int8_t* hi, int8_t* lo, int32_t* sum) {
  __m512 top = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; ++i) top = _mm512_max_ps(top, _mm512_abs_ps(_mm512_loadu_ps(x + 16 * i)));
  const float largest = _mm512_reduce_max_ps(top);
  const __m512 inverse = _mm512_set1_ps(largest > 0.f ? 32639.f / largest : 0.f);
  __m512i total = _mm512_setzero_si512();
  for (int64_t i = 0; i < n; ++i) {
    const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + 16 * i), inverse));
    const __m512i high = _mm512_srai_epi32(_mm512_add_epi32(q, _mm512_set1_epi32(128)), 8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + 16 * i), _mm512_cvtepi32_epi8(high));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + 16 * i),
                     _mm512_cvtepi32_epi8(_mm512_sub_epi32(q, _mm512_slli_epi32(high, 8))));
    total = _mm512_add_epi32(total, q);
  }
  *sum = _mm512_reduce_add_epi32(total);
  return largest / 32639.f;
}

// acc + the dot products of a's unsigned bytes with the 4 signed bytes at b, in every lane: the
// broadcast folded into vpdpbusd's memory operand (GCC 12 emits a separate vpbroadcastd for each,
// which drew ~22% of the int8 kernel's perf samples on an EPYC; hot, the kernel went from about
// 29 to 25 ns per token without them, in noisy single runs).
static inline __m512i dpbusd_broadcast(__m512i acc, __m512i a, const int32_t* b) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(a), "m"(*b));
  return acc;
}

// acc + the dot products of a's int16 pairs with the pair at b, in every lane (as dpbusd_broadcast).
static inline __m512i dpwssd_broadcast(__m512i acc, __m512i a, const int32_t* b) {
  asm("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(a), "m"(*b));
  return acc;
}

// The int4 value affines of m consecutive tokens of a block (per token: groups x (step, minimum)
// in float16) into float32 step[c * stride + t] and low[c * stride + t]: 64 halves at a time,
// each (group, part) picked out by one word permute and widened 16 at a time. (Widened one by
// one, this was 13% of the int4 kernel's perf samples on a hot pool.)
static inline void widen_value_affines(const c10::Half* src, int64_t m, int64_t groups, float* step, float* low,
                                       int64_t stride) {
  const int64_t per = 2 * groups, tokens = 64 / per;  // halves per token; tokens per 64 halves
  alignas(64) static const int16_t lanes[32] = {0,  1,  2,  3,  4,  5,  6,  7,  8,  9,  10, 11, 12, 13, 14, 15,
                                                16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31};
  const __m512i base = _mm512_mullo_epi16(_mm512_load_si512(lanes), _mm512_set1_epi16(static_cast<int16_t>(per)));
  auto halves_mask = [](int64_t k) -> __mmask32 {
    return k <= 0 ? 0 : k >= 32 ? 0xFFFFFFFFu : static_cast<__mmask32>((1ull << k) - 1);
  };
  for (int64_t t0 = 0; t0 < m; t0 += tokens) {
    const int64_t count = std::min(tokens, m - t0), halves = count * per;
    const c10::Half* at = src + t0 * per;
    const __m512i a = _mm512_maskz_loadu_epi16(halves_mask(halves), at);
    const __m512i b = _mm512_maskz_loadu_epi16(halves_mask(halves - 32), at + 32);
    for (int64_t c = 0; c < groups; ++c)
      for (int part = 0; part < 2; ++part) {
        const __m512i index = _mm512_add_epi16(base, _mm512_set1_epi16(static_cast<int16_t>(2 * c + part)));
        const __m512 wide = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutex2var_epi16(a, index, b)));
        _mm512_mask_storeu_ps((part == 0 ? step : low) + c * stride + t0, tail_mask(count), wide);
      }
  }
}

// x[r] dword d -> x[d] dword r: a 16 x 16 transpose of 32-bit elements in 64 shuffles.
static inline void transpose16x16_epi32(__m512i (&x)[16]) {
  __m512i t[16];
  for (int a = 0; a < 4; ++a) {  // rows 4a..4a+3: x[4a + j] 128-bit lane L = those rows' dword 4L + j
    const __m512i* r = x + 4 * a;
    const __m512i p0 = _mm512_unpacklo_epi32(r[0], r[1]), p1 = _mm512_unpackhi_epi32(r[0], r[1]);
    const __m512i p2 = _mm512_unpacklo_epi32(r[2], r[3]), p3 = _mm512_unpackhi_epi32(r[2], r[3]);
    t[4 * a] = _mm512_unpacklo_epi64(p0, p2);
    t[4 * a + 1] = _mm512_unpackhi_epi64(p0, p2);
    t[4 * a + 2] = _mm512_unpacklo_epi64(p1, p3);
    t[4 * a + 3] = _mm512_unpackhi_epi64(p1, p3);
  }
  for (int j = 0; j < 4; ++j) {  // the 128-bit lanes of t[j], t[4 + j], t[8 + j], t[12 + j] transposed
    const __m512i v0 = _mm512_shuffle_i32x4(t[j], t[4 + j], 0x44), v1 = _mm512_shuffle_i32x4(t[j], t[4 + j], 0xEE);
    const __m512i v2 = _mm512_shuffle_i32x4(t[8 + j], t[12 + j], 0x44);
    const __m512i v3 = _mm512_shuffle_i32x4(t[8 + j], t[12 + j], 0xEE);
    x[j] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    x[4 + j] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
    x[8 + j] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    x[12 + j] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
  }
}

// Channels [64c, 64c + 64) of 16 key rows (the first m of them real: the others repeat row m - 1,
// their scores unused) as unsigned bytes (int8: code + 128; int4: the nibble), transposed: out[i]
// dword r = row r's channels 64c + 4i .. 64c + 4i + 3. C = head_dim / 64.
template <int KIND, int C>
static inline void key_bytes_transposed(const uint8_t* rows, int64_t rb, int m, int c, __m512i (&out)[16]) {
  for (int r = 0; r < 16; ++r) {
    const uint8_t* row = rows + std::min(r, m - 1) * rb;
    if constexpr (KIND == kI8) {
      out[r] = _mm512_xor_si512(_mm512_loadu_si512(row + 64 * c), _mm512_set1_epi8(static_cast<char>(0x80)));
    } else if constexpr (C == 1) {  // int4, 32 bytes: channels 0-31 low nibbles, 32-63 high
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
      const __m256i low = _mm256_and_si256(b, _mm256_set1_epi8(15));
      const __m256i high = _mm256_and_si256(_mm256_srli_epi16(b, 4), _mm256_set1_epi8(15));
      out[r] = _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
    } else {  // int4: channel d in byte d's low nibble, d + dim/2 in its high one
      const __m512i b = _mm512_loadu_si512(row + 64 * (c % (C / 2)));
      out[r] = _mm512_and_si512(c < C / 2 ? b : _mm512_srli_epi16(b, 4), _mm512_set1_epi8(15));
    }
  }
  transpose16x16_epi32(out);
}

// NEXT: the value pass prefetches the next job's keys (NextKeys), every 8 rows. A template
// parameter, not a run-time test: with the test in the job, int8 ran 1.17-1.36x slower at 140-512
// tokens even where it was false (the job's code, not its memory traffic).
template <int KIND, int NB, int G, bool NEXT>
static void decode_int_vnni(const float* qf, const QuantPool& pool, const int64_t* table, int64_t len,
                            int64_t tail_slot, int64_t h, float* probs, float* acc, float* tile,
                            const NextKeys& next) {
  constexpr int64_t dim = NB * 32;
  constexpr int NV = 2 * NB;
  const int64_t bs = pool.block_size, num_blocks = (len + bs - 1) / bs, kv_heads = pool.kv_heads;
  const int64_t rb = pool.row_bytes, tile_bytes = bs * rb, groups = pool.groups, chunks_per_group = NB / groups;
  // blocks read as codes; a partial last block kept in full precision goes through a float tile
  const int64_t coded = pool.tail != nullptr && len % bs != 0 ? num_blocks - 1 : num_blocks;
  const int64_t coded_len = std::min(len, coded * bs);
  __m512 q[G][NV];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < NV; ++i) q[g][i] = _mm512_loadu_ps(qf + g * dim + 16 * i);
  constexpr int C = NB / 2;  // 64-channel chunks of a key row
  alignas(64) int8_t qbytes[G][2][dim];  // q * key_scale as hi and lo bytes (round_to_byte_pairs)
  float unit[G], bias[G] = {};
  __m512i offset[G];  // int8: 128 times the sum of q, from the codes' + 128
  auto round_query = [&](const float* key_scale) {
    float scaled[dim];
    for (int g = 0; g < G; ++g) {
      for (int i = 0; i < NV; ++i)
        _mm512_storeu_ps(scaled + 16 * i, _mm512_mul_ps(q[g][i], _mm512_loadu_ps(key_scale + 16 * i)));
      int32_t sum;
      unit[g] = round_to_byte_pairs(scaled, NV, qbytes[g][0], qbytes[g][1], &sum);
      offset[g] = _mm512_set1_epi32(KIND == kI8 ? 128 * sum : 0);
    }
  };
  if (KIND == kI8 && !pool.key_per_block) round_query(pool.key_scales + h * dim);
  const uint8_t* head_keys = pool.data + h * tile_bytes;
  const uint8_t* head_values = pool.data + (kv_heads + h) * tile_bytes;
  for (int64_t blk = 0; blk < coded; ++blk) {
    const int64_t block = table[blk], first = blk * bs, n = std::min(bs, len - first);
    if constexpr (KIND == kI4) {  // q·(step*code + min) = (q*step)·code + q·min
      float step[dim], low[dim];
      const c10::Half* affine = pool.key_affine + (block * kv_heads + h) * 2 * dim;
      to_float(affine, step, dim);
      to_float(affine + dim, low, dim);
      round_query(step);
      for (int g = 0; g < G; ++g) {
        __m512 s = _mm512_setzero_ps();
        for (int i = 0; i < NV; ++i) s = _mm512_fmadd_ps(q[g][i], _mm512_loadu_ps(low + 16 * i), s);
        bias[g] = _mm512_reduce_add_ps(s);
      }
    } else if (pool.key_per_block) {
      round_query(pool.key_scales + (block * kv_heads + h) * dim);
    }
    const uint8_t* rows = head_keys + block * pool.block_bytes();
    for (int64_t r0 = 0; r0 < n; r0 += 16) {
      const int m = static_cast<int>(std::min<int64_t>(16, n - r0));
      prefetch_key_pass(pool, table, h, first + r0, m, coded_len);
      __m512i high[G], low[G];
      for (int g = 0; g < G; ++g) high[g] = low[g] = _mm512_setzero_si512();
      for (int c = 0; c < C; ++c) {
        __m512i k[16];
        key_bytes_transposed<KIND, C>(rows + r0 * rb, rb, m, c, k);
        for (int g = 0; g < G; ++g) {
          const int32_t* hi = reinterpret_cast<const int32_t*>(qbytes[g][0]) + 16 * c;
          const int32_t* lo = reinterpret_cast<const int32_t*>(qbytes[g][1]) + 16 * c;
          for (int i = 0; i < 16; ++i) {
            high[g] = dpbusd_broadcast(high[g], k[i], hi + i);
            low[g] = dpbusd_broadcast(low[g], k[i], lo + i);
          }
        }
      }
      for (int g = 0; g < G; ++g) {
        const __m512i sums = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(high[g], 8), low[g]), offset[g]);
        _mm512_mask_storeu_ps(probs + g * len + first + r0, tail_mask(m),
                              _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_set1_ps(unit[g]), _mm512_set1_ps(bias[g])));
      }
    }
  }
  if (coded < num_blocks) tile_rows<NV, G>(pool, table, coded, len, tail_slot, h, q, probs, tile);
  softmax_rows(probs, G, len);
  // accumulators in the interleaved order: a[g][2j] holds dims 32j + 8L + i, a[g][2j + 1] dims
  // 32j + 8L + 4 + i, for 128-bit lane L and i < 4
  __m512 a[G][NV];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < NV; ++i) a[g][i] = _mm512_setzero_ps();
  constexpr int kMaxGroups = KIND == kI4 ? NB : 1;
  alignas(64) int16_t weights[G][kMaxGroups][256];
  float step[kMaxGroups][256], low[kMaxGroups][256];  // int4: each token's value affine, by group
  // Value tiles of whole blocks, at 16- and 32-token blocks of 64 tokens (4 or 2 blocks): the
  // per-tile work (weights rounded to int16, sums scaled back) is then spread over more tokens.
  const int64_t span = bs % 16 == 0 && bs < 64 ? 64 / bs : 1;
  for (int64_t blk0 = 0; blk0 < coded; blk0 += span) {
    const int64_t first = blk0 * bs, n = std::min(span * bs, coded_len - first);
    if constexpr (KIND == kI4) {
      for (int64_t t0 = 0; t0 < n; t0 += bs) {  // block by block: no division per token
        widen_value_affines(pool.value_affine + pool.token_index(table, h, first + t0) * groups * 2,
                            std::min(bs, n - t0), groups, &step[0][t0], &low[0][t0], 256);
      }
    }
    const float* chunk_scales[16];  // each 16 tokens' value scales (a chunk lies in one block)
    if constexpr (KIND != kI4) {
      for (int64_t t = 0; t < n; t += 16)
        chunk_scales[t / 16] =
            pool.value_scales == nullptr ? nullptr : pool.value_scales + pool.token_index(table, h, first + t);
    }
    float wunit[G][kMaxGroups], offset[G][kMaxGroups];
    for (int g = 0; g < G; ++g)
      for (int64_t c = 0; c < (KIND == kI4 ? groups : 1); ++c) {
        float w[256];  // p * scale; zeros past n up to the next 16
        __m512 top = _mm512_setzero_ps(), shift = _mm512_setzero_ps();
        for (int64_t t = 0; t < n; t += 16) {
          const __mmask16 live = tail_mask(n - t);
          const __m512 p = _mm512_maskz_loadu_ps(live, probs + g * len + first + t);
          __m512 scale;
          if constexpr (KIND == kI4) {
            scale = _mm512_maskz_loadu_ps(live, step[c] + t);
            shift = _mm512_fmadd_ps(p, _mm512_maskz_loadu_ps(live, low[c] + t), shift);
          } else {
            scale = chunk_scales[t / 16] == nullptr ? _mm512_set1_ps(pool.v_scale)
                                                    : _mm512_maskz_loadu_ps(live, chunk_scales[t / 16]);
          }
          const __m512 weight = _mm512_maskz_mul_ps(live, p, scale);
          top = _mm512_max_ps(top, _mm512_abs_ps(weight));
          _mm512_storeu_ps(w + t, weight);
        }
        offset[g][c] = _mm512_reduce_add_ps(shift);  // int4: sum of p * min, the same for the group's dims
        const float largest = _mm512_reduce_max_ps(top);
        const __m512 inverse = _mm512_set1_ps(largest > 0.f ? 32767.f / largest : 0.f);
        for (int64_t t = 0; t < n; t += 16)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(weights[g][c] + t),
                              _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(w + t), inverse))));
        wunit[g][c] = largest / 32767.f;
      }
    __m512i sums[G][NV];
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < NV; ++i) sums[g][i] = _mm512_setzero_si512();
    for (int64_t t0 = 0; t0 < n; t0 += bs) {  // the tile's blocks
      const uint8_t* rows = head_values + table[blk0 + t0 / bs] * pool.block_bytes();
      const int64_t m = std::min(bs, n - t0);
      // NEXT: the next job's key rows in this block (rows of row_bytes bytes)
      [[maybe_unused]] NextRows<uint8_t> ahead;
      if constexpr (NEXT) ahead = next.rows(pool.data, pool.block_bytes(), bs, rb, blk0 + t0 / bs, m);
      for (int64_t t = 0; t < m; t += 2) {
        if constexpr (NEXT)
          if (t % 8 == 0 && t < ahead.count) prefetch_row(ahead.first + t * rb, 8 * rb);
        __m512i first_row[NB], second_row[NB], lo[NB], hi[NB];
        widen_codes<KIND, NB>(rows + t * rb, first_row);
        if (t + 1 < m) widen_codes<KIND, NB>(rows + (t + 1) * rb, second_row);
        else
          for (int j = 0; j < NB; ++j) second_row[j] = _mm512_setzero_si512();
        for (int j = 0; j < NB; ++j) {
          lo[j] = _mm512_unpacklo_epi16(first_row[j], second_row[j]);
          hi[j] = _mm512_unpackhi_epi16(first_row[j], second_row[j]);
        }
        for (int g = 0; g < G; ++g)
          for (int j = 0; j < NB; ++j) {
            // tokens t and t + 1's weights for chunk j's group (a zero past n)
            const int32_t* both =
                reinterpret_cast<const int32_t*>(weights[g][KIND == kI4 ? j / chunks_per_group : 0] + t0 + t);
            sums[g][2 * j] = dpwssd_broadcast(sums[g][2 * j], lo[j], both);
            sums[g][2 * j + 1] = dpwssd_broadcast(sums[g][2 * j + 1], hi[j], both);
          }
      }
    }
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < NV; ++i) {
        const int64_t c = KIND == kI4 ? i / 2 / chunks_per_group : 0;
        a[g][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[g][i]), _mm512_set1_ps(wunit[g][c]), a[g][i]);
        if constexpr (KIND == kI4) a[g][i] = _mm512_add_ps(a[g][i], _mm512_set1_ps(offset[g][c]));
      }
  }
  alignas(64) static const int32_t low_dims[16] = {0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23};
  alignas(64) static const int32_t high_dims[16] = {8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31};
  const __m512i to_low = _mm512_load_si512(low_dims), to_high = _mm512_load_si512(high_dims);
  __m512 ordered[G][NV];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < NB; ++j) {
      ordered[g][2 * j] = _mm512_permutex2var_ps(a[g][2 * j], to_low, a[g][2 * j + 1]);
      ordered[g][2 * j + 1] = _mm512_permutex2var_ps(a[g][2 * j], to_high, a[g][2 * j + 1]);
    }
  if (coded < num_blocks) tile_rows<NV, G>(pool, table, coded, len, tail_slot, kv_heads + h, ordered, probs, tile);
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < NV; ++i) _mm512_storeu_ps(acc + g * dim + 16 * i, ordered[g][i]);
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
// fp8 pools (e4m3, e5m2) on CPUs with AVX512-BF16 and VBMI: every fp8 value is exact in bf16,
// so a code becomes its bf16 value by byte-table lookups — vpermi2b over the high and the low
// bytes of the 128 magnitudes' bf16 values (two registers each), the code's sign bit ORed into the
// high byte: 64 codes in 5 instructions instead of float16 and float32 conversions. Keys are then
// scored with vdpbf16ps against the query times the key scales in bf16 (2^-9 relative, far below
// fp8's own step; float32 queries as two bf16 parts, exact to ~2^-17, so float32 models keep
// their precision); values are widened to float32 (a shift or a mask) for exact FMAs. (Scoring
// widened keys with float32 FMAs, and values two tokens per vdpbf16ps, both measured slower on
// a Xeon with AMX.)
// Unpacking the low and high bytes puts each 128-bit lane's first 8 codes in one word vector
// and its last 8 in the other, so the query is laid out in that channel order and the outputs
// put back in the natural one.
struct Fp8Bytes {
  __m512i high0, high1, low0, low1;  // bf16 bytes of magnitudes 0-63 and 64-127

  explicit Fp8Bytes(const uint8_t* bytes)  // [high bytes of 128 magnitudes, then low bytes]
      : high0(_mm512_loadu_si512(bytes)), high1(_mm512_loadu_si512(bytes + 64)),
        low0(_mm512_loadu_si512(bytes + 128)), low1(_mm512_loadu_si512(bytes + 192)) {}

  // The 64 codes at p as bf16: out[0] holds channels 16L..16L+7 of each lane L, out[1] 16L+8..16L+15.
  void to_bf16(const uint8_t* p, __m512i (&out)[2]) const {
    const __m512i codes = _mm512_loadu_si512(p);
    const __m512i high = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(high0, codes, high1), codes,
                                                   _mm512_set1_epi8(static_cast<char>(0x80)), 0xF8);  // a | (b & c)
    const __m512i low = _mm512_permutex2var_epi8(low0, codes, low1);
    out[0] = _mm512_unpacklo_epi8(low, high);
    out[1] = _mm512_unpackhi_epi8(low, high);
  }
};

// The natural channel of bf16 word w (0-31) of word vector v (chunk v / 2 of 64, half v % 2).
static inline int64_t fp8_channel(int64_t v, int64_t w) { return 64 * (v / 2) + 16 * (w / 8) + 8 * (v % 2) + w % 8; }

// The high bytes, then the low bytes, of the bf16 values of fp8 magnitudes 0-127 (lut: code -> float).
static void fp8_bf16_bytes(const float* lut, uint8_t* bytes) {
  for (int c = 0; c < 128; ++c) {
    uint32_t bits;
    std::memcpy(&bits, lut + c, sizeof(bits));
    bytes[c] = static_cast<uint8_t>(bits >> 24);
    bytes[128 + c] = static_cast<uint8_t>(bits >> 16);
  }
}

template <int NC, int G, bool SPLIT>
static void decode_fp8_bf16(const float* qf, const QuantPool& pool, const int64_t* table, int64_t len,
                            int64_t tail_slot, int64_t h, float* probs, float* acc, float* tile,
                            const NextKeys&) {
  constexpr int64_t dim = NC * 64;
  constexpr int NB = 2 * NC, NV = 4 * NC;  // bf16 word vectors, float32 vectors per row
  const Fp8Bytes bytes(pool.fp8_bytes);
  const int64_t bs = pool.block_size, num_blocks = (len + bs - 1) / bs, kv_heads = pool.kv_heads;
  const int64_t rb = pool.row_bytes, tile_bytes = bs * rb;
  const int64_t coded = pool.tail != nullptr && len % bs != 0 ? num_blocks - 1 : num_blocks;
  const int64_t coded_len = std::min(len, coded * bs);
  // qb = q * key_scale in bf16, in the words' channel order; SPLIT (float32 queries): plus the
  // remainder in qr, so the two products together are exact to ~2^-17
  __m512bh qb[G][NB], qr[G][NB];
  auto round_query = [&](const float* key_scale) {
    for (int g = 0; g < G; ++g)
      for (int v = 0; v < NB; ++v) {
        alignas(64) float lanes[32];
        for (int w = 0; w < 32; ++w) {
          const int64_t d = fp8_channel(v, w);
          lanes[w] = qf[g * dim + d] * (key_scale != nullptr ? key_scale[d] : 1.f);
        }
        const __m512 low = _mm512_load_ps(lanes), high = _mm512_load_ps(lanes + 16);
        qb[g][v] = _mm512_cvtne2ps_pbh(high, low);
        if constexpr (SPLIT) {
          const __m512i words = (__m512i)qb[g][v];  // the rounded halves back in float32, subtracted
          const __m512 low_rounded = _mm512_cvtpbh_ps((__m256bh)_mm512_castsi512_si256(words));
          const __m512 high_rounded = _mm512_cvtpbh_ps((__m256bh)_mm512_extracti64x4_epi64(words, 1));
          qr[g][v] = _mm512_cvtne2ps_pbh(_mm512_sub_ps(high, high_rounded), _mm512_sub_ps(low, low_rounded));
        }
      }
  };
  if (!pool.key_per_block) round_query(pool.key_scales == nullptr ? nullptr : pool.key_scales + h * dim);
  const uint8_t* head_keys = pool.data + h * tile_bytes;
  const uint8_t* head_values = pool.data + (kv_heads + h) * tile_bytes;
  for (int64_t blk = 0; blk < coded; ++blk) {
    const int64_t block = table[blk], first = blk * bs, n = std::min(bs, len - first);
    if (pool.key_per_block) round_query(pool.key_scales + (block * kv_heads + h) * dim);
    const uint8_t* rows = head_keys + block * pool.block_bytes();
    for (int64_t r0 = 0; r0 < n; r0 += 16) {
      const int m = static_cast<int>(std::min<int64_t>(16, n - r0));
      prefetch_key_pass(pool, table, h, first + r0, m, coded_len);
      __m512i keys[16][NB];  // the rows in bf16 (L1), then scored head by head, as the bf16 kernel does
      for (int r = 0; r < m; ++r)
        for (int c = 0; c < NC; ++c) {
          __m512i k[2];
          bytes.to_bf16(rows + (r0 + r) * rb + 64 * c, k);
          keys[r][2 * c] = k[0];
          keys[r][2 * c + 1] = k[1];
        }
      for (int g = 0; g < G; ++g) {
        __m512 part[16];
        for (int r = 0; r < 16; ++r) {
          part[r] = _mm512_setzero_ps();
          if (r < m)
            for (int v = 0; v < NB; ++v) {
              part[r] = _mm512_dpbf16_ps(part[r], qb[g][v], (__m512bh)keys[r][v]);
              if constexpr (SPLIT) part[r] = _mm512_dpbf16_ps(part[r], qr[g][v], (__m512bh)keys[r][v]);
            }
        }
        _mm512_mask_storeu_ps(probs + g * len + first + r0, tail_mask(m), lane_sums16(part));
      }
    }
  }
  __m512 q[G][NV];  // the natural-order query, for a tail block kept in full precision
  if (coded < num_blocks) {
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < NV; ++i) q[g][i] = _mm512_loadu_ps(qf + g * dim + 16 * i);
    tile_rows<NV, G>(pool, table, coded, len, tail_slot, h, q, probs, tile);
  }
  softmax_rows(probs, G, len);
  // a[g][2v] holds the even words of word vector v, a[g][2v + 1] its odd ones
  __m512 a[G][NV];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < NV; ++i) a[g][i] = _mm512_setzero_ps();
  for (int64_t blk = 0; blk < coded; ++blk) {
    const int64_t first = blk * bs, n = std::min(bs, len - first);
    const uint8_t* rows = head_values + table[blk] * pool.block_bytes();
    // per-token value scales multiply the block's probabilities first (one v_scale multiplies
    // the outputs at the end), so each row's weight is a broadcast from memory
    if (pool.value_scales != nullptr) {
      const float* scales = pool.value_scales + (table[blk] * kv_heads + h) * bs;
      for (int g = 0; g < G; ++g)
        for (int64_t t = 0; t < n; t += 16) {
          const __mmask16 live = tail_mask(n - t);
          float* p = probs + g * len + first + t;
          _mm512_mask_storeu_ps(p, live, _mm512_mul_ps(_mm512_maskz_loadu_ps(live, p), _mm512_maskz_loadu_ps(live, scales + t)));
        }
    }
    for (int64_t t = 0; t < n; ++t) {
      __m512 v[NV];
      for (int c = 0; c < NC; ++c) {
        __m512i words[2];
        bytes.to_bf16(rows + t * rb + 64 * c, words);
        for (int i = 0; i < 2; ++i) widen_bf16_words(words[i], v[4 * c + 2 * i], v[4 * c + 2 * i + 1]);
      }
      accumulate_row<NV, G>(a, v, probs, len, first + t);
    }
  }
  const float unit = pool.value_scales == nullptr ? pool.v_scale : 1.f;
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < NV; ++i) {
      alignas(64) float lanes[16];
      _mm512_store_ps(lanes, a[g][i]);
      for (int j = 0; j < 16; ++j) acc[g * dim + fp8_channel(i / 2, 2 * j + i % 2)] = lanes[j] * unit;
    }
  if (coded < num_blocks) {
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < NV; ++i) a[g][i] = _mm512_loadu_ps(acc + g * dim + 16 * i);
    tile_rows<NV, G>(pool, table, coded, len, tail_slot, kv_heads + h, a, probs, tile);
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < NV; ++i) _mm512_storeu_ps(acc + g * dim + 16 * i, a[g][i]);
  }
}
#endif

template <int KIND, int NV>
static QuantJob pick_quant_group(int64_t group) {
  return by_group(group, [](auto g) -> QuantJob { return decode_quant_avx512<KIND, NV, decltype(g)::value>; });
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
template <int KIND, int NB>
static QuantJob vnni_job(int64_t group, bool next_keys) {
  if (next_keys) return by_group(group, [](auto g) -> QuantJob { return decode_int_vnni<KIND, NB, decltype(g)::value, true>; });
  return by_group(group, [](auto g) -> QuantJob { return decode_int_vnni<KIND, NB, decltype(g)::value, false>; });
}
#endif

// split_query: float32 queries, which the fp8 path scores as two bf16 parts (see decode_fp8_bf16)
// next_keys: the job that prefetches the next job's keys, where a kind has one (int8, int4 with VNNI)
template <int NV>
static QuantJob pick_quant_kind(int64_t kind, int64_t group, bool split_query, bool next_keys) {
  (void)split_query;
  (void)next_keys;
  switch (kind) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    case kI8: return vnni_job<kI8, NV / 2>(group, next_keys);
    case kI4: return vnni_job<kI4, NV / 2>(group, next_keys);
#else
    case kI8: return pick_quant_group<kI8, NV>(group);
    case kI4: return pick_quant_group<kI4, NV>(group);
#endif
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
    case kE4M3:
    case kE5M2:
      if (split_query) return by_group(group, [](auto g) -> QuantJob { return decode_fp8_bf16<NV / 4, decltype(g)::value, true>; });
      return by_group(group, [](auto g) -> QuantJob { return decode_fp8_bf16<NV / 4, decltype(g)::value, false>; });
#else
    case kE4M3: return pick_quant_group<kE4M3, NV>(group);
    case kE5M2: return pick_quant_group<kE5M2, NV>(group);
#endif
    default: return pick_quant_group<kF32, NV>(group);  // any float kind: through float tiles
  }
}
#endif

#if defined(KVSERVE_AVX2_ROWS)
// int8 and int4 keys in integer dot products on AVX2 (no VNNI): a query row rounded to int16
// against its largest element, q ~ q16 * step, times the codes widened to int16, two products per
// 32-bit lane (vpmaddwd): exact int32 sums for head_dim up to 256 (256 x 127 x 32767 < 2^31). Per
// 16 int8 channels that is one widening, shared by up to 3 query heads, then a multiply-add and an
// add per head, where the float tile took a widening, a conversion and a store per 8, then an FMA
// per 8 per head; per 16 int4 bytes (32 channels: d and d + dim/2) one widening, a mask and a
// shift, then two multiply-adds per head. Head dims 64-256, as the VNNI job takes: smaller heads
// (the tests' tiny models) stay on the float tile, where the 16-bit query's rounding would show
// in runs the tests compare token for token.
constexpr int64_t kMinIntKeyDim = 64, kMaxIntKeyDim = 256;

static inline bool keys_in_integers(const QuantPool& pool) {
  const int64_t lanes = pool.kind == kI8 ? 16 : pool.kind == kI4 ? 32 : 0;  // channels per widening
  return lanes != 0 && pool.dim % lanes == 0 && pool.dim >= kMinIntKeyDim && pool.dim <= kMaxIntKeyDim;
}

// q16[g][d] = round(x[g][d] / step[g]), step[g] = max_d |x[g][d]| / 32767 (1 for a zero row), for
// x = q times the key scales (per channel; none: q itself). x is never stored: one pass finds its
// largest magnitude, a second rounds it. It runs per block where key scales are per block (int8
// without calibration, int4): separate scaling, maximum and rounding passes there took 3-6% more
// of the job's time on a Zen 3.
static void round_queries_int16(const float* q, const float* scales, int64_t group, int64_t dim, int16_t* q16,
                                float* step) {
  auto scaled = [&](const float* qg, int64_t d) {
    const __m256 x = _mm256_loadu_ps(qg + d);
    return scales == nullptr ? x : _mm256_mul_ps(x, _mm256_loadu_ps(scales + d));
  };
  for (int64_t g = 0; g < group; ++g) {
    const float* qg = q + g * dim;
    __m256 top = _mm256_setzero_ps();
    for (int64_t d = 0; d < dim; d += 8)
      top = _mm256_max_ps(top, _mm256_andnot_ps(_mm256_set1_ps(-0.f), scaled(qg, d)));  // |x|
    const float amax = max8(top);
    step[g] = amax > 0.f ? amax / 32767.f : 1.f;
    const __m256 inv = _mm256_set1_ps(1.f / step[g]);
    for (int64_t d = 0; d < dim; d += 16) {  // nearest, ties to even (the MXCSR default), as nearbyint
      const __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(scaled(qg, d), inv));
      const __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(scaled(qg, d + 8), inv));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q16 + g * dim + d),
                          _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8));
    }
  }
}

// scores[g * stride + t] = step[g] * (q16[g] . keys[t]) for GB query heads and n key rows
// (row_bytes apart) of int8 codes, or of int4 ones (kInt4: unsigned nibbles, channel d in byte d's
// low half and d + dim/2 in its high one): 4 rows at a time, each 16 bytes widened once for the
// GB heads, whose 4 x GB int32 sums stay in registers and are reduced together (a hadd tree) at the end.
template <int GB, bool kInt4>
static void score_rows_int(const int16_t* q16, const float* step, int64_t dim, const uint8_t* keys,
                           int64_t row_bytes, int64_t n, float* scores, int64_t stride) {
  const int64_t half = dim / 2, bytes = kInt4 ? half : dim;
  int64_t t = 0;
  for (; t + 4 <= n; t += 4) {
    __m256i s[GB][4];
    KVSERVE_UNROLL
    for (int g = 0; g < GB; ++g)
      KVSERVE_UNROLL
      for (int j = 0; j < 4; ++j) s[g][j] = _mm256_setzero_si256();
    for (int64_t c = 0; c < bytes; c += 16)
      KVSERVE_UNROLL
      for (int j = 0; j < 4; ++j) {
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(keys + (t + j) * row_bytes + c));
        auto q_at = [&](int g, int64_t d) {
          return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q16 + g * dim + d));
        };
        if constexpr (kInt4) {
          const __m256i k = _mm256_cvtepu8_epi16(raw);
          const __m256i low = _mm256_and_si256(k, _mm256_set1_epi16(15)), high = _mm256_srli_epi16(k, 4);
          KVSERVE_UNROLL
          for (int g = 0; g < GB; ++g)
            s[g][j] = _mm256_add_epi32(s[g][j], _mm256_add_epi32(_mm256_madd_epi16(low, q_at(g, c)),
                                                                 _mm256_madd_epi16(high, q_at(g, half + c))));
        } else {
          const __m256i k = _mm256_cvtepi8_epi16(raw);
          KVSERVE_UNROLL
          for (int g = 0; g < GB; ++g) s[g][j] = _mm256_add_epi32(s[g][j], _mm256_madd_epi16(k, q_at(g, c)));
        }
      }
    KVSERVE_UNROLL
    for (int g = 0; g < GB; ++g) {
      const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(s[g][0], s[g][1]), _mm256_hadd_epi32(s[g][2], s[g][3]));
      const __m128i sums = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
      _mm_storeu_ps(scores + g * stride + t, _mm_mul_ps(_mm_cvtepi32_ps(sums), _mm_set1_ps(step[g])));
    }
  }
  for (; t < n; ++t)
    KVSERVE_UNROLL
    for (int g = 0; g < GB; ++g) {
      const uint8_t* row = keys + t * row_bytes;
      int32_t sum = 0;
      for (int64_t d = 0; d < dim; ++d) {
        const int32_t code = !kInt4 ? static_cast<int8_t>(row[d]) : d < half ? row[d] & 15 : row[d - half] >> 4;
        sum += static_cast<int32_t>(q16[g * dim + d]) * code;
      }
      scores[g * stride + t] = static_cast<float>(sum) * step[g];
    }
}

// All `group` heads, two at a time: 8 sums in registers (three, 12 of AVX2's 16, left GCC
// spilling some of them to the stack in the loop: 3-9% slower hot on a Zen 3).
template <bool kInt4>
static void score_rows_int(const int16_t* q16, const float* step, int64_t group, int64_t dim, const uint8_t* keys,
                           int64_t row_bytes, int64_t n, float* scores, int64_t stride) {
  int64_t g = 0;
  for (; g + 2 <= group; g += 2)
    score_rows_int<2, kInt4>(q16 + g * dim, step + g, dim, keys, row_bytes, n, scores + g * stride, stride);
  if (g < group) score_rows_int<1, kInt4>(q16 + g * dim, step + g, dim, keys, row_bytes, n, scores + g * stride, stride);
}
#endif

constexpr int64_t kCodeSliceRows = 16;  // 1 KB of 8-bit keys at head_dim 64: the float job's 8 bf16 rows

// The int4 value pass of one decode job (head h, `group` query heads): acc[g] += sum_t p[g][t] *
// (step[t][k] * code[t][d] + minimum[t][k]) for each dim d in value group k. The steps are
// folded into the weights per group; the minimums' share, sum_t p * minimum, is summed per head
// and group over the blocks and added to the outputs once, by finish().
// The codes in place (in_place: the low nibbles as the first half-row, the high ones as the
// second, a group's dims cut where the halves meet), else unscaled in the tile. Scratch is the
// caller's: scratch_floats() of it, the sums and weights first (with the weights placed after
// the affine tables, 128-token blocks ran 2-9% slower on a Zen 3: likely loads aliasing the
// weights' stores 4 KB apart).
struct Int4ValuePass {
  const QuantPool& pool;
  int64_t group;
  float* scratch;

  static int64_t scratch_floats(const QuantPool& pool, int64_t group) {
    return pool.block_size * (pool.groups * 4 + group) + group * pool.groups;
  }

  void start() const {  // the minimums' sums start at zero
    std::fill(scratch, scratch + group * pool.groups, 0.f);
  }

  // Rows [0, n) of block blk of a sequence (table), weighted by p[g * stride + t].
  void block(const int64_t* table, int64_t blk, int64_t n, int64_t h, const float* p, int64_t stride, bool in_place,
             float* acc, float* tile) const {
    const int64_t bs = pool.block_size, dim = pool.dim, half = dim / 2, groups = pool.groups, width = dim / groups;
    float* sums = scratch;                      // [head][group]: sums of p * minimum
    float* weights = sums + group * groups;     // [head][token]
    float* affines = weights + group * bs;      // [token][group][step, minimum]
    float* steps = affines + bs * groups * 2;   // [group][token]
    float* lows = steps + bs * groups;          // [group][token]
    to_float(pool.value_affine + pool.token_index(table, h, blk * bs) * groups * 2, affines, n * groups * 2);
    for (int64_t t = 0; t < n; ++t)
      for (int64_t k = 0; k < groups; ++k) {
        steps[k * bs + t] = affines[(t * groups + k) * 2];
        lows[k * bs + t] = affines[(t * groups + k) * 2 + 1];
      }
    const uint8_t* rows = pool.row_at(table, pool.kv_heads + h, blk * bs);
    if (!in_place) pool.code_rows(table[blk], pool.kv_heads + h, n, tile);
    for (int64_t k = 0; k < groups; ++k) {
      const float* step = steps + k * bs;
      const float* low = lows + k * bs;
      for (int64_t g = 0; g < group; ++g) {
        const float* pg = p + g * stride;
        float* w = weights + g * bs;
        float shift = 0.f;
#pragma omp simd reduction(+ : shift)
        for (int64_t t = 0; t < n; ++t) {
          w[t] = pg[t] * step[t];
          shift += pg[t] * low[t];
        }
        sums[g * groups + k] += shift;
      }
      const int64_t begin = k * width, end = begin + width;
      if (!in_place) {
        accumulate_rows(weights, bs, group, dim, tile + begin, n, acc + begin, width);
        continue;
      }
      if (begin < half)  // low nibbles: dims [begin, min(end, half)) from byte begin
        accumulate_rows(weights, bs, group, dim, reinterpret_cast<const Int4Low*>(rows) + begin, n, acc + begin,
                        std::min(end, half) - begin, pool.row_bytes);
      if (end > half) {  // high nibbles: dims [max(begin, half), end) from byte max(begin, half) - half
        const int64_t from = std::max(begin, half);
        accumulate_rows(weights, bs, group, dim, reinterpret_cast<const Int4High*>(rows) + from - half, n,
                        acc + from, end - from, pool.row_bytes);
      }
    }
  }

  void finish(float* acc) const {  // each head's sum of p * minimum added to its group's dims
    const int64_t dim = pool.dim, groups = pool.groups, width = dim / groups;
    for (int64_t g = 0; g < group; ++g)
      for (int64_t k = 0; k < groups; ++k) {
        const float shift = scratch[g * groups + k];
        for (int64_t d = k * width; d < (k + 1) * width; ++d) acc[g * dim + d] += shift;
      }
  }
};

// The portable job over a quantized pool (the reference for the vector one): each block
// decoded into a float32 tile, then the float path's score_rows / accumulate_rows. Codes stay
// unscaled, as in the vector job: the key scales are folded into the queries (per block where
// they are per block) and each value's scale into its weights (a separate scaling pass over the
// tile was a third of this job's time on a Zen 3). int4's affines likewise: a block's key steps
// folded into the query and q . minimum added to its scores, each value's steps into its weights
// per group of dims and p . minimum added to that group's outputs (an affine pass over the tile
// was 1.2-1.3x the time at 64- and 128-token blocks). With AVX2 the codes skip the tile: read in
// place and widened in registers (int8 and int4 keys in int16 products; int4 values as two
// half-rows of nibbles). Float kinds and a tail block are dequantized whole. The key pass
// prefetches per slice of codes read in place, else per block.
static void decode_quant_scalar(const float* qf, const QuantPool& pool, const int64_t* table, int64_t len,
                                int64_t tail_slot, int64_t h, int64_t group, float* probs, float* acc, float* tile) {
  const int64_t bs = pool.block_size, dim = pool.dim, kv_heads = pool.kv_heads, num_blocks = (len + bs - 1) / bs;
  const bool int4 = pool.kind == kI4;
  const bool codes = pool.kind == kI8 || pool.kind == kE4M3 || pool.kind == kE5M2 || int4;
  auto whole = [&](int64_t blk) { return !codes || pool.in_tail(len, blk); };
  thread_local std::vector<float> scaled, weights;
  scaled.resize(group * dim);
  weights.resize(group * bs);
#if defined(KVSERVE_AVX2_ROWS)
  const bool int_keys = keys_in_integers(pool);
  thread_local std::vector<int16_t> q16;
  thread_local std::vector<float> q_step;
  q16.resize(group * dim);
  q_step.resize(group);
#else
  const bool int_keys = false;
#endif
  // codes read in place where the row loops widen them (AVX2; int4: where its keys go in integers)
  const bool in_place = int4 ? int_keys : codes && rows_widened<int8_t>(dim);
  // what codes read in place are scaled by (e4m3's widening gives value / kE4M3Unit): folded
  // into the queries and the value weights
  const float unit = in_place && pool.kind == kE4M3 ? kE4M3Unit : 1.f;
  // fn(the rows of head j from pos on, typed by their kind): int8 and fp8 codes
  auto code_rows_at = [&](int64_t j, int64_t pos, const auto& fn) {
    const uint8_t* rows = pool.row_at(table, j, pos);
    if (pool.kind == kI8) return fn(reinterpret_cast<const int8_t*>(rows));
    if (pool.kind == kE4M3) return fn(reinterpret_cast<const Fp8E4M3*>(rows));
    return fn(reinterpret_cast<const Fp8E5M2*>(rows));
  };
  // the query heads times the key scales (int8/fp8 codes; int4: steps, and q . minimum into
  // biases where minimums are given, in the same pass), and their int16 form for integer keys
  thread_local std::vector<float> biases;
  biases.resize(group);
  auto scale_queries = [&](const float* key_scales, const float* minimums = nullptr) {
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = qf + g * dim;
      if (minimums != nullptr) {
        float bias = 0.f;
#pragma omp simd reduction(+ : bias)
        for (int64_t d = 0; d < dim; ++d) bias += qg[d] * minimums[d];
        biases[g] = bias;
      }
      if (int_keys) continue;  // rounded straight to int16 below, the float product not kept
      float* out = scaled.data() + g * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) out[d] = qg[d] * (key_scales == nullptr ? unit : key_scales[d] * unit);
    }
#if defined(KVSERVE_AVX2_ROWS)
    if (int_keys) round_queries_int16(qf, key_scales, group, dim, q16.data(), q_step.data());
#endif
  };
  if (codes && !int4 && (pool.key_scales != nullptr || unit != 1.f) && !pool.key_per_block)
    scale_queries(pool.key_scales != nullptr ? pool.key_scale_row(0, h) : nullptr);
#if defined(KVSERVE_AVX2_ROWS)
  if (int_keys && pool.key_scales == nullptr && !int4)
    round_queries_int16(qf, nullptr, group, dim, q16.data(), q_step.data());
#endif
  // codes in place go kCodeSliceRows at a time, each slice prefetching its values and the key
  // rows ahead (prefetch_key_pass); tiles a block at a time, prefetching 2 KB of the next
  // block's keys and of this block's values
  const int64_t coded_len = pool.tail != nullptr ? len - len % bs : len;
  thread_local std::vector<float> affine;  // int4: a block's key (step, minimum) per channel
  affine.resize(2 * dim);
  for (int64_t blk = 0; blk < num_blocks; ++blk) {
    const int64_t first = blk * bs, n = std::min(bs, len - first);
    if (!in_place || whole(blk)) {
      const int64_t bytes = std::min<int64_t>(2048, bs * pool.row_bytes);
      if (blk + 1 < num_blocks) prefetch_row(pool.row_at(table, h, first + bs), bytes);
      prefetch_row(pool.row_at(table, kv_heads + h, first), bytes);
    }
    if (whole(blk)) {
      pool.tile(table, blk, len, tail_slot, h, tile);
      score_rows(qf, group, dim, tile, n, probs + first, len);
      continue;
    }
    // q . (step * code + minimum) = (q * step) . code + q . minimum (int4: the block's key
    // affine folded into the query, its scores then shifted by q . minimum)
    if (int4) {
      to_float(pool.key_affine + (table[blk] * kv_heads + h) * 2 * dim, affine.data(), 2 * dim);
      scale_queries(affine.data(), affine.data() + dim);
    } else if (pool.key_scales != nullptr && pool.key_per_block) {
      scale_queries(pool.key_scale_row(table[blk], h));
    }
    const float* q = int4 || pool.key_scales != nullptr || unit != 1.f ? scaled.data() : qf;
    if (in_place) {
      for (int64_t r0 = 0; r0 < n; r0 += kCodeSliceRows) {
        const int64_t m = std::min(kCodeSliceRows, n - r0);
        prefetch_key_pass(pool, table, h, first + r0, m, coded_len);
#if defined(KVSERVE_AVX2_ROWS)
        if (int_keys) {
          const auto score = int4 ? score_rows_int<true> : score_rows_int<false>;
          score(q16.data(), q_step.data(), group, dim, pool.row_at(table, h, first + r0), pool.row_bytes, m,
                probs + first + r0, len);
          continue;
        }
#endif
        code_rows_at(h, first + r0, [&](const auto* rows) { score_rows(q, group, dim, rows, m, probs + first + r0, len); });
      }
    } else {
      pool.code_rows(table[blk], h, n, tile);
      score_rows(q, group, dim, tile, n, probs + first, len);
    }
    if (int4)
      for (int64_t g = 0; g < group; ++g)
#pragma omp simd
        for (int64_t t = 0; t < n; ++t) probs[g * len + first + t] += biases[g];
  }
  softmax_rows(probs, group, len);
  std::fill(acc, acc + group * dim, 0.f);
  thread_local std::vector<float> int4_scratch;
  if (int4) int4_scratch.resize(Int4ValuePass::scratch_floats(pool, group));
  const Int4ValuePass int4_values{pool, group, int4_scratch.data()};
  if (int4) int4_values.start();
  for (int64_t blk = 0; blk < num_blocks; ++blk) {
    const int64_t n = std::min(bs, len - blk * bs);
    if (whole(blk)) {
      pool.tile(table, blk, len, tail_slot, kv_heads + h, tile);
      accumulate_rows(probs + blk * bs, len, group, dim, tile, n, acc);
      continue;
    }
    if (int4) {
      int4_values.block(table, blk, n, h, probs + blk * bs, len, in_place, acc, tile);
      continue;
    }
    if (!in_place) pool.code_rows(table[blk], kv_heads + h, n, tile);
    // each head's weights times the value scales, a contiguous run of both per head (a loop
    // over tokens, then heads, was a tenth of the int8 job's time on a Zen 3)
    const float* vs = pool.value_scale_row(table[blk], h);
    for (int64_t g = 0; g < group; ++g) {
      const float* p = probs + g * len + blk * bs;
      float* w = weights.data() + g * bs;
      if (vs == nullptr) {
        const float v_scale = pool.v_scale * unit;
#pragma omp simd
        for (int64_t t = 0; t < n; ++t) w[t] = p[t] * v_scale;
      } else {
#pragma omp simd
        for (int64_t t = 0; t < n; ++t) w[t] = p[t] * vs[t] * unit;
      }
    }
    auto accumulate = [&](const auto* rows) { accumulate_rows(weights.data(), bs, group, dim, rows, n, acc); };
    if (in_place) code_rows_at(kv_heads + h, blk * bs, accumulate);
    else accumulate(static_cast<const float*>(tile));
  }
  if (int4) int4_values.finish(acc);
}

static int64_t kind_of(torch::ScalarType t) {
  return t == torch::kFloat ? kF32 : t == torch::kHalf ? kF16 : kBF16;
}

bool paged_attention_quantized(torch::Tensor out, torch::Tensor q, torch::Tensor data, int64_t kind,
                               c10::optional<torch::Tensor> key_scales, c10::optional<torch::Tensor> value_scales,
                               double v_scale, c10::optional<torch::Tensor> lut, c10::optional<torch::Tensor> tail,
                               c10::optional<torch::Tensor> tail_slots, torch::Tensor block_tables,
                               torch::Tensor seq_lens, int64_t query_len, double scale) {
  // Attention over one layer's quantized pool (see QuantPool); query_len 1 is decode, more is
  // prefill (false, touching nothing, where there is no vector path for the head size).
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "q must be [tokens, heads, dim] rows");
  TORCH_CHECK(out.dim() == 3 && out.stride(2) == 1 && out.stride(1) == out.size(2), "out must be like q");
  TORCH_CHECK(out.scalar_type() == q.scalar_type(), "out must have q's dtype");
  TORCH_CHECK(data.dim() == 4 && data.is_contiguous(), "data must be [blocks, 2*kv_heads, block, row]");
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && seq_lens.scalar_type() == torch::kLong, "int64 tables");
  TORCH_CHECK(kind >= kF32 && kind <= kI4, "unknown KV kind");
  TORCH_CHECK(q.size(0) == block_tables.size(0) * query_len, "q must hold query_len tokens per sequence");
  const int64_t dim = q.size(2), heads = q.size(1), kv_heads = data.size(1) / 2;
  QuantPool pool{};
  pool.data = reinterpret_cast<const uint8_t*>(data.data_ptr());
  pool.kind = kind;
  pool.kv_heads = kv_heads;
  pool.block_size = data.size(2);
  pool.blocks = BlockSize::of(pool.block_size);
  pool.dim = dim;
  pool.row_bytes = data.size(3) * data.element_size();
  if (kind == kI4) {
    TORCH_CHECK(key_scales.has_value() && value_scales.has_value() && key_scales->scalar_type() == torch::kHalf &&
                value_scales->scalar_type() == torch::kHalf && value_scales->dim() == 5,
                "int4 needs float16 (step, minimum) tables for keys and values");
    pool.key_affine = key_scales->data_ptr<c10::Half>();
    pool.value_affine = value_scales->data_ptr<c10::Half>();
    pool.groups = value_scales->size(3);
  } else {
    pool.key_scales = key_scales.has_value() ? key_scales->data_ptr<float>() : nullptr;
    pool.key_per_block = key_scales.has_value() && key_scales->dim() == 3;
    pool.value_scales = value_scales.has_value() ? value_scales->data_ptr<float>() : nullptr;
    pool.groups = 1;
  }
  pool.v_scale = static_cast<float>(v_scale);
  pool.lut = lut.has_value() ? lut->data_ptr<float>() : nullptr;
  TORCH_CHECK((kind != kE4M3 && kind != kE5M2) || pool.lut != nullptr, "fp8 needs its lookup table");
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
  alignas(64) uint8_t fp8_bytes[256];
  if (pool.lut != nullptr) {
    fp8_bf16_bytes(pool.lut, fp8_bytes);
    pool.fp8_bytes = fp8_bytes;
  }
#endif
  if (tail.has_value()) {
    TORCH_CHECK(tail->is_contiguous() && tail_slots.has_value(), "a tail needs contiguous slots and slot ids");
    pool.tail = reinterpret_cast<const uint8_t*>(tail->data_ptr());
    pool.tail_kind = kind_of(tail->scalar_type());
    pool.tail_elem = tail->element_size();
  }
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto slots = tail_slots.has_value() ? tail_slots->contiguous() : torch::Tensor();
  const int64_t* tab = tables.data_ptr<int64_t>();
  const int64_t* slot_ids = slots.defined() ? slots.data_ptr<int64_t>() : nullptr;
  const int64_t width = tables.size(1), bs = pool.block_size, group = heads / kv_heads;
  auto slot_of = [&](int64_t b) { return slot_ids == nullptr ? int64_t(-1) : slot_ids[b]; };
  bool done = false;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention_quantized", [&] {
    if constexpr (!std::is_same_v<scalar_t, double>) {
      if (query_len == 1) {
#if defined(__AVX512F__)
        const bool split = std::is_same_v<scalar_t, float>;
        auto pick = [&](bool next_keys) {
          return dim == 64 ? pick_quant_kind<4>(kind, group, split, next_keys)
                 : dim == 128 ? pick_quant_kind<8>(kind, group, split, next_keys)
                 : dim == 256 ? pick_quant_kind<16>(kind, group, split, next_keys) : nullptr;
        };
        // a job with next keys to prefetch (NextKeys::unless_short: sequences over half of L2) takes
        // the kind's prefetching job (only the VNNI int8/int4 jobs have one: fp8's value pass ran
        // 1.2-1.3x slower with it, cold)
        const QuantJob short_job = pick(false), long_job = pick(true);
#endif
        decode_driver(q.data_ptr<scalar_t>(), q.stride(0), tab, width, lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(),
                      out.stride(0), tables.size(0), heads, kv_heads, dim, static_cast<float>(scale),
                      [&](int64_t b, int64_t h, const float* qf, int64_t len, float* probs, float* acc, float*,
                          [[maybe_unused]] const NextKeys& next) {
          thread_local std::vector<float> tile;
          tile.resize(bs * dim);
#if defined(__AVX512F__)
          const NextKeys next_keys = next.unless_short(len * 2 * kv_heads * pool.row_bytes);
          if (const QuantJob job_fn = next_keys.table != nullptr ? long_job : short_job; job_fn != nullptr)
            return job_fn(qf, pool, tab + b * width, len, slot_of(b), h, probs, acc, tile.data(), next_keys);
#endif
          decode_quant_scalar(qf, pool, tab + b * width, len, slot_of(b), h, group, probs, acc, tile.data());
        });
        done = true;
      }
#if defined(__AVX512BF16__)
      else if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
        // bf16 queries: the bf16 prefill kernel over the rows dequantized and rounded to bf16
        // (2^-9 relative, finer than any quantized format's step), in place of float32 FMAs
        auto fill_pairs = [&](int64_t b, int64_t h, int64_t len, int64_t /*stride*/, uint32_t* kp, uint32_t* vp,
                            bool amx) {
          thread_local std::vector<float> tile;
          thread_local std::vector<c10::BFloat16> keys, values;
          tile.resize(bs * dim);
          keys.resize(len * dim);
          values.resize(len * dim);
          for (int64_t blk = 0; blk * bs < len; ++blk) {
            const int64_t n = pool.tile(tab + b * width, blk, len, slot_of(b), h, tile.data());
            from_float(tile.data(), keys.data() + blk * bs * dim, n * dim);
            pool.tile(tab + b * width, blk, len, slot_of(b), kv_heads + h, tile.data());
            from_float(tile.data(), values.data() + blk * bs * dim, n * dim);
          }
          fill_bf16_pairs([&](int64_t pos) { return keys.data() + pos * dim; },
                          [&](int64_t pos) { return values.data() + pos * dim; }, len, dim, kp, vp, amx);
        };
        done = run_prefill<scalar_t, true>(q.data_ptr<scalar_t>(), q.stride(0), lens.data_ptr<int64_t>(),
                                           out.data_ptr<scalar_t>(), out.stride(0), tables.size(0), query_len, heads,
                                           kv_heads, dim, static_cast<float>(scale), fill_pairs);
      }
#endif
#if defined(KVSERVE_FLOAT_PREFILL)  // the float kernel over the rows dequantized to float32
      else {
        auto fill = [&](int64_t b, int64_t h, int64_t len, int64_t stride, float* kt, float* vs, bool) {
          thread_local std::vector<float> tile;
          tile.resize(bs * dim);
          for (int64_t blk = 0; blk * bs < len; ++blk) {
            const int64_t n = pool.tile(tab + b * width, blk, len, slot_of(b), h, tile.data());
            for (int64_t t = 0; t < n; ++t)
              for (int64_t d = 0; d < dim; ++d) kt[d * stride + blk * bs + t] = tile[t * dim + d];
            pool.tile(tab + b * width, blk, len, slot_of(b), kv_heads + h, vs + blk * bs * dim);
          }
        };
        done = run_prefill(q.data_ptr<scalar_t>(), q.stride(0), lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(),
                           out.stride(0), tables.size(0), query_len, heads, kv_heads, dim, static_cast<float>(scale),
                           fill);
      }
#endif
    }
  });
  return done;
}
