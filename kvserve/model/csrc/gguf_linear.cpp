// GGUF's quantized weights served in their own bits (kvserve.model.gguf_linear).
//
// gguf_pack repacks a GGUF tensor's blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) once,
// straight from the file's bytes, into tiles of 16 output channels: every weight group (32
// inputs; 16 for Q6_K, whose scales are per 16) keeps its codes' bits and becomes
//   w = s * code + m   (s, m float16 per channel and group)
// with unsigned 4/5/6-bit codes (m = -offset * s for the symmetric formats and not stored) or
// signed 8-bit ones (Q8_0, m = 0). K-quants' two-level scales (d * 6-bit sub-scale) are rounded
// once into float16 (2^-11 relative, far below the codes' own step).
//
// A tile's group: s[16] (float16), m[16] when stored, then the codes, in 4-input steps laid out
// as [half of 8 channels][channel][4 inputs], so one 32-byte load is 8 channels x 4 inputs:
//   4/5/6 bits: per pair of steps 64 bytes of nibbles, the first step in the low nibbles;
//   5 and 6 bits: 64 bytes of high bits, byte i of each half holding those of byte i of every
//     step: bit s the fifth bit of step s (6 bits: 4 steps, bit s + 4 the sixth), so one shift
//     and one mask put a step's bits in place (a bit-to-byte spread per step had cost twice that);
//   8 bits: per step 64 bytes of codes.
//
// gguf_linear quantizes each row of x per 32 inputs to int16 (round(x / s), s = max|x| / 32767:
// 2^-16 of the group's largest value, near float32's answers, where with llama.cpp's 8-bit q8_0
// only 13 of 40 SmolLM2 greedy continuations kept to the float reference for 32 tokens) and
// sums code products exactly in int32 per weight group, then in float32:
//   sum_k w x = s_w * s_x * sum(code * x_code) + m * sum_group(x as quantized).
// On AVX2 the products are vpmaddwd, two 16-bit products per 32-bit lane: as many multiplies a
// step as llama.cpp's 8-bit vpmaddubsw + vpmaddwd pair. The codes are widened in registers (a
// 16-bit mask or shift of the bytes); the portable build runs the same arithmetic in scalar code.
// gguf_rows gives rows of a packed weight in float32 (the embedding's lookup).
#include "common.h"
#include "ops.h"

