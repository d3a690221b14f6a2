// The decoder's elementwise steps and int8 linear layers.
// add_rms_norm / silu_and_mul: residual add + RMSNorm and SwiGLU's gate, one pass each instead
// of several torch ops (each a dispatch and a trip through memory), float32 inside.
// int8_linear (+ int8_gemm_pack): a W8A8 linear layer in one call, on the VNNI int8 GEMM (avx512
// and amx builds; the amx build's AMX tiles from 8 rows) or the 16-bit pairs one (avx2, portable);
// bf16_linear (+ bf16_gemm_pack): the same for bf16 weights (AVX512-BF16 dot products, AMX tiles).
// quantize_rows_int8 / scale_rows_: the two ends of an int8 layer where oneDNN does the GEMM.
#include <omp.h>
#if defined(__x86_64__)
#include <immintrin.h>  // the pairs kernel's SSE2 at the portable level
#endif

#include "amx.h"
#include "common.h"
#include "ops.h"

// res += delta for one row, stored rounded to T; x = the row as stored (normalized as torch would
// normalize it), d scratch.
template <typename T>
static inline void add_to_residual(T* res, const T* delta, float* x, float* d, int64_t n) {
  to_float(res, x, n);
  to_float(delta, d, n);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) x[i] += d[i];
  from_float(x, res, n);
  to_float(res, x, n);
}

template <typename T>
static void add_rms_norm_kernel(T* residual, const T* delta, const T* weight, T* out, int64_t tokens, int64_t hidden,
                                float eps) {
  at::parallel_for(0, tokens, row_grain(hidden), [&](int64_t begin, int64_t end) {
    std::vector<float> x(hidden), d(hidden), w(hidden);
    to_float(weight, w.data(), hidden);
    for (int64_t t = begin; t < end; ++t) {
      T* res = residual + t * hidden;
      if (delta != nullptr) add_to_residual(res, delta + t * hidden, x.data(), d.data(), hidden);
      else to_float(res, x.data(), hidden);
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

#if defined(__AVX512F__)
// silu(gate) * up for 16 lanes. exp16, not std::exp: GCC called the scalar expf per element (0.6
// ns each on 2 threads at 2,048 x 1,536, a prefill chunk: 1.9 ms, more than a tenth of the GEMM
// before it). e^-gate capped at e^80: 1 / (1 + inf) is NaN under -ffast-math's reciprocal.
static inline __m512 silu_mul16(__m512 gate, __m512 up) {
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 e = exp16(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), gate), _mm512_set1_ps(80.f)));
  return _mm512_mul_ps(_mm512_mul_ps(gate, _mm512_div_ps(one, _mm512_add_ps(one, e))), up);
}
#endif

// g[i] = silu(g[i]) * u[i] for i < n, in float32.
static inline void silu_mul_rows(float* g, const float* u, int64_t n) {
#if defined(__AVX512F__)
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    _mm512_mask_storeu_ps(g + i, m, silu_mul16(_mm512_maskz_loadu_ps(m, g + i), _mm512_maskz_loadu_ps(m, u + i)));
  }
#else
  // the same cap as above: without AVX-512 (measured on a Zen 3) gate = -100 gave NaN
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) g[i] = g[i] / (1.f + std::exp(std::min(-g[i], 80.f))) * u[i];
#endif
}

