// AMX tile units (Intel's TMUL): what bf16_gemm.cpp and quant_gemm.cpp share. A kernel
// describes the shapes of the 8 tiles it uses and loads them with `configure` before
// its first tile instruction; `bf16_amx_available()` (bf16_gemm.h) says whether the
// CPU has the tiles and Linux has granted them to this process.
#pragma once

#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AMX_TILE__) && \
    defined(__AMX_BF16__) && defined(__linux__)
#include <immintrin.h>
#define LOOM_HAVE_AMX 1
#else
#define LOOM_HAVE_AMX 0
#endif

namespace loom::amx {
// Fewer rows than this never take the tiles: they stream the weights once at memory
// speed already, where a tile product would be mostly empty.
constexpr int64_t kMinRows = 8;
}  // namespace loom::amx

#if LOOM_HAVE_AMX
namespace loom::amx {

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Load tile t's shape (rows[t] rows of colsb[t] bytes; 0 rows: unused) unless the
// shapes named `key` are loaded already. `configured` lives for one thread's share of
// one kernel call: other code on the thread (oneDNN's AMX kernels) loads its own
// shapes and releases the tiles between calls.
inline void configure(int64_t key, int64_t& configured, const uint8_t (&rows)[8],
                      const uint16_t (&colsb)[8]) {
  if (configured == key) return;
  TileConfig config{};
  config.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = rows[t];
    config.colsb[t] = rows[t] ? colsb[t] : 0;
  }
  // GCC's _tile_loadconfig tells the compiler it reads only the first 8 bytes of the
  // configuration, so without this barrier the stores of the shapes are dropped as dead
  // and the tiles are configured empty (a tile instruction then faults, SIGILL).
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
  configured = key;
}

// The end of a thread's share of a call: no tile state left behind (as oneDNN does).
inline void release(int64_t configured) {
  if (configured >= 0) _tile_release();
}

}  // namespace loom::amx
#endif
