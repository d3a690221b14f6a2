// CPU ops for the paged KV cache and the decoder's elementwise steps.
// paged_decode_attention: reads each sequence's K/V straight from the block pool through its
// block table (no gathered copy), one query token per sequence, GQA, two-pass softmax in
// float32 (scores for the whole sequence, then values). Parallel over (sequence, KV head).
// bf16 pools where the CPU has AVX512-BF16: key dot products in vdpbf16ps (see decode_job_bf16);
// int8/int4 pools where it has AVX512-VNNI: keys and values in int16 dot products (see decode_int_vnni).
// rope_and_write_kv: rotary on the fused qkv in place, then each token's K/V into its slot.
// add_rms_norm / silu_and_mul: residual add + RMSNorm and SwiGLU's gate, one pass each instead
// of several torch ops (each a dispatch and a trip through memory), float32 inside.
// int8_linear (+ int8_gemm_pack): a W8A8 linear layer in one call, VNNI int8 GEMM;
// quantize_rows_int8 / scale_rows_: the two ends of one where oneDNN does the GEMM.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include <unistd.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
// exp for 16 lanes: 2^n * e^r with n = round(x / ln 2), r = x - n ln 2 split hi/lo (Cody-Waite),
// e^r by its degree-6 Taylor polynomial on |r| <= ln2/2 (relative error < 2e-7). Inputs here
// are <= 0 (scores minus their max); below -87 the result flushes to 0.
static inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// The first min(remaining, 16) lanes; none when remaining <= 0.
static inline __mmask16 tail_mask(int64_t remaining) {
  if (remaining <= 0) return 0;
  return remaining >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << remaining) - 1);
}
#endif

// Softmax of each of `rows` score rows of length len, in place, in float32; with `lse`, each
// row's log-sum-exp (max + log sum) there too, to merge partial softmaxes (cascade attention).
static void softmax_rows(float* scores, int64_t rows, int64_t len, float* lse = nullptr) {
  for (int64_t g = 0; g < rows; ++g) {
    float* pg = scores + g * len;
#if defined(__AVX512F__)
    __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t i = 0; i < len; i += 16)
      vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(vmax, tail_mask(len - i), pg + i));
    const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t i = 0; i < len; i += 16) {
      const __mmask16 m = tail_mask(len - i);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, pg + i), mx));
      vsum = _mm512_add_ps(vsum, _mm512_maskz_mov_ps(m, e));
      _mm512_mask_storeu_ps(pg + i, m, e);
    }
    const float total = _mm512_reduce_add_ps(vsum);
    if (lse != nullptr) lse[g] = _mm512_reduce_max_ps(mx) + std::log(total);
    const __m512 inv = _mm512_set1_ps(1.f / total);
    for (int64_t i = 0; i < len; i += 16) {
      const __mmask16 m = tail_mask(len - i);
      _mm512_mask_storeu_ps(pg + i, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, pg + i), inv));
    }
#else
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t pos = 0; pos < len; ++pos) mx = std::max(mx, pg[pos]);
    float sum = 0.f;
    for (int64_t pos = 0; pos < len; ++pos) {
      pg[pos] = std::exp(pg[pos] - mx);
      sum += pg[pos];
    }
    if (lse != nullptr) lse[g] = mx + std::log(sum);
    const float inv = 1.f / sum;
    for (int64_t pos = 0; pos < len; ++pos) pg[pos] *= inv;
#endif
  }
}

// One (sequence, KV head) job, portable C++: the reference the vector path must match.
template <typename T>
static void decode_job_scalar(const float* qf, const T* kv, const int64_t* table, int64_t len, int64_t group,
                              int64_t dim, int64_t h, int64_t kv_heads, int64_t block_size, float* probs,
                              float* acc, float* row, float* lse) {
  const int64_t block_stride = 2 * kv_heads * block_size * dim;  // elements per block
  std::fill(acc, acc + group * dim, 0.f);
  // pass 1: scores; each key row is converted once and dotted with every query head
  for (int64_t pos = 0; pos < len; ++pos) {
    const T* kt = kv + table[pos / block_size] * block_stride + (h * block_size + pos % block_size) * dim;
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) row[d] = static_cast<float>(kt[d]);
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = qf + g * dim;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < dim; ++d) s += qg[d] * row[d];
      probs[g * len + pos] = s;
    }
  }
  softmax_rows(probs, group, len, lse);
  // pass 2: each value row is converted once and added into every query head's output
  for (int64_t pos = 0; pos < len; ++pos) {
    const T* vt = kv + table[pos / block_size] * block_stride + ((kv_heads + h) * block_size + pos % block_size) * dim;
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) row[d] = static_cast<float>(vt[d]);
    for (int64_t g = 0; g < group; ++g) {
      const float p = probs[g * len + pos];
      float* ag = acc + g * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) ag[d] += p * row[d];
    }
  }
}

#if defined(__AVX512F__)
// 16 lanes of T widened to float32. bf16 -> f32 is a 16-bit shift, exact.
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
static inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Into L2. asm, not _mm_prefetch: GCC 12 deleted _mm_prefetch loops in some inlining shapes.
static inline void prefetch_row(const void* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) asm volatile("prefetcht1 %0" : : "m"(static_cast<const char*>(p)[off]));
}

// Whether the first KV head's decode job should pull each next block of a sequence (all heads)
// into L2 for the other heads' jobs, which run next on the same thread: only while the
// sequence's K/V (`bytes`, all heads) fits in half of L2, so the lines are still there when
// those jobs read them. Past that they are evicted first and the prefetch only adds traffic:
// on a Xeon with 2 MB of L2, 21 x 4,500 bf16 tokens ran 18-20% slower with it, 32 x 2,048 13%
// (an earlier session measured it ~10% faster on an EPYC's cold pools, sequences unrecorded).
static bool prefetch_whole_blocks(int64_t bytes) {
  static const int64_t half_l2 = [] {
    long l2 = 0;
#if defined(_SC_LEVEL2_CACHE_SIZE)
    l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
#endif
    return static_cast<int64_t>(l2 > 0 ? l2 : 1 << 20) / 2;
  }();
  return bytes <= half_l2;
}

// 32 bf16 words as float32, exactly: even[i] is word 2i, odd[i] word 2i + 1 (a shift and a mask,
// no permute; the caller keeps its accumulators in that order).
static inline void widen_bf16_words(__m512i words, __m512& even, __m512& odd) {
  even = _mm512_castsi512_ps(_mm512_slli_epi32(words, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(words, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// One key row against the G query heads in registers: a score per head at position pos.
template <int NV, int G>
static inline void score_row(const __m512 (&q)[G][NV], const __m512 (&k)[NV], float* probs, int64_t len,
                             int64_t pos) {
  for (int g = 0; g < G; ++g) {
    __m512 s = _mm512_mul_ps(k[0], q[g][0]);
    for (int i = 1; i < NV; ++i) s = _mm512_fmadd_ps(k[i], q[g][i], s);
    probs[g * len + pos] = _mm512_reduce_add_ps(s);
  }
}

// One value row into the G heads' accumulators, weighted by each head's probability at pos.
template <int NV, int G>
static inline void accumulate_row(__m512 (&acc)[G][NV], const __m512 (&v)[NV], const float* probs, int64_t len,
                                  int64_t pos) {
  for (int g = 0; g < G; ++g) {
    const __m512 p = _mm512_set1_ps(probs[g * len + pos]);
    for (int i = 0; i < NV; ++i) acc[g][i] = _mm512_fmadd_ps(p, v[i], acc[g][i]);
  }
}

// The same job with AVX-512 for head_dim = 16 * NV and G query heads per KV head, so the
// queries and the output accumulators stay in registers: a K or V row is widened once and
// used by all G heads. Walks each block's contiguous [block_size, dim] tile.
template <typename T, int NV, int G>
static void decode_job_avx512(const float* qf, const T* kv, const int64_t* table, int64_t len, int64_t h,
                              int64_t kv_heads, int64_t block_size, float* probs, float* acc, float* lse) {
  constexpr int64_t dim = NV * 16;
  const int64_t block_stride = 2 * kv_heads * block_size * dim;
  const int64_t num_blocks = (len + block_size - 1) / block_size;
  __m512 reg[G][NV];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < NV; ++i) reg[g][i] = _mm512_loadu_ps(qf + g * dim + 16 * i);
  // Blocks are scattered, so hardware prefetch stops at each block edge: the key pass fetches
  // the key row kAhead tokens ahead, and this token's value row for the value pass to come;
  // the first KV head's job may pull each next whole block (all heads) into L2 for the jobs
  // of the other heads (prefetch_whole_blocks).
  constexpr int64_t kAhead = 32;
  const bool whole_blocks = h == 0 && prefetch_whole_blocks(len * 2 * kv_heads * dim * static_cast<int64_t>(sizeof(T)));
  const T* key_base = kv + h * block_size * dim;
  const T* value_base = kv + (kv_heads + h) * block_size * dim;
  for (int64_t blk = 0; blk < num_blocks; ++blk) {
    const T* tile = key_base + table[blk] * block_stride;
    const int64_t first = blk * block_size, n = std::min(block_size, len - first);
    if (whole_blocks && blk + 1 < num_blocks)
      prefetch_row(kv + table[blk + 1] * block_stride, block_stride * static_cast<int64_t>(sizeof(T)));
    for (int64_t t = 0; t < n; ++t) {
      const int64_t pos = first + t, ahead = std::min(pos + kAhead, len - 1);
      prefetch_row(key_base + table[ahead / block_size] * block_stride + (ahead % block_size) * dim, dim * sizeof(T));
      prefetch_row(value_base + table[blk] * block_stride + t * dim, dim * sizeof(T));
      __m512 k[NV];
      for (int i = 0; i < NV; ++i) k[i] = load16(tile + t * dim + 16 * i);
      score_row<NV, G>(reg, k, probs, len, pos);
    }
  }
  softmax_rows(probs, G, len, lse);
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < NV; ++i) reg[g][i] = _mm512_setzero_ps();
  for (int64_t blk = 0; blk < num_blocks; ++blk) {
    const T* tile = value_base + table[blk] * block_stride;
    const int64_t first = blk * block_size, n = std::min(block_size, len - first);
    for (int64_t t = 0; t < n; ++t) {
      __m512 v[NV];
      for (int i = 0; i < NV; ++i) v[i] = load16(tile + t * dim + 16 * i);
      accumulate_row<NV, G>(reg, v, probs, len, first + t);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < NV; ++i) _mm512_storeu_ps(acc + g * dim + 16 * i, reg[g][i]);
}

// out[i] = the sum of v[i]'s 16 lanes, for 16 vectors at once: 45 shuffles and adds instead of
// 16 horizontal reductions of ~8 each.
static inline __m512 lane_sums16(const __m512 (&v)[16]) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: v[2i] and v[2i+1] folded to 2 partials each
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: one partial for each of v[4i..4i+3]
    b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0x44), _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 2; ++i)  // 128-bit lanes paired: half sums of v[8i..8i+7]
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

// make(std::integral_constant<int, G>{}) for the run-time group size G (query heads per KV head),
// 1-8, the sizes compiled; nullptr for any other.
template <typename Make>
static auto by_group(int64_t group, const Make& make) -> decltype(make(std::integral_constant<int, 1>{})) {
  switch (group) {
    case 1: return make(std::integral_constant<int, 1>{});
    case 2: return make(std::integral_constant<int, 2>{});
    case 3: return make(std::integral_constant<int, 3>{});
    case 4: return make(std::integral_constant<int, 4>{});
    case 5: return make(std::integral_constant<int, 5>{});
    case 6: return make(std::integral_constant<int, 6>{});
    case 7: return make(std::integral_constant<int, 7>{});
    case 8: return make(std::integral_constant<int, 8>{});
    default: return nullptr;
  }
}

#if defined(__AVX512BF16__)

// The bf16 pool's job with AVX512-BF16 dot products, for head_dim = 32 * NB: a key row is NB
// loads and NB vdpbf16ps per query head (no widening), and 16 rows' scores are reduced together.
// The query is taken unscaled (its bf16 values, exact) and the scale applied to the scores, so
// every product is the float path's. Values are widened 32 at a time as their even and odd
// elements (a shift and a mask, no permute), so the accumulators hold dims (32j + 2i,
// 32j + 2i + 1) until the final interleave. (A one-pass online-softmax variant reading each
// block's heads together measured 30% slower here, cold pool and hot.)
template <int NB, int G>
static void decode_job_bf16(const float* qf, const c10::BFloat16* kv, const int64_t* table, int64_t len, int64_t h,
                            int64_t kv_heads, int64_t block_size, float scale, float* probs, float* acc,
                            float* lse) {
  constexpr int64_t dim = NB * 32;
  const int64_t block_stride = 2 * kv_heads * block_size * dim, value_offset = kv_heads * block_size * dim;
  __m512bh qb[G][NB];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < NB; ++j)
      qb[g][j] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(qf + g * dim + 32 * j + 16), _mm512_loadu_ps(qf + g * dim + 32 * j));
  const __m512 vscale = _mm512_set1_ps(scale);
  const c10::BFloat16* key_base = kv + h * block_size * dim;
  constexpr int64_t kAhead = 32;  // rows: blocks are scattered, so prefetch where hardware would stop
  int64_t blk = 0, t = 0, ahead_blk = kAhead / block_size, ahead_t = kAhead % block_size;
  const bool whole_blocks = h == 0 && prefetch_whole_blocks(len * 2 * kv_heads * dim * 2);
  const c10::BFloat16* rows[16];
  for (int64_t pos = 0; pos < len; pos += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, len - pos));
    for (int r = 0; r < n; ++r) {
      if (t == 0 && whole_blocks && (blk + 1) * block_size < len)  // the next block, all heads (prefetch_whole_blocks)
        prefetch_row(kv + table[blk + 1] * block_stride, block_stride * 2);
      rows[r] = key_base + table[blk] * block_stride + t * dim;
      prefetch_row(rows[r] + value_offset, dim * 2);  // for the value pass
      if (ahead_blk * block_size + ahead_t < len)
        prefetch_row(key_base + table[ahead_blk] * block_stride + ahead_t * dim, dim * 2);
      if (++t == block_size) t = 0, ++blk;
      if (++ahead_t == block_size) ahead_t = 0, ++ahead_blk;
    }
    for (int g = 0; g < G; ++g) {
      __m512 part[16];
      for (int r = 0; r < 16; ++r) {
        part[r] = _mm512_setzero_ps();
        if (r < n)
          for (int j = 0; j < NB; ++j)
            part[r] = _mm512_dpbf16_ps(part[r], qb[g][j], (__m512bh)_mm512_loadu_si512(rows[r] + 32 * j));
      }
      _mm512_mask_storeu_ps(probs + g * len + pos, tail_mask(n), _mm512_mul_ps(lane_sums16(part), vscale));
    }
  }
  softmax_rows(probs, G, len, lse);
  __m512 reg[G][2 * NB];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < 2 * NB; ++i) reg[g][i] = _mm512_setzero_ps();
  const int64_t num_blocks = (len + block_size - 1) / block_size;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const c10::BFloat16* tile = key_base + value_offset + table[b] * block_stride;
    const int64_t first = b * block_size, m = std::min(block_size, len - first);
    for (int64_t r = 0; r < m; ++r) {
      __m512 v[2 * NB];
      for (int j = 0; j < NB; ++j) widen_bf16_words(_mm512_loadu_si512(tile + r * dim + 32 * j), v[2 * j], v[2 * j + 1]);
      accumulate_row<2 * NB, G>(reg, v, probs, len, first + r);
    }
  }
  const __m512i first_half = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i second_half = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < NB; ++j) {
      _mm512_storeu_ps(acc + g * dim + 32 * j, _mm512_permutex2var_ps(reg[g][2 * j], first_half, reg[g][2 * j + 1]));
      _mm512_storeu_ps(acc + g * dim + 32 * j + 16,
                       _mm512_permutex2var_ps(reg[g][2 * j], second_half, reg[g][2 * j + 1]));
    }
}