namespace {

enum PackKind : int64_t { kQ4 = 0, kQ4Min = 1, kQ5 = 2, kQ5Min = 3, kQ6 = 4, kQ8 = 5 };

struct KindInfo {
  int bits, group;
  bool has_min;
  int offset;  // symmetric formats: code - offset is the signed value
};
constexpr KindInfo kKinds[] = {{4, 32, false, 8}, {4, 32, true, 0}, {5, 32, false, 16},
                               {5, 32, true, 0},  {6, 16, false, 32}, {8, 32, false, 0}};
constexpr int64_t kTile = 16;  // output channels per tile

constexpr int64_t header_bytes(KindInfo k) { return k.has_min ? 64 : 32; }
constexpr int64_t nibble_bytes(KindInfo k) { return k.bits == 8 ? 0 : k.group * 8; }
constexpr int64_t plane_bytes(KindInfo k) { return k.bits == 5 || k.bits == 6 ? 64 : 0; }
constexpr int64_t group_bytes(KindInfo k) {
  return header_bytes(k) + nibble_bytes(k) + plane_bytes(k) + (k.bits == 8 ? k.group * 16 : 0);
}
// where a step's fifth and sixth bits lie in a plane byte
constexpr int fifth_bit(int step) { return step; }
constexpr int sixth_bit(int step) { return step + 4; }

KindInfo kind_info(int64_t kind) {
  TORCH_CHECK(kind >= 0 && kind < 6, "unknown packed weight kind ", kind);
  return kKinds[kind];
}

// ------------------------------------------------------------------------------ GGUF blocks

enum GgmlType : int64_t { kGgmlQ4_0 = 2, kGgmlQ4_1 = 3, kGgmlQ5_0 = 6, kGgmlQ5_1 = 7, kGgmlQ8_0 = 8,
                          kGgmlQ4_K = 12, kGgmlQ5_K = 13, kGgmlQ6_K = 14 };

float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

uint32_t u32_at(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// (pack kind, elements per block, bytes per block) of a GGML type
struct BlockFormat {
  int64_t kind, elements, bytes;
};
BlockFormat block_format(int64_t ggml_type) {
  switch (ggml_type) {
    case kGgmlQ4_0: return {kQ4, 32, 18};
    case kGgmlQ4_1: return {kQ4Min, 32, 20};
    case kGgmlQ5_0: return {kQ5, 32, 22};
    case kGgmlQ5_1: return {kQ5Min, 32, 24};
    case kGgmlQ8_0: return {kQ8, 32, 34};
    case kGgmlQ4_K: return {kQ4Min, 256, 144};
    case kGgmlQ5_K: return {kQ5Min, 256, 176};
    case kGgmlQ6_K: return {kQ6, 256, 210};
    default: TORCH_CHECK(false, "GGML type ", ggml_type, " is not a block format gguf_pack reads");
  }
  return {};
}

// K-quants' 6-bit sub-scale and sub-minimum j of 8, packed in 12 bytes
void scale_min_k4(int j, const uint8_t* q, int& scale, int& min) {
  if (j < 4) {
    scale = q[j] & 63;
    min = q[j + 4] & 63;
  } else {
    scale = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// One block of a row: codes (unsigned, or signed for Q8_0) and each group's s and m (m as stored:
// for symmetric kinds it is implied and left alone).
void decode_block(int64_t type, const uint8_t* b, int32_t* codes, float* s, float* m) {
  switch (type) {
    case kGgmlQ4_0:
    case kGgmlQ4_1: {
      const uint8_t* qs = b + (type == kGgmlQ4_1 ? 4 : 2);
      s[0] = half_at(b);
      if (type == kGgmlQ4_1) m[0] = half_at(b + 2);
      for (int j = 0; j < 16; ++j) {
        codes[j] = qs[j] & 15;
        codes[j + 16] = qs[j] >> 4;
      }
      break;
    }
    case kGgmlQ5_0:
    case kGgmlQ5_1: {
      const int64_t head = type == kGgmlQ5_1 ? 4 : 2;
      const uint32_t qh = u32_at(b + head);
      const uint8_t* qs = b + head + 4;
      s[0] = half_at(b);
      if (type == kGgmlQ5_1) m[0] = half_at(b + 2);
      for (int j = 0; j < 16; ++j) {
        codes[j] = (qs[j] & 15) | static_cast<int32_t>(((qh >> j) & 1) << 4);
        codes[j + 16] = (qs[j] >> 4) | static_cast<int32_t>(((qh >> (j + 16)) & 1) << 4);
      }
      break;
    }
    case kGgmlQ8_0:
      s[0] = half_at(b);
      for (int j = 0; j < 32; ++j) codes[j] = static_cast<int8_t>(b[2 + j]);
      break;
    case kGgmlQ4_K:
    case kGgmlQ5_K: {
      const float d = half_at(b), dmin = half_at(b + 2);
      const uint8_t* scales = b + 4;
      const uint8_t* qh = b + 16;  // Q5_K's fifth bits
      const uint8_t* qs = b + (type == kGgmlQ5_K ? 48 : 16);
      for (int j = 0; j < 4; ++j) {  // 64 inputs: two groups, low then high nibbles
        for (int half = 0; half < 2; ++half) {
          int sc, mn;
          scale_min_k4(2 * j + half, scales, sc, mn);
          s[2 * j + half] = d * static_cast<float>(sc);
          m[2 * j + half] = -dmin * static_cast<float>(mn);
          for (int l = 0; l < 32; ++l) {
            int32_t code = half == 0 ? qs[32 * j + l] & 15 : qs[32 * j + l] >> 4;
            if (type == kGgmlQ5_K) code |= ((qh[l] >> (2 * j + half)) & 1) << 4;
            codes[64 * j + 32 * half + l] = code;
          }
        }
      }
      break;
    }
    case kGgmlQ6_K: {
      const uint8_t* ql = b;
      const uint8_t* qh = b + 128;
      const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
      const float d = half_at(b + 208);
      for (int g = 0; g < 16; ++g) s[g] = d * static_cast<float>(scales[g]);
      for (int n = 0; n < 2; ++n) {
        const uint8_t* l_ = ql + 64 * n;
        const uint8_t* h_ = qh + 32 * n;
        int32_t* y = codes + 128 * n;
        for (int l = 0; l < 32; ++l) {
          y[l] = (l_[l] & 15) | (((h_[l] >> 0) & 3) << 4);
          y[l + 32] = (l_[l + 32] & 15) | (((h_[l] >> 2) & 3) << 4);
          y[l + 64] = (l_[l] >> 4) | (((h_[l] >> 4) & 3) << 4);
          y[l + 96] = (l_[l + 32] >> 4) | (((h_[l] >> 6) & 3) << 4);
        }
      }
      break;
    }
    default: TORCH_CHECK(false, "unsupported GGML type ", type);
  }
}

uint16_t half_bits(float v) { return c10::Half(v).x; }

// One tile's group from 16 channels' codes [16][group] and s, m (channels past the weight: zeros).
void write_group(KindInfo k, const int32_t (*codes)[32], const float* s, const float* m, uint8_t* out) {
  for (int c = 0; c < 16; ++c) {
    const uint16_t sb = half_bits(s[c]);
    std::memcpy(out + 2 * c, &sb, 2);
    if (k.has_min) {
      const uint16_t mb = half_bits(m[c]);
      std::memcpy(out + 32 + 2 * c, &mb, 2);
    }
  }
  uint8_t* body = out + header_bytes(k);
  if (k.bits == 8) {
    for (int t = 0; t < k.group / 4; ++t)
      for (int c = 0; c < 16; ++c)
        for (int j = 0; j < 4; ++j) body[64 * t + 4 * c + j] = static_cast<uint8_t>(static_cast<int8_t>(codes[c][4 * t + j]));
    return;
  }
  for (int p = 0; p < k.group / 8; ++p)
    for (int c = 0; c < 16; ++c)
      for (int j = 0; j < 4; ++j)
        body[64 * p + 4 * c + j] = static_cast<uint8_t>((codes[c][8 * p + j] & 15) | ((codes[c][8 * p + 4 + j] & 15) << 4));
  uint8_t* plane = body + nibble_bytes(k);
  for (int c = 0; c < 16 && k.bits > 4; ++c)
    for (int j = 0; j < 4; ++j) {
      int byte = 0;
      for (int t = 0; t < k.group / 4; ++t) {
        byte |= ((codes[c][4 * t + j] >> 4) & 1) << fifth_bit(t);
        if (k.bits == 6) byte |= ((codes[c][4 * t + j] >> 5) & 1) << sixth_bit(t);
      }
      plane[4 * c + j] = static_cast<uint8_t>(byte);
    }
}

// The inverse: a tile's group back to codes [16][group], s and m (m = -offset * s where implied).
void read_group(KindInfo k, const uint8_t* in, int32_t (*codes)[32], float* s, float* m) {
  for (int c = 0; c < 16; ++c) {
    s[c] = half_at(in + 2 * c);
    m[c] = k.has_min ? half_at(in + 32 + 2 * c) : -static_cast<float>(k.offset) * s[c];
  }
  const uint8_t* body = in + header_bytes(k);
  if (k.bits == 8) {
    for (int t = 0; t < k.group / 4; ++t)
      for (int c = 0; c < 16; ++c)
        for (int j = 0; j < 4; ++j) codes[c][4 * t + j] = static_cast<int8_t>(body[64 * t + 4 * c + j]);
    return;
  }
  for (int p = 0; p < k.group / 8; ++p)
    for (int c = 0; c < 16; ++c)
      for (int j = 0; j < 4; ++j) {
        const uint8_t byte = body[64 * p + 4 * c + j];
        codes[c][8 * p + j] = byte & 15;
        codes[c][8 * p + 4 + j] = byte >> 4;
      }
  const uint8_t* plane = body + nibble_bytes(k);
  for (int c = 0; c < 16 && k.bits > 4; ++c)
    for (int j = 0; j < 4; ++j)
      for (int t = 0; t < k.group / 4; ++t) {
        codes[c][4 * t + j] |= ((plane[4 * c + j] >> fifth_bit(t)) & 1) << 4;
        if (k.bits == 6) codes[c][4 * t + j] |= ((plane[4 * c + j] >> sixth_bit(t)) & 1) << 5;
      }
}

// ------------------------------------------------------------------------------ activations

// x's rows quantized per 32 inputs to int16: codes [m, k], each 4-input step stored as inputs
// (0, 2, 1, 3) (the pairs the kernel's widened weights hold: see widen_step), scales [m, k / 32]
// and, per 16 inputs, the sum of the quantized values (scale * sum of codes) [m, k / 16].
constexpr int kStepOrder[4] = {0, 2, 1, 3};  // its own inverse

struct QuantizedRows {
  int16_t* codes;
  float* scales;
  float* sums16;
  int64_t k;
  const int16_t* row_codes(int64_t r) const { return codes + r * k; }
  const float* row_scales(int64_t r) const { return scales + r * (k / 32); }
  const float* row_sums(int64_t r) const { return sums16 + r * (k / 16); }
  // the scale of row r at input k0, and its sum over the weight group of `group` inputs there
  float group_scale(int64_t r, int64_t k0) const { return row_scales(r)[k0 / 32]; }
  float group_sum(int64_t r, int64_t k0, int group) const {
    const float* sums = row_sums(r) + k0 / 16;
    return group == 32 ? sums[0] + sums[1] : sums[0];
  }
};

// One group of 32 floats: its int16 codes in step order, its scale and the sums of its two
// halves' codes.
inline float quantize_group(const float* f, int16_t* codes, int32_t (&sums)[2]) {
#if defined(__AVX2__)
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 v[4], top = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(f + 8 * i);
    top = _mm256_max_ps(top, _mm256_and_ps(v[i], magnitude));
  }
  __m128 half = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
  half = _mm_max_ps(half, _mm_movehl_ps(half, half));
  const float amax = _mm_cvtss_f32(_mm_max_ss(half, _mm_movehdup_ps(half)));
#else
  float amax = 0.f;
  for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(f[j]));
#endif
  const float scale = amax > 0.f ? amax / 32767.f : 1.f, inv = 1.f / scale;
#if defined(__AVX2__)
  __m256i c[4];
  for (int i = 0; i < 4; ++i)  // rounded to nearest even, as nearbyint; then inputs (0, 2, 1, 3)
    c[i] = _mm256_shuffle_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv))), _MM_SHUFFLE(3, 1, 2, 0));
  for (int h = 0; h < 2; ++h) {
    const __m256i sum = _mm256_add_epi32(c[2 * h], c[2 * h + 1]);
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
    sums[h] = _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1))));
    // packs interleaves the 128-bit lanes of its two sources; the permute puts them back in order
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(c[2 * h], c[2 * h + 1]), _MM_SHUFFLE(3, 1, 2, 0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + 16 * h), packed);
  }
