// Helpers every C++ op file shares: vector exp and tail masks, the float32 softmax, row
// conversions to and from float32, software prefetch, and the KV element kinds.
#pragma once

#include <torch/types.h>  // not torch/extension.h: pybind11 and the C++ API double the parse, per file
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include <omp.h>
#include <unistd.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
// exp's method (exp16, exp8): 2^n * e^r with n = round(x / ln 2), r = x - n ln 2 split hi/lo
// (Cody-Waite), e^r by its degree-6 Taylor polynomial on |r| <= ln2/2 (relative error < 2e-7),
// evaluated by Horner from 1/720 through these coefficients.
static constexpr float kLog2e = 1.44269504f, kLn2Hi = 0.693145751953125f, kLn2Lo = 1.428606765330187e-06f;
static constexpr float kExpTaylor[] = {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f};

#if defined(__AVX512F__)
// exp for 16 lanes. Below -87 the result flushes to 0; above ~88.7 it is +inf.
static inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x));
  __m512 p = _mm512_set1_ps(1.f / 720);
  for (const float c : kExpTaylor) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

// The first min(remaining, 16) lanes; none when remaining <= 0.
static inline __mmask16 tail_mask(int64_t remaining) {
  if (remaining <= 0) return 0;
  return remaining >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << remaining) - 1);
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// exp for 8 lanes (CPUs without AVX-512): 2^n built in the exponent bits, so x is clamped to
// [-87, 88.5] (n within the normal range; e^88.5 is near float's largest).
static inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.5f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x));
  __m256 p = _mm256_set1_ps(1.f / 720);
  for (const float c : kExpTaylor) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}
#endif

// Softmax of each of `rows` score rows of length len, in place, in float32; with `lse`, each
// row's log-sum-exp (max + log sum) there too, to merge partial softmaxes (cascade attention).
static inline void softmax_rows(float* scores, int64_t rows, int64_t len, float* lse = nullptr) {
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
    int64_t pos = 0;
#if defined(__AVX2__) && defined(__FMA__)
    // vector exp: glibc's scalar expf per score was most of an AVX2 decode step's attention
    __m256 vsum = _mm256_setzero_ps();
    for (; pos + 8 <= len; pos += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(pg + pos), _mm256_set1_ps(mx)));
      vsum = _mm256_add_ps(vsum, e);
      _mm256_storeu_ps(pg + pos, e);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, vsum);
    for (float lane : lanes) sum += lane;
#endif
    for (; pos < len; ++pos) {
      pg[pos] = std::exp(pg[pos] - mx);
      sum += pg[pos];
    }
    if (lse != nullptr) lse[g] = mx + std::log(sum);
    const float inv = 1.f / sum;
    for (int64_t p = 0; p < len; ++p) pg[p] *= inv;
#endif
  }
}
// Into L2 (nothing off x86-64). asm, not _mm_prefetch: GCC 12 deleted _mm_prefetch loops in
// some inlining shapes.
static inline void prefetch_row(const void* p, int64_t bytes) {
#if defined(__x86_64__)
  for (int64_t off = 0; off < bytes; off += 64) asm volatile("prefetcht1 %0" : : "m"(static_cast<const char*>(p)[off]));
#else
  (void)p;
  (void)bytes;
#endif
}

// A sequence position's block and its offset there: by a shift and a mask where the block size
// is a power of two (every size in use), else by division: the portable job finds each 8-row
// slice's rows and its prefetches this way, and a 64-bit division costs tens of cycles.
struct BlockSize {
  int64_t size = 1, shift = 0;  // shift -1: not a power of two

  static BlockSize of(int64_t size) {
    return {size, (size & (size - 1)) == 0 ? static_cast<int64_t>(__builtin_ctzll(static_cast<uint64_t>(size))) : -1};
  }
  int64_t block(int64_t pos) const { return shift >= 0 ? pos >> shift : pos / size; }
  int64_t offset(int64_t pos) const { return shift >= 0 ? pos & (size - 1) : pos % size; }
};

