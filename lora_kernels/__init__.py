"""lora_kernels: SGMV kernels, batch metadata and adapter memory for multi-LoRA serving."""

from lora_kernels import _backends
from lora_kernels.batch_info import BatchInfoBuilder, LoRABatchInfo
from lora_kernels.ops import apply_lora, resolve_backend, sgmv_expand, sgmv_shrink

HAS_CUDA_EXT = _backends.HAS_CUDA_EXT
if HAS_CUDA_EXT:
    from lora_kernels import _fake

    _fake.register()

__all__ = ["BatchInfoBuilder", "LoRABatchInfo", "HAS_CUDA_EXT", "apply_lora", "resolve_backend", "sgmv_expand",
           "sgmv_shrink"]
__version__ = "0.1.0"
