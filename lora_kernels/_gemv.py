"""`lora_linear(mode="gemv")`: decode batches (1..16 rows of x) as one launch of the extension's `lora_gemv`.

The kernel (csrc/kernels/lora_gemv.cuh) streams the base weight once with the LoRA shrink and expand inside it, so
a module costs one launch instead of cuBLAS plus two, and y is written once instead of written, read and written
again. Its CTAs meet once inside the launch (the expand waits for every CTA's shrink), on two int32 words in device
memory that every launch leaves at zero. Words therefore come from one zeroed per-device buffer:

* an eager call takes its stream's slot (calls on one stream run in order; streams get distinct slots);
* a call under CUDA-graph capture takes a slot of its own for good (a graph replays its kernels on whatever stream
  it is launched on, maybe beside eager calls or other graphs).

The buffer is created and zeroed by the first eager call on the device; a call captured before any eager call
there (or once every slot is taken) returns False and `lora_linear` runs its fallback mode. Engines warm up
eagerly before they capture, so their graphs get the one-launch path.
"""

from __future__ import annotations

import os

import torch

from lora_kernels.batch_info import LoRABatchInfo

MAX_ROWS = 16  # kGemvRows
K_ALIGN = 256  # kGemvKAlign
MAX_RANK = 64  # kGemvMaxR
SLOTS = 1 << 16  # sync slots per device (2 int32 words each: 512 KB), enough for every module of many graphs


class _SyncWords:
    """The per-device zeroed words and who holds which slot."""

    __slots__ = ("words", "by_stream", "next_slot")

    def __init__(self, device: torch.device):
        self.words = torch.zeros(2 * SLOTS, dtype=torch.int32, device=device)
        self.by_stream: dict[int, int] = {}
        self.next_slot = 0

    def slot(self, stream: torch.cuda.Stream, capturing: bool) -> int | None:
        if not capturing:
            slot = self.by_stream.get(stream.cuda_stream)
            if slot is not None:
                return slot
        if self.next_slot >= SLOTS:
            return None
        slot, self.next_slot = self.next_slot, self.next_slot + 1
        if not capturing:
            self.by_stream[stream.cuda_stream] = slot
        return slot


_WORDS: dict[int, _SyncWords] = {}


def _sync_slot(device: torch.device):
    """(words, slot) for a launch on the current stream, or None where none can be given (module docstring)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    capturing = torch.cuda.is_current_stream_capturing()
    words = _WORDS.get(index)
    if words is None:
        if capturing:
            return None
        words = _WORDS[index] = _SyncWords(torch.device("cuda", index))
    slot = words.slot(torch.cuda.current_stream(device), capturing)
    return None if slot is None else (words.words, slot)


def backend_allows(backend: str | None) -> bool:
    """The one-launch kernel is the cuda backend's: it runs where that or "auto" is asked for."""
    return (backend or os.environ.get("LORA_KERNELS_BACKEND") or "auto") in ("auto", "cuda")


def supports(x: torch.Tensor, weight: torch.Tensor, bias, lora_a: torch.Tensor, lora_b: torch.Tensor,
             info: LoRABatchInfo) -> bool:
    """Whether `lora_gemv` takes these inputs (the extension re-checks them and raises on anything else)."""
    from lora_kernels.backends.cuda import HAS_CUDA_EXT

    return (HAS_CUDA_EXT and x.is_cuda and 1 <= x.shape[0] <= MAX_ROWS and x.dtype in (torch.float16, torch.bfloat16)
            and x.shape[1] % K_ALIGN == 0 and lora_b.shape[2] % 8 == 0 and lora_b.shape[2] <= MAX_RANK
            and weight.is_contiguous() and (bias is None or bias.is_contiguous()) and info.work is not None
            and all(t.data_ptr() % 16 == 0 for t in (x, weight, lora_a, lora_b))
            and torch.cuda.get_device_capability(x.device)[0] >= 8)


def run(x, weight, bias, lora_a, lora_b, info: LoRABatchInfo, slice_offsets, out) -> bool:
    """out = x weightᵀ (+ bias) + the LoRA delta in one launch; False (nothing launched) where it cannot run."""
    if not supports(x, weight, bias, lora_a, lora_b, info):
        return False
    sync = _sync_slot(x.device)
    if sync is None:
        return False
    torch.ops.lora_kernels.lora_gemv.default(x, weight, bias, lora_a, lora_b, info.work, info.lora_ranks,
                                             info.scalings, info.permutation, list(slice_offsets), info.max_tiles,
                                             sync[0], sync[1], out)
    return True
