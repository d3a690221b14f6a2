// Attention over a float KV pool (float32, float16, bf16).
// paged_decode_attention: reads each sequence's K/V straight from the block pool through its
// block table (no gathered copy), one query token per sequence, GQA, two-pass softmax in
// float32 (scores for the whole sequence, then values). Parallel over (sequence, KV head).
// bf16 pools where the CPU has AVX512-BF16: key dot products in vdpbf16ps (see decode_job_bf16).
// paged_prefill_attention: causal (or full) attention for chunks of new tokens (attention.h).
// cascade_attention: a shared prefix read once for every sequence, merged with each one's own part.
#include "attention.h"
#include "ops.h"

// One (sequence, KV head) job, portable C++: the reference the vector path must match. Rows of
// the head go through score_rows / accumulate_rows as they are where those take them
// (rows_widened: float32, and with AVX2 bf16/float16), else widened to float32 in `tile`
// (block_size * dim) first. The key pass goes kSliceRows at a time, prefetching (prefetch_slice)
// the value rows of the slice and the key rows ahead of it.
constexpr int64_t kSliceRows = 8;

template <typename T>
static void decode_job_scalar(const float* qf, const T* kv, const int64_t* table, int64_t len, int64_t group,
                              int64_t dim, int64_t h, int64_t kv_heads, int64_t block_size, float* probs,
                              float* acc, float* tile, float* lse) {
  const int64_t block_stride = 2 * kv_heads * block_size * dim;  // elements per block
  const int64_t row_bytes = dim * static_cast<int64_t>(sizeof(T));
  const BlockSize blocks = BlockSize::of(block_size);
  // head j's row at position pos of the sequence
  auto row = [&](int64_t j, int64_t pos) {
    return kv + table[blocks.block(pos)] * block_stride + (j * block_size + blocks.offset(pos)) * dim;
  };
  // up to m rows from pos on, not past pos's block or the sequence
  auto rows_from = [&](int64_t pos, int64_t m) { return std::min({m, block_size - blocks.offset(pos), len - pos}); };
  auto prefetch = [&](int64_t j) {
    return [&, j](int64_t pos, int64_t m) {
      if (pos < len) prefetch_row(row(j, pos), rows_from(pos, m) * row_bytes);
    };
  };
  // fn(rows) on head j's m rows from pos (within one block), as they are or as a float32 tile
  const bool in_place = rows_widened<T>(dim);
  auto with_rows = [&](int64_t j, int64_t pos, int64_t m, const auto& fn) {
    if (in_place) return fn(row(j, pos));
    to_float(row(j, pos), tile, m * dim);
    fn(static_cast<const float*>(tile));
  };
  for (int64_t pos = 0, m; pos < len; pos += m) {
    m = rows_from(pos, kSliceRows);
    prefetch_slice(pos, m, prefetch(h), prefetch(kv_heads + h));
    with_rows(h, pos, m, [&](const auto* rows) { score_rows(qf, group, dim, rows, m, probs + pos, len); });
  }
  softmax_rows(probs, group, len, lse);
  std::fill(acc, acc + group * dim, 0.f);
  for (int64_t pos = 0, m; pos < len; pos += m) {
    m = rows_from(pos, block_size);
    with_rows(kv_heads + h, pos, m, [&](const auto* rows) { accumulate_rows(probs + pos, len, group, dim, rows, m, acc); });
  }
}
#if defined(__AVX512F__)
// The same job with AVX-512 for head_dim = 16 * NV and G query heads per KV head, so the
// queries and the output accumulators stay in registers: a K or V row is widened once and
// used by all G heads. Walks each block's contiguous [block_size, dim] tile.
template <typename T, int NV, int G>
static void decode_job_avx512(const float* qf, const T* kv, const int64_t* table, int64_t len, int64_t h,
                              int64_t kv_heads, int64_t block_size, float* probs, float* acc, float* lse,
                              const NextKeys& next) {
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
  const int64_t sequence_bytes = len * 2 * kv_heads * dim * static_cast<int64_t>(sizeof(T));
  const bool whole_blocks = h == 0 && prefetch_whole_blocks(sequence_bytes);
  const NextKeys next_keys = next.unless_short(sequence_bytes);
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
    const NextRows<T> ahead = next_keys.rows(kv, block_stride, block_size, dim, blk, n);
    for (int64_t t = 0; t < n; ++t) {
      if (t < ahead.count) prefetch_row(ahead.first + t * dim, dim * sizeof(T));  // the next job's keys (NextKeys)
      __m512 v[NV];
      for (int i = 0; i < NV; ++i) v[i] = load16(tile + t * dim + 16 * i);
      accumulate_row<NV, G>(reg, v, probs, len, first + t);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < NV; ++i) _mm512_storeu_ps(acc + g * dim + 16 * i, reg[g][i]);
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
                            float* lse, const NextKeys& next) {
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
  const int64_t token_bytes = 2 * kv_heads * dim * 2, sequence_bytes = len * token_bytes;
  const bool whole_blocks = h == 0 && prefetch_whole_blocks(sequence_bytes);
  const NextKeys next_keys = next.unless_short(sequence_bytes);
  next.prefetch_short_sequence(kv, block_stride * 2, block_size, token_bytes, h, kv_heads);
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
    const NextRows<c10::BFloat16> ahead = next_keys.rows(kv, block_stride, block_size, dim, b, m);
    for (int64_t r = 0; r < m; ++r) {
      if (r < ahead.count) prefetch_row(ahead.first + r * dim, dim * 2);  // the next job's keys (NextKeys)
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
                         float*, float*, float*, const NextKeys&);

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
                           float*, const NextKeys&);

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
// out in T, or float32 (a cascade's partial results); queries in T, or float32 (Q: a float32
// model over a 16-bit pool).
template <typename T, typename O, typename Q = T>
static void decode_kernel(const Q* q, int64_t q_stride, const T* kv, const int64_t* tables, const int64_t* lens,
                          O* out, int64_t out_stride, int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
                          int64_t width, int64_t block_size, float scale, float* lse_out) {
  const int64_t group = heads / kv_heads;
#if defined(__AVX512BF16__)
  // bf16 queries only: the bf16 dot products would round float32 queries to bf16
  if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<Q, T>) {
    if (const Bf16Job bf16 = bf16_job(dim, group); bf16 != nullptr) {
      // unscaled queries: the job scales the scores
      return decode_driver(q, q_stride, tables, width, lens, out, out_stride, batch, heads, kv_heads, dim, 1.f,
                           [&](int64_t b, int64_t h, const float* qf, int64_t len, float* probs, float* acc, float* lse,
                               const NextKeys& next) {
        bf16(qf, kv, tables + b * width, len, h, kv_heads, block_size, scale, probs, acc, lse, next);
      }, lse_out);
    }
  }