template <typename T>
static void silu_and_mul_kernel(const T* gate_up, T* out, int64_t tokens, int64_t inter) {
  at::parallel_for(0, tokens, row_grain(2 * inter), [&](int64_t begin, int64_t end) {
    std::vector<float> g(inter), u(inter);
    for (int64_t t = begin; t < end; ++t) {
      to_float(gate_up + t * 2 * inter, g.data(), inter);
      to_float(gate_up + t * 2 * inter + inter, u.data(), inter);
      silu_mul_rows(g.data(), u.data(), inter);
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

// Greedy sampling's argmax of each row of float32 logits: the first index of the row's maximum
// (torch's tie rule; NaNs are not looked for). torch's argmax took 1.3 ms over 32 x 49,152 here.
torch::Tensor argmax_rows(torch::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && logits.size(1) > 0 &&
              logits.scalar_type() == at::kFloat, "logits must be float32 [rows, n > 0], rows contiguous");
  const int64_t rows = logits.size(0), n = logits.size(1), stride = logits.stride(0);
  auto out = torch::empty({rows}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* best_index = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = x + r * stride;
      int64_t i = 0, index = 0;
      float top = row[0];
#if defined(__AVX512F__)
      if (n >= 16) {  // per lane: its maximum and where it first was; then the lanes merged
        __m512 lane_top = _mm512_loadu_ps(row);
        __m512i lane_index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        __m512i position = lane_index;
        const __m512i step = _mm512_set1_epi32(16);
        for (i = 16; i + 16 <= n; i += 16) {
          position = _mm512_add_epi32(position, step);
          const __m512 v = _mm512_loadu_ps(row + i);
          const __mmask16 higher = _mm512_cmp_ps_mask(v, lane_top, _CMP_GT_OQ);
          lane_top = _mm512_mask_mov_ps(lane_top, higher, v);
          lane_index = _mm512_mask_mov_epi32(lane_index, higher, position);
        }
        top = _mm512_reduce_max_ps(lane_top);
        const __mmask16 at_top = _mm512_cmp_ps_mask(lane_top, _mm512_set1_ps(top), _CMP_EQ_OQ);
        index = _mm512_mask_reduce_min_epi32(at_top, lane_index);
      }
#endif
      for (; i < n; ++i)
        if (row[i] > top) top = row[i], index = i;
      best_index[r] = index;
    }
  });
  return out;
}

// ---------------------------------------------------------------------------------------------
// int8 linear layers (W8A8, kvserve.model.int8_linear): activations are quantized per row
// (token) here; with kvserve's int8 GEMM (VNNI in the avx512 build, 16-bit pairs in the avx2 and
// portable ones) the whole layer is int8_linear below (quantize, int8 GEMM, rescale in one
// call); in the amx build the codes go to oneDNN (which applies the output channels' scales) and
// the products are scaled back here by each row's scale.

#if defined(__AVX512F__)
// One Walsh-Hadamard butterfly stage inside a 16-lane vector: lanes i and i ^ S become
// (a + b, a - b), a the lane without bit S: x * sign + partner, sign -1 on the lanes with bit S.
// The partners by in-lane shuffles (S 1, 2) and 128-bit lane shuffles (S 4, 8), not a full
// permute: one shuffle and one FMA a stage.
template <int S>
static inline __m512 hadamard_lanes(__m512 x) {
  __m512 partner;
  if constexpr (S == 1) partner = _mm512_permute_ps(x, 0xB1);
  else if constexpr (S == 2) partner = _mm512_permute_ps(x, 0x4E);
  else if constexpr (S == 4) partner = _mm512_shuffle_f32x4(x, x, 0xB1);
  else partner = _mm512_shuffle_f32x4(x, x, 0x4E);
  constexpr int high = S == 1 ? 0xAAAA : S == 2 ? 0xCCCC : S == 4 ? 0xF0F0 : 0xFF00;
  const __m512 sign = _mm512_mask_blend_ps(static_cast<__mmask16>(high), _mm512_set1_ps(1.f), _mm512_set1_ps(-1.f));
  return _mm512_fmadd_ps(x, sign, partner);
}

// x times the 16 x 16 +-1 Walsh-Hadamard matrix (Sylvester's order): the strides 1-8 of a block.
static inline __m512 hadamard16(__m512 x) {
  return hadamard_lanes<8>(hadamard_lanes<4>(hadamard_lanes<2>(hadamard_lanes<1>(x))));
}
#endif

// f [cols] times the block-diagonal +-1 Walsh-Hadamard matrix of ``block`` (a power of two
// dividing cols; Sylvester's order, as kvserve.model.rotation.hadamard_block): a butterfly
// (a, b) -> (a + b, a - b) at every stride below the block. 1: nothing to do.
static void hadamard_blocks(float* f, int64_t cols, int64_t block) {
  int64_t stride = 1;
#if defined(__AVX512F__)
  if (block >= 16) {  // strides 1-8 inside each vector
    for (int64_t i = 0; i < cols; i += 16) _mm512_storeu_ps(f + i, hadamard16(_mm512_loadu_ps(f + i)));
    stride = 16;
  }
#endif
  for (; stride < block; stride *= 2)
    for (int64_t start = 0; start < cols; start += 2 * stride)
#pragma omp simd
      for (int64_t j = start; j < start + stride; ++j) {
        const float a = f[j], b = f[j + stride];
        f[j] = a + b;
        f[j + stride] = a - b;
      }
}

#if defined(__AVX512F__)
// One pass of row_to_float for blocks of V vectors (16 V floats, cols a multiple): each block is
// loaded, widened, turned in registers when kTurn (strides 1-8 inside each vector, then 16 and up
// between vectors) and stored, with the running max |value|. One pass for the conversion, one
// per stride and one for the max had cost 14.0 us against 9.7 now (a 32 x 1,536 bf16 down
// projection's rows into a 16-channel layer, block 128; 800 against 529 us at 2,048 rows).
template <int V, bool kTurn, typename T>
static float row_to_float_blocks(const T* x, float* f, int64_t cols) {
  __m512 top = _mm512_setzero_ps();
  for (int64_t i = 0; i < cols; i += 16 * V) {
    __m512 v[V];
#pragma GCC unroll 8
    for (int j = 0; j < V; ++j) {
      v[j] = load16(x + i + 16 * j);
      if constexpr (kTurn) v[j] = hadamard16(v[j]);
    }
    if constexpr (kTurn) {
#pragma GCC unroll 4
      for (int s = 1; s < V; s *= 2)
#pragma GCC unroll 8
        for (int j = 0; j < V; ++j)
          if ((j & s) == 0) {
            const __m512 a = v[j], b = v[j + s];
            v[j] = _mm512_add_ps(a, b);
            v[j + s] = _mm512_sub_ps(a, b);
          }
    }
#pragma GCC unroll 8
    for (int j = 0; j < V; ++j) {
      _mm512_storeu_ps(f + i + 16 * j, v[j]);
      top = _mm512_max_ps(top, _mm512_abs_ps(v[j]));
    }
  }
  return _mm512_reduce_max_ps(top);
}
#endif

// f = x's row as float32, turned by hadamard_blocks(., rotate_block) when rotate_block > 1;
// returns max |f|.
template <typename T>
static float row_to_float(const T* x, float* f, int64_t cols, int64_t rotate_block) {
#if defined(__AVX512F__)
  if constexpr (!std::is_same_v<T, double>) {
    if (cols % 16 == 0) switch (rotate_block) {  // 16-128: the blocks rotation.hadamard_block picks
        case 1: return row_to_float_blocks<1, false>(x, f, cols);
        case 16: return row_to_float_blocks<1, true>(x, f, cols);
        case 32: return row_to_float_blocks<2, true>(x, f, cols);
        case 64: return row_to_float_blocks<4, true>(x, f, cols);
        case 128: return row_to_float_blocks<8, true>(x, f, cols);
        default: break;
      }
  }
#endif
  to_float(x, f, cols);
  if (rotate_block > 1) hadamard_blocks(f, cols, rotate_block);
  float amax = 0.f;
#pragma omp simd reduction(max : amax)
  for (int64_t i = 0; i < cols; ++i) amax = std::max(amax, std::fabs(f[i]));
  return amax;
}

// row = the int8 codes of f [cols], round(f / s) with s = amax / 127 (amax = max |f|; s = 1 for an
// all-zero row); returns s. ``flip`` 0x80: codes + 128 as uint8 (oneDNN's u8 activations, zero
// point 128, and the VNNI kernel's), 0: int8.
static float store_row_codes(const float* f, float amax, uint8_t* row, int64_t cols, int flip) {
  const float scale = amax > 0.f ? amax / 127.f : 1.f, inv = 1.f / scale;
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 vinv = _mm512_set1_ps(inv);
  const __m128i vflip = _mm_set1_epi8(static_cast<char>(flip));
  for (; i + 16 <= cols; i += 16) {  // round to nearest even, saturate to int8
    const __m128i q = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(f + i), vinv)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(row + i), _mm_xor_si128(q, vflip));
  }
#elif defined(__AVX2__)
  const __m256 vinv = _mm256_set1_ps(inv);
  const __m128i vflip = _mm_set1_epi8(static_cast<char>(flip));
  for (; i + 8 <= cols; i += 8) {  // round to nearest even; |code| <= 127, so the packs never saturate
    const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(f + i), vinv));
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(row + i), _mm_xor_si128(_mm_packs_epi16(w, w), vflip));
  }
#endif
  for (; i < cols; ++i)
    row[i] = static_cast<uint8_t>(static_cast<int8_t>(std::nearbyint(f[i] * inv))) ^ static_cast<uint8_t>(flip);
  return scale;
}

// Rows [begin, end) of x quantized per row: codes [rows, cols] and scales [rows] (store_row_codes).
// ``offset``: codes + 128 as uint8, else int8. ``rotate_block`` > 1: each row is first turned by
// hadamard_blocks (an int8 layer's rotated input).
template <typename T>
static void quantize_row_range(const T* x, uint8_t* codes, float* scales, int64_t begin, int64_t end, int64_t cols,
                               bool offset, int64_t rotate_block = 1) {
  const int flip = offset ? 0x80 : 0;  // two's complement + 128 = the sign bit flipped
  std::vector<float> f(cols);
  for (int64_t r = begin; r < end; ++r) {
    const float amax = row_to_float(x + r * cols, f.data(), cols, rotate_block);
    scales[r] = store_row_codes(f.data(), amax, codes + r * cols, cols, flip);
  }
}