using Bf16Job = void (*)(const float*, const c10::BFloat16*, const int64_t*, int64_t, int64_t, int64_t, int64_t, float,
                         float*, float*, float*);

template <int NB>
static Bf16Job bf16_group(int64_t group) {
  return by_group(group, [](auto g) -> Bf16Job { return decode_job_bf16<NB, decltype(g)::value>; });
}

static Bf16Job bf16_job(int64_t dim, int64_t group) {
  if (dim == 64) return bf16_group<2>(group);
  if (dim == 128) return bf16_group<4>(group);
  if (dim == 256) return bf16_group<8>(group);
  return nullptr;
}
#endif

// The vector job for this (dim, group), or nullptr where only the portable job applies.
template <typename T>
using DecodeJob = void (*)(const float*, const T*, const int64_t*, int64_t, int64_t, int64_t, int64_t, float*, float*,
                           float*);

template <typename T, int NV>
static DecodeJob<T> pick_group(int64_t group) {
  return by_group(group, [](auto g) -> DecodeJob<T> { return decode_job_avx512<T, NV, decltype(g)::value>; });
}

template <typename T>
static DecodeJob<T> vector_job(int64_t dim, int64_t group) {
  if constexpr (std::is_same_v<T, double>) return nullptr;
  else if (dim == 64) return pick_group<T, 4>(group);
  else if (dim == 128) return pick_group<T, 8>(group);
  else if (dim == 256) return pick_group<T, 16>(group);  // Gemma 3: 5x the portable loop here, spills and all
  return nullptr;
}
#endif

// Row conversions to and from float32 (vector loads where AVX-512 is available).
template <typename T>
static inline void to_float(const T* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  if constexpr (!std::is_same_v<T, double>)
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, load16(src + i));
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <typename T>
static inline void from_float(const float* src, T* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, _mm512_loadu_ps(src + i));
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    for (; i + 16 <= n; i += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                          _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
#if defined(__AVX512BF16__)
  else if constexpr (std::is_same_v<T, c10::BFloat16>) {  // round to nearest even, like c10's cast
    for (; i + 16 <= n; i += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i)));
  }
#endif
#endif
  for (; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

// Runs job(b, h, qf, len, probs, acc, lse) for every (sequence, KV head) in parallel: qf holds
// the group's scaled queries in float32, the job leaves the group's outputs in acc and, where
// lse_out ([batch, heads]) is given, their log-sum-exps at lse.
template <typename T, typename O, typename Job>
static void decode_driver(const T* q, int64_t q_stride, const int64_t* lens, O* out, int64_t out_stride,
                          int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim, float scale, const Job& job,
                          float* lse_out = nullptr) {
  const int64_t group = heads / kv_heads;
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * dim), acc(group * dim), probs;
    for (int64_t j = begin; j < end; ++j) {
      const int64_t b = j / kv_heads, h = j % kv_heads;
      const int64_t len = lens[b];
      if (static_cast<int64_t>(probs.size()) < group * len) probs.resize(group * len);
      for (int64_t g = 0; g < group; ++g) {
        const T* qrow = q + b * q_stride + (h * group + g) * dim;
        for (int64_t d = 0; d < dim; ++d) qf[g * dim + d] = static_cast<float>(qrow[d]) * scale;
      }
      job(b, h, qf.data(), len, probs.data(), acc.data(), lse_out != nullptr ? lse_out + b * heads + h * group : nullptr);
      for (int64_t g = 0; g < group; ++g) from_float(acc.data() + g * dim, out + b * out_stride + (h * group + g) * dim, dim);
    }
  });
}

// out in T, or float32 (a cascade's partial results).
template <typename T, typename O>
static void decode_kernel(const T* q, int64_t q_stride, const T* kv, const int64_t* tables, const int64_t* lens,
                          O* out, int64_t out_stride, int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
                          int64_t width, int64_t block_size, float scale, float* lse_out) {
  const int64_t group = heads / kv_heads;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (const Bf16Job bf16 = bf16_job(dim, group); bf16 != nullptr) {
      // unscaled queries: the job scales the scores
      return decode_driver(q, q_stride, lens, out, out_stride, batch, heads, kv_heads, dim, 1.f,
                           [&](int64_t b, int64_t h, const float* qf, int64_t len, float* probs, float* acc, float* lse) {
        bf16(qf, kv, tables + b * width, len, h, kv_heads, block_size, scale, probs, acc, lse);
      }, lse_out);
    }
  }
#endif
#if defined(__AVX512F__)
  const DecodeJob<T> job_fn = vector_job<T>(dim, group);
#endif
  decode_driver(q, q_stride, lens, out, out_stride, batch, heads, kv_heads, dim, scale,
                [&](int64_t b, int64_t h, const float* qf, int64_t len, float* probs, float* acc, float* lse) {
    const int64_t* table = tables + b * width;
#if defined(__AVX512F__)
    if (job_fn != nullptr) return job_fn(qf, kv, table, len, h, kv_heads, block_size, probs, acc, lse);
#endif
    thread_local std::vector<float> row;
    row.resize(dim);
    decode_job_scalar<T>(qf, kv, table, len, group, dim, h, kv_heads, block_size, probs, acc, row.data(), lse);
  }, lse_out);
}

// float32 [rows, heads] contiguous, for log-sum-exps (cascade attention); nullptr when absent.
static float* lse_pointer(const c10::optional<torch::Tensor>& lse, int64_t rows, int64_t heads) {
  if (!lse.has_value()) return nullptr;
  TORCH_CHECK(lse->scalar_type() == torch::kFloat && lse->is_contiguous() && lse->dim() == 2 && lse->size(0) == rows &&
              lse->size(1) == heads, "lse must be float32 [rows, heads], contiguous");
  return lse->data_ptr<float>();
}

static void check_paged_call(const torch::Tensor& q, const torch::Tensor& kv_cache, const torch::Tensor& block_tables,
                             const torch::Tensor& seq_lens) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "q must be [tokens, heads, dim] rows");
  TORCH_CHECK(kv_cache.dim() == 4 && kv_cache.is_contiguous(), "kv_cache must be [blocks, 2*kv_heads, block, dim]");
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && seq_lens.scalar_type() == torch::kLong, "int64 tables");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type(), "q and kv_cache: one dtype");
}

void paged_decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_tables,
                            torch::Tensor seq_lens, double scale) {
  // q, out: [batch, heads, dim] with contiguous rows (a batch stride of their own is allowed)
  check_paged_call(q, kv_cache, block_tables, seq_lens);
  TORCH_CHECK(out.dim() == 3 && out.stride(2) == 1 && out.stride(1) == out.size(2), "out must be like q");
  TORCH_CHECK(out.scalar_type() == q.scalar_type(), "out and q: one dtype");
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = kv_cache.size(1) / 2, block_size = kv_cache.size(2);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    decode_kernel<scalar_t, scalar_t>(q.data_ptr<scalar_t>(), q.stride(0), kv_cache.data_ptr<scalar_t>(),
                            tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(),
                            out.stride(0), batch, heads, kv_heads, dim, tables.size(1), block_size,
                            static_cast<float>(scale), nullptr);
  });
}

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