#else
  sums[0] = sums[1] = 0;
  for (int j = 0; j < 32; ++j) {
    const int32_t code = static_cast<int32_t>(std::nearbyint(f[j] * inv));
    codes[(j & ~3) + kStepOrder[j & 3]] = static_cast<int16_t>(code);
    sums[j / 16] += code;
  }
#endif
  return scale;
}

template <typename T>
void quantize_rows_per32(const T* x, QuantizedRows& q, int64_t begin, int64_t end) {
  const int64_t k = q.k;
  thread_local std::vector<float> row;  // kept by each thread: a layer call is tens of microseconds
  row.resize(static_cast<size_t>(k));
  for (int64_t r = begin; r < end; ++r) {
    to_float(x + r * k, row.data(), k);
    for (int64_t g = 0; g < k / 32; ++g) {
      int32_t sums[2];
      const float scale = quantize_group(row.data() + 32 * g, q.codes + r * k + 32 * g, sums);
      q.scales[r * (k / 32) + g] = scale;
      q.sums16[r * (k / 16) + 2 * g] = scale * static_cast<float>(sums[0]);
      q.sums16[r * (k / 16) + 2 * g + 1] = scale * static_cast<float>(sums[1]);
    }
  }
}

// ------------------------------------------------------------------------------ the GEMM