// An int8 layer's rows taken from the residual stream (int8_linear_after_norm): residual += delta
// (when given; stored rounded to T, as add_rms_norm stores it), then the codes (+ 128) of the
// row's RMS norm with unit weight. The norm only scales a row, so the codes are the residual's
// own and 1 / rms(row) goes into the row's scale.
template <typename T>
static void add_norm_quantize_row_range(T* residual, const T* delta, uint8_t* codes, float* scales, int64_t begin,
                                        int64_t end, int64_t cols, float eps, bool offset) {
  std::vector<float> f(cols), d(cols);
  for (int64_t r = begin; r < end; ++r) {
    T* res = residual + r * cols;
    if (delta != nullptr) add_to_residual(res, delta + r * cols, f.data(), d.data(), cols);
    else to_float(res, f.data(), cols);
    float amax = 0.f, sum = 0.f;
#pragma omp simd reduction(max : amax) reduction(+ : sum)
    for (int64_t i = 0; i < cols; ++i) {
      amax = std::max(amax, std::fabs(f[i]));
      sum += f[i] * f[i];
    }
    scales[r] = store_row_codes(f.data(), amax, codes + r * cols, cols, offset ? 0x80 : 0) /
                std::sqrt(sum / static_cast<float>(cols) + eps);
  }
}

template <typename T>
static void quantize_rows_kernel(const T* x, uint8_t* codes, float* scales, int64_t rows, int64_t cols, bool offset) {
  at::parallel_for(0, rows, row_grain(cols), [&](int64_t begin, int64_t end) {
    quantize_row_range(x, codes, scales, begin, end, cols, offset);
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

#if defined(__AVX512F__)
// The cache lines of the next panel that one tile prefetches: a panel's groups are contiguous, so
// its lines are one run of 64-byte lines; each tile of a panel takes an equal share, so the
// weights stream from memory at an even rate over the whole panel (a burst at its first tile
// left the other tiles' time without memory traffic).
struct PrefetchShare {
  const char* begin;  // [begin, end): this tile's lines of the next panel; begin == end: none
  const char* end;
};

// One tile's sums: MR rows of x against NR packed groups of 16 output channels, each k step a
// 32-bit broadcast of a row's next kPerWord inputs times the groups' 64-byte weight vectors, by
// dot (the dot-product instruction); meanwhile the share's lines are prefetched, a line or a few
// per k step. Into L1 (T0): on the Zen 5, 30 cold layers at 32 rows took 0.87-0.90x the time
// they took with the lines prefetched into L2 (T1). Written with pointers stepping through k:
// GCC keeps every accumulator in a register, where an older form with the prefetch bookkeeping
// inside the loop spilled one each step (0.96-0.98x the time).
template <int MR, int NR, int kPerWord, typename Acc, typename X, typename W, typename Dot>
__attribute__((always_inline)) static inline void tile_sums(const X* x, int64_t k, const W* w,
                                                             const PrefetchShare& share, Acc (&acc)[MR][NR],
                                                             const Dot& dot) {
  const int64_t stride = k * 16;  // elements per packed group
  const int64_t steps = k / kPerWord;
  const char* line = share.begin;
  const char* const last = share.end;
  const int64_t per_step = steps > 0 ? ((last - line) / 64 + steps - 1) / steps : 0;
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) acc[i][j] = Acc{};
  const X* xs = x;
  const W* ws = w;
  for (int64_t step = 0; step < steps; ++step, xs += kPerWord, ws += kPerWord * 16) {
    for (int64_t p = 0; p < per_step && line < last; ++p, line += 64) _mm_prefetch(line, _MM_HINT_T0);
    __m512i b[NR];
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) b[j] = _mm512_loadu_si512(ws + j * stride);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      int32_t word;
      std::memcpy(&word, xs + i * k, 4);
      const __m512i xi = _mm512_set1_epi32(word);
#pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) acc[i][j] = dot(acc[i][j], xi, b[j]);
    }
  }
}

// A tile's outputs: value(i, j) is row i's 16 float32 results of group j, rounded into out.
template <int MR, int NR, typename T, typename Value>
__attribute__((always_inline)) static inline void store_tile(T* out, int64_t n, int64_t row, int64_t group,
                                                              const Value& value) {
  const int64_t col = group * 16, cols = std::min<int64_t>(NR * 16, n - col);
  float result[NR * 16];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) _mm512_storeu_ps(result + 16 * j, value(i, j));
    from_float(result, out + (row + i) * n + col, cols);
  }
}

// A gated layer's tile (SwiGLU's gate and up projections in one, kvserve.model.llama.fuse_swiglu):
// its groups come in (gate, up) pairs, so NR is even and out has n / 2 columns; each pair j gives
// 16 outputs silu(gate) * up, from the float32 sums (no rounding between the two, no second op).
template <int MR, int NR, typename T, typename Value>
__attribute__((always_inline)) static inline void store_gated_tile(T* out, int64_t n, int64_t row, int64_t group,
                                                                    const Value& value) {
  static_assert(NR % 2 == 0, "a gated tile holds whole (gate, up) pairs");
  const int64_t half = n / 2, col = group / 2 * 16, cols = std::min<int64_t>(NR / 2 * 16, half - col);
  float result[NR / 2 * 16];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
    for (int j = 0; j < NR / 2; ++j) _mm512_storeu_ps(result + 16 * j, silu_mul16(value(i, 2 * j), value(i, 2 * j + 1)));
    from_float(result, out + (row + i) * half + col, cols);
  }
}

// A tile's outputs, plain or gated (``gated`` is only ever set with even NR: see packed_gemm).
template <int MR, int NR, typename T, typename Value>
__attribute__((always_inline)) static inline void store_any_tile(T* out, int64_t n, int64_t row, int64_t group,
                                                                  bool gated, const Value& value) {
  if constexpr (NR % 2 == 0) {
    if (gated) return store_gated_tile<MR, NR>(out, n, row, group, value);
  }
  store_tile<MR, NR>(out, n, row, group, value);
}
#endif

// The int8 GEMM of those layers where the CPU has AVX512-VNNI (the pairs kernel below on AVX2): vpdpbusd
// multiplies 4 unsigned activation bytes (code + 128) by 4 signed weight bytes per 32-bit lane,
// so the weight is packed as [groups of 16 output channels][k / 4][16][4] bytes (one 64-byte
// load = 16 channels x 4 k) and 128 * sum_k w[n][k] is subtracted per channel at the end. A
// tile keeps MR rows x NR groups of int32 sums in registers (24 of the 32), reading each weight
// vector once per MR rows; a thread owns consecutive groups, and while the tiles of a panel
// run they prefetch the next panel into L1 (the weights stream from memory once per step at
// decode sizes). Measured at batch 32 on 30 layers of SmolLM2's shapes (EPYC, 2 threads,
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
  bool gated;              // (gate, up) group pairs -> silu(gate) * up, out [m, n / 2]
};

struct Int8Tile {
  using Args = Int8GemmArgs;
  using Sum = int32_t;
  static constexpr int kPerWord = 4;
  static const void* group_start(const Args& a, int64_t group) { return a.packed + group * a.k * 16; }
  // row's 16 results at channels [c, c + 16) from their int32 sums
  static __m512 result(const Args& a, __m512i sums, int64_t row, int64_t c) {
    const __m512 exact = _mm512_cvtepi32_ps(_mm512_sub_epi32(sums, _mm512_loadu_si512(a.comp + c)));
    const __m512 v = _mm512_mul_ps(exact, _mm512_mul_ps(_mm512_loadu_ps(a.w_scales + c), _mm512_set1_ps(a.x_scales[row])));
    return a.bias != nullptr ? _mm512_add_ps(v, _mm512_loadu_ps(a.bias + c)) : v;
  }
  template <int MR, int NR, typename T>
  static void run(const Args& a, int64_t row, int64_t group, T* out, const PrefetchShare& prefetch) {
    __m512i acc[MR][NR];
    tile_sums<MR, NR, 4>(a.x + row * a.k, a.k, a.packed + group * a.k * 16, prefetch, acc,
                         [](__m512i sum, __m512i x, __m512i w) { return dpbusd(sum, x, w); });
    store_any_tile<MR, NR>(out, a.n, row, group, a.gated,
                           [&](int i, int j) { return result(a, acc[i][j], row + i, group * 16 + 16 * j); });
  }
};
#endif