template <typename T>
static void rope_write_kernel(T* qkv, const float* cos, const float* sin, T* kv, const int64_t* slots,
                              int64_t tokens, int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size) {
  const int64_t row = (heads + 2 * kv_heads) * dim;
  at::parallel_for(0, tokens, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> x(dim);
    for (int64_t t = begin; t < end; ++t) {
      rope_token(qkv + t * row, cos + t * dim, sin + t * dim, heads + kv_heads, dim, x.data());
      const int64_t slot = slots[t], block = slot / block_size, offset = slot % block_size;
      for (int64_t j = 0; j < 2 * kv_heads; ++j) {  // K heads then V heads, as in the block layout
        const T* src = qkv + t * row + (heads + j) * dim;
        T* dst = kv + ((block * 2 * kv_heads + j) * block_size + offset) * dim;
        std::copy(src, src + dim, dst);
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
  TORCH_CHECK(kv_cache.scalar_type() == qkv.scalar_type(), "pool dtype");
  auto slots = slot_mapping.contiguous();
  const int64_t kv_heads = kv_cache.size(1) / 2;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_and_write_kv", [&] {
    rope_write_kernel<scalar_t>(qkv.data_ptr<scalar_t>(), cos.data_ptr<float>(), sin.data_ptr<float>(),
                                kv_cache.data_ptr<scalar_t>(), slots.data_ptr<int64_t>(), qkv.size(0), heads,
                                kv_heads, qkv.size(2), kv_cache.size(2));
  });
}

// How a KV pool stores its elements (kv_quant.KIND_CODES).
enum KVKind : int64_t { kF32 = 0, kF16 = 1, kBF16 = 2, kE4M3 = 3, kE5M2 = 4, kI8 = 5, kI4 = 6 };

// The int8 write must store exactly what kv_quant.quantize stores (a fused and an unfused step
// then cache the same bytes): true float32 divisions, not -ffast-math's reciprocals.
#pragma GCC push_options
#pragma GCC optimize("no-fast-math")
// int8 code of x / scale as kv_quant.quantize makes it: float32 division, round half to even, clipped to +-127.
static inline int8_t int8_code(float x, float scale) {
  return static_cast<int8_t>(std::max(-127.f, std::min(127.f, std::nearbyint(x / scale))));
}

// dst[d] = int8_code(x[d], scale[d]) for d < dim (scale: a per-channel row, or one value), and the
// number of |x[d]| > 127.5 * scale[d] (counted where asked).
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

// Rows per task so that small (decode) batches stay on one thread: forking costs more than the work.
static int64_t row_grain(int64_t row_elems) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(row_elems, 1)); }

template <typename T>
static void add_rms_norm_kernel(T* residual, const T* delta, const T* weight, T* out, int64_t tokens, int64_t hidden,
                                float eps) {
  at::parallel_for(0, tokens, row_grain(hidden), [&](int64_t begin, int64_t end) {
    std::vector<float> x(hidden), d(hidden), w(hidden);
    to_float(weight, w.data(), hidden);
    for (int64_t t = begin; t < end; ++t) {
      T* res = residual + t * hidden;
      to_float(res, x.data(), hidden);
      if (delta != nullptr) {
        to_float(delta + t * hidden, d.data(), hidden);
#pragma omp simd
        for (int64_t i = 0; i < hidden; ++i) x[i] += d[i];
        from_float(x.data(), res, hidden);
        to_float(res, x.data(), hidden);  // normalize the residual as stored (rounded to T), as torch would
      }
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < hidden; ++i) sum += x[i] * x[i];
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(hidden) + eps);
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) x[i] = x[i] * inv * w[i];
      from_float(x.data(), out + t * hidden, hidden);
    }
  });
}

torch::Tensor add_rms_norm(torch::Tensor residual, c10::optional<torch::Tensor> delta, torch::Tensor weight,
                           double eps) {
  // residual [tokens, hidden] contiguous, updated in place by += delta (when given); returns
  // rms_norm(residual) * weight as a new tensor.
  TORCH_CHECK(residual.dim() == 2 && residual.is_contiguous(), "residual must be contiguous [tokens, hidden]");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == residual.size(1) &&
              weight.scalar_type() == residual.scalar_type(), "weight must be [hidden] in the residual's dtype");
  if (delta.has_value())
    TORCH_CHECK(delta->sizes() == residual.sizes() && delta->is_contiguous() &&
                delta->scalar_type() == residual.scalar_type(), "delta must match the residual");
  auto out = torch::empty_like(residual);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, residual.scalar_type(), "add_rms_norm", [&] {
    add_rms_norm_kernel<scalar_t>(residual.data_ptr<scalar_t>(),
                                  delta.has_value() ? delta->data_ptr<scalar_t>() : nullptr,
                                  weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), residual.size(0),
                                  residual.size(1), static_cast<float>(eps));
  });
  return out;
}

template <typename T>
static void silu_and_mul_kernel(const T* gate_up, T* out, int64_t tokens, int64_t inter) {
  at::parallel_for(0, tokens, row_grain(2 * inter), [&](int64_t begin, int64_t end) {
    std::vector<float> g(inter), u(inter);
    for (int64_t t = begin; t < end; ++t) {
      to_float(gate_up + t * 2 * inter, g.data(), inter);
      to_float(gate_up + t * 2 * inter + inter, u.data(), inter);
#pragma omp simd
      for (int64_t i = 0; i < inter; ++i) g[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
      from_float(g.data(), out + t * inter, inter);
    }
  });
}

torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  // gate_up [tokens, 2 * inter] contiguous (gate then up) -> silu(gate) * up [tokens, inter]
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "gate_up must be contiguous [tokens, 2 * intermediate]");
  const int64_t inter = gate_up.size(1) / 2;
  auto out = torch::empty({gate_up.size(0), inter}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul_kernel<scalar_t>(gate_up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), gate_up.size(0), inter);
  });
  return out;
}

// ---------------------------------------------------------------------------------------------
// int8 linear layers (W8A8, kvserve.model.int8_linear): activations are quantized per row
// (token) here; with AVX512-VNNI the whole layer is int8_linear below (quantize, int8 GEMM,
// rescale in one call); elsewhere the codes go to oneDNN (which applies the output channels'
// scales) and the products are scaled back here by each row's scale.

// codes = round(x / s) with s = max|x| / 127 per row (1 for an all-zero row); scales[r] = s.
// ``offset``: codes + 128 as uint8 (oneDNN's u8 activations, zero point 128), else int8.
template <typename T>
static void quantize_rows_kernel(const T* x, uint8_t* codes, float* scales, int64_t rows, int64_t cols, bool offset) {
  const int flip = offset ? 0x80 : 0;  // two's complement + 128 = the sign bit flipped
  at::parallel_for(0, rows, row_grain(cols), [&](int64_t begin, int64_t end) {
    std::vector<float> f(cols);
    for (int64_t r = begin; r < end; ++r) {
      to_float(x + r * cols, f.data(), cols);
      float amax = 0.f;
#pragma omp simd reduction(max : amax)
      for (int64_t i = 0; i < cols; ++i) amax = std::max(amax, std::fabs(f[i]));
      const float scale = amax > 0.f ? amax / 127.f : 1.f, inv = 1.f / scale;
      scales[r] = scale;
      uint8_t* row = codes + r * cols;
      int64_t i = 0;
#if defined(__AVX512F__)
      const __m512 vinv = _mm512_set1_ps(inv);
      const __m128i vflip = _mm_set1_epi8(static_cast<char>(flip));
      for (; i + 16 <= cols; i += 16) {  // round to nearest even, saturate to int8
        const __m128i q = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(f.data() + i), vinv)));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(row + i), _mm_xor_si128(q, vflip));
      }
#endif
      for (; i < cols; ++i)
        row[i] = static_cast<uint8_t>(static_cast<int8_t>(std::nearbyint(f[i] * inv))) ^ static_cast<uint8_t>(flip);
    }
  });
}

std::vector<torch::Tensor> quantize_rows_int8(torch::Tensor x, bool offset) {
  // x [rows, cols] contiguous float -> (codes [rows, cols]: int8, or uint8 + 128 with offset; float32 scales [rows])
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be contiguous [rows, cols]");
  auto codes = torch::empty(x.sizes(), x.options().dtype(offset ? torch::kUInt8 : torch::kInt8));
  auto scales = torch::empty({x.size(0)}, x.options().dtype(torch::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quantize_rows_int8", [&] {
    quantize_rows_kernel<scalar_t>(x.data_ptr<scalar_t>(), static_cast<uint8_t*>(codes.data_ptr()),
                                   scales.data_ptr<float>(), x.size(0), x.size(1), offset);
  });
  return {codes, scales};
}

// x[r][c] = x[r][c] * row_scales[r] (+ bias[c]), in place.
template <typename T>
static void scale_rows_kernel(T* x, const float* row_scales, const T* bias, int64_t rows, int64_t cols) {
  at::parallel_for(0, rows, row_grain(cols), [&](int64_t begin, int64_t end) {
    std::vector<float> f(cols), b(bias != nullptr ? cols : 0);
    if (bias != nullptr) to_float(bias, b.data(), cols);
    for (int64_t r = begin; r < end; ++r) {
      T* row = x + r * cols;
      to_float(row, f.data(), cols);
      const float s = row_scales[r];
      if (bias != nullptr) {
#pragma omp simd
        for (int64_t c = 0; c < cols; ++c) f[c] = f[c] * s + b[c];
      } else {
#pragma omp simd
        for (int64_t c = 0; c < cols; ++c) f[c] *= s;
      }
      from_float(f.data(), row, cols);
    }
  });
}

void scale_rows_(torch::Tensor x, torch::Tensor row_scales, c10::optional<torch::Tensor> bias) {
  // x [rows, cols] contiguous float, scaled in place per row (row_scales float32 [rows]), then + bias [cols]
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be contiguous [rows, cols]");
  TORCH_CHECK(row_scales.scalar_type() == torch::kFloat && row_scales.is_contiguous() &&
              row_scales.numel() == x.size(0), "row_scales: float32 [rows]");
  if (bias.has_value())
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == x.size(1) && bias->scalar_type() == x.scalar_type(),
                "bias: [cols] in x's dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "scale_rows_", [&] {
    scale_rows_kernel<scalar_t>(x.data_ptr<scalar_t>(), row_scales.data_ptr<float>(),
                                bias.has_value() ? bias->data_ptr<scalar_t>() : nullptr, x.size(0), x.size(1));
  });
}

// The int8 GEMM of those layers where the CPU has AVX512-VNNI (oneDNN's otherwise): vpdpbusd
// multiplies 4 unsigned activation bytes (code + 128) by 4 signed weight bytes per 32-bit lane,
// so the weight is packed as [groups of 16 output channels][k / 4][16][4] bytes (one 64-byte
// load = 16 channels x 4 k) and 128 * sum_k w[n][k] is subtracted per channel at the end. A
// tile keeps MR rows x NR groups of int32 sums in registers (24 of the 32), reading each weight
// vector once per MR rows; a thread owns consecutive groups, and while its first tile of a
// panel runs it prefetches the next panel into L2 (the weights stream from memory once per step
// at decode sizes). Measured at batch 32 on 30 layers of SmolLM2's shapes (EPYC, 2 threads,
// weights cold): 11.7-13.8 ms against oneDNN's 18.3-23.4 ms with the same row quantization.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// acc + a . b per lane, in place: GCC 12's intrinsic copies every accumulator around each
// vpdpbusd and spills them (measured 2x slower than this).
static inline __m512i dpbusd(__m512i acc, __m512i a, __m512i b) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}

