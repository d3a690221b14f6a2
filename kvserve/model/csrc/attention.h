// The attention machinery both attention files run: the decode driver (a job per sequence and
// KV head, in parallel) and the prefill kernels (flash-style tiles of query rows over a
// sequence's keys and values, laid out once per call by a fill function; AVX512-BF16 and AMX
// paths for bf16 pairs).
#pragma once

#include "amx.h"
#include "common.h"

// Some key rows of one block of the next job: NextKeys::rows.
template <typename T>
struct NextRows {
  const T* first = nullptr;  // the block's first key row
  int64_t count = 0;         // rows of it to prefetch
};

// The keys of the job a thread runs after the current one: its sequence's block table and length,
// and its KV head (table nullptr: none). A job prefetches them while its value pass runs: that
// pass reads values the key pass already brought into L2, so without it the memory idled through
// every value pass (bf16 at 32 x 2,048 on a Zen 5: 0.81-0.88x the time cold).
struct NextKeys {
  const int64_t* table = nullptr;
  int64_t len = 0, h = 0;
  bool whole_sequence = false;  // the next job is all of a sequence's KV heads, on this thread

  // the key rows (dim elements of T each) in the sequence's block-th block, up to m (none past len,
  // or no next job); found once a block: per row, the lookup cost the bf16 job 1.4x its time in cache
  template <typename T>
  NextRows<T> rows(const T* kv, int64_t block_stride, int64_t block_size, int64_t dim, int64_t block, int64_t m) const {
    const int64_t count = table == nullptr ? 0 : std::min(m, len - block * block_size);
    if (count <= 0) return {};
    return {kv + table[block] * block_stride + h * block_size * dim, count};
  }

  // none while the current sequence's K/V (`bytes`, all heads) fits in half of L2: its reads then
  // come from cache or the whole-block prefetch (prefetch_whole_blocks), and these prefetches
  // only cost (bf16 at 2 and 8 x 512 tokens, 30 layers: 1.06-1.07x the time; 1.3x from L2)
  NextKeys unless_short(int64_t bytes) const { return prefetch_whole_blocks(bytes) ? NextKeys{} : *this; }

  // As the job of a sequence's last KV head starts: where the next job is a whole sequence short
  // enough for whole-block prefetching, all of its blocks (every head's K and V, block_bytes each;
  // token_bytes a token), so that its first blocks are not read at memory latency while the
  // whole-block prefetch of its first head runs only one block ahead. The AVX512-BF16 job's (30
  // cold layers: 32 x 135 tokens 0.93-0.97x the time, 32 x 256 0.87-0.98x, 8 x 512 0.92-0.98x
  // over five runs); the float job, which also serves float32 queries, measured 0.96-1.04x, so not there.
  void prefetch_short_sequence(const void* kv, int64_t block_bytes, int64_t block_size, int64_t token_bytes,
                               int64_t h, int64_t kv_heads) const {
    if (h + 1 != kv_heads || !whole_sequence || table == nullptr || !prefetch_whole_blocks(len * token_bytes)) return;
    for (int64_t b = 0; b * block_size < len; ++b)
      prefetch_row(static_cast<const char*>(kv) + table[b] * block_bytes, block_bytes);
  }
};

