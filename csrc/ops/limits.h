// The limits every layer shares, mirrored from lora_kernels/limits.py and lora_kernels/batch_info.py
// (tests/test_cuda_backend.py::test_cpp_limits_match_python parses this file and compares).
// Plain constants, no torch headers: csrc/kernels/ includes it too.
#pragma once

namespace lora_kernels {

constexpr int kMaxRank = 256;  // MAX_RANK: largest pool rank R
constexpr int kMaxSlices = 4;  // MAX_SLICES: slices per module group (qkv = 3, gate_up = 2)
constexpr int kTileM = 16;     // TILE_M: rows per work-list tile (batch_info.py)

}  // namespace lora_kernels