struct Int8GemmArgs {
  const uint8_t* x;        // [m, k] activation codes + 128
  const float* x_scales;   // [m]
  const int8_t* packed;    // [groups, k / 4, 16, 4]
  const int32_t* comp;     // [groups * 16]: 128 * sum_k w[n][k]
  const float* w_scales;   // [groups * 16]
  const float* bias;       // [groups * 16] or nullptr
  int64_t m, k, n;
};

template <int MR, int NR, typename T>
static void int8_tile(const Int8GemmArgs& a, int64_t row, int64_t group, T* out, const int8_t* prefetch) {
  const int64_t stride = a.k * 16;  // bytes per packed group
  const int8_t* w = a.packed + group * stride;
  const uint8_t* x = a.x + row * a.k;
  __m512i acc[MR][NR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_si512();
  for (int64_t kk = 0; kk < a.k; kk += 4) {
    __m512i b[NR];
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) {
      if (prefetch != nullptr) _mm_prefetch(reinterpret_cast<const char*>(prefetch + j * stride + kk * 16), _MM_HINT_T1);
      b[j] = _mm512_loadu_si512(w + j * stride + kk * 16);
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      int32_t four;
      std::memcpy(&four, x + i * a.k + kk, 4);
      const __m512i xi = _mm512_set1_epi32(four);
#pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) acc[i][j] = dpbusd(acc[i][j], xi, b[j]);
    }
  }
  const int64_t col = group * 16, cols = std::min<int64_t>(NR * 16, a.n - col);
  float result[NR * 16];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    const __m512 xs = _mm512_set1_ps(a.x_scales[row + i]);
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) {
      const int64_t c = col + 16 * j;
      const __m512 sums = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[i][j], _mm512_loadu_si512(a.comp + c)));
      __m512 v = _mm512_mul_ps(sums, _mm512_mul_ps(_mm512_loadu_ps(a.w_scales + c), xs));
      if (a.bias != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(a.bias + c));
      _mm512_storeu_ps(result + 16 * j, v);
    }
    from_float(result, out + (row + i) * a.n + col, cols);
  }
}

// Rows [0, m) against groups [group, group + NR): MR-row tiles, then the remaining rows.
template <int NR, typename T>
static void int8_panel(const Int8GemmArgs& a, int64_t group, T* out, const int8_t* prefetch) {
  constexpr int MR = NR == 4 ? 6 : 8;  // MR * NR accumulators + NR weight vectors + 1 broadcast <= 32
  int64_t row = 0;
  for (; row + MR <= a.m; row += MR, prefetch = nullptr) int8_tile<MR, NR>(a, row, group, out, prefetch);
  switch (a.m - row) {
#define KVSERVE_INT8_TAIL(R) \
  case R: int8_tile<R, NR>(a, row, group, out, prefetch); break;
    KVSERVE_INT8_TAIL(1) KVSERVE_INT8_TAIL(2) KVSERVE_INT8_TAIL(3) KVSERVE_INT8_TAIL(4) KVSERVE_INT8_TAIL(5)
    KVSERVE_INT8_TAIL(6) KVSERVE_INT8_TAIL(7)
#undef KVSERVE_INT8_TAIL
    default: break;
  }
}

template <typename T>
static void int8_gemm(const Int8GemmArgs& a, T* out) {
  const int64_t groups = (a.n + 15) / 16;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end;) {
      const int64_t nr = std::min<int64_t>(4, end - g);
      const int8_t* next = g + nr < end ? a.packed + (g + nr) * a.k * 16 : nullptr;
      switch (nr) {
        case 4: int8_panel<4>(a, g, out, next); break;
        case 3: int8_panel<3>(a, g, out, next); break;
        case 2: int8_panel<2>(a, g, out, next); break;
        default: int8_panel<1>(a, g, out, next); break;
      }
      g += nr;
    }
  });
}
#endif

std::vector<torch::Tensor> int8_gemm_pack(torch::Tensor codes, torch::Tensor scales) {
  // codes int8 [n, k], scales float32 [n] -> (packed int8 [groups, k / 4, 16, 4], comp int32 [groups * 16],
  // scales float32 [groups * 16]), channels past n zero; empty where this build has no VNNI GEMM or k % 4 != 0,
  // and on CPUs with AMX-INT8, where oneDNN multiplies in tiles (the kernel was not measured against those)
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && !defined(__AMX_INT8__)
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == torch::kChar && scales.numel() == codes.size(0),
              "codes: int8 [n, k], scales: [n]");
  const int64_t n = codes.size(0), k = codes.size(1), groups = (n + 15) / 16;
  if (k % 4 != 0) return {};
  auto w = codes.contiguous();
  auto packed = torch::zeros({groups, k / 4, 16, 4}, w.options());
  auto comp = torch::zeros({groups * 16}, w.options().dtype(torch::kInt));
  auto padded = torch::zeros({groups * 16}, w.options().dtype(torch::kFloat));
  padded.narrow(0, 0, n).copy_(scales);
  const int8_t* src = w.data_ptr<int8_t>();
  int8_t* dst = packed.data_ptr<int8_t>();
  int32_t* c = comp.data_ptr<int32_t>();
  for (int64_t r = 0; r < n; ++r) {
    int32_t sum = 0;
    for (int64_t j = 0; j < k; ++j) {
      dst[(((r / 16) * (k / 4) + j / 4) * 16 + r % 16) * 4 + j % 4] = src[r * k + j];
      sum += src[r * k + j];
    }
    c[r] = 128 * sum;
  }
  return {packed, comp, padded};
#else
  (void)codes;
  (void)scales;
  return {};
#endif
}

torch::Tensor int8_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor comp, torch::Tensor scales,
                          int64_t out_features, c10::optional<torch::Tensor> bias) {
  // x [m, k] contiguous float -> x @ W.T (+ bias) [m, out_features] in x's dtype, W from int8_gemm_pack;
  // bias float32, padded like the scales (prepared once at load, not per call)
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be contiguous [rows, cols]");
  const int64_t m = x.size(0), k = x.size(1), groups = (out_features + 15) / 16;
  TORCH_CHECK(packed.dim() == 4 && packed.size(0) == groups && packed.size(1) * 4 == k && comp.numel() == groups * 16 &&
              scales.numel() == groups * 16, "packed weight does not match x / out_features");
  auto codes = torch::empty({m, k}, x.options().dtype(torch::kByte));
  auto x_scales = torch::empty({m}, x.options().dtype(torch::kFloat));
  auto out = torch::empty({m, out_features}, x.options());
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->is_contiguous() && bias->numel() == groups * 16,
                "bias: float32 [out_features padded to a multiple of 16]");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "int8_linear", [&] {
    quantize_rows_kernel<scalar_t>(x.data_ptr<scalar_t>(), codes.data_ptr<uint8_t>(), x_scales.data_ptr<float>(), m, k,
                                   true);
    const Int8GemmArgs args{codes.data_ptr<uint8_t>(), x_scales.data_ptr<float>(), packed.data_ptr<int8_t>(),
                            comp.data_ptr<int32_t>(), scales.data_ptr<float>(),
                            bias.has_value() ? bias->data_ptr<float>() : nullptr, m, k, out_features};
    int8_gemm<scalar_t>(args, out.data_ptr<scalar_t>());
  });
  return out;
#else
  TORCH_CHECK(false, "int8_linear needs AVX512-VNNI (int8_gemm_pack returned nothing)");
#endif
}

