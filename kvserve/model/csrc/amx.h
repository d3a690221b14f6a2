// AMX tile state and products, shared by the attention and GEMM kernels of the amx build.
#pragma once

#include <atomic>
#include <cstdint>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__) && defined(__AVX512BF16__)
#define KVSERVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

// Linux hands out the AMX tile state only on request (ARCH_REQ_XCOMP_PERM for XTILEDATA).
static inline bool amx_permitted() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
}

// Tiles 0-7 all 16 rows x 64 bytes: 16 x 16 float32 or int32 sums, 16 rows of 16 bf16 pairs or
// of 64 bytes. The configuration is per thread: each thread that runs tiles loads it.
static inline void configure_tiles() {
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

// The tiles' dot product: bf16 pairs into float32 sums (tdpbf16ps), or 4 unsigned bytes of A by 4
// signed bytes of B into int32 sums (tdpbusd).
enum class TileDot { kBf16, kInt8 };

// (a macro: GCC's tile intrinsics spell their tile numbers into the asm, so they must be literals)
#define KVSERVE_TILE_DOT(D, C, A, B)                        \
  do {                                                      \
    if constexpr (D == TileDot::kBf16) _tile_dpbf16ps(C, A, B); \
    else _tile_dpbusd(C, A, B);                             \
  } while (0)

// C tiles 2i + j += A_i B_j for i < MT, j < NG (each 1 or 2): A_i loaded into tile 4 + i, B_j into 6 + j.
template <TileDot D, int MT = 2, int NG = 2>
static inline void tile_product(const void* a0, const void* a1, int64_t a_stride, const void* b0, const void* b1,
                                int64_t b_stride) {
  static_assert(MT >= 1 && MT <= 2 && NG >= 1 && NG <= 2, "up to 2 x 2 tiles of sums");
  _tile_loadd(4, a0, a_stride);
  if constexpr (MT == 2) _tile_loadd(5, a1, a_stride);
  _tile_loadd(6, b0, b_stride);
  if constexpr (NG == 2) _tile_loadd(7, b1, b_stride);
  KVSERVE_TILE_DOT(D, 0, 4, 6);
  if constexpr (NG == 2) KVSERVE_TILE_DOT(D, 1, 4, 7);
  if constexpr (MT == 2) KVSERVE_TILE_DOT(D, 2, 5, 6);
  if constexpr (MT == 2 && NG == 2) KVSERVE_TILE_DOT(D, 3, 5, 7);
}
#endif

inline std::atomic<bool> amx_on{true};  // one for every file; set_amx turns the tile paths off (tests, benchmarks)

static inline bool use_amx() {
#if defined(KVSERVE_AMX)
  return amx_permitted() && amx_on.load(std::memory_order_relaxed);
#else
  return false;
#endif
}
