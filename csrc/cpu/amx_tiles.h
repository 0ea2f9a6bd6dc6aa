// The tile state every AMX kernel of the amx build runs in (attention_rows_amx.h, tile_linear_amx.h):
// eight tiles of 16 rows of 64 bytes, configured for a task and released after it.
#pragma once

#if defined(__AMX_BF16__)

#include <immintrin.h>

#include <cstdint>

namespace kvtool::cpu::KVTOOL_CPU_ISA {

// Every tile 16 rows of 64 bytes (palette 1): a float32 C tile [16][16], a bfloat16 A tile [16][32],
// a B tile [16 pairs][16 columns].
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};

  TileConfig() {
    for (int i = 0; i < 8; ++i) {
      colsb[i] = 64;
      rows[i] = 16;
    }
  }
};

// A task's tiles configured while it runs and released after it (a thread holding tile state makes
// every context switch save 8 KB more).
class TilesInUse {
 public:
  TilesInUse() {
    static const TileConfig config;
    _tile_loadconfig(&config);
  }
  ~TilesInUse() { _tile_release(); }
  TilesInUse(const TilesInUse&) = delete;
  TilesInUse& operator=(const TilesInUse&) = delete;
};

constexpr int kTileRows = 16;

}  // namespace kvtool::cpu::KVTOOL_CPU_ISA

#endif