#if defined(__AVX512F__)
// Prefill attention for RB query rows of one (sequence, KV head): scores against 16 keys at a
// time from the transposed float32 keys (a broadcast query value times a row of 16 keys, so no
// horizontal sums), a float32 softmax per row over its causal length, then probabilities times
// values with the RB rows' accumulators in registers.
template <int NV, int RB>
static void prefill_rows(const float* qf, const int64_t* row_len, const float* keys_t, int64_t stride,
                         const float* values, float* scores, float* acc, float* lse) {
  constexpr int64_t dim = NV * 16;
  int64_t max_len = 0;
  for (int r = 0; r < RB; ++r) max_len = std::max(max_len, row_len[r]);
  for (int64_t tile = 0; tile * 16 < max_len; ++tile) {
    __m512 s[RB];
    for (int r = 0; r < RB; ++r) s[r] = _mm512_setzero_ps();
    const float* col = keys_t + tile * 16;
    for (int64_t d = 0; d < dim; ++d) {
      const __m512 k = _mm512_loadu_ps(col + d * stride);
      for (int r = 0; r < RB; ++r) s[r] = _mm512_fmadd_ps(_mm512_set1_ps(qf[r * dim + d]), k, s[r]);
    }
    for (int r = 0; r < RB; ++r) _mm512_storeu_ps(scores + r * stride + tile * 16, s[r]);
  }
  for (int r = 0; r < RB; ++r) {
    float* row = scores + r * stride;
    if (row_len[r] > 0) softmax_rows(row, 1, row_len[r], lse != nullptr ? lse + r : nullptr);
    std::fill(row + row_len[r], row + max_len, 0.f);  // keys past a row's position get no weight
  }
  __m512 a[RB][NV];
  for (int r = 0; r < RB; ++r)
    for (int i = 0; i < NV; ++i) a[r][i] = _mm512_setzero_ps();
  for (int64_t j = 0; j < max_len; ++j) {
    __m512 v[NV];
    for (int i = 0; i < NV; ++i) v[i] = _mm512_loadu_ps(values + j * dim + 16 * i);
    for (int r = 0; r < RB; ++r) {
      const __m512 p = _mm512_set1_ps(scores[r * stride + j]);
      for (int i = 0; i < NV; ++i) a[r][i] = _mm512_fmadd_ps(p, v[i], a[r][i]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int i = 0; i < NV; ++i) _mm512_storeu_ps(acc + r * dim + 16 * i, a[r][i]);
}

#if defined(__AVX512BF16__)
constexpr float kSoftmaxSlack = 12.f;  // log2 units: a flash kernel's unnormalized weights stay below 2^12
constexpr float kLog2e = 1.44269504f;  // scaled scores to the flash kernels' log2 units

// A flash kernel row's log-sum-exp (natural log, of the scaled scores) from its maximum in use
// (log2 units) and its sum of weights 2^(score - maximum).
static inline float log_sum_exp_of(float top_log2, float total) { return top_log2 * 0.69314718f + std::log(total); }

// 2^y for 16 lanes of finite y (any size: scalef flushes to 0 or infinity): 2^floor(y) (scalef)
// times 1 + f (c1 + f (c2 + f (c3 + f c4))) for the fraction f = y - floor(y) (vreduceps),
// weighted least squares on [0, 1): relative error < 3e-6, far below the 2^-9 of the bf16
// weights made from it; exactly 1 at y = 0.
static inline __m512 exp2_16(__m512 y) {
  const __m512 f = _mm512_reduce_ps(y, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 p = _mm512_set1_ps(0.01342655f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.0522409f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24128269f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.693044f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, y);
}

constexpr int64_t kFlashChunk = 256;  // keys per online-softmax step: a tile's scores stay in L1

// prefill_rows for bf16 pools in AVX512-BF16 dot products, as a flash kernel: keys go by
// kFlashChunk at a time with a running maximum per row (log2 units), the outputs rescaled only
// when a chunk's maximum passes the one in use by more than kSoftmaxSlack. Keys are bf16 pairs
// per 32-key tile, [stride/32][dim/2][32] (pair i of key j: its elements 2i, 2i+1; each tile one
// contiguous read), values key pairs, [stride/2][dim] (pair jp at dim d: keys 2jp and 2jp+1
// there), the query unscaled bf16 pairs (exact; the scale goes on the scores): one vdpbf16ps is
// 16 keys x 2 dims of the scores, or 16 dims x 2 keys of the output, where the float32 path's
// FMA does 16 x 1. Weights are rounded to bf16 for the values (as SDPA's flash path does for
// bf16): 2^-9 relative per weight. acc is the RB rows' accumulator, normalized at the end.
template <int NV, int RB>
static void prefill_rows_bf16(const uint32_t* qp, const int64_t* row_len, const uint32_t* keys_p,
                              const uint32_t* values_p, float scale, float* acc, float* lse) {
  constexpr int64_t dim = NV * 16, pairs = dim / 2;
  alignas(64) float scores[RB][kFlashChunk];
  alignas(64) uint32_t weights[RB][kFlashChunk / 2];  // bf16 key pairs
  float top_in_use[RB], total[RB];
  int64_t max_len = 0;
  for (int r = 0; r < RB; ++r) {
    max_len = std::max(max_len, row_len[r]);
    top_in_use[r] = -1e30f;  // finite: a first chunk's rescale factor is 2^-200 = 0, not NaN
    total[r] = 0.f;
  }
  std::fill(acc, acc + RB * dim, 0.f);
  const int64_t padded = (max_len + 31) / 32 * 32;  // <= stride: the kernel pads sequences to 32
  const float scale2 = scale * kLog2e;
  for (int64_t c0 = 0; c0 < padded; c0 += kFlashChunk) {
    const int64_t n = std::min(kFlashChunk, padded - c0);
    for (int64_t j = 0; j < n; j += 32) {  // 32 keys a pass: each broadcast query pair serves two
      __m512 s[RB][2];
      for (int r = 0; r < RB; ++r) s[r][0] = s[r][1] = _mm512_setzero_ps();
      const uint32_t* tile = keys_p + (c0 + j) * pairs;
      for (int64_t i = 0; i < pairs; ++i) {
        const __m512bh k0 = (__m512bh)_mm512_loadu_si512(tile + 32 * i);
        const __m512bh k1 = (__m512bh)_mm512_loadu_si512(tile + 32 * i + 16);
        for (int r = 0; r < RB; ++r) {
          const __m512bh qv = (__m512bh)_mm512_set1_epi32(static_cast<int>(qp[r * pairs + i]));
          s[r][0] = _mm512_dpbf16_ps(s[r][0], qv, k0);
          s[r][1] = _mm512_dpbf16_ps(s[r][1], qv, k1);
        }
      }
      for (int r = 0; r < RB; ++r) {
        _mm512_store_ps(&scores[r][j], s[r][0]);
        _mm512_store_ps(&scores[r][j + 16], s[r][1]);
      }
    }
    for (int r = 0; r < RB; ++r) {
      const int64_t len = row_len[r] - c0;  // the row sees this chunk's keys [0, len)
      __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      for (int64_t t = 0; t < std::min(n, len); t += 16)
        vmax = _mm512_mask_max_ps(vmax, tail_mask(len - t), vmax, _mm512_load_ps(&scores[r][t]));
      const float top = len > 0 ? _mm512_reduce_max_ps(vmax) * scale2 : -std::numeric_limits<float>::infinity();
      if (top > top_in_use[r] + kSoftmaxSlack) {
        const float factor = std::exp2(std::max(top_in_use[r] - top, -200.f));
        total[r] *= factor;
        for (int64_t d = 0; d < dim; ++d) acc[r * dim + d] *= factor;
        top_in_use[r] = top;
      }
      const __m512 vscale = _mm512_set1_ps(scale2), shift = _mm512_set1_ps(-top_in_use[r]);
      __m512 vsum = _mm512_setzero_ps();
      for (int64_t t = 0; t < n; t += 32) {
        const __m512 e0 = _mm512_maskz_mov_ps(tail_mask(len - t),
                                              exp2_16(_mm512_fmadd_ps(_mm512_load_ps(&scores[r][t]), vscale, shift)));
        const __m512 e1 = _mm512_maskz_mov_ps(tail_mask(len - t - 16),
                                              exp2_16(_mm512_fmadd_ps(_mm512_load_ps(&scores[r][t + 16]), vscale, shift)));
        vsum = _mm512_add_ps(vsum, _mm512_add_ps(e0, e1));
        _mm512_store_si512(&weights[r][t / 2], (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
      }
      total[r] += _mm512_reduce_add_ps(vsum);
    }
    __m512 a[RB][NV];
    for (int r = 0; r < RB; ++r)
      for (int i = 0; i < NV; ++i) a[r][i] = _mm512_loadu_ps(acc + r * dim + 16 * i);
    const uint32_t* vp = values_p + c0 / 2 * dim;
    for (int64_t jp = 0; jp < n / 2; ++jp) {
      __m512bh v[NV];
      for (int i = 0; i < NV; ++i) v[i] = (__m512bh)_mm512_loadu_si512(vp + jp * dim + 16 * i);
      for (int r = 0; r < RB; ++r) {
        const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(weights[r][jp]));
        for (int i = 0; i < NV; ++i) a[r][i] = _mm512_dpbf16_ps(a[r][i], p, v[i]);
      }
    }
    for (int r = 0; r < RB; ++r)
      for (int i = 0; i < NV; ++i) _mm512_storeu_ps(acc + r * dim + 16 * i, a[r][i]);
  }
  for (int r = 0; r < RB; ++r) {
    const float inv = row_len[r] > 0 ? 1.f / total[r] : 0.f;
    for (int64_t d = 0; d < dim; ++d) acc[r * dim + d] *= inv;
    if (lse != nullptr && row_len[r] > 0) lse[r] = log_sum_exp_of(top_in_use[r], total[r]);
  }
}

// One bf16 pool row pair interleaved for prefill_rows_bf16's values: out[d] = (r0[d], r1[d]).
static inline void interleave_bf16_rows(const void* r0, const void* r1, uint32_t* out, int64_t dim) {
  const auto* a16 = static_cast<const c10::BFloat16*>(r0);
  const auto* b16 = static_cast<const c10::BFloat16*>(r1);
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                      37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int64_t d = 0; d < dim; d += 32) {
    const __m512i a = _mm512_loadu_si512(a16 + d);
    const __m512i b = b16 != nullptr ? _mm512_loadu_si512(b16 + d) : _mm512_setzero_si512();
    _mm512_storeu_si512(out + d, _mm512_permutex2var_epi16(a, lo, b));
    _mm512_storeu_si512(out + d + 16, _mm512_permutex2var_epi16(a, hi, b));
  }
}

// One (sequence, KV head)'s len keys and values in prefill_rows_bf16's layout (keys
// [stride/32][dim/2][32] pairs, values [stride/2][dim] key pairs), or with amx_layout in
// prefill_rows_amx's (keys as rows [stride][dim], values transposed per 32 keys,
// [stride/32][dim][32]), from bf16 rows key(pos) and value(pos).
template <typename KeyRow, typename ValueRow>
static void fill_bf16_pairs(const KeyRow& key, const ValueRow& value, int64_t len, int64_t dim,
                            uint32_t* kp, uint32_t* vp, bool amx_layout) {
  if (amx_layout) {
    auto* values_t = reinterpret_cast<uint16_t*>(vp);
    for (int64_t pos = 0; pos < len; ++pos) {
      std::memcpy(kp + pos * dim / 2, key(pos), dim * 2);
      const auto* row = reinterpret_cast<const uint16_t*>(value(pos));
      uint16_t* block = values_t + pos / 32 * 32 * dim + pos % 32;
      for (int64_t d = 0; d < dim; ++d) block[d * 32] = row[d];
    }
    return;
  }
  for (int64_t pos = 0; pos < len; ++pos) {  // a 32-bit transpose per 32-key tile: pair i of key pos
    const uint32_t* krow = reinterpret_cast<const uint32_t*>(key(pos));
    uint32_t* tile = kp + (pos & ~int64_t{31}) * dim / 2 + (pos & 31);
    for (int64_t i = 0; i < dim / 2; ++i) tile[i * 32] = krow[i];
  }
  for (int64_t pos = 0; pos < len; pos += 2)
    interleave_bf16_rows(value(pos), pos + 1 < len ? value(pos + 1) : nullptr, vp + pos / 2 * dim, dim);
}
#endif

// AMX: tdpbf16ps on 16 x 64-byte tiles, written with the tile intrinsics (the kernel before this
// one called oneDNN's brgemm per 512 keys and measured 2x slower: scores and weights for a whole
// row went through L2, and values were read at a stride of the sequence length). Scores come out
// transposed, [keys][32 queries] = keys x queries^T: the keys are the A operand as rows ([len][dim]
// bf16, copied from the pool), the 32 query rows' bf16 pairs the B operand, so a query's softmax
// runs down a column with no horizontal sums. Outputs come out transposed too, [dim][32 queries]
// += values^T x weights^T: values^T (per 32 keys a [dim][32] bf16 block, from the fill) as A, the
// bf16 weights of key pairs as B. Keys go by in chunks of kAmxChunk with a running maximum per
// query (flash attention's online softmax); the outputs are rescaled only when a chunk's maximum
// passes the one in use by more than kSoftmaxSlack, which after the first chunk is rare.
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define KVSERVE_AMX 1
#include <sys/syscall.h>

constexpr int64_t kAmxChunk = 256;

// Linux hands out the AMX tile state only on request (ARCH_REQ_XCOMP_PERM for XTILEDATA).
static bool amx_permitted() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
}

// Tiles 0-7 all 16 rows x 64 bytes: 16 x 16 float32, or 16 rows of 16 bf16 pairs.
static void configure_tiles() {
  struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  } config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = 16;
  }
  _tile_loadconfig(&config);
}

// The tile loads are asm without a memory clobber: make the compiler finish plain stores first.
static inline void memory_fence_for_tiles() { asm volatile("" ::: "memory"); }

// C tiles 0-3 += two A tiles (loaded into 4, 5) times two B tiles (6, 7): tile 2i + j += A_i B_j.
static inline void tile_product_2x2(const void* a0, const void* a1, int64_t a_stride, const void* b0, const void* b1,
                                    int64_t b_stride) {
  _tile_loadd(4, a0, a_stride);
  _tile_loadd(5, a1, a_stride);
  _tile_loadd(6, b0, b_stride);
  _tile_loadd(7, b1, b_stride);
  _tile_dpbf16ps(0, 4, 6);
  _tile_dpbf16ps(1, 4, 7);
  _tile_dpbf16ps(2, 5, 6);
  _tile_dpbf16ps(3, 5, 7);
}

// C tiles 0-3 to or from 32 rows of a [rows][32] float32 buffer: tile 2i + j at rows 16i, columns 16j.
static inline void store_tiles_2x2(float* rows) {
  _tile_stored(0, rows, 128);
  _tile_stored(1, rows + 16, 128);
  _tile_stored(2, rows + 16 * 32, 128);
  _tile_stored(3, rows + 16 * 32 + 16, 128);
}

