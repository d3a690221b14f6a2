// Fused paged decode attention for CPU: reads each sequence's K/V straight from the block
// pool through its block table (no gathered copy), one query token per sequence, GQA,
// block-wise online softmax in float32. Parallel over (sequence, KV head).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <limits>
#include <vector>

template <typename T>
static void decode_kernel(const T* q, const T* kv, const int64_t* tables, const int64_t* lens, T* out,
                          int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim, int64_t width,
                          int64_t block_size, float scale) {
  const int64_t group = heads / kv_heads;
  const int64_t block_stride = 2 * kv_heads * block_size * dim;  // elements per block
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * dim), acc(group * dim), probs(group * block_size), row(dim), m(group), l(group);
    for (int64_t job = begin; job < end; ++job) {
      const int64_t b = job / kv_heads, h = job % kv_heads;
      const int64_t len = lens[b];
      for (int64_t g = 0; g < group; ++g) {
        const T* qrow = q + (b * heads + h * group + g) * dim;
        for (int64_t d = 0; d < dim; ++d) qf[g * dim + d] = static_cast<float>(qrow[d]) * scale;
        m[g] = -std::numeric_limits<float>::infinity();
        l[g] = 0.f;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      float* r = row.data();
      for (int64_t blk = 0; blk * block_size < len; ++blk) {
        const int64_t n = std::min(block_size, len - blk * block_size);
        const T* base = kv + tables[b * width + blk] * block_stride;
        const T* k = base + h * block_size * dim;
        const T* v = base + (kv_heads + h) * block_size * dim;
        // scores: each key row is converted once and dotted with every query head of the group
        for (int64_t t = 0; t < n; ++t) {
          const T* kt = k + t * dim;
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) r[d] = static_cast<float>(kt[d]);
          for (int64_t g = 0; g < group; ++g) {
            const float* qg = qf.data() + g * dim;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < dim; ++d) s += qg[d] * r[d];
            probs[g * block_size + t] = s;
          }
        }
        // block-wise online softmax: rescale the running sums once per block
        for (int64_t g = 0; g < group; ++g) {
          float* pg = probs.data() + g * block_size;
          float block_max = -std::numeric_limits<float>::infinity();
          for (int64_t t = 0; t < n; ++t) block_max = std::max(block_max, pg[t]);
          const float new_max = std::max(m[g], block_max);
          const float correction = std::exp(m[g] - new_max);
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t t = 0; t < n; ++t) {
            pg[t] = std::exp(pg[t] - new_max);
            sum += pg[t];
          }
          float* ag = acc.data() + g * dim;
          if (correction != 1.f) {
#pragma omp simd
            for (int64_t d = 0; d < dim; ++d) ag[d] *= correction;
          }
          l[g] = l[g] * correction + sum;
          m[g] = new_max;
        }
        // values: each value row is converted once and added into every query head's sum
        for (int64_t t = 0; t < n; ++t) {
          const T* vt = v + t * dim;
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) r[d] = static_cast<float>(vt[d]);
          for (int64_t g = 0; g < group; ++g) {
            const float p = probs[g * block_size + t];
            float* ag = acc.data() + g * dim;
#pragma omp simd
            for (int64_t d = 0; d < dim; ++d) ag[d] += p * r[d];
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        T* orow = out + (b * heads + h * group + g) * dim;
        const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
        for (int64_t d = 0; d < dim; ++d) orow[d] = static_cast<T>(acc[g * dim + d] * inv);
      }
    }
  });
}

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_tables,
                                     torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be a contiguous [batch, heads, dim] tensor");
  TORCH_CHECK(kv_cache.dim() == 4 && kv_cache.is_contiguous(), "kv_cache must be [blocks, 2*kv_heads, block, dim]");
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && seq_lens.scalar_type() == torch::kLong, "int64 tables");
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto out = torch::empty_like(q);
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = kv_cache.size(1) / 2, block_size = kv_cache.size(2);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    decode_kernel<scalar_t>(q.data_ptr<scalar_t>(), kv_cache.data_ptr<scalar_t>(), tables.data_ptr<int64_t>(),
                            lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), batch, heads, kv_heads, dim,
                            tables.size(1), block_size, static_cast<float>(scale));
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention over a paged KV cache: (q, kv_cache, block_tables, seq_lens, scale) -> out");
}
