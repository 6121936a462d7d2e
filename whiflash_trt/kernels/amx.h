// What the AMX code of the GEMM (linear_bf16.cpp) and of the attention (attention_amx.cpp) share: the tile
// configuration's layout and whether this process runs its AMX loops (one switch: the GEMM loop it chose).
#pragma once

#include <cstdint>

namespace whiflash {

struct TileConfig {            // the LDTILECFG layout, palette 1
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// GCC's tile loads and stores are asm statements that name no memory: around them the compiler may move or drop
// plain stores and loads of a buffer they read or write. A tile load must follow this (after the buffer is filled),
// a read of what a tile store wrote must follow it too.
inline void tile_memory_fence() { asm volatile("" ::: "memory"); }

// The process's GEMM loop is AMX (set_gemm_variant): the attention takes its AMX path too, every call alike, so a
// decode row rounds as a verify row does. Defined in linear_bf16.cpp.
bool amx_selected();

}  // namespace whiflash
