// CPU ops for the paged KV cache.
// paged_decode_attention: reads each sequence's K/V straight from the block pool through its
// block table (no gathered copy), one query token per sequence, GQA, two-pass softmax in
// float32 (scores for the whole sequence, then values). Parallel over (sequence, KV head).
// rope_and_write_kv: rotary on the fused qkv in place, then each token's K/V into its slot.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <limits>
#include <vector>

template <typename T>
static void decode_kernel(const T* q, int64_t q_stride, const T* kv, const int64_t* tables, const int64_t* lens,
                          T* out, int64_t out_stride, int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
                          int64_t width, int64_t block_size, float scale) {
  const int64_t group = heads / kv_heads;
  const int64_t block_stride = 2 * kv_heads * block_size * dim;  // elements per block
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * dim), acc(group * dim), row(dim), probs;
    for (int64_t job = begin; job < end; ++job) {
      const int64_t b = job / kv_heads, h = job % kv_heads;
      const int64_t len = lens[b];
      if (static_cast<int64_t>(probs.size()) < group * len) probs.resize(group * len);
      for (int64_t g = 0; g < group; ++g) {
        const T* qrow = q + b * q_stride + (h * group + g) * dim;
        for (int64_t d = 0; d < dim; ++d) qf[g * dim + d] = static_cast<float>(qrow[d]) * scale;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      float* r = row.data();
      // pass 1: scores; each key row is converted once and dotted with every query head
      for (int64_t pos = 0; pos < len; ++pos) {
        const int64_t blk = pos / block_size, t = pos % block_size;
        const T* kt = kv + tables[b * width + blk] * block_stride + (h * block_size + t) * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) r[d] = static_cast<float>(kt[d]);
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf.data() + g * dim;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < dim; ++d) s += qg[d] * r[d];
          probs[g * len + pos] = s;
        }
      }
      // softmax over the whole sequence, in float32
      for (int64_t g = 0; g < group; ++g) {
        float* pg = probs.data() + g * len;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t pos = 0; pos < len; ++pos) mx = std::max(mx, pg[pos]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t pos = 0; pos < len; ++pos) {
          pg[pos] = std::exp(pg[pos] - mx);
          sum += pg[pos];
        }
        const float inv = 1.f / sum;
#pragma omp simd
        for (int64_t pos = 0; pos < len; ++pos) pg[pos] *= inv;
      }
      // pass 2: each value row is converted once and added into every query head's output
      for (int64_t pos = 0; pos < len; ++pos) {
        const int64_t blk = pos / block_size, t = pos % block_size;
        const T* vt = kv + tables[b * width + blk] * block_stride + ((kv_heads + h) * block_size + t) * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) r[d] = static_cast<float>(vt[d]);
        for (int64_t g = 0; g < group; ++g) {
          const float p = probs[g * len + pos];
          float* ag = acc.data() + g * dim;
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) ag[d] += p * r[d];
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        T* orow = out + b * out_stride + (h * group + g) * dim;
        for (int64_t d = 0; d < dim; ++d) orow[d] = static_cast<T>(acc[g * dim + d]);
      }
    }
  });
}

void paged_decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_tables,
                            torch::Tensor seq_lens, double scale) {
  // q, out: [batch, heads, dim] with contiguous rows (a batch stride of their own is allowed)
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "q must be [batch, heads, dim] rows");
  TORCH_CHECK(out.dim() == 3 && out.stride(2) == 1 && out.stride(1) == out.size(2), "out must be like q");
  TORCH_CHECK(kv_cache.dim() == 4 && kv_cache.is_contiguous(), "kv_cache must be [blocks, 2*kv_heads, block, dim]");
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && seq_lens.scalar_type() == torch::kLong, "int64 tables");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type() && out.scalar_type() == q.scalar_type(), "one dtype");
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = kv_cache.size(1) / 2, block_size = kv_cache.size(2);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    decode_kernel<scalar_t>(q.data_ptr<scalar_t>(), q.stride(0), kv_cache.data_ptr<scalar_t>(),
                            tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(),
                            out.stride(0), batch, heads, kv_heads, dim, tables.size(1), block_size,
                            static_cast<float>(scale));
  });
}

template <typename T>
static void rope_write_kernel(T* qkv, const float* cos, const float* sin, T* kv, const int64_t* slots,
                              int64_t tokens, int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size) {
  const int64_t half = dim / 2, row = (heads + 2 * kv_heads) * dim;
  at::parallel_for(0, tokens, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> x(dim);
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos + t * dim;
      const float* s = sin + t * dim;  // first half negated: rotate_half's sign folded in
      for (int64_t hd = 0; hd < heads + kv_heads; ++hd) {
        T* p = qkv + t * row + hd * dim;
        for (int64_t d = 0; d < dim; ++d) x[d] = static_cast<float>(p[d]);
        for (int64_t d = 0; d < half; ++d) p[d] = static_cast<T>(x[d] * c[d] + x[d + half] * s[d]);
        for (int64_t d = half; d < dim; ++d) p[d] = static_cast<T>(x[d] * c[d] + x[d - half] * s[d]);
      }
      const int64_t slot = slots[t], block = slot / block_size, offset = slot % block_size;
      for (int64_t j = 0; j < 2 * kv_heads; ++j) {  // K heads then V heads, as in the block layout
        const T* src = qkv + t * row + (heads + j) * dim;
        T* dst = kv + ((block * 2 * kv_heads + j) * block_size + offset) * dim;
        std::copy(src, src + dim, dst);
      }
    }
  });
}

void rope_and_write_kv(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor kv_cache,
                       torch::Tensor slot_mapping, int64_t heads) {
  // qkv [tokens, heads + 2*kv_heads, dim] contiguous: rotary applied in place to the query and
  // key heads, then the token's K and V heads are copied into its slot of the pool.
  TORCH_CHECK(qkv.dim() == 3 && qkv.is_contiguous(), "qkv must be contiguous [tokens, heads, dim]");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat && sin.scalar_type() == torch::kFloat, "float32 cos/sin");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous(), "contiguous cos/sin");
  TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.scalar_type() == qkv.scalar_type(), "pool dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kLong, "int64 slots");
  auto slots = slot_mapping.contiguous();
  const int64_t kv_heads = kv_cache.size(1) / 2;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_and_write_kv", [&] {
    rope_write_kernel<scalar_t>(qkv.data_ptr<scalar_t>(), cos.data_ptr<float>(), sin.data_ptr<float>(),
                                kv_cache.data_ptr<scalar_t>(), slots.data_ptr<int64_t>(), qkv.size(0), heads,
                                kv_heads, qkv.size(2), kv_cache.size(2));
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rope_and_write_kv", &rope_and_write_kv,
        "rotary on the query/key heads of qkv in place, then K/V into the pool: (qkv, cos, sin, kv_cache, slots, heads)");
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention over a paged KV cache, written into out: (out, q, kv_cache, block_tables, seq_lens, scale)");
}
