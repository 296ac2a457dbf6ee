"""The limits every layer shares, defined once (csrc/ops/limits.h mirrors them for the C++ checks)."""

import torch

MAX_RANK = 256  # largest pool rank R any backend accepts
MAX_SLICES = 4  # slices per module group (qkv = 3, gate_up = 2)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # x, weights and out share one of these