// Runs job(b, h, qf, len, probs, acc, lse, next) for every (sequence, KV head) in parallel: qf
// holds the group's scaled queries in float32, the job leaves the group's outputs in acc and,
// where lse_out ([batch, heads]) is given, their log-sum-exps at lse; next names the keys this
// thread reads next (NextKeys). A sequence costs its length, and lengths in a batch differ by 3x
// or more, so work is not cut into equal counts per thread: each thread takes the next job from
// a shared counter, longest sequences first, so the last to start are the shortest; it takes it
// as the previous one starts, so that one knows whose keys to prefetch. A job is a whole
// sequence, its heads in order on one thread (see prefetch_whole_blocks), unless there are too
// few sequences to keep the threads busy; then it is one KV head of one sequence. tables: the
// block tables, width entries a sequence.
template <typename T, typename O, typename Job>
static void decode_driver(const T* q, int64_t q_stride, const int64_t* tables, int64_t width, const int64_t* lens,
                          O* out, int64_t out_stride, int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
                          float scale, const Job& job, float* lse_out = nullptr) {
  const int64_t group = heads / kv_heads, threads = at::get_num_threads();
  const int64_t heads_per_job = batch >= 2 * threads ? kv_heads : 1, parts = kv_heads / heads_per_job;
  const int64_t jobs = batch * parts;
  std::vector<int64_t> order(jobs);
  for (int64_t j = 0; j < jobs; ++j) order[j] = j;
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t x, int64_t y) { return lens[x / parts] > lens[y / parts]; });
  std::atomic<int64_t> next{0};
  // one call per thread (or one call for all where the region cannot fork): each drains the counter
  at::parallel_for(0, std::max<int64_t>(1, std::min(jobs, threads)), 1, [&](int64_t, int64_t) {
    std::vector<float> qf(group * dim), acc(group * dim), probs;
    const auto keys_of = [&](int64_t b, int64_t h) { return NextKeys{tables + b * width, lens[b], h}; };
    for (int64_t k = next.fetch_add(1, std::memory_order_relaxed); k < jobs;) {
      const int64_t after = next.fetch_add(1, std::memory_order_relaxed);
      const int64_t b = order[k] / parts, first = order[k] % parts * heads_per_job, len = lens[b];
      if (static_cast<int64_t>(probs.size()) < group * len) probs.resize(group * len);
      for (int64_t h = first; h < first + heads_per_job; ++h) {
        for (int64_t g = 0; g < group; ++g) {
          const T* qrow = q + b * q_stride + (h * group + g) * dim;
          for (int64_t d = 0; d < dim; ++d) qf[g * dim + d] = static_cast<float>(qrow[d]) * scale;
        }
        NextKeys next_keys = h + 1 < first + heads_per_job ? keys_of(b, h + 1)
                             : after < jobs ? keys_of(order[after] / parts, order[after] % parts * heads_per_job)
                                            : NextKeys{};
        next_keys.whole_sequence = heads_per_job == kv_heads;
        job(b, h, qf.data(), len, probs.data(), acc.data(),
            lse_out != nullptr ? lse_out + b * heads + h * group : nullptr, next_keys);
        for (int64_t g = 0; g < group; ++g)
          from_float(acc.data() + g * dim, out + b * out_stride + (h * group + g) * dim, dim);
      }
      k = after;
    }
  });
}

// The portable decode jobs' two passes over n consecutive rows (dim elements each) of one KV
// head: keys scored against the group's queries, values added into its outputs. The rows are
// float32, or, with AVX2 (CPUs without AVX-512, where these jobs are the decode path), bf16 or
// float16 rows of the pool as they are, widened in registers as they are used (widen8): a
// float32 tile of them took a widening and a store per 8 elements first, a third of a hot bf16
// job's perf samples on a Zen 3. Widened rows go 4 at a time for up to 3 query heads, each 8
// elements widened once for the 3 heads and the 12 sums reduced together (hadd trees); their
// values 8 x 4 dims at a time for up to 3 heads, so a row is widened once in all. float32 rows
// keep the reference's AVX2 loops (8 rows' sums per head, the rows as FMA memory operands).
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
#define KVSERVE_AVX2_ROWS 1