static inline void load_tiles_2x2(const float* rows) {
  _tile_loadd(0, rows, 128);
  _tile_loadd(1, rows + 16, 128);
  _tile_loadd(2, rows + 16 * 32, 128);
  _tile_loadd(3, rows + 16 * 32 + 16, 128);
}

template <int NV>
static void prefill_rows_amx(const uint32_t* qp, const int64_t* row_len, const uint32_t* keys_p,
                             const uint32_t* values_p, float scale, float* acc, float* lse) {
  constexpr int64_t dim = NV * 16, pairs = dim / 2, steps = dim / 32;  // steps: 32-dim slices of a key
  const auto* keys = reinterpret_cast<const c10::BFloat16*>(keys_p);
  const auto* values_t = reinterpret_cast<const c10::BFloat16*>(values_p);
  alignas(64) uint32_t qt[steps][2][16][16];   // B tiles: [dim slice][query half][pair][query]
  alignas(64) float st[kAmxChunk][32];         // scores^T of a chunk
  alignas(64) uint32_t pt[kAmxChunk / 2][32];  // weights^T as key pairs: [key pair][query]
  alignas(64) float out_t[dim][32];            // outputs^T, unnormalized
  alignas(64) int32_t len32[32];
  int64_t max_len = 0, min_len = row_len[0];
  for (int r = 0; r < 32; ++r) {
    max_len = std::max(max_len, row_len[r]);
    min_len = std::min(min_len, row_len[r]);
    len32[r] = static_cast<int32_t>(row_len[r]);
  }
  for (int64_t s = 0; s < steps; ++s)
    for (int h = 0; h < 2; ++h)
      for (int p = 0; p < 16; ++p)
        for (int n = 0; n < 16; ++n) qt[s][h][p][n] = qp[(h * 16 + n) * pairs + s * 16 + p];
  std::memset(out_t, 0, sizeof(out_t));
  // per query half h: its lengths, the running maximum in use (log2 units; finite, so that rows
  // with no keys yet make no NaNs) and the sum of weights
  const __m512i len[2] = {_mm512_load_si512(len32), _mm512_load_si512(len32 + 16)};
  __m512 m[2] = {_mm512_set1_ps(-1e30f), _mm512_set1_ps(-1e30f)}, l[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  const __m512 scale2 = _mm512_set1_ps(scale * kLog2e);
  const __m512i pair_order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                              22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const int64_t padded = (max_len + 31) / 32 * 32, seen_by_all = min_len & ~int64_t{1};
  auto visible = [&](int64_t key, int h) { return _mm512_cmplt_epi32_mask(_mm512_set1_epi32(static_cast<int32_t>(key)), len[h]); };
  for (int64_t c0 = 0; c0 < padded; c0 += kAmxChunk) {
    // keys [c0, c0 + open) are seen by every query of the tile: no masks there
    const int64_t n = std::min(kAmxChunk, padded - c0), open = std::clamp<int64_t>(seen_by_all - c0, 0, n);
    memory_fence_for_tiles();
    // scores^T: 32 keys x 32 queries a step (C tiles 0-3: four independent sums)
    for (int64_t j = 0; j < n; j += 32) {
      const c10::BFloat16* k = keys + (c0 + j) * dim;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t s = 0; s < steps; ++s)
        tile_product_2x2(k + 32 * s, k + 16 * dim + 32 * s, dim * 2, &qt[s][0][0][0], &qt[s][1][0][0], 64);
      store_tiles_2x2(&st[j][0]);
    }
    // this chunk's maximum per query; the outputs are rescaled only when it passes the one in use
    __m512 top[2];
    __mmask16 grew = 0;
    for (int h = 0; h < 2; ++h) {
      // four running maxima (one would wait on each max's latency); keys from open & ~3 on masked
      __m512 p0 = _mm512_set1_ps(-std::numeric_limits<float>::infinity()), p1 = p0, p2 = p0, p3 = p0;
      int64_t t = 0;
      for (; t + 4 <= open; t += 4) {
        p0 = _mm512_max_ps(p0, _mm512_load_ps(&st[t][16 * h]));
        p1 = _mm512_max_ps(p1, _mm512_load_ps(&st[t + 1][16 * h]));
        p2 = _mm512_max_ps(p2, _mm512_load_ps(&st[t + 2][16 * h]));
        p3 = _mm512_max_ps(p3, _mm512_load_ps(&st[t + 3][16 * h]));
      }
      for (; t < n; ++t) p0 = _mm512_mask_max_ps(p0, visible(c0 + t, h), p0, _mm512_load_ps(&st[t][16 * h]));
      top[h] = _mm512_mul_ps(_mm512_max_ps(_mm512_max_ps(p0, p1), _mm512_max_ps(p2, p3)), scale2);
      grew |= _mm512_cmp_ps_mask(top[h], _mm512_add_ps(m[h], _mm512_set1_ps(kSoftmaxSlack)), _CMP_GT_OQ);
    }
    if (grew != 0) {
      __m512 factor[2];
      for (int h = 0; h < 2; ++h) {
        const __m512 next = _mm512_max_ps(m[h], top[h]);
        factor[h] = exp2_16(_mm512_max_ps(_mm512_sub_ps(m[h], next), _mm512_set1_ps(-200.f)));
        l[h] = _mm512_mul_ps(l[h], factor[h]);
        m[h] = next;
      }
      for (int64_t d = 0; d < dim; ++d)
        for (int h = 0; h < 2; ++h) _mm512_store_ps(&out_t[d][16 * h], _mm512_mul_ps(_mm512_load_ps(&out_t[d][16 * h]), factor[h]));
    }
    // weights 2^(scale2 * s - m), zero where the query may not see the key, as bf16 key pairs
    for (int h = 0; h < 2; ++h) {
      const __m512 shift = _mm512_sub_ps(_mm512_setzero_ps(), m[h]);
      for (int64_t t = 0; t < n; t += 2) {
        __m512 e0 = exp2_16(_mm512_fmadd_ps(_mm512_load_ps(&st[t][16 * h]), scale2, shift));
        __m512 e1 = exp2_16(_mm512_fmadd_ps(_mm512_load_ps(&st[t + 1][16 * h]), scale2, shift));
        if (t >= open) {
          e0 = _mm512_maskz_mov_ps(visible(c0 + t, h), e0);
          e1 = _mm512_maskz_mov_ps(visible(c0 + t + 1, h), e1);
        }
        l[h] = _mm512_add_ps(l[h], _mm512_add_ps(e0, e1));
        _mm512_store_si512(&pt[t / 2][16 * h], _mm512_permutexvar_epi16(pair_order, (__m512i)_mm512_cvtne2ps_pbh(e1, e0)));
      }
    }
    memory_fence_for_tiles();
    // outputs^T += values^T x weights^T, two 16-dim slices at a time (C tiles 0-3)
    for (int64_t d0 = 0; d0 < dim; d0 += 32) {
      load_tiles_2x2(&out_t[d0][0]);
      for (int64_t j = 0; j < n; j += 32) {
        const c10::BFloat16* v = values_t + (c0 + j) * dim + d0 * 32;  // this 32-key block's [dim][32]
        tile_product_2x2(v, v + 16 * 32, 64, &pt[j / 2][0], &pt[j / 2][16], 128);
      }
      store_tiles_2x2(&out_t[d0][0]);
    }
  }
  alignas(64) float mf[32], lf[32];
  for (int h = 0; h < 2; ++h) {
    _mm512_store_ps(mf + 16 * h, m[h]);
    _mm512_store_ps(lf + 16 * h, l[h]);
  }
  for (int r = 0; r < 32; ++r) {
    const float inv = row_len[r] > 0 ? 1.f / lf[r] : 0.f;
    for (int64_t d = 0; d < dim; ++d) acc[r * dim + d] = out_t[d][r] * inv;
    if (lse != nullptr && row_len[r] > 0) lse[r] = log_sum_exp_of(mf[r], lf[r]);
  }
}
#endif

static std::atomic<bool> amx_on{true};  // set_amx turns the tile path off (tests, benchmarks)

static bool use_amx() {
#if defined(KVSERVE_AMX)
  return amx_permitted() && amx_on.load(std::memory_order_relaxed);
#else
  return false;
#endif
}

// Prefill for batch sequences of query_len new tokens each. fill(b, h, len, stride, keys_t,
// values) writes sequence b's KV head h: as float32, keys transposed [dim][stride] and values
// [len][dim]; with kPairs (bf16 pools), bf16 pairs in prefill_rows_bf16's layout (or, with kAmx,
// prefill_rows_amx's: fill_bf16_pairs). Buffers start zeroed, so columns past len weigh nothing.
// Not causal: every query sees all len keys of its sequence (a cascade's shared prefix). With
// lse_out ([batch * query_len, heads] float32), each query row's log-sum-exp goes there too.
template <typename T, int NV, int RB, bool kPairs, bool kAmx, typename O, typename Fill>
static void prefill_kernel(const T* q, int64_t q_stride, const int64_t* lens, O* out, int64_t out_stride,
                           int64_t batch, int64_t query_len, int64_t heads, int64_t kv_heads, float scale,
                           const Fill& fill, bool causal, float* lse_out) {
  using Word = std::conditional_t<kPairs, uint32_t, float>;
  constexpr int64_t dim = NV * 16, words = kPairs ? dim / 2 : dim, pad = kPairs ? 32 : 16;
  const int64_t group = heads / kv_heads;
  // Phase 1: each sequence's keys and values, once per (sequence, KV head), padded to `pad`.
  std::vector<int64_t> padded(batch), base(batch + 1, 0);
  for (int64_t b = 0; b < batch; ++b) {
    padded[b] = (lens[b] + pad - 1) / pad * pad;
    base[b + 1] = base[b] + kv_heads * padded[b] * words;
  }
  std::vector<Word> keys_t(base[batch]), values(base[batch]);
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t job = begin; job < end; ++job) {
      const int64_t b = job / kv_heads, h = job % kv_heads, stride = padded[b];
      fill(b, h, lens[b], stride, keys_t.data() + base[b] + h * stride * words,
           values.data() + base[b] + h * stride * words, kAmx);
    }
  });
  // Phase 2: tiles of RB query rows (row = position * group + head in group). Causal tiles
  // cost more the later they sit, so jobs are dealt from both ends to balance the threads.
  const int64_t tiles_per_head = (query_len * group + RB - 1) / RB;
  const int64_t jobs = batch * kv_heads * tiles_per_head;
  int64_t max_stride = pad;
  for (int64_t b = 0; b < batch; ++b) max_stride = std::max(max_stride, padded[b]);
  at::parallel_for(0, jobs, 1, [&](int64_t begin, int64_t end) {
    std::vector<Word> qw(RB * words);
    std::vector<float> acc(RB * dim), scores(kPairs ? 0 : RB * max_stride);  // the bf16 kernels keep their own
#if defined(KVSERVE_AMX)
    if constexpr (kAmx) configure_tiles();  // per thread
#endif
    int64_t row_len[RB];
    float lse[RB];
    for (int64_t k = begin; k < end; ++k) {
      const int64_t job = k % 2 == 0 ? k / 2 : jobs - 1 - k / 2;
      const int64_t tile = job % tiles_per_head, bh = job / tiles_per_head;
      const int64_t b = bh / kv_heads, h = bh % kv_heads, stride = padded[b];
      for (int r = 0; r < RB; ++r) {
        const int64_t row = tile * RB + r, i = row / group, g = row % group;
        Word* qr = qw.data() + r * words;
        if (row >= query_len * group) {
          row_len[r] = 0;
          std::fill(qr, qr + words, Word(0));
          continue;
        }
        row_len[r] = causal ? lens[b] - query_len + i + 1 : lens[b];
        const T* src = q + (b * query_len + i) * q_stride + (h * group + g) * dim;
        if constexpr (kPairs) {
          std::memcpy(qr, src, dim * sizeof(T));  // bf16 pairs as they are: the scale goes on the scores
        } else {
          to_float(src, qr, dim);
          for (int64_t d = 0; d < dim; ++d) qr[d] *= scale;
        }
      }
      const Word* kt = keys_t.data() + base[b] + h * stride * words;
      const Word* vs = values.data() + base[b] + h * stride * words;
      if constexpr (kAmx) {
#if defined(KVSERVE_AMX)  // only instantiated where it is defined (run_prefill)
        static_assert(RB == 32, "the AMX kernel takes 32 query rows");
        prefill_rows_amx<NV>(qw.data(), row_len, kt, vs, scale, acc.data(), lse);
#endif
      } else if constexpr (kPairs) {
#if defined(__AVX512BF16__)
        prefill_rows_bf16<NV, RB>(qw.data(), row_len, kt, vs, scale, acc.data(), lse);
#endif
      } else {
        prefill_rows<NV, RB>(qw.data(), row_len, kt, stride, vs, scores.data(), acc.data(), lse);
      }
      for (int r = 0; r < RB; ++r) {
        const int64_t row = tile * RB + r, i = row / group, g = row % group;
        if (row >= query_len * group) continue;
        from_float(acc.data() + r * dim, out + (b * query_len + i) * out_stride + (h * group + g) * dim, dim);
        if (lse_out != nullptr) lse_out[(b * query_len + i) * heads + h * group + g] = lse[r];
      }
    }
#if defined(KVSERVE_AMX)
    if constexpr (kAmx) _tile_release();  // this thread's tile state
#endif
  });
}