struct Segment {  // one packed weight: its tiles write out's columns [column, column + n)
  const uint8_t* packed;
  int64_t kind, n, column, tile_bytes;
};

constexpr int64_t kRowBlock = 64;  // rows whose codes stay in L1/L2 while a thread's tiles pass

// The portable path: each group unpacked to int32 codes, scalar sums per row and channel.
template <typename Store>
void tile_rows_scalar(const Segment& seg, const uint8_t* tile, const QuantizedRows& q, int64_t row, int64_t rows,
                      const Store& store) {
  const KindInfo k = kind_info(seg.kind);
  const int64_t groups = q.k / k.group;
  float acc[kRowBlock][16] = {};
  int32_t codes[16][32];
  float s[16], m[16];
  for (int64_t g = 0; g < groups; ++g) {
    read_group(k, tile + g * group_bytes(k), codes, s, m);
    const int64_t k0 = g * k.group;
    for (int64_t r = 0; r < rows; ++r) {
      const int16_t* x = q.row_codes(row + r) + k0;
      const float xs = q.group_scale(row + r, k0), xsum = q.group_sum(row + r, k0, k.group);
      for (int c = 0; c < 16; ++c) {
        int32_t dot = 0;
        for (int j = 0; j < k.group; ++j) dot += codes[c][j] * x[(j & ~3) + kStepOrder[j & 3]];
        acc[r][c] += s[c] * xs * static_cast<float>(dot) + m[c] * xsum;
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) store(row + r, acc[r], 16);
}

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
// bit From of every byte of plane moved to bit To, all other bits cleared
template <int From, int To>
inline __m256i plane_bit(__m256i plane) {
  const __m256i moved = From < To ? _mm256_slli_epi16(plane, To - From)
                        : From > To ? _mm256_srli_epi16(plane, From - To) : plane;
  return _mm256_and_si256(moved, _mm256_set1_epi8(static_cast<char>(1 << To)));
}

// a step's codes from its nibbles and (5 and 6 bits) its high bits in the plane
template <int Bits, int Step>
inline __m256i with_high_bits(__m256i nibbles, __m256i plane) {
  if constexpr (Bits >= 5) nibbles = _mm256_or_si256(nibbles, plane_bit<fifth_bit(Step), 4>(plane));
  if constexpr (Bits == 6) nibbles = _mm256_or_si256(nibbles, plane_bit<sixth_bit(Step), 5>(plane));
  return nibbles;
}

inline __m256i broadcast_pair(const int16_t* p) {
  int32_t word;
  std::memcpy(&word, p, 4);
  return _mm256_set1_epi32(word);
}

// Each 32-bit lane of a step's bytes holds one channel's 4 codes (inputs 0-3); widened to 16
// bits they become two pair vectors, inputs (0, 2) and (1, 3): the activations' step order.
template <bool Signed>
inline void widen_step(__m256i bytes, __m256i& even, __m256i& odd) {
  if constexpr (Signed) {
    even = _mm256_srai_epi16(_mm256_slli_epi16(bytes, 8), 8);
    odd = _mm256_srai_epi16(bytes, 8);
  } else {
    even = _mm256_and_si256(bytes, _mm256_set1_epi16(0xFF));
    odd = _mm256_srli_epi16(bytes, 8);
  }
}

// A group's steps for the 8 channels of half h, widened to 16-bit pairs in registers: f(t, even,
// odd) per step t, even holding inputs (0, 2) and odd (1, 3) of each channel.
template <int64_t Kind, int Pair = 0, typename F>
__attribute__((always_inline)) inline void half_steps(const uint8_t* body, int h, __m256i plane, const F& f) {
  constexpr KindInfo k = kKinds[Kind];
  if constexpr (k.bits == 8) {
    if constexpr (Pair < k.group / 4) {
      __m256i even, odd;
      widen_step<true>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(body + 64 * Pair + 32 * h)), even, odd);
      f(Pair, even, odd);
      half_steps<Kind, Pair + 1>(body, h, plane, f);
    }
  } else if constexpr (Pair < k.group / 8) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(body + 64 * Pair + 32 * h));
    __m256i even, odd;
    widen_step<false>(with_high_bits<k.bits, 2 * Pair>(_mm256_and_si256(v, low), plane), even, odd);
    f(2 * Pair, even, odd);
    widen_step<false>(with_high_bits<k.bits, 2 * Pair + 1>(_mm256_and_si256(_mm256_srli_epi16(v, 4), low), plane),
                      even, odd);
    f(2 * Pair + 1, even, odd);
    half_steps<Kind, Pair + 1>(body, h, plane, f);
  }
}