// A decode job's software prefetch as its key pass starts rows [pos, pos + m)
// of a sequence (within one block): values(pos, m) for the value pass to come, and keys(p, m)
// for the rows kPrefetchAheadRows on (at pos 0, also every slice up to there); the AVX-512
// quantized jobs run it 16 rows at a time (prefetch_key_pass). Blocks are scattered, so the
// hardware's prefetchers stop at each block's end. A slice at a time through the pass, not a
// block's 2 KB in one burst: the burst left the memory idle while the block was computed (AVX2,
// bf16, Zen 3: slices of 8 rows took 0.6-0.87x the time at blocks of 128 and 16).
constexpr int64_t kPrefetchAheadRows = 64;

template <typename Keys, typename Values>
static inline void prefetch_slice(int64_t pos, int64_t m, const Keys& keys, const Values& values) {
  values(pos, m);
  if (pos == 0)
    for (int64_t p = m; p < kPrefetchAheadRows; p += m) keys(p, m);
  keys(pos + kPrefetchAheadRows, m);
}

// Whether the first KV head's decode job should pull each next block of a sequence (all heads)
// into L2 for the other heads' jobs, which run next on the same thread: only while the
// sequence's K/V (`bytes`, all heads) fits in half of L2, so the lines are still there when
// those jobs read them. Past that they are evicted first and the prefetch only adds traffic:
// on a Xeon with 2 MB of L2, 21 x 4,500 bf16 tokens ran 18-20% slower with it, 32 x 2,048 13%
// (measured ~10% faster on an EPYC's cold pools, sequences unrecorded).
static inline bool prefetch_whole_blocks(int64_t bytes) {
  static const int64_t half_l2 = [] {
    long l2 = 0;
#if defined(_SC_LEVEL2_CACHE_SIZE)
    l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
#endif
    return static_cast<int64_t>(l2 > 0 ? l2 : 1 << 20) / 2;
  }();
  return bytes <= half_l2;
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
#endif
#if defined(__AVX512F__)
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
#endif
// Before a loop of a compile-time count over an array of vector accumulators: unrolled from
// the start, the array lives in registers. GCC 12 at -O3 otherwise kept such loops rolled long
// enough to make the array memory, storing every FMA's result to the stack as well (12 stores
// a row in the AVX2 value loop: half an int8 job's hot time on a Zen 3).
#define KVSERVE_UNROLL _Pragma("GCC unroll 16")

// A pool's fp8 codes as row elements, for the row loops that widen them in registers; float()
// is the code's value through float16, as widen8 takes it: exact for e5m2 (float16's top byte),
// in units of kE4M3Unit for e4m3 (its bits shifted into float16's fields give value / 256), so
// that the multiply back is folded into a query's or a weight's scale, not made per code.
constexpr float kE4M3Unit = 256.f;
struct Fp8E4M3 {
  uint8_t bits;
  explicit operator float() const {
    const auto half = static_cast<uint16_t>(((bits & 0x80) << 8) | ((bits & 0x7F) << 7));
    return static_cast<float>(c10::Half(half, c10::Half::from_bits()));
  }
};
struct Fp8E5M2 {
  uint8_t bits;
  explicit operator float() const {
    return static_cast<float>(c10::Half(static_cast<uint16_t>(bits << 8), c10::Half::from_bits()));
  }
};
// A pool's int4 codes (0..15, unscaled) as row elements: channel d sits in byte d's low nibble and
// channel d + dim/2 in its high one, so a packed row is read as two half-rows over the same bytes.
struct Int4Low {
  uint8_t bits;
  explicit operator float() const { return static_cast<float>(bits & 15); }
};
struct Int4High {
  uint8_t bits;
  explicit operator float() const { return static_cast<float>(bits >> 4); }
};

#if defined(__AVX2__) && !defined(__AVX512F__)
// The largest of 8 lanes.
static inline float max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

// 8 elements as float32 (CPUs without AVX-512): bf16 by a 16-bit shift, float16 by F16C.
static inline __m256 widen8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
// int8 codes (a quantized pool's, unscaled) by sign extension.
static inline __m256 widen8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
// int4 nibbles by zero extension, then two shifts (low: a mask's constant took the register the
// value loop's 12 sums, 3 weights and a row vector leave none for, and its sums went to the stack)
// or one (high).
static inline __m256i widen8_bytes(const void* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
static inline __m256 widen8(const Int4Low* p) {
  return _mm256_cvtepi32_ps(_mm256_srli_epi32(_mm256_slli_epi32(widen8_bytes(p), 28), 28));
}
static inline __m256 widen8(const Int4High* p) { return _mm256_cvtepi32_ps(_mm256_srli_epi32(widen8_bytes(p), 4)); }
#if defined(__F16C__)
static inline __m256 widen8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
// 8 lanes of a row as float32 (load16's counterpart): float32 as it is, bf16 and float16 widened.
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const c10::BFloat16* p) { return widen8(p); }
static inline __m256 load8(const c10::Half* p) { return widen8(p); }
// fp8 codes through float16 (a table lookup per code took 2.5x the int8 job's time on a Zen 3):
// e5m2 is float16's top byte; e4m3's bits shifted into float16's fields give the value / 256,
// subnormals included.
static inline __m128i fp8_high_bytes(const void* p) {  // 8 codes, each the high byte of a 16-bit word
  return _mm_unpacklo_epi8(_mm_setzero_si128(), _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
static inline __m256 widen8(const Fp8E5M2* p) { return _mm256_cvtph_ps(fp8_high_bytes(p)); }
static inline __m256 widen8(const Fp8E4M3* p) {  // in units of kE4M3Unit
  // an arithmetic shift right by one copies the sign into the top exponent bit, which the mask clears
  const __m128i half = _mm_and_si128(_mm_srai_epi16(fp8_high_bytes(p), 1), _mm_set1_epi16(static_cast<short>(0xBFFF)));
  return _mm256_cvtph_ps(half);
}
#endif
#endif

// Row conversions to and from float32 (vector loads where AVX-512 is available).
template <typename T>
static inline void to_float(const T* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  if constexpr (!std::is_same_v<T, double>)
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, load16(src + i));
#elif defined(__AVX2__)
  // 8 at a time (CPUs without AVX-512): bf16 by a 16-bit shift, float16 by F16C where present
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, widen8(src + i));
  }
#if defined(__F16C__)
  else if constexpr (std::is_same_v<T, c10::Half>) {
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, widen8(src + i));
  }