// out[j] = the sum of v[j]'s 8 lanes.
static inline __m256 lane_sums8(const __m256 (&v)[8]) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// The sums of 4 vectors' 8 lanes, in lane_sums8's order.
static inline __m128 lane_sums4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// acc[0, 8 * NA) += sum_t weights[t] * rows[t][0, 8 * NA) (rows row_stride apart), in registers.
template <int NA>
static inline void accumulate_dims(const float* weights, const float* rows, int64_t n, int64_t row_stride, float* acc) {
  __m256 a[NA];
  KVSERVE_UNROLL
  for (int i = 0; i < NA; ++i) a[i] = _mm256_loadu_ps(acc + 8 * i);
  for (int64_t t = 0; t < n; ++t) {
    const __m256 p = _mm256_broadcast_ss(weights + t);
    KVSERVE_UNROLL
    for (int i = 0; i < NA; ++i) a[i] = _mm256_fmadd_ps(p, _mm256_loadu_ps(rows + t * row_stride + 8 * i), a[i]);
  }
  KVSERVE_UNROLL
  for (int i = 0; i < NA; ++i) _mm256_storeu_ps(acc + 8 * i, a[i]);
}

template <typename T>
constexpr bool kWidens8 = std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, c10::Half> || std::is_same_v<T, int8_t> ||
                         std::is_same_v<T, Fp8E4M3> || std::is_same_v<T, Fp8E5M2> || std::is_same_v<T, Int4Low> ||
                         std::is_same_v<T, Int4High>;

// fn(std::integral_constant<int, GB>{}, first) for the heads [0, group) in runs of GB <= 3
// (what AVX2's 16 registers hold: 4 rows' sums, or 4 vectors of outputs, for each head).
template <typename Fn>
static inline void by_head_triples(int64_t group, const Fn& fn) {
  int64_t g = 0;
  for (; g + 3 <= group; g += 3) fn(std::integral_constant<int, 3>{}, g);
  if (group - g == 2) fn(std::integral_constant<int, 2>{}, g);
  if (group - g == 1) fn(std::integral_constant<int, 1>{}, g);
}

// scores[g * stride + t] = q[g] . rows[t] for GB query heads (float32 rows, dim apart).
template <int GB, typename T>
static void score_rows_widened(const float* q, int64_t dim, const T* rows, int64_t n, float* scores, int64_t stride) {
  for (int64_t t = 0; t < n; t += 4) {
    const int m = static_cast<int>(std::min<int64_t>(4, n - t));  // rows past n repeat the last: sums unused
    const T* row[4];
    KVSERVE_UNROLL
    for (int j = 0; j < 4; ++j) row[j] = rows + (t + std::min(j, m - 1)) * dim;
    __m256 s[GB][4];
    KVSERVE_UNROLL
    for (int g = 0; g < GB; ++g)
      KVSERVE_UNROLL
      for (int j = 0; j < 4; ++j) s[g][j] = _mm256_setzero_ps();
    for (int64_t c = 0; c < dim; c += 8)
      KVSERVE_UNROLL
      for (int j = 0; j < 4; ++j) {
        const __m256 k = widen8(row[j] + c);
        KVSERVE_UNROLL
        for (int g = 0; g < GB; ++g) s[g][j] = _mm256_fmadd_ps(k, _mm256_loadu_ps(q + g * dim + c), s[g][j]);
      }
    KVSERVE_UNROLL
    for (int g = 0; g < GB; ++g) {
      const __m128 sums = lane_sums4(s[g][0], s[g][1], s[g][2], s[g][3]);
      if (m == 4) {
        _mm_storeu_ps(scores + g * stride + t, sums);
      } else {
        alignas(16) float part[4];
        _mm_store_ps(part, sums);
        for (int j = 0; j < m; ++j) scores[g * stride + t + j] = part[j];
      }
    }
  }
}