#if defined(__AVX512F__)
// Rows [0, m) against groups [group, group + NR) of 16 output channels: MR-row tiles, then the
// remaining rows; the tiles share the prefetch of the next panel's ``next_lines`` lines.
template <typename Tile, int NR, typename T>
static void gemm_panel(const typename Tile::Args& a, int64_t group, T* out, const void* next, int64_t next_lines) {
  constexpr int MR = NR == 4 ? 6 : 8;  // MR * NR accumulators + NR weight vectors + 1 broadcast <= 32
  const int64_t tiles = (a.m + MR - 1) / MR;
  int64_t row = 0, tile = 0;
  const char* base = static_cast<const char*>(next);  // nullptr with next_lines 0: an empty share
  const auto share = [&]() {
    return PrefetchShare{base + 64 * (next_lines * tile / tiles), base + 64 * (next_lines * (tile + 1) / tiles)};
  };
  for (; row + MR <= a.m; row += MR, ++tile) Tile::template run<MR, NR>(a, row, group, out, share());
  switch (a.m - row) {
#define KVSERVE_GEMM_TAIL(R) \
  case R: Tile::template run<R, NR>(a, row, group, out, share()); break;
    KVSERVE_GEMM_TAIL(1) KVSERVE_GEMM_TAIL(2) KVSERVE_GEMM_TAIL(3) KVSERVE_GEMM_TAIL(4) KVSERVE_GEMM_TAIL(5)
    KVSERVE_GEMM_TAIL(6) KVSERVE_GEMM_TAIL(7)
#undef KVSERVE_GEMM_TAIL
    default: break;
  }
}

// A GEMM over weights packed by groups of 16 output channels (parallel_gemm): each thread goes
// through its groups in panels of up to 4.
// Groups in the panel that starts at group g of a thread's range [.., end): up to 4 (0 past the
// end); even wherever the range's length is (a gated layer's).
static inline int64_t panel_groups(int64_t g, int64_t end) { return std::clamp<int64_t>(end - g, 0, 4); }

template <typename Tile, typename T, typename Prologue>
static void packed_gemm(const typename Tile::Args& a, T* out, const Prologue& prologue) {
  parallel_gemm(a.m, (a.n + 15) / 16, a.gated, prologue, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end;) {
      const int64_t nr = panel_groups(g, end);
      const void* next = g + nr < end ? Tile::group_start(a, g + nr) : nullptr;
      const int64_t next_lines = panel_groups(g + nr, end) * (a.k / Tile::kPerWord);
      switch (nr) {
        case 4: gemm_panel<Tile, 4>(a, g, out, next, next_lines); break;
        case 3: gemm_panel<Tile, 3>(a, g, out, next, next_lines); break;
        case 2: gemm_panel<Tile, 2>(a, g, out, next, next_lines); break;
        default: gemm_panel<Tile, 1>(a, g, out, next, next_lines); break;
      }
      g += nr;
    }
  });
}
#endif