constexpr int kAmxRows = 32;  // query rows per AMX tile job (two 16-row tiles)

// The prefill kernel for this head size; false where there is no vector path for it. (head_dim
// 256 with one query row per tile measured 2x slower than SDPA's causal flash path: none.)
template <typename T, bool kPairs = false, typename O, typename Fill>
static bool run_prefill(const T* q, int64_t q_stride, const int64_t* lens, O* out, int64_t out_stride, int64_t batch,
                        int64_t query_len, int64_t heads, int64_t kv_heads, int64_t dim, float scale, const Fill& fill,
                        bool causal = true, float* lse_out = nullptr) {
  auto launch = [&](auto nv) {  // dim = 16 * NV
    constexpr int NV = decltype(nv)::value;
#if defined(KVSERVE_AMX)
    if constexpr (kPairs) {
      if (use_amx())
        return prefill_kernel<T, NV, kAmxRows, true, true, O>(q, q_stride, lens, out, out_stride, batch, query_len,
                                                              heads, kv_heads, scale, fill, causal, lse_out);
    }
#endif
    constexpr int kRows = NV == 4 ? 4 : 2;  // query rows per tile: accumulators that fit the registers
    prefill_kernel<T, NV, kRows, kPairs, false, O>(q, q_stride, lens, out, out_stride, batch, query_len, heads,
                                                    kv_heads, scale, fill, causal, lse_out);
  };
  if (dim == 64) launch(std::integral_constant<int, 4>{});
  else if (dim == 128) launch(std::integral_constant<int, 8>{});
  else return false;
  return true;
}
#endif

// Prefill (or, causal false, full) attention of the query rows q ([batch * query_len, heads,
// dim], rows contiguous) over the pool through the tables, into out (T or float32 rows of
// heads * dim at out_stride); false, touching nothing, where there is no vector path.
template <typename T, typename O>
static bool prefill_into(O* out, int64_t out_stride, const torch::Tensor& q, const torch::Tensor& kv_cache,
                         const torch::Tensor& block_tables, const torch::Tensor& seq_lens, int64_t query_len,
                         float scale, bool causal, float* lse_out) {
#if defined(__AVX512F__)
  if constexpr (!std::is_same_v<T, double>) {
    auto tables = block_tables.contiguous();
    auto lens = seq_lens.contiguous();
    const int64_t heads = q.size(1), dim = q.size(2), kv_heads = kv_cache.size(1) / 2;
    const T* kv = kv_cache.data_ptr<T>();
    const int64_t* tab = tables.data_ptr<int64_t>();
    const int64_t width = tables.size(1), block_size = kv_cache.size(2);
    const int64_t block_stride = 2 * kv_heads * block_size * dim;
    auto row_at = [&](int64_t b, int64_t head, int64_t pos) {
      return kv + tab[b * width + pos / block_size] * block_stride + (head * block_size + pos % block_size) * dim;
    };
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      auto fill_pairs = [&](int64_t b, int64_t h, int64_t len, int64_t /*stride*/, uint32_t* kp, uint32_t* vp,
                            bool amx) {
        fill_bf16_pairs([&](int64_t pos) { return row_at(b, h, pos); },
                        [&](int64_t pos) { return row_at(b, kv_heads + h, pos); }, len, dim, kp, vp, amx);
      };
      return run_prefill<T, true>(q.data_ptr<T>(), q.stride(0), lens.data_ptr<int64_t>(), out, out_stride,
                                  tables.size(0), query_len, heads, kv_heads, dim, scale, fill_pairs, causal, lse_out);
    }
#endif
    auto fill = [&](int64_t b, int64_t h, int64_t len, int64_t stride, float* kt, float* vs, bool) {
      for (int64_t pos = 0; pos < len; ++pos) {
        const T* krow = row_at(b, h, pos);
        for (int64_t d = 0; d < dim; ++d) kt[d * stride + pos] = static_cast<float>(krow[d]);
        to_float(row_at(b, kv_heads + h, pos), vs + pos * dim, dim);
      }
    };
    return run_prefill(q.data_ptr<T>(), q.stride(0), lens.data_ptr<int64_t>(), out, out_stride, tables.size(0),
                       query_len, heads, kv_heads, dim, scale, fill, causal, lse_out);
  }
#endif
  return false;
}

bool paged_prefill_attention(torch::Tensor out, torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_tables,
                             torch::Tensor seq_lens, int64_t query_len, double scale, bool causal,
                             c10::optional<torch::Tensor> lse) {
  // q, out: [batch * query_len, heads, dim] rows; sequence b's queries are its last query_len
  // positions (its K/V, cached prefix included, already in the pool), or with causal false
  // queries that see all seq_len keys (lse [batch * query_len, heads] gets their log-sum-exps).
  // Returns false, touching nothing, where this build has no vector path for the shape (the
  // caller falls back).
  check_paged_call(q, kv_cache, block_tables, seq_lens);
  TORCH_CHECK(out.dim() == 3 && out.stride(2) == 1 && out.stride(1) == out.size(2), "out must be like q");
  TORCH_CHECK(out.scalar_type() == q.scalar_type(), "out and q: one dtype");
  TORCH_CHECK(q.size(0) == block_tables.size(0) * query_len, "q must hold query_len tokens per sequence");
  bool done = false;
  float* lse_out = lse_pointer(lse, q.size(0), q.size(1));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_prefill_attention", [&] {
    done = prefill_into<scalar_t, scalar_t>(out.data_ptr<scalar_t>(), out.stride(0), q, kv_cache, block_tables,
                                            seq_lens, query_len, static_cast<float>(scale), causal, lse_out);
  });
  return done;
}