// acc[g * dim + d] += sum_t weights[g * stride + t] * rows[t][d] for GB heads and the S x 8
// dims d from 0 (rows row_stride apart): outputs in registers over the rows, each row's S
// vectors widened once.
template <int GB, int S, typename T>
static inline void accumulate_widened(const float* weights, int64_t stride, const T* rows, int64_t row_stride, int64_t n,
                                      int64_t dim, float* acc) {
  __m256 a[GB][S];
  KVSERVE_UNROLL
  for (int g = 0; g < GB; ++g)
    KVSERVE_UNROLL
    for (int i = 0; i < S; ++i) a[g][i] = _mm256_loadu_ps(acc + g * dim + 8 * i);
  for (int64_t t = 0; t < n; ++t) {
    __m256 p[GB];
    KVSERVE_UNROLL
    for (int g = 0; g < GB; ++g) p[g] = _mm256_broadcast_ss(weights + g * stride + t);
    KVSERVE_UNROLL
    for (int i = 0; i < S; ++i) {
      const __m256 v = widen8(rows + t * row_stride + 8 * i);
      KVSERVE_UNROLL
      for (int g = 0; g < GB; ++g) a[g][i] = _mm256_fmadd_ps(p[g], v, a[g][i]);
    }
  }
  KVSERVE_UNROLL
  for (int g = 0; g < GB; ++g)
    KVSERVE_UNROLL
    for (int i = 0; i < S; ++i) _mm256_storeu_ps(acc + g * dim + 8 * i, a[g][i]);
}
#endif

// Whether score_rows / accumulate_rows take rows of T as they are, for this head size (else a
// float32 tile of them).
template <typename T>
static inline bool rows_widened(int64_t dim) {
#if defined(KVSERVE_AVX2_ROWS)
  if constexpr (kWidens8<T>) return dim % 8 == 0;
#endif
  (void)dim;
  return std::is_same_v<T, float>;
}

// scores[g * stride + t] = qf[g] . rows[t] for the group's query rows qf [group, dim]; rows of T
// where rows_widened<T>(dim).
template <typename T>
static inline void score_rows(const float* qf, int64_t group, int64_t dim, const T* rows, int64_t n, float* scores,
                              int64_t stride) {
  int64_t first = 0;
#if defined(KVSERVE_AVX2_ROWS)
  if constexpr (kWidens8<T>) {
    if (dim % 8 == 0)
      return by_head_triples(group, [&](auto gb, int64_t g) {
        score_rows_widened<decltype(gb)::value>(qf + g * dim, dim, rows, n, scores + g * stride, stride);
      });
  } else if constexpr (std::is_same_v<T, float>) {
    if (dim % 8 == 0)
      for (; first + 8 <= n; first += 8)
        for (int64_t g = 0; g < group; ++g) {
          __m256 s[8];
          for (int j = 0; j < 8; ++j) s[j] = _mm256_setzero_ps();
          for (int64_t c = 0; c < dim; c += 8) {
            const __m256 qc = _mm256_loadu_ps(qf + g * dim + c);
            for (int j = 0; j < 8; ++j) s[j] = _mm256_fmadd_ps(_mm256_loadu_ps(rows + (first + j) * dim + c), qc, s[j]);
          }
          _mm256_storeu_ps(scores + g * stride + first, lane_sums8(s));
        }
  }
#endif
  for (int64_t t = first; t < n; ++t)
    for (int64_t g = 0; g < group; ++g) {
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < dim; ++d) s += qf[g * dim + d] * static_cast<float>(rows[t * dim + d]);
      scores[g * stride + t] = s;
    }
}