#if defined(__AVX512BF16__)
// The bf16 GEMM of decode-sized batches (oneDNN's brgemm measured 230-340 GFLOP/s at 16-64 rows
// on this model's shapes against ~400 at 2,048): vdpbf16ps multiplies 2 activation values
// (one broadcast 32-bit pair) by 2 weights per output lane, so the weight is packed as [groups of
// 16 output channels][k / 2][16][2] (one 64-byte load = 16 channels x 2 k), float32 sums in
// registers, rounded once to bf16.
static inline __m512 dpbf16(__m512 acc, __m512i a, __m512i b) {
  asm("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));  // in place (see dpbusd)
  return acc;
}

struct Bf16GemmArgs {
  const uint16_t* x;       // [m, k] bf16
  const uint16_t* packed;  // [groups, k / 2, 16, 2] bf16
  const float* bias;       // [groups * 16] or nullptr
  int64_t m, k, n;
  bool gated;              // as Int8GemmArgs'
};

struct Bf16Tile {
  using Args = Bf16GemmArgs;
  using Sum = float;
  static constexpr int kPerWord = 2;
  static const void* group_start(const Args& a, int64_t group) { return a.packed + group * a.k * 16; }
  static __m512 result(const Args& a, __m512 sums, int64_t, int64_t c) {
    return a.bias != nullptr ? _mm512_add_ps(sums, _mm512_loadu_ps(a.bias + c)) : sums;
  }
  template <int MR, int NR, typename T>
  static void run(const Args& a, int64_t row, int64_t group, T* out, const PrefetchShare& prefetch) {
    __m512 acc[MR][NR];
    tile_sums<MR, NR, 2>(a.x + row * a.k, a.k, a.packed + group * a.k * 16, prefetch,
                         acc, [](__m512 sum, __m512i x, __m512i w) { return dpbf16(sum, x, w); });
    store_any_tile<MR, NR>(out, a.n, row, group, a.gated,
                           [&](int i, int j) { return result(a, acc[i][j], row + i, group * 16 + 16 * j); });
  }
};
#endif

#if defined(KVSERVE_AMX)
// The GEMMs of prefill-sized batches in the amx build: AMX tiles on the vector kernels' packed
// weights, so one copy of a weight serves both. A packed group's k step of 16 rows x 64 bytes
// ([k / 4][16][4] int8: 16 k quads; [k / 2][16][2] bf16: 16 k pairs) lies as a B tile, 1 KiB
// contiguous; the activations' rows (u8 codes + 128 or bf16, 64 bytes of k a step) are the A tiles.
// A thread's groups go by in blocks of up to 1 MiB of weights (read from memory once, kept in L2);
// each block of 32 rows (in L1) passes a block's groups in pairs (2 x 2 tiles of sums; the B tiles
// are contiguous, so they stream from L2 at the prefetchers' pace: groups outer and rows inner
// took 1.3x the time of a 2,048 x 576 -> 3,072 bf16 layer). The sums go through a buffer into the
// vector kernels' epilogue (Tile::result: scales, bias; then the gated SwiGLU; rounding). At 2,048
// rows (30 cold layers) the int8 layers took 0.84x oneDNN's time and the bf16 ones 1.26x, at 256
// rows 0.80x and 0.88x (benchmarks/linear_gemm.py); two buffers of sums, to overlap each block's
// epilogue with the next block's tiles, measured no faster.
// Rows from which the tiles beat the vector kernels (30 layers of SmolLM2's shapes, weights cold, 2
// threads of a Sapphire Rapids Xeon: bf16 on par at 1 row and ahead from 2, 1.3-3x at 8-48; int8
// ahead from 8, 1.2-1.3x at 8-32); below them the weight streams once per step either way.
constexpr int64_t kAmxMinRowsBf16 = 2, kAmxMinRowsInt8 = 8;
constexpr int64_t kAmxBlockBytes = 1 << 20;

template <TileDot D, int MT, int NG, typename Sum>
static inline void amx_sums(const char* a, int64_t a_stride, const char* b, int64_t group_bytes, int64_t steps,
                            Sum (*sums)[32]) {
  _tile_zero(0);
  if constexpr (NG == 2) _tile_zero(1);
  if constexpr (MT == 2) _tile_zero(2);
  if constexpr (MT == 2 && NG == 2) _tile_zero(3);
  for (int64_t s = 0; s < steps; ++s)
    tile_product<D, MT, NG>(a + 64 * s, a + 16 * a_stride + 64 * s, a_stride, b + 1024 * s, b + group_bytes + 1024 * s,
                            64);
  _tile_stored(0, sums[0], 128);
  if constexpr (NG == 2) _tile_stored(1, sums[0] + 16, 128);
  if constexpr (MT == 2) _tile_stored(2, sums[16], 128);
  if constexpr (MT == 2 && NG == 2) _tile_stored(3, sums[16] + 16, 128);
}

// Groups [begin, end) of a.n's (whole (gate, up) pairs when gated) for rows [0, a.m) of x_rows
// (a_stride bytes each; readable up to a.m rounded up to 16: the rows past a.m are computed, never
// stored), into out.
template <typename Tile, TileDot D, typename T>
static void amx_gemm(const typename Tile::Args& a, const void* x_rows, int64_t a_stride, int64_t begin, int64_t end,
                     T* out) {
  using Sum = typename Tile::Sum;
  const char* x = static_cast<const char*>(x_rows);
  const char* packed = static_cast<const char*>(Tile::group_start(a, 0));
  const int64_t group_bytes = a_stride * 16, steps = a_stride / 64;
  alignas(64) Sum sums[32][32];
  // groups in blocks of up to kAmxBlockBytes of weights (whole pairs)
  const int64_t block_groups = std::max<int64_t>(2, kAmxBlockBytes / group_bytes / 2 * 2);
  configure_tiles();
  for (int64_t block = begin; block < end; block += block_groups) {
    const int64_t block_end = std::min(end, block + block_groups);
    for (int64_t row = 0; row < a.m; row += 32) {
      const char* rows = x + row * a_stride;
      const bool two = row + 16 < a.m;
      for (int64_t g = block; g < block_end; g += 2) {
        const bool pair = g + 1 < block_end;
        const char* b = packed + g * group_bytes;
        memory_fence_for_tiles();
        if (two && pair) amx_sums<D, 2, 2>(rows, a_stride, b, group_bytes, steps, sums);
        else if (two) amx_sums<D, 2, 1>(rows, a_stride, b, group_bytes, steps, sums);
        else if (pair) amx_sums<D, 1, 2>(rows, a_stride, b, group_bytes, steps, sums);
        else amx_sums<D, 1, 1>(rows, a_stride, b, group_bytes, steps, sums);
        memory_fence_for_tiles();
        for (int64_t i = 0; i < std::min<int64_t>(32, a.m - row); ++i) {
          const auto value = [&](int, int j) {
            if constexpr (std::is_same_v<Sum, float>) return Tile::result(a, _mm512_load_ps(sums[i] + 16 * j), row + i, g * 16 + 16 * j);
            else return Tile::result(a, _mm512_load_si512(sums[i] + 16 * j), row + i, g * 16 + 16 * j);
          };
          // (gated: block_groups and the thread's range are whole pairs)
          if (pair) store_any_tile<1, 2>(out, a.n, row + i, g, a.gated, value);
          else store_any_tile<1, 1>(out, a.n, row + i, g, a.gated, value);
        }
      }
    }
  }
  _tile_release();
}

// Whether a layer of m rows and k_bytes of input per row runs on the tiles.
static inline bool amx_gemm_fits(int64_t m, int64_t min_rows, int64_t k_bytes) {
  return m >= min_rows && k_bytes % 64 == 0 && use_amx();
}
#endif

std::vector<torch::Tensor> bf16_gemm_pack(torch::Tensor w) {
  // w bf16 [n, k] -> packed bf16 [groups, k / 2, 16, 2] for bf16_linear, channels past n zero; empty
  // where this build has no AVX512-BF16 or k is odd
#if defined(__AVX512BF16__)
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kBFloat16, "w: bf16 [n, k]");
  const int64_t n = w.size(0), k = w.size(1), groups = (n + 15) / 16;
  if (k % 2 != 0) return {};
  auto padded = torch::zeros({groups * 16, k}, w.options());
  padded.narrow(0, 0, n).copy_(w);
  // [groups, 16, k/2, 2] -> [groups, k/2, 16, 2]
  return {padded.view({groups, 16, k / 2, 2}).permute({0, 2, 1, 3}).contiguous()};
#else
  (void)w;
  return {};
#endif
}

// A gated layer's out_features: whole (gate, up) pairs of 16-channel groups (see store_gated_tile).
[[maybe_unused]] static int64_t output_columns(int64_t out_features, bool gated) {
  TORCH_CHECK(!gated || out_features % 32 == 0, "a gated layer needs out_features = 2 x a multiple of 16, got ",
              out_features);
  return gated ? out_features / 2 : out_features;
}

torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor packed, int64_t out_features,
                          c10::optional<torch::Tensor> bias, bool gated) {
  // x bf16 [m, k] contiguous -> x @ W.T (+ bias) [m, out_features] bf16, W from bf16_gemm_pack; bias
  // float32, padded to the groups (prepared once at load); gated: W's groups of 16 channels
  // alternate gate and up, and the result is silu(gate) * up [m, out_features / 2]
#if defined(__AVX512BF16__)
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kBFloat16, "x: contiguous bf16 [m, k]");
  const int64_t m = x.size(0), k = x.size(1), groups = (out_features + 15) / 16;
  TORCH_CHECK(packed.dim() == 4 && packed.size(0) == groups && packed.size(1) * 2 == k && packed.is_contiguous(),
              "packed weight does not match x / out_features");
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->is_contiguous() && bias->numel() == groups * 16,
                "bias: float32 [out_features padded to a multiple of 16]");
  auto out = torch::empty({m, output_columns(out_features, gated)}, x.options());
  const Bf16GemmArgs args{reinterpret_cast<const uint16_t*>(x.data_ptr()),
                          reinterpret_cast<const uint16_t*>(packed.data_ptr()),
                          bias.has_value() ? bias->data_ptr<float>() : nullptr, m, k, out_features, gated};
#if defined(KVSERVE_AMX)
  if (amx_gemm_fits(m, kAmxMinRowsBf16, k * 2)) {
    // the tiles read whole 16-row blocks: a last partial one from a zero-padded copy
    const torch::Tensor rows = m % 16 == 0 ? x : torch::constant_pad_nd(x, {0, 0, 0, 16 - m % 16});
    auto* result = out.data_ptr<c10::BFloat16>();
    parallel_gemm(m, groups, gated, [](int64_t, int64_t) {}, [&](int64_t begin, int64_t end) {
      amx_gemm<Bf16Tile, TileDot::kBf16>(args, rows.data_ptr(), k * 2, begin, end, result);
    });
    return out;
  }
