"""lora_kernels: SGMV kernels, batch metadata and adapter memory for multi-LoRA serving."""

from lora_kernels.backends.cuda import HAS_CUDA_EXT
from lora_kernels.batch_info import BatchInfoBuilder, LoRABatchInfo
from lora_kernels.limits import MAX_RANK, MAX_SLICES
from lora_kernels.ops import apply_lora, resolve_backend, sgmv_expand, sgmv_shrink
from lora_kernels.linear import lora_linear, lora_linear_with

__all__ = ["BatchInfoBuilder", "LoRABatchInfo", "HAS_CUDA_EXT", "MAX_RANK", "MAX_SLICES", "apply_lora",
           "lora_linear", "lora_linear_with",
           "resolve_backend", "sgmv_expand", "sgmv_shrink"]
__version__ = "0.1.0"