// acc[g] += sum_t weights[g * stride + t] * rows[t] for the group's outputs acc [group, dim];
// rows of T where rows_widened<T>(dim). Only dims [0, width) where width is given (>= 0), with
// rows row_stride elements apart where that is given (int4 values, whose weights differ per
// group of dims and whose packed rows are two half-rows of nibbles); outputs stay dim apart.
template <typename T>
static inline void accumulate_rows(const float* weights, int64_t stride, int64_t group, int64_t dim, const T* rows,
                                   int64_t n, float* acc, int64_t width = -1, int64_t row_stride = -1) {
  if (width < 0) width = dim;
  if (row_stride < 0) row_stride = dim;
#if defined(KVSERVE_AVX2_ROWS)
  if constexpr (kWidens8<T>) {
    if (width % 8 == 0)
      return by_head_triples(group, [&](auto gb, int64_t g) {
        constexpr int GB = decltype(gb)::value, S = GB == 1 ? 8 : 4;
        int64_t c = 0;
        for (; c + 8 * S <= width; c += 8 * S)
          accumulate_widened<GB, S>(weights + g * stride, stride, rows + c, row_stride, n, dim, acc + g * dim + c);
        for (; c < width; c += 8)
          accumulate_widened<GB, 1>(weights + g * stride, stride, rows + c, row_stride, n, dim, acc + g * dim + c);
      });
  } else if constexpr (std::is_same_v<T, float>) {
    if (width % 8 == 0) {
      for (int64_t g = 0; g < group; ++g) {
        const float* w = weights + g * stride;
        float* out = acc + g * dim;
        int64_t c = 0;
        for (; c + 64 <= width; c += 64) accumulate_dims<8>(w, rows + c, n, row_stride, out + c);
        for (; c + 32 <= width; c += 32) accumulate_dims<4>(w, rows + c, n, row_stride, out + c);
        for (; c < width; c += 8) accumulate_dims<1>(w, rows + c, n, row_stride, out + c);
      }
      return;
    }
  }
#endif
  for (int64_t t = 0; t < n; ++t)
    for (int64_t g = 0; g < group; ++g) {
      const float p = weights[g * stride + t];
#pragma omp simd
      for (int64_t d = 0; d < width; ++d) acc[g * dim + d] += p * static_cast<float>(rows[t * row_stride + d]);
    }
}

// The float prefill kernels (prefill_kernel below): AVX-512, or AVX2 with FMA and F16C.
#if defined(__AVX512F__) || defined(KVSERVE_AVX2_ROWS)
#define KVSERVE_FLOAT_PREFILL 1

// The longest causal length among RB query rows.
template <int RB>
static inline int64_t max_row_len(const int64_t* row_len) {
  int64_t max_len = 0;
  for (int r = 0; r < RB; ++r) max_len = std::max(max_len, row_len[r]);
  return max_len;
}