template <int64_t Kind>
__attribute__((always_inline)) inline __m256i half_plane(const uint8_t* body, int h) {
  constexpr KindInfo k = kKinds[Kind];
  if constexpr (k.bits == 5 || k.bits == 6)
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(body + nibble_bytes(k) + 32 * h));
  else
    return _mm256_setzero_si256();
}

// One group of a tile widened to 16-bit pairs, both halves: w[t][h][0] holds inputs (0, 2) and
// w[t][h][1] inputs (1, 3) of step t for the 8 channels of half h. Widened once per group and
// read by every row of the block from L1: widening per 4 rows had cost more than the products.
template <int64_t Kind>
__attribute__((always_inline)) inline void widen_group(const uint8_t* gp, __m256i (*w)[2][2]) {
  constexpr KindInfo k = kKinds[Kind];
  const uint8_t* body = gp + header_bytes(k);
  for (int h = 0; h < 2; ++h)
    half_steps<Kind>(body, h, half_plane<Kind>(body, h), [&](int t, __m256i even, __m256i odd) {
      w[t][h][0] = even;
      w[t][h][1] = odd;
    });
}

// The group's int32 sums for MR rows (1 or 2) straight from the codes, widened in registers and
// used at once: at one row the widened copy in L1 cost 1.2x the time of the whole layer; from 3
// rows on, the copy shared by the rows is faster.
template <int64_t Kind, int MR>
__attribute__((always_inline)) inline void direct_sums(const uint8_t* gp, const QuantizedRows& q, int64_t row,
                                                       int64_t k0, __m256i (&isum)[MR][2]) {
  constexpr KindInfo k = kKinds[Kind];
  const uint8_t* body = gp + header_bytes(k);
  const int16_t* x[MR];
  for (int r = 0; r < MR; ++r) x[r] = q.row_codes(row + r) + k0;
  for (int h = 0; h < 2; ++h) {
    for (int r = 0; r < MR; ++r) isum[r][h] = _mm256_setzero_si256();
    half_steps<Kind>(body, h, half_plane<Kind>(body, h), [&](int t, __m256i even, __m256i odd) {
      for (int r = 0; r < MR; ++r)
        isum[r][h] = _mm256_add_epi32(isum[r][h], _mm256_add_epi32(_mm256_madd_epi16(even, broadcast_pair(x[r] + 4 * t)),
                                                                    _mm256_madd_epi16(odd, broadcast_pair(x[r] + 4 * t + 2))));
    });
  }
}