#endif
  packed_gemm<Bf16Tile>(args, out.data_ptr<c10::BFloat16>(), [](int64_t, int64_t) {});
  return out;
#else
  (void)gated;
  TORCH_CHECK(false, "bf16_linear needs AVX512-BF16 (bf16_gemm_pack returned nothing)");
#endif
}

#if defined(__x86_64__) && !(defined(__AVX512VNNI__) && defined(__AVX512BW__))
// The int8 GEMM of the avx2 and portable builds, its sums as exact as the VNNI kernel's. Below
// AVX512-VNNI no 8-bit multiply is exact for 8-bit codes (vpmaddubsw adds two u8 x s8 products
// in saturating 16 bits, so oneDNN keeps the weights to 7 bits there: KL 0.019 and +3.9%
// perplexity on SmolLM2, measured on a Zen 3), so the codes are widened to 16 bits and pmaddwd
// adds pairs of 16-bit products into 32-bit lanes. The weight is packed as [groups of 16
// channels][k / 2][16][2] bytes and widened as it is loaded; the activation codes are widened
// once, in the prologue, and each row's next pair is broadcast. A tile keeps MR rows x 16 NG
// channels of sums in registers (NG 2: a gated layer's (gate, up) pair of groups).
#define KVSERVE_INT8_PAIRS 1
constexpr int kInt8PerWord = 2;  // k values per packed word of a channel

struct PairVec {  // the tile's vector ops: 8 int32 lanes with AVX2, 4 with the baseline's SSE2
#if defined(__AVX2__)
  using V = __m256i;
  static constexpr int kLanes = 8;
  static V zero() { return _mm256_setzero_si256(); }
  static V broadcast(int32_t word) { return _mm256_set1_epi32(word); }
  static V weights(const int8_t* w) {  // kLanes channels x 2 codes, widened
    return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  }
  static V madd_add(V acc, V x, V w) { return _mm256_add_epi32(acc, _mm256_madd_epi16(x, w)); }
  static void store(int32_t* dst, V v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), v); }
#else
  using V = __m128i;
  static constexpr int kLanes = 4;
  static V zero() { return _mm_setzero_si128(); }
  static V broadcast(int32_t word) { return _mm_set1_epi32(word); }
  static V weights(const int8_t* w) {  // SSE2 has no sign extension: each byte into a word's top, shifted down
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w));
    return _mm_srai_epi16(_mm_unpacklo_epi8(bytes, bytes), 8);
  }
  static V madd_add(V acc, V x, V w) { return _mm_add_epi32(acc, _mm_madd_epi16(x, w)); }
  static void store(int32_t* dst, V v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), v); }
#endif
};

struct Int8PairArgs {
  const int16_t* x;        // [m, k] activation codes, widened
  const float* x_scales;   // [m]
  const int8_t* packed;    // [groups, k / 2, 16, 2]
  const float* w_scales;   // [groups * 16]
  const float* bias;       // [groups * 16] or nullptr
  int64_t m, k, n;
  bool gated;              // (gate, up) group pairs -> silu(gate) * up, out [m, n / 2]
};

// The sums of MR rows x groups [group, group + NG) into sums[row][16 NG], accumulators as arrays
// (GCC keeps them in registers for the small tiles).
template <int MR, int NG>
static void pair_sums(const Int8PairArgs& a, int64_t row, int64_t group, int32_t (*sums)[NG * 16]) {
  constexpr int kPerGroup = 16 / PairVec::kLanes, NV = NG * kPerGroup;  // accumulators per row
  PairVec::V acc[MR][NV];
  for (auto& row_acc : acc)
    for (auto& v : row_acc) v = PairVec::zero();
  const int8_t* w = a.packed + group * a.k * 16;
  const int16_t* x = a.x + row * a.k;
  for (int64_t p = 0; p < a.k / 2; ++p, w += 32, x += 2) {
    PairVec::V pairs[MR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      int32_t word;
      std::memcpy(&word, x + i * a.k, 4);
      pairs[i] = PairVec::broadcast(word);
    }
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) {
      const PairVec::V wv = PairVec::weights(w + (v / kPerGroup) * a.k * 16 + (v % kPerGroup) * 2 * PairVec::kLanes);
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) acc[i][v] = PairVec::madd_add(acc[i][v], pairs[i], wv);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) PairVec::store(sums[i] + v * PairVec::kLanes, acc[i][v]);
}

#if defined(__AVX2__)
// Prefill's tile: 6 rows x one group's 16 channels, the 12 sums pinned in registers by hand. Each
// k pair widens the group's two weight vectors once and serves all 6 rows (a broadcast and two
// pmaddwd a row). Written in C++ as arrays, GCC 12 spilled half the sums to the stack every step
// (151 GOP/s at 2,048 rows on a Zen 4, against 194 for the 4-row tile). sums[i] at sums + i * stride.
constexpr int kPairRows = 6;

static void pair_sums_6x16(const int8_t* w, const int16_t* x, int64_t k, int32_t* sums, int64_t stride) {
  // ymm0-11: row i's sums of channels 0-7 in ymm(2i), 8-15 in ymm(2i + 1); ymm12-13 the widened
  // weights, ymm14 a row's broadcast pair, ymm15 a product
  const char* x0 = reinterpret_cast<const char*>(x);
  const char* x3 = x0 + 3 * 2 * k;
  const int64_t row_bytes = 2 * k, stride_bytes = 4 * stride;
  int64_t pairs = k / 2;
  int32_t* s3 = sums + 3 * stride;
#define KVSERVE_PAIR_ROW(ADDR, A, B)                                                  \
  "vpbroadcastd " ADDR ", %%ymm14\n\t"                                               \
  "vpmaddwd %%ymm12, %%ymm14, %%ymm15\n\tvpaddd %%ymm15, %%ymm" A ", %%ymm" A "\n\t" \
  "vpmaddwd %%ymm13, %%ymm14, %%ymm15\n\tvpaddd %%ymm15, %%ymm" B ", %%ymm" B "\n\t"
#define KVSERVE_PAIR_STORE(ADDR, A, B) "vmovdqu %%ymm" A ", " ADDR "\n\tvmovdqu %%ymm" B ", 32+" ADDR "\n\t"
// OP(address of row i, its two sums' registers) for the 6 rows: rows 0-2 at B0 + i S, rows 3-5 at
// B3 + (i - 3) S (an x86 address scales an index by at most 8, so two bases)
#define KVSERVE_SIX_ROWS(OP, B0, B3, S)                                                              \
  OP("(%[" B0 "])", "0", "1") OP("(%[" B0 "],%[" S "])", "2", "3") OP("(%[" B0 "],%[" S "],2)", "4", "5") \
  OP("(%[" B3 "])", "6", "7") OP("(%[" B3 "],%[" S "])", "8", "9") OP("(%[" B3 "],%[" S "],2)", "10", "11")
  asm volatile(
      "vpxor %%xmm0, %%xmm0, %%xmm0\n\tvmovdqa %%ymm0, %%ymm1\n\tvmovdqa %%ymm0, %%ymm2\n\t"
      "vmovdqa %%ymm0, %%ymm3\n\tvmovdqa %%ymm0, %%ymm4\n\tvmovdqa %%ymm0, %%ymm5\n\tvmovdqa %%ymm0, %%ymm6\n\t"
      "vmovdqa %%ymm0, %%ymm7\n\tvmovdqa %%ymm0, %%ymm8\n\tvmovdqa %%ymm0, %%ymm9\n\tvmovdqa %%ymm0, %%ymm10\n\t"
      "vmovdqa %%ymm0, %%ymm11\n\t"
      "test %[n], %[n]\n\tjz 2f\n"
      "1:\n\t"
      "vpmovsxbw (%[w]), %%ymm12\n\t"
      "vpmovsxbw 16(%[w]), %%ymm13\n\t"
      KVSERVE_SIX_ROWS(KVSERVE_PAIR_ROW, "x0", "x3", "rb")
      "add $32, %[w]\n\tadd $4, %[x0]\n\tadd $4, %[x3]\n\tdec %[n]\n\tjnz 1b\n"
      "2:\n\t"
      KVSERVE_SIX_ROWS(KVSERVE_PAIR_STORE, "s0", "s3", "sb")
      "vzeroupper\n\t"
      : [w] "+r"(w), [x0] "+r"(x0), [x3] "+r"(x3), [n] "+r"(pairs)
      : [rb] "r"(row_bytes), [s0] "r"(sums), [s3] "r"(s3), [sb] "r"(stride_bytes)
      : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12",
        "xmm13", "xmm14", "xmm15", "cc", "memory");
#undef KVSERVE_PAIR_ROW
#undef KVSERVE_PAIR_STORE
#undef KVSERVE_SIX_ROWS
}
#else
constexpr int kPairRows = 0;  // no hand-written tile: the generic ones throughout
#endif