// Cascade attention (attention.Cascade): query_len queries per sequence over a prefix of
// shared blocks all of them see (one full prefill-kernel call, the queries as its rows) and
// each sequence's own blocks (decode kernel, or causal prefill kernel), both into float32 with
// their log-sum-exps, merged: with a = exp(lse_own - m), b = exp(lse_shared - m), m the larger,
// out = (a * own + b * shared) / (a + b), rounded once to the model dtype. Returns false,
// touching nothing, where the prefill kernel has no vector path for the shape.
bool cascade_attention(torch::Tensor out, torch::Tensor q, torch::Tensor kv_cache, torch::Tensor shared_table,
                       torch::Tensor shared_len, torch::Tensor own_tables, torch::Tensor own_lens, int64_t query_len,
                       double scale) {
  check_paged_call(q, kv_cache, own_tables, own_lens);
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type(),
              "out must be contiguous, shaped and typed like q");
  TORCH_CHECK(shared_table.size(0) == 1 && q.size(0) == own_tables.size(0) * query_len, "one shared prefix, "
              "query_len queries per sequence");
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2), width = q.size(1) * q.size(2);
  auto as_float = torch::TensorOptions().dtype(torch::kFloat);
  auto shared = torch::empty({rows, heads, dim}, as_float), own = torch::empty({rows, heads, dim}, as_float);
  auto lse_shared = torch::empty({rows, heads}, as_float), lse_own = torch::empty({rows, heads}, as_float);
  const float sc = static_cast<float>(scale);
  bool done = false;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "cascade_attention", [&] {
    done = prefill_into<scalar_t, float>(shared.data_ptr<float>(), width, q, kv_cache, shared_table, shared_len, rows,
                                         sc, false, lse_shared.data_ptr<float>());
    if (!done) return;
    if (query_len == 1) {
      auto tables = own_tables.contiguous();
      auto lens = own_lens.contiguous();
      decode_kernel<scalar_t, float>(q.data_ptr<scalar_t>(), q.stride(0), kv_cache.data_ptr<scalar_t>(),
                                     tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), own.data_ptr<float>(), width,
                                     rows, heads, kv_cache.size(1) / 2, dim, tables.size(1), kv_cache.size(2), sc,
                                     lse_own.data_ptr<float>());
    } else {
      done = prefill_into<scalar_t, float>(own.data_ptr<float>(), width, q, kv_cache, own_tables, own_lens, query_len,
                                           sc, true, lse_own.data_ptr<float>());
      if (!done) return;
    }
    scalar_t* o = out.data_ptr<scalar_t>();
    const float *x = own.data_ptr<float>(), *y = shared.data_ptr<float>();
    const float *lx = lse_own.data_ptr<float>(), *ly = lse_shared.data_ptr<float>();
    at::parallel_for(0, rows * heads, row_grain(dim), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const float m = std::max(lx[r], ly[r]);
        const float a = std::exp(lx[r] - m), b = std::exp(ly[r] - m), inv = 1.f / (a + b);
        for (int64_t d = 0; d < dim; ++d)
          o[r * dim + d] = static_cast<scalar_t>((a * x[r * dim + d] + b * y[r * dim + d]) * inv);
      }
    });
  });
  return done;
}

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

  int64_t block_bytes() const { return 2 * kv_heads * block_size * row_bytes; }

  // A sequence's (table: its block ids) row of head j (K heads, then V heads) at position pos.
  const uint8_t* row_at(const int64_t* table, int64_t j, int64_t pos) const {
    return data + table[pos / block_size] * block_bytes() + (j * block_size + pos % block_size) * row_bytes;
  }

  // Its token at pos in the per-token tables of KV head h (value scales, int4 value affines).
  int64_t token_index(const int64_t* table, int64_t h, int64_t pos) const {
    return (table[pos / block_size] * kv_heads + h) * block_size + pos % block_size;
  }

  // Row `src` (one head of one token, row_bytes) unscaled to float32.
  void decode_row(const uint8_t* src, float* dst) const {
    switch (kind) {
      case kF32: to_float(reinterpret_cast<const float*>(src), dst, dim); break;
      case kF16: to_float(reinterpret_cast<const c10::Half*>(src), dst, dim); break;
      case kBF16: to_float(reinterpret_cast<const c10::BFloat16*>(src), dst, dim); break;
      case kE4M3:
      case kE5M2:
        for (int64_t d = 0; d < dim; ++d) dst[d] = lut[src[d]];
        break;
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

  // Rows [0, n) of head j (K heads 0..kv_heads-1, then V heads) of pool block `block` -> dst [n, dim].
  void block_rows(int64_t block, int64_t j, int64_t n, float* dst) const {
    const uint8_t* rows = data + block * block_bytes() + j * block_size * row_bytes;
    for (int64_t t = 0; t < n; ++t) decode_row(rows + t * row_bytes, dst + t * dim);
    if (kind == kI4) return affine_rows(block, j, n, dst);
    if (j < kv_heads) {
      if (key_scales == nullptr) return;
      const float* ks = key_scales + ((key_per_block ? block * kv_heads : 0) + j) * dim;
      for (int64_t t = 0; t < n; ++t) {
        float* row = dst + t * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) row[d] *= ks[d];
      }
      return;
    }
    const int64_t width = dim / groups;
    for (int64_t t = 0; t < n; ++t) {
      float* row = dst + t * dim;
      for (int64_t g = 0; g < groups; ++g) {
        const float vs = value_scales == nullptr
            ? v_scale : value_scales[((block * kv_heads + j - kv_heads) * block_size + t) * groups + g];
#pragma omp simd
        for (int64_t d = g * width; d < (g + 1) * width; ++d) row[d] *= vs;
      }
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

  // Block blk of a sequence of len tokens (table: its block ids), head j, as float32 rows;
  // a partial last block comes from the tail slot when the pool keeps one. Returns the rows.
  int64_t tile(const int64_t* table, int64_t blk, int64_t len, int64_t tail_slot, int64_t j, float* dst) const {
    const int64_t n = std::min(block_size, len - blk * block_size);
    if (tail != nullptr && n < block_size) tail_rows(tail_slot, j, n, dst);
    else block_rows(table[blk], j, n, dst);
    return n;
  }
};

// Decode over a quantized pool for one (sequence, KV head), vector path for dim = 16 * NV.
// Quantized kinds are read straight from the pool's bytes, with the scales folded outside the
// per-element work: keys' per-channel scales (int4: steps) multiply the query once per block
// (int4's minimums add q·min to the block's scores), a value's per-token scale multiplies its
// probability. float kinds of another dtype, and a sequence's tail block, go through a float
// tile. fp8 widens through float16: e5m2 is float16's top byte; e4m3's magnitude bits shifted
// into float16's exponent/mantissa fields give the value / 256 (subnormals included).
#if defined(__AVX512F__)
// A quantized decode job's software prefetch, called as the key pass starts rows [pos, pos + m)
// (within one block) of head h: those rows' values and value scales (int4: affines), for the
// value pass (which then runs from L2), and the key rows kAheadRows further on, with their
// block's key scales (int4: affines) where those are per block. Blocks are scattered, so the
// hardware's prefetchers stop at each block's end. 16 rows at a time, not a whole block: a
// 16-row group of int8 keys is scored faster than memory answers, so one block ahead at
// 16-token blocks measured 1.2x slower cold than 64 rows (EPYC); `end` is where the coded rows stop.
static inline void prefetch_key_pass(const QuantPool& pool, const int64_t* table, int64_t h, int64_t pos, int64_t m,
                                     int64_t end) {
  constexpr int64_t kAheadRows = 64;
  const int64_t bs = pool.block_size, rb = pool.row_bytes;
  auto keys_from = [&](int64_t p) {  // up to m rows, not past p's block or end; at a block's start its key tables
    if (p >= end) return;
    prefetch_row(pool.row_at(table, h, p), std::min({m, bs - p % bs, end - p}) * rb);
    if (p % bs != 0) return;
    const int64_t head_block = table[p / bs] * pool.kv_heads + h;
    if (pool.key_affine != nullptr) prefetch_row(pool.key_affine + head_block * 2 * pool.dim, 4 * pool.dim);
    else if (pool.key_per_block) prefetch_row(pool.key_scales + head_block * pool.dim, 4 * pool.dim);
  };
  prefetch_row(pool.row_at(table, pool.kv_heads + h, pos), m * rb);
  const int64_t token = pool.token_index(table, h, pos);
  if (pool.value_affine != nullptr) prefetch_row(pool.value_affine + token * pool.groups * 2, m * pool.groups * 4);
  else if (pool.value_scales != nullptr) prefetch_row(pool.value_scales + token, m * 4);
  if (pos == 0)
    for (int64_t p = m; p < kAheadRows; p += m) keys_from(p);
  keys_from(pos + kAheadRows);
}

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
static constexpr float kFp8Unit = KIND == kE4M3 ? 256.f : 1.f;  // what load_codes' values must be scaled by

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
                                int64_t tail_slot, int64_t h, float* probs, float* acc, float* tile) {
  constexpr int64_t dim = NV * 16;
  const int64_t bs = pool.block_size, num_blocks = (len + bs - 1) / bs;
  const int64_t kv_heads = pool.kv_heads, rb = pool.row_bytes;
  __m512 q[G][NV], qs[G][NV];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < NV; ++i) q[g][i] = _mm512_loadu_ps(qf + g * dim + 16 * i);
  auto tail_block = [&](int64_t blk) {  // a partial last block kept in full precision
    return pool.tail != nullptr && len - blk * bs < bs;
  };
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
    if (KIND == kF32 || KIND == kF16 || KIND == kBF16 || tail_block(blk)) {
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
    if (KIND == kF32 || KIND == kF16 || KIND == kBF16 || tail_block(blk)) {
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
                          float*);

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

template <int KIND, int NB, int G>
static void decode_int_vnni(const float* qf, const QuantPool& pool, const int64_t* table, int64_t len,
                            int64_t tail_slot, int64_t h, float* probs, float* acc, float* tile) {
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
      for (int64_t t = 0; t < m; t += 2) {
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
                            int64_t tail_slot, int64_t h, float* probs, float* acc, float* tile) {
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

// split_query: float32 queries, which the fp8 path scores as two bf16 parts (see decode_fp8_bf16)
template <int NV>
static QuantJob pick_quant_kind(int64_t kind, int64_t group, bool split_query) {
  (void)split_query;
  switch (kind) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    case kI8: return by_group(group, [](auto g) -> QuantJob { return decode_int_vnni<kI8, NV / 2, decltype(g)::value>; });
    case kI4: return by_group(group, [](auto g) -> QuantJob { return decode_int_vnni<kI4, NV / 2, decltype(g)::value>; });
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

// The portable job over a quantized pool (the reference for the vector one).
static void decode_quant_scalar(const float* qf, const QuantPool& pool, const int64_t* table, int64_t len,
                                int64_t tail_slot, int64_t h, int64_t group, float* probs, float* acc, float* tile) {
  const int64_t bs = pool.block_size, dim = pool.dim, num_blocks = (len + bs - 1) / bs;
  for (int64_t blk = 0; blk < num_blocks; ++blk) {
    const int64_t n = pool.tile(table, blk, len, tail_slot, h, tile);
    for (int64_t t = 0; t < n; ++t)
      for (int64_t g = 0; g < group; ++g) {
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t d = 0; d < dim; ++d) s += qf[g * dim + d] * tile[t * dim + d];
        probs[g * len + blk * bs + t] = s;
      }
  }
  softmax_rows(probs, group, len);
  std::fill(acc, acc + group * dim, 0.f);
  for (int64_t blk = 0; blk < num_blocks; ++blk) {
    const int64_t n = pool.tile(table, blk, len, tail_slot, pool.kv_heads + h, tile);
    for (int64_t t = 0; t < n; ++t)
      for (int64_t g = 0; g < group; ++g) {
        const float p = probs[g * len + blk * bs + t];
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) acc[g * dim + d] += p * tile[t * dim + d];
      }
  }
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
        const QuantJob job_fn = dim == 64 ? pick_quant_kind<4>(kind, group, split)
                                : dim == 128 ? pick_quant_kind<8>(kind, group, split)
                                : dim == 256 ? pick_quant_kind<16>(kind, group, split) : nullptr;
#endif
        decode_driver(q.data_ptr<scalar_t>(), q.stride(0), lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(),
                      out.stride(0), tables.size(0), heads, kv_heads, dim, static_cast<float>(scale),
                      [&](int64_t b, int64_t h, const float* qf, int64_t len, float* probs, float* acc, float*) {
          thread_local std::vector<float> tile;
          tile.resize(bs * dim);
#if defined(__AVX512F__)
          if (job_fn != nullptr) return job_fn(qf, pool, tab + b * width, len, slot_of(b), h, probs, acc, tile.data());
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
#if defined(__AVX512F__)
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

bool set_amx(bool enabled) {
#if defined(__AVX512BF16__)
  amx_on.store(enabled);
  return use_amx();
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention_quantized", &paged_attention_quantized,
        "attention over a quantized paged pool, written into out; False where unsupported: (out, q, data, kind, "
        "key_scales, value_scales, v_scale, lut, tail, tail_slots, block_tables, seq_lens, query_len, scale)");
  m.def("rope_and_write_kv", &rope_and_write_kv,
        "rotary on the query/key heads of qkv in place, then K/V into the pool: (qkv, cos, sin, kv_cache, slots, heads)");
  m.def("quantize_blocks", &quantize_blocks,
        "whole blocks into an int4 or per-block int8 pool as the torch path: (src, rows, block_ids, kind, data, "
        "key_scales, value_scales) -> bool");
  m.def("rope_and_write_kv_int8", &rope_and_write_kv_int8,
        "rope_and_write_kv into an int8 pool: keys by static per-channel scales, values per token: (qkv, cos, sin, "
        "kv_cache, slots, heads, key_scales, value_scales, clipped)");
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention over a paged KV cache, written into out: (out, q, kv_cache, block_tables, seq_lens, scale)");
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
  m.def("add_rms_norm", &add_rms_norm,
        "residual += delta (in place, when delta is given), returns rms_norm(residual) * weight: "
        "(residual, delta, weight, eps)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up for gate_up = [gate | up]: (gate_up)");
  m.def("quantize_rows_int8", &quantize_rows_int8,
        "per-row symmetric int8: (x, offset) -> (codes: int8, or uint8 + 128 with offset; float32 scales = max|row| / 127)");
  m.def("scale_rows_", &scale_rows_, "x *= row_scales[:, None] (+ bias), in place: (x, row_scales, bias)");
  m.def("int8_gemm_pack", &int8_gemm_pack,
        "an int8 weight [n, k] and its channel scales packed for int8_linear; empty where unsupported: (codes, scales) "
        "-> (packed, comp, scales)");
  m.def("int8_linear", &int8_linear,
        "W8A8 linear: x's rows quantized to int8, times the packed weight in VNNI, rescaled (+ bias, float32 padded "
        "like scales), in x's dtype: (x, packed, comp, scales, out_features, bias)");
}