// Rows [row, row + MR) against one widened group (inputs from k0), both halves: per step and row
// two 32-bit broadcasts of activation pairs and four vpmaddwd, int32 sums over the group.
template <int64_t Kind, int MR>
__attribute__((always_inline)) inline void widened_sums(const __m256i (*w)[2][2], const QuantizedRows& q, int64_t row,
                                                        int64_t k0, __m256i (&isum)[MR][2]) {
  constexpr KindInfo k = kKinds[Kind];
  const int16_t* x[MR];
  for (int r = 0; r < MR; ++r) {
    isum[r][0] = isum[r][1] = _mm256_setzero_si256();
    x[r] = q.row_codes(row + r) + k0;
  }
  for (int t = 0; t < k.group / 4; ++t)
    for (int r = 0; r < MR; ++r) {
      const __m256i even = broadcast_pair(x[r] + 4 * t), odd = broadcast_pair(x[r] + 4 * t + 2);
      for (int h = 0; h < 2; ++h)
        isum[r][h] = _mm256_add_epi32(isum[r][h], _mm256_add_epi32(_mm256_madd_epi16(w[t][h][0], even),
                                                                   _mm256_madd_epi16(w[t][h][1], odd)));
    }
}

// acc[r] += s * (sums * x scale) + m * (the group's activation sum), per row
template <int64_t Kind, int MR>
__attribute__((always_inline)) inline void add_group(const __m256i (&isum)[MR][2], const __m256 (&s)[2],
                                                     const __m256 (&m)[2], const QuantizedRows& q, int64_t row,
                                                     int64_t k0, float (*acc)[16]) {
  constexpr KindInfo k = kKinds[Kind];
  for (int r = 0; r < MR; ++r) {
    const __m256 xs = _mm256_set1_ps(q.group_scale(row + r, k0));
    const __m256 xsum = _mm256_set1_ps(q.group_sum(row + r, k0, k.group));
    for (int h = 0; h < 2; ++h) {
      __m256 a = _mm256_fmadd_ps(s[h], _mm256_mul_ps(_mm256_cvtepi32_ps(isum[r][h]), xs), _mm256_load_ps(acc[r] + 8 * h));
      if constexpr (k.has_min || k.offset != 0) a = _mm256_fmadd_ps(m[h], xsum, a);
      _mm256_store_ps(acc[r] + 8 * h, a);
    }
  }
}

template <int64_t Kind, int MR>
__attribute__((always_inline)) inline void group_rows(const __m256i (*w)[2][2], const __m256 (&s)[2],
                                                      const __m256 (&m)[2], const QuantizedRows& q, int64_t row,
                                                      int64_t k0, float (*acc)[16]) {
  __m256i isum[MR][2];
  widened_sums<Kind, MR>(w, q, row, k0, isum);
  add_group<Kind, MR>(isum, s, m, q, row, k0, acc);
}

// The same for 1 or 2 rows straight from the codes (direct_sums)
template <int64_t Kind, int MR>
__attribute__((always_inline)) inline void direct_rows(const uint8_t* gp, const __m256 (&s)[2], const __m256 (&m)[2],
                                                       const QuantizedRows& q, int64_t row, int64_t k0,
                                                       float (*acc)[16]) {
  __m256i isum[MR][2];
  direct_sums<Kind, MR>(gp, q, row, k0, isum);
  add_group<Kind, MR>(isum, s, m, q, row, k0, acc);
}

// How far ahead of the group in hand its thread's weights are prefetched (a thread's tiles are
// contiguous): at one row the hardware prefetchers alone kept ~14 GB/s of weights coming on an
// AVX2 EPYC, 23 GB/s with 4 KiB ahead in L1 (1 KiB: 20).
constexpr int64_t kPrefetchAhead = 4096;

template <int64_t Kind, typename Store>
void tile_rows_kind(const uint8_t* tile, const QuantizedRows& q, int64_t row, int64_t rows, const Store& store) {
  constexpr KindInfo k = kKinds[Kind];
  constexpr int MR = 6;  // 12 sums in registers; 6 rows measured 1.2x 4 rows a group at 32-256 rows
  alignas(32) float acc[kRowBlock][16];
  std::fill_n(&acc[0][0], rows * 16, 0.f);
  __m256i w[k.group / 4][2][2];
  for (int64_t g = 0; g < q.k / k.group; ++g) {
    const uint8_t* gp = tile + g * group_bytes(k);
    for (int64_t line = 0; line < group_bytes(k); line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(gp + kPrefetchAhead + line), _MM_HINT_T0);
    __m256 s[2], m[2];
    for (int h = 0; h < 2; ++h) {
      s[h] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(gp + 16 * h)));
      if constexpr (k.has_min) m[h] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(gp + 32 + 16 * h)));
      else m[h] = _mm256_mul_ps(s[h], _mm256_set1_ps(-static_cast<float>(k.offset)));
    }
    const int64_t k0 = g * k.group;
    if (rows <= 2) {  // decode sizes: the codes widened in registers, used at once
      if (rows == 1) direct_rows<Kind, 1>(gp, s, m, q, row, k0, acc);
      else direct_rows<Kind, 2>(gp, s, m, q, row, k0, acc);
      continue;
    }
    widen_group<Kind>(gp, w);
    int64_t r = 0;
    for (; r + MR <= rows; r += MR) group_rows<Kind, MR>(w, s, m, q, row + r, k0, acc + r);
    switch (rows - r) {
      case 5: group_rows<Kind, 5>(w, s, m, q, row + r, k0, acc + r); break;
      case 4: group_rows<Kind, 4>(w, s, m, q, row + r, k0, acc + r); break;
      case 3: group_rows<Kind, 3>(w, s, m, q, row + r, k0, acc + r); break;
      case 2: group_rows<Kind, 2>(w, s, m, q, row + r, k0, acc + r); break;
      case 1: group_rows<Kind, 1>(w, s, m, q, row + r, k0, acc + r); break;
      default: break;
    }
  }
  for (int64_t r = 0; r < rows; ++r) store(row + r, acc[r], 0, 16);
}
#endif