#endif
#if defined(__AVX512F__)
  const DecodeJob<T> job_fn = vector_job<T>(dim, group);
#endif
  decode_driver(q, q_stride, tables, width, lens, out, out_stride, batch, heads, kv_heads, dim, scale,
                [&](int64_t b, int64_t h, const float* qf, int64_t len, float* probs, float* acc, float* lse,
                    [[maybe_unused]] const NextKeys& next) {
    const int64_t* table = tables + b * width;
#if defined(__AVX512F__)
    if (job_fn != nullptr) return job_fn(qf, kv, table, len, h, kv_heads, block_size, probs, acc, lse, next);
#endif
    thread_local std::vector<float> tile;
    tile.resize(block_size * dim);
    decode_job_scalar<T>(qf, kv, table, len, group, dim, h, kv_heads, block_size, probs, acc, tile.data(), lse);
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
                             const torch::Tensor& seq_lens, bool float32_queries_allowed = false) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "q must be [tokens, heads, dim] rows");
  TORCH_CHECK(kv_cache.dim() == 4 && kv_cache.is_contiguous(), "kv_cache must be [blocks, 2*kv_heads, block, dim]");
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && seq_lens.scalar_type() == torch::kLong, "int64 tables");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type() ||
              (float32_queries_allowed && float32_over_16_bit(q.scalar_type(), kv_cache.scalar_type())),
              "q and kv_cache: one dtype (decode: or float32 q over a bf16/float16 pool)");
}

void paged_decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_tables,
                            torch::Tensor seq_lens, double scale) {
  // q, out: [batch, heads, dim] with contiguous rows (a batch stride of their own is allowed)
  check_paged_call(q, kv_cache, block_tables, seq_lens, true);
  TORCH_CHECK(out.dim() == 3 && out.stride(2) == 1 && out.stride(1) == out.size(2), "out must be like q");
  TORCH_CHECK(out.scalar_type() == q.scalar_type(), "out and q: one dtype");
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = kv_cache.size(1) / 2, block_size = kv_cache.size(2);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, kv_cache.scalar_type(), "paged_decode_attention", [&] {
    auto run = [&](auto* queries, auto* outputs) {
      decode_kernel<scalar_t>(queries, q.stride(0), kv_cache.data_ptr<scalar_t>(), tables.data_ptr<int64_t>(),
                              lens.data_ptr<int64_t>(), outputs, out.stride(0), batch, heads, kv_heads, dim,
                              tables.size(1), block_size, static_cast<float>(scale), nullptr);
    };
    if constexpr (kSixteenBit<scalar_t>) {  // float32 queries over a bf16/float16 pool
      if (q.scalar_type() == torch::kFloat) return run(q.data_ptr<float>(), out.data_ptr<float>());
    }
    run(q.data_ptr<scalar_t>(), out.data_ptr<scalar_t>());
  });
}

// Prefill (or, causal false, full) attention of the query rows q ([batch * query_len, heads,
// dim], rows contiguous) over the pool through the tables, into out (T or float32 rows of
// heads * dim at out_stride); false, touching nothing, where there is no vector path.
template <typename T, typename O>
static bool prefill_into(O* out, int64_t out_stride, const torch::Tensor& q, const torch::Tensor& kv_cache,
                         const torch::Tensor& block_tables, const torch::Tensor& seq_lens, int64_t query_len,
                         float scale, bool causal, float* lse_out) {
#if defined(KVSERVE_FLOAT_PREFILL)
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

bool set_amx(bool enabled) {
#if defined(__AVX512BF16__)
  amx_on.store(enabled);
  return use_amx();
#else
  return false;
#endif
}