#endif
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

// Float32 queries or K/V over a bf16/float16 pool (a float32 model with --kv-cache-dtype bf16):
// the float ops widen its rows as they read them and round into them as they write.
static inline bool float32_over_16_bit(torch::ScalarType rows, torch::ScalarType pool) {
  return rows == torch::kFloat && (pool == torch::kBFloat16 || pool == torch::kHalf);
}
template <typename T>
constexpr bool kSixteenBit = std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, c10::Half>;

// How a KV pool stores its elements (kv_quant.KIND_CODES).
enum KVKind : int64_t { kF32 = 0, kF16 = 1, kBF16 = 2, kE4M3 = 3, kE5M2 = 4, kI8 = 5, kI4 = 6 };
// Rows per task so that small (decode) batches stay on one thread: forking costs more than the work.
static inline int64_t row_grain(int64_t row_elems) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(row_elems, 1)); }

// A GEMM's one parallel region over weights packed by groups of 16 output channels: each thread
// first runs prologue(row_begin, row_end) on its share of the m rows (an int8 layer quantizes its
// activations there), waits for the others, then runs body(group_begin, group_end) on its
// consecutive groups (whole (gate, up) pairs when gated). One region rather than two
// parallel_for calls: at decode sizes a layer is ~50-200 us and the second fork/join and a
// one-thread quantization showed.
template <typename Prologue, typename Body>
static void parallel_gemm(int64_t m, int64_t groups, bool gated, const Prologue& prologue, const Body& body) {
  // at least one thread: num_threads(0) is not valid OpenMP (a layer with no outputs still quantizes its rows)
  const int threads = at::in_parallel_region() ? 1 : static_cast<int>(std::clamp<int64_t>(groups, 1, at::get_num_threads()));
#pragma omp parallel num_threads(threads)
  {
    const int64_t thread = omp_get_thread_num(), team = omp_get_num_threads();
    prologue(m * thread / team, m * (thread + 1) / team);
#pragma omp barrier
    const int64_t pair = gated ? 2 : 1;
    const int64_t chunk = ((groups + team - 1) / team + pair - 1) / pair * pair;
    body(std::min(groups, thread * chunk), std::min(groups, (thread + 1) * chunk));
  }
}