// rows [row, row + rows) of x against one tile; store(row, values, first_channel, count)
template <typename Store>
void tile_rows(const Segment& seg, const uint8_t* tile, const QuantizedRows& q, int64_t row, int64_t rows,
               const Store& store) {
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
  switch (seg.kind) {
    case kQ4: return tile_rows_kind<kQ4>(tile, q, row, rows, store);
    case kQ4Min: return tile_rows_kind<kQ4Min>(tile, q, row, rows, store);
    case kQ5: return tile_rows_kind<kQ5>(tile, q, row, rows, store);
    case kQ5Min: return tile_rows_kind<kQ5Min>(tile, q, row, rows, store);
    case kQ6: return tile_rows_kind<kQ6>(tile, q, row, rows, store);
    default: return tile_rows_kind<kQ8>(tile, q, row, rows, store);
  }
#else
  tile_rows_scalar(seg, tile, q, row, rows, [&](int64_t r, const float* v, int64_t n) { store(r, v, 0, n); });
#endif
}

template <typename T>
void gguf_gemm(const T* x, T* out, int64_t m, int64_t k, const std::vector<Segment>& segments, int64_t out_cols,
               const float* bias) {
  std::vector<int64_t> first_tile{0};  // segment i's tiles: [first_tile[i], first_tile[i + 1])
  for (const Segment& seg : segments) first_tile.push_back(first_tile.back() + (seg.n + kTile - 1) / kTile);
  // the activations live only within this call: in a buffer the calling thread keeps (as
  // int8_linear's), not allocated and zeroed at every call; codes as floats' words after the sums
  thread_local std::vector<float> scratch;
  scratch.resize(static_cast<size_t>(m * k / 32 + m * k / 16 + (m * k + 1) / 2));
  QuantizedRows q{reinterpret_cast<int16_t*>(scratch.data() + m * k / 32 + m * k / 16), scratch.data(),
                  scratch.data() + m * k / 32, k};
  parallel_gemm(
      m, first_tile.back(), false, [&](int64_t begin, int64_t end) { quantize_rows_per32(x, q, begin, end); },
      [&](int64_t begin, int64_t end) {
        for (int64_t row = 0; row < m; row += kRowBlock) {
          const int64_t rows = std::min(kRowBlock, m - row);
          size_t s = 0;
          for (int64_t t = begin; t < end; ++t) {
            while (t >= first_tile[s + 1]) ++s;
            const Segment& seg = segments[s];
            const int64_t local = t - first_tile[s];
            const int64_t channels = std::min(kTile, seg.n - local * kTile);
            const int64_t column = seg.column + local * kTile;
            tile_rows(seg, seg.packed + local * seg.tile_bytes, q, row, rows,
                      [&](int64_t r, const float* values, int64_t first, int64_t count) {
                        const int64_t n = std::min(count, channels - first);
                        if (n <= 0) return;
                        float buffer[16];
                        for (int64_t c = 0; c < n; ++c)
                          buffer[c] = values[c] + (bias != nullptr ? bias[column + first + c] : 0.f);
                        from_float(buffer, out + r * out_cols + column + first, n);
                      });
          }
        }
      });
}

}  // namespace