// Each of RB rows of scores (stride apart) softmaxed over its causal length (its log-sum-exp
// into lse[r] when lse is given), zero from there to max_len: keys past a row's position get no
// weight.
template <int RB>
static inline void softmax_score_rows(float* scores, int64_t stride, const int64_t* row_len, int64_t max_len,
                                      float* lse) {
  for (int r = 0; r < RB; ++r) {
    float* row = scores + r * stride;
    if (row_len[r] > 0) softmax_rows(row, 1, row_len[r], lse != nullptr ? lse + r : nullptr);
    std::fill(row + row_len[r], row + max_len, 0.f);
  }
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
  const int64_t max_len = max_row_len<RB>(row_len);
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
  softmax_score_rows<RB>(scores, stride, row_len, max_len, lse);
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

// query rows per tile of the AVX-512 prefill kernels (head_dim 16 * nv): accumulators that fit the registers
constexpr int register_rows(int nv) { return nv == 4 ? 4 : 2; }
#else
// out[r * out_stride + c] = sum over t < n of a[r * a_stride + t] * b[t * b_stride + c], for RB
// rows and 16 columns c: the 2 x RB sums in registers, a broadcast value of a times two vectors of b.
template <int RB>
static inline void rows_by_16_columns(const float* a, int64_t a_stride, const float* b, int64_t b_stride, int64_t n,
                                      float* out, int64_t out_stride) {
  __m256 s[RB][2];
  KVSERVE_UNROLL
  for (int r = 0; r < RB; ++r) s[r][0] = s[r][1] = _mm256_setzero_ps();
  for (int64_t t = 0; t < n; ++t) {
    const __m256 b0 = _mm256_loadu_ps(b + t * b_stride), b1 = _mm256_loadu_ps(b + t * b_stride + 8);
    KVSERVE_UNROLL
    for (int r = 0; r < RB; ++r) {
      const __m256 x = _mm256_broadcast_ss(a + r * a_stride + t);
      s[r][0] = _mm256_fmadd_ps(x, b0, s[r][0]);
      s[r][1] = _mm256_fmadd_ps(x, b1, s[r][1]);
    }
  }
  KVSERVE_UNROLL
  for (int r = 0; r < RB; ++r) {
    _mm256_storeu_ps(out + r * out_stride, s[r][0]);
    _mm256_storeu_ps(out + r * out_stride + 8, s[r][1]);
  }
}

// prefill_rows in AVX2's 8-lane vectors: scores 16 keys at a time (query values times the
// transposed keys), then the outputs 16 dims at a time over all the keys (probabilities times
// values; each row's probabilities re-read from L1 per 16 dims), since RB rows x head_dim of sums
// would not fit the 16 vector registers.
template <int NV, int RB>
static void prefill_rows(const float* qf, const int64_t* row_len, const float* keys_t, int64_t stride,
                         const float* values, float* scores, float* acc, float* lse) {
  constexpr int64_t dim = NV * 16;
  const int64_t max_len = max_row_len<RB>(row_len);
  for (int64_t tile = 0; tile * 16 < max_len; ++tile)
    rows_by_16_columns<RB>(qf, dim, keys_t + tile * 16, stride, dim, scores + tile * 16, stride);
  softmax_score_rows<RB>(scores, stride, row_len, max_len, lse);
  for (int64_t c = 0; c < dim; c += 16) rows_by_16_columns<RB>(scores, stride, values + c, dim, max_len, acc + c, dim);
}

constexpr int register_rows(int) { return 4; }  // query rows per tile of the AVX2 prefill kernel
#endif

#if defined(__AVX512BF16__)
constexpr float kSoftmaxSlack = 12.f;  // log2 units: a flash kernel's unnormalized weights stay below 2^12
// the flash kernels score in log2 units: scores scaled by kLog2e (common.h)

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

// One chunk of n keys from c0 for one tile of RB rows (prefill_rows_bf16): scores, the running
// maxima (rescaling acc and total where one passes the maximum in use), weights, values.
template <int NV, int RB>
static inline void flash_chunk_bf16(const uint32_t* qp, const int64_t* row_len, const uint32_t* keys_p,
                                    const uint32_t* values_p, int64_t c0, int64_t n, float scale2, float* acc,
                                    float* top_in_use, float* total) {
  constexpr int64_t dim = NV * 16, pairs = dim / 2;
  alignas(64) float scores[RB][kFlashChunk];
  alignas(64) uint32_t weights[RB][kFlashChunk / 2];  // bf16 key pairs
  for (int64_t j = 0; j < n; j += 32) {  // 32 keys a pass: each broadcast query pair serves two
    // sums [r][16 keys][pair parity]: 4 * RB independent chains, since one chain of vdpbf16ps
    // waits on its latency (Zen 5: 16 chains run 1.5x as many a second as 8, scratch loop)
    __m512 s[RB][2][2];
    for (int r = 0; r < RB; ++r) s[r][0][0] = s[r][0][1] = s[r][1][0] = s[r][1][1] = _mm512_setzero_ps();
    const uint32_t* tile = keys_p + (c0 + j) * pairs;
    for (int64_t i = 0; i < pairs; i += 2) {  // pairs = dim / 2 is even
      __m512bh k[2][2];
      for (int u = 0; u < 2; ++u)
        for (int half = 0; half < 2; ++half) k[half][u] = (__m512bh)_mm512_loadu_si512(tile + 32 * (i + u) + 16 * half);
      for (int r = 0; r < RB; ++r)
        for (int u = 0; u < 2; ++u) {
          const __m512bh qv = (__m512bh)_mm512_set1_epi32(static_cast<int>(qp[r * pairs + i + u]));
          for (int half = 0; half < 2; ++half) s[r][half][u] = _mm512_dpbf16_ps(s[r][half][u], qv, k[half][u]);
        }
    }
    for (int r = 0; r < RB; ++r)
      for (int half = 0; half < 2; ++half)
        _mm512_store_ps(&scores[r][j + 16 * half], _mm512_add_ps(s[r][half][0], s[r][half][1]));
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

// prefill_rows for bf16 pools in AVX512-BF16 dot products, as a flash kernel: keys go by
// kFlashChunk at a time with a running maximum per row (log2 units), the outputs rescaled only
// when a chunk's maximum passes the one in use by more than kSoftmaxSlack. Keys are bf16 pairs
// per 32-key tile, [stride/32][dim/2][32] (pair i of key j: its elements 2i, 2i+1; each tile one
// contiguous read), values key pairs, [stride/2][dim] (pair jp at dim d: keys 2jp and 2jp+1
// there), the query unscaled bf16 pairs (exact; the scale goes on the scores): one vdpbf16ps is
// 16 keys x 2 dims of the scores, or 16 dims x 2 keys of the output, where the float32 path's
// FMA does 16 x 1. Weights are rounded to bf16 for the values (as SDPA's flash path does for
// bf16): 2^-9 relative per weight. acc is the rows' accumulator, normalized at the end. The rows
// go as T tiles of RB (RB: what the registers hold), every tile taking a chunk of keys before
// the next chunk is read: one (sequence, KV head)'s keys and values at 6,000 tokens are 1.5 MB,
// more than a core's L2, and 4 rows alone use each key 8 times for its 256 bytes read.
template <int NV, int RB, int T>
static void prefill_rows_bf16(const uint32_t* qp, const int64_t* row_len, const uint32_t* keys_p,
                              const uint32_t* values_p, float scale, float* acc, float* lse) {
  constexpr int64_t dim = NV * 16, pairs = dim / 2, rows = RB * T;
  float top_in_use[rows], total[rows];
  int64_t padded[T] = {};  // per tile: its longest row, padded to 32 (<= stride: the kernel pads sequences to 32)
  for (int r = 0; r < rows; ++r) {
    padded[r / RB] = std::max(padded[r / RB], (row_len[r] + 31) / 32 * 32);
    top_in_use[r] = -1e30f;  // finite: a first chunk's rescale factor is 2^-200 = 0, not NaN
    total[r] = 0.f;
  }
  std::fill(acc, acc + rows * dim, 0.f);
  const int64_t longest = *std::max_element(padded, padded + T);
  const float scale2 = scale * kLog2e;
  for (int64_t c0 = 0; c0 < longest; c0 += kFlashChunk)
    for (int t = 0; t < T; ++t)
      if (c0 < padded[t])
        flash_chunk_bf16<NV, RB>(qp + t * RB * pairs, row_len + t * RB, keys_p, values_p, c0,
                                 std::min(kFlashChunk, padded[t] - c0), scale2, acc + t * RB * dim,
                                 top_in_use + t * RB, total + t * RB);
  for (int r = 0; r < rows; ++r) {
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
#if defined(KVSERVE_AMX)
constexpr int64_t kAmxChunk = 256;

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
        tile_product<TileDot::kBf16>(k + 32 * s, k + 16 * dim + 32 * s, dim * 2, &qt[s][0][0][0], &qt[s][1][0][0], 64);
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
        tile_product<TileDot::kBf16>(v, v + 16 * 32, 64, &pt[j / 2][0], &pt[j / 2][16], 128);
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
        prefill_rows_bf16<NV, register_rows(NV), RB / register_rows(NV)>(qw.data(), row_len, kt, vs, scale, acc.data(),
                                                                         lse);
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
constexpr int kPairTiles = 4;  // tiles of register_rows per prefill_rows_bf16 job (see there)

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
    constexpr int kRows = kPairs ? register_rows(NV) * kPairTiles : register_rows(NV);
    prefill_kernel<T, NV, kRows, kPairs, false, O>(q, q_stride, lens, out, out_stride, batch, query_len, heads,
                                                    kv_heads, scale, fill, causal, lse_out);
  };
  if (dim == 64) launch(std::integral_constant<int, 4>{});
  else if (dim == 128) launch(std::integral_constant<int, 8>{});
  else return false;
  return true;
}
#endif  // KVSERVE_FLOAT_PREFILL