template <int MR, int NG, typename T>
static void pair_tile(const Int8PairArgs& a, int64_t row, int64_t group, T* out) {
  alignas(64) int32_t sums[MR][NG * 16];
#if defined(__AVX2__)
  if constexpr (MR == kPairRows) {
    for (int j = 0; j < NG; ++j)
      pair_sums_6x16(a.packed + (group + j) * a.k * 16, a.x + row * a.k, a.k, sums[0] + 16 * j, NG * 16);
  } else
#endif
    pair_sums<MR, NG>(a, row, group, sums);
  float result[NG * 16];
  const int64_t channel = group * 16;
  for (int i = 0; i < MR; ++i) {
    const float x_scale = a.x_scales[row + i];
    for (int c = 0; c < NG * 16; ++c)
      result[c] = static_cast<float>(sums[i][c]) * a.w_scales[channel + c] * x_scale +
                  (a.bias != nullptr ? a.bias[channel + c] : 0.f);
    if constexpr (NG == 2) {  // gated: silu(gate) * up
      const int64_t half = a.n / 2, col = group / 2 * 16;
      silu_mul_rows(result, result + 16, 16);
      from_float(result, out + (row + i) * half + col, std::min<int64_t>(16, half - col));
    } else {
      from_float(result, out + (row + i) * a.n + channel, std::min<int64_t>(16, a.n - channel));
    }
  }
}

// Rows [begin, end) against groups [group, group + NG): the hand-written 6-row tile with AVX2,
// then tiles of as many rows as keep the sums, the broadcast pairs and a weight vector within the
// 16 vector registers, then single rows.
template <int NG, typename T>
static void pair_rows(const Int8PairArgs& a, int64_t group, int64_t begin, int64_t end, T* out) {
  constexpr int NV = NG * 16 / PairVec::kLanes, MR = std::clamp(15 / (NV + 1), 1, 4);
  int64_t row = begin;
  if constexpr (kPairRows > 0)
    for (; row + kPairRows <= end; row += kPairRows) pair_tile<kPairRows, NG>(a, row, group, out);
  for (; row + MR <= end; row += MR) pair_tile<MR, NG>(a, row, group, out);
  for (; row < end; ++row) pair_tile<1, NG>(a, row, group, out);
}

// A thread's groups [begin, end) for every row, blocked for the caches: groups by blocks of up to
// 256 KiB of weights (read from memory once, then kept in L2), and within a block rows by 96 (their
// widened codes, 110 KiB at k = 576, stay in L2 while the block's groups pass). Every group over
// all the rows had read the whole widened activations from L3 once per group (2.4 MB x 192 groups
// for a 2,048-row gate/up projection; 8 layers of this model's shapes at 2,048 rows took
// 139 ms before, 124-133 ms blocked, on a Zen 4 with AVX2 only).
template <typename T>
static void pair_gemm(const Int8PairArgs& a, int64_t begin, int64_t end, T* out) {
  constexpr int64_t kRowBlock = 96, kBlockBytes = 256 << 10;
  const int64_t step = a.gated ? 2 : 1;
  const int64_t block = std::max<int64_t>(step, kBlockBytes / (16 * a.k) / step * step);
  for (int64_t first = begin; first < end; first += block) {
    const int64_t last = std::min(end, first + block);
    for (int64_t row = 0; row < a.m; row += kRowBlock) {
      const int64_t rows_end = std::min(a.m, row + kRowBlock);
      for (int64_t g = first; g < last; g += step) {
        if (a.gated) pair_rows<2>(a, g, row, rows_end, out);
        else pair_rows<1>(a, g, row, rows_end, out);
      }
    }
  }
}
#elif defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define KVSERVE_INT8_VNNI 1
constexpr int kInt8PerWord = 4;
#endif

