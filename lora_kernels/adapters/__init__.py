"""Adapter memory (DESIGN.md §6): PEFT loading (peft.py; reader.py reads a folder straight into its packed
buffer), the packed byte layout and its copy plans (layout.py), the pinned host store and its host-stage
workers, the GPU slot pool and the async loader."""

from lora_kernels.adapters.h2d import batched_h2d_copy
from lora_kernels.adapters.host_stage import HostStage, HostStager
from lora_kernels.adapters.host_store import HostAdapterStore, PackedAdapter, pack_adapter
from lora_kernels.adapters.loader import AdapterLoader
from lora_kernels.adapters.peft import AdapterFormatError, AdapterWeights, load_peft_adapter
from lora_kernels.adapters.pool import GpuAdapterPool
from lora_kernels.adapters.spec import ModelSpec, ModuleGroup

__all__ = ["AdapterFormatError", "AdapterLoader", "AdapterWeights", "GpuAdapterPool", "HostAdapterStore", "HostStage",
           "HostStager", "ModelSpec", "ModuleGroup", "PackedAdapter", "batched_h2d_copy", "load_peft_adapter",
           "pack_adapter"]