std::tuple<torch::Tensor, int64_t> gguf_pack(torch::Tensor raw, int64_t ggml_type, int64_t k) {
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == torch::kUInt8 && raw.is_contiguous(),
              "raw: contiguous uint8 [rows, bytes per row]");
  const BlockFormat format = block_format(ggml_type);
  TORCH_CHECK(k % format.elements == 0 && raw.size(1) == k / format.elements * format.bytes,
              "raw rows do not hold ", k, " values of GGML type ", ggml_type);
  const KindInfo info = kind_info(format.kind);
  const int64_t n = raw.size(0), tiles = (n + kTile - 1) / kTile, groups = k / info.group;
  const int64_t tile_bytes = groups * group_bytes(info), row_bytes = raw.size(1);
  auto packed = torch::zeros({tiles, tile_bytes}, raw.options());
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    // 16 rows decoded: codes [16][k], s and m [16][k / group]
    std::vector<int32_t> codes(kTile * k);
    std::vector<float> s(kTile * groups), m(kTile * groups);
    int32_t group_codes[16][32];
    float gs[16], gm[16];
    for (int64_t tile = begin; tile < end; ++tile) {
      std::fill(codes.begin(), codes.end(), 0);
      std::fill(s.begin(), s.end(), 0.f);
      std::fill(m.begin(), m.end(), 0.f);
      for (int64_t c = 0; c < kTile && tile * kTile + c < n; ++c) {
        const uint8_t* row = src + (tile * kTile + c) * row_bytes;
        const int64_t per_block = format.elements / info.group;
        for (int64_t b = 0; b < k / format.elements; ++b)
          decode_block(ggml_type, row + b * format.bytes, codes.data() + c * k + b * format.elements,
                       s.data() + c * groups + b * per_block, m.data() + c * groups + b * per_block);
      }
      for (int64_t g = 0; g < groups; ++g) {
        for (int c = 0; c < 16; ++c) {
          std::copy_n(codes.data() + c * k + g * info.group, info.group, group_codes[c]);
          gs[c] = s[c * groups + g];
          gm[c] = m[c * groups + g];
        }
        write_group(info, group_codes, gs, gm, dst + tile * tile_bytes + g * group_bytes(info));
      }
    }
  });
  return {packed, format.kind};
}

torch::Tensor gguf_rows(torch::Tensor packed, int64_t kind, int64_t k, torch::Tensor ids) {
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == torch::kUInt8 && packed.is_contiguous(), "packed: uint8 [tiles, bytes]");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == torch::kLong, "ids: int64 [rows]");
  const KindInfo info = kind_info(kind);
  const int64_t groups = k / info.group;
  TORCH_CHECK(k % info.group == 0 && packed.size(1) == groups * group_bytes(info), "packed does not hold k = ", k);
  const int64_t rows = ids.size(0), channels = packed.size(0) * kTile;
  const auto ids_c = ids.contiguous();
  const int64_t* id = ids_c.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(id[r] >= 0 && id[r] < channels, "row ", id[r], " is outside the packed weight's ", channels, " rows");
  auto out = torch::empty({rows, k}, packed.options().dtype(torch::kFloat));
  float* o = out.data_ptr<float>();
  const uint8_t* base = packed.data_ptr<uint8_t>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    int32_t codes[16][32];
    float s[16], m[16];
    for (int64_t r = begin; r < end; ++r) {
      const int64_t tile = id[r] / kTile, c = id[r] % kTile;
      for (int64_t g = 0; g < groups; ++g) {
        read_group(info, base + packed.size(1) * tile + g * group_bytes(info), codes, s, m);
        for (int j = 0; j < info.group; ++j) o[r * k + g * info.group + j] = s[c] * static_cast<float>(codes[c][j]) + m[c];
      }
    }
  });
  return out;
}

torch::Tensor gguf_linear(torch::Tensor x, std::vector<torch::Tensor> packed, std::vector<int64_t> kinds,
                          std::vector<int64_t> out_features, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x: contiguous [m, k]");
  TORCH_CHECK(!packed.empty() && packed.size() == kinds.size() && kinds.size() == out_features.size(),
              "one kind and out_features per packed weight");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(k % 32 == 0, "in_features must be a multiple of 32, got ", k);
  std::vector<Segment> segments;
  int64_t columns = 0;
  for (size_t i = 0; i < packed.size(); ++i) {
    const KindInfo info = kind_info(kinds[i]);
    const int64_t tiles = (out_features[i] + kTile - 1) / kTile;
    TORCH_CHECK(packed[i].dim() == 2 && packed[i].scalar_type() == torch::kUInt8 && packed[i].is_contiguous() &&
                    packed[i].size(0) == tiles && packed[i].size(1) == k / info.group * group_bytes(info),
                "packed weight ", i, " does not match in_features ", k, " and out_features ", out_features[i]);
    segments.push_back({packed[i].data_ptr<uint8_t>(), kinds[i], out_features[i], columns, packed[i].size(1)});
    columns += out_features[i];
  }
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->is_contiguous() && bias->numel() == columns,
                "bias: float32 [out_features]");
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  auto out = torch::empty({m, columns}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "gguf_linear", [&] {
    gguf_gemm(x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), m, k, segments, columns, b);
  });
  return out;
}