std::vector<torch::Tensor> int8_gemm_pack(torch::Tensor codes, torch::Tensor scales) {
  // codes int8 [n, k], scales float32 [n] -> (packed int8 [groups, k / w, 16, w], comp int32 [groups * 16]: 128 *
  // each channel's sum (the VNNI kernel's offset), scales float32 [groups * 16]), channels past n zero; w = 4 for
  // the VNNI kernel (and the amx build's tiles), 2 for the pairs kernel. Empty where k % w != 0 or where this build
  // has no int8 GEMM
#if defined(KVSERVE_INT8_VNNI) || defined(KVSERVE_INT8_PAIRS)
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == torch::kChar && scales.numel() == codes.size(0),
              "codes: int8 [n, k], scales: [n]");
  constexpr int64_t w = kInt8PerWord;
  const int64_t n = codes.size(0), k = codes.size(1), groups = (n + 15) / 16;
  if (k % w != 0) return {};
  auto contiguous = codes.contiguous();
  auto packed = torch::zeros({groups, k / w, 16, w}, contiguous.options());
  auto comp = torch::zeros({groups * 16}, contiguous.options().dtype(torch::kInt));
  auto padded = torch::zeros({groups * 16}, contiguous.options().dtype(torch::kFloat));
  padded.narrow(0, 0, n).copy_(scales);
  const int8_t* src = contiguous.data_ptr<int8_t>();
  int8_t* dst = packed.data_ptr<int8_t>();
  int32_t* c = comp.data_ptr<int32_t>();
  for (int64_t r = 0; r < n; ++r) {
    int32_t sum = 0;
    for (int64_t j = 0; j < k; ++j) {
      dst[(((r / 16) * (k / w) + j / w) * 16 + r % 16) * w + j % w] = src[r * k + j];
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

#if defined(KVSERVE_INT8_VNNI) || defined(KVSERVE_INT8_PAIRS)
// The VNNI kernel takes activation codes + 128 (unsigned), the pairs kernel signed ones.
#if defined(KVSERVE_INT8_VNNI)
constexpr bool kInt8Offset = true;
#else
constexpr bool kInt8Offset = false;
#endif

// An int8 layer on x [m, k] (int8_linear, int8_linear_after_norm): the checks, the activation
// buffers and the GEMM, in whose parallel region each thread first runs
// quantize(rows, codes, scales, begin, end) on its share of the rows (rows: x's data, typed).
template <typename Quantize>
static torch::Tensor int8_layer(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& comp,
                                const torch::Tensor& scales, int64_t out_features,
                                const c10::optional<torch::Tensor>& bias, bool gated, const Quantize& quantize) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be contiguous [rows, cols]");
  const int64_t m = x.size(0), k = x.size(1), groups = (out_features + 15) / 16;
  TORCH_CHECK(packed.dim() == 4 && packed.size(0) == groups && packed.size(3) == kInt8PerWord &&
              packed.size(1) * kInt8PerWord == k && comp.numel() == groups * 16 && scales.numel() == groups * 16,
              "packed weight does not match x / out_features");
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->is_contiguous() && bias->numel() == groups * 16,
                "bias: float32 [out_features padded to a multiple of 16]");
  // the activation codes and their scales live only within this call: in a buffer the calling
  // thread keeps, not two tensors (with the fused pass above: 4.5 -> 3.6 us a call at 32 x 576);
  // the pairs kernel's codes widened to 16 bits after them
  thread_local std::vector<float> scratch;
  // (the AMX tiles read the codes in whole 16-row blocks: rows up to a multiple of 16)
  const int64_t code_words = ((m + 15) / 16 * 16 * k + 3) / 4, wide_words = kInt8Offset ? 0 : (m * k + 1) / 2;
  scratch.resize(static_cast<size_t>(m + code_words + wide_words));
  float* row_scales = scratch.data();
  uint8_t* row_codes = reinterpret_cast<uint8_t*>(scratch.data() + m);
  auto out = torch::empty({m, output_columns(out_features, gated)}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "int8_linear", [&] {
    scalar_t* rows = x.data_ptr<scalar_t>();
    const float* bias_data = bias.has_value() ? bias->data_ptr<float>() : nullptr;
#if defined(KVSERVE_INT8_VNNI)
    const Int8GemmArgs args{row_codes, row_scales, packed.data_ptr<int8_t>(), comp.data_ptr<int32_t>(),
                            scales.data_ptr<float>(), bias_data, m, k, out_features, gated};
    const auto prologue = [&](int64_t begin, int64_t end) { quantize(rows, row_codes, row_scales, begin, end); };
#if defined(KVSERVE_AMX)
    if (amx_gemm_fits(m, kAmxMinRowsInt8, k)) {
      scalar_t* result = out.data_ptr<scalar_t>();
      parallel_gemm(m, groups, gated, prologue, [&](int64_t begin, int64_t end) {
        amx_gemm<Int8Tile, TileDot::kInt8>(args, row_codes, k, begin, end, result);
      });
      return;
    }
#endif
    packed_gemm<Int8Tile>(args, out.data_ptr<scalar_t>(), prologue);
#else
    int16_t* wide = reinterpret_cast<int16_t*>(scratch.data() + m + code_words);
    const Int8PairArgs args{wide, row_scales, packed.data_ptr<int8_t>(), scales.data_ptr<float>(), bias_data,
                            m, k, out_features, gated};
    scalar_t* result = out.data_ptr<scalar_t>();
    parallel_gemm(m, groups, gated, [&](int64_t begin, int64_t end) {
      quantize(rows, row_codes, row_scales, begin, end);
      for (int64_t i = begin * k; i < end * k; ++i) wide[i] = static_cast<int8_t>(row_codes[i]);
    }, [&](int64_t begin, int64_t end) { pair_gemm(args, begin, end, result); });
#endif
  });
  return out;
}
#endif

torch::Tensor int8_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor comp, torch::Tensor scales,
                          int64_t out_features, c10::optional<torch::Tensor> bias, int64_t rotate_block,
                          bool gated) {
  // x [m, k] contiguous float -> x @ W.T (+ bias) [m, out_features] in x's dtype, W from int8_gemm_pack;
  // bias float32, padded like the scales (prepared once at load, not per call); rotate_block > 1:
  // x's rows are turned by the block Walsh-Hadamard matrix first (W was turned at load); gated: as
  // bf16_linear's
#if defined(KVSERVE_INT8_VNNI) || defined(KVSERVE_INT8_PAIRS)
  TORCH_CHECK(x.dim() == 2, "x must be contiguous [rows, cols]");
  const int64_t k = x.size(1);
  TORCH_CHECK(rotate_block >= 1 && (rotate_block & (rotate_block - 1)) == 0 && k % rotate_block == 0,
              "rotate_block must be a power of two dividing in_features");
  return int8_layer(x, packed, comp, scales, out_features, bias, gated,
                    [&](auto* rows, uint8_t* codes, float* row_scales, int64_t begin, int64_t end) {
                      quantize_row_range(rows, codes, row_scales, begin, end, k, kInt8Offset, rotate_block);
                    });
#else
  (void)x, (void)packed, (void)comp, (void)scales, (void)out_features, (void)bias, (void)rotate_block, (void)gated;
  TORCH_CHECK(false, "int8_linear: this build has no int8 GEMM (int8_gemm_pack returned nothing)");
#endif
}

torch::Tensor int8_linear_after_norm(torch::Tensor residual, c10::optional<torch::Tensor> delta, double eps,
                                     torch::Tensor packed, torch::Tensor comp, torch::Tensor scales,
                                     int64_t out_features, c10::optional<torch::Tensor> bias, bool gated) {
  // int8_linear(add_rms_norm(residual, delta, ones, eps), ...) in one call: residual [m, k] is
  // updated in place by += delta (when given), and the layer's input is its RMS norm with unit
  // weight (a norm whose weight was folded into W: kvserve.model.rotation)
#if defined(KVSERVE_INT8_VNNI) || defined(KVSERVE_INT8_PAIRS)
  TORCH_CHECK(residual.dim() == 2, "residual must be contiguous [rows, cols]");
  if (delta.has_value())
    TORCH_CHECK(delta->sizes() == residual.sizes() && delta->is_contiguous() &&
                delta->scalar_type() == residual.scalar_type(), "delta must match the residual");
  const int64_t k = residual.size(1);
  return int8_layer(residual, packed, comp, scales, out_features, bias, gated,
                    [&](auto* rows, uint8_t* codes, float* row_scales, int64_t begin, int64_t end) {
                      using T = std::remove_pointer_t<decltype(rows)>;
                      add_norm_quantize_row_range(rows, delta.has_value() ? delta->data_ptr<T>() : nullptr, codes,
                                                  row_scales, begin, end, k, static_cast<float>(eps), kInt8Offset);
                    });
#else
  (void)residual, (void)delta, (void)eps, (void)packed, (void)comp, (void)scales, (void)out_features, (void)bias;
  (void)gated;
  TORCH_CHECK(false, "int8_linear_after_norm: this build has no int8 GEMM (int8_gemm_pack returned nothing)");
#endif
}
