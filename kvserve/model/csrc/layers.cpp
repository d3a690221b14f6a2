// The decoder's elementwise steps and int8 linear layers.
// add_rms_norm / silu_and_mul: residual add + RMSNorm and SwiGLU's gate, one pass each instead
// of several torch ops (each a dispatch and a trip through memory), float32 inside.
// int8_linear (+ int8_gemm_pack): a W8A8 linear layer in one call, VNNI int8 GEMM;
// quantize_rows_int8 / scale_rows_: the two ends of one where oneDNN does the GEMM.
#include "common.h"
#include "ops.h"

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
