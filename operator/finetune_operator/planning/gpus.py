"""The GPU table: canonical GPU types, and how nodes name them in their labels.

The catalog and plans speak of canonical types (`H100-80GB`); nodes carry what GPU Feature
Discovery (GFD) or the cloud provider writes into a label (`nvidia.com/gpu.product:
NVIDIA-H100-80GB-HBM3`, `cloud.google.com/gke-accelerator: nvidia-h100-80gb`). This table
maps both ways: a label value to its type, and a type to the values a label takes on nodes
of that type, which is what pins an attempt's pods to its GPU type.
"""

from __future__ import annotations

from dataclasses import dataclass

MiB = 1024**2

GPU_RESOURCE = "nvidia.com/gpu"
GFD_PRODUCT = "nvidia.com/gpu.product"
GFD_MEMORY = "nvidia.com/gpu.memory"  # MiB
GFD_COUNT = "nvidia.com/gpu.count"
GKE_ACCELERATOR = "cloud.google.com/gke-accelerator"


@dataclass(frozen=True)
class GpuType:
    """One GPU model: its canonical name, usable memory and dense bf16 tensor throughput."""

    name: str
    memory_bytes: int  # what the driver reports (nvidia.com/gpu.memory, MiB x 2^20)
    bf16_tflops: float  # dense (no sparsity) peak, from the vendor's data sheet
    nvlink: bool  # the usual server form factor has NVLink/NVSwitch between GPUs
    # Maximum board power (TDP) of the usual form factor, from the vendor's data sheet: the
    # provenance record's energy estimate (GPU-hours x this), an upper bound of what the card draws.
    board_power_watts: int


def _gpu(name: str, memory_mib: int, tflops: float, nvlink: bool, watts: int) -> GpuType:
    return GpuType(name, memory_mib * MiB, tflops, nvlink, watts)


# Canonical types. Memory is the MiB figure GPU Feature Discovery publishes for the card.
CANONICAL_TYPES = [
    _gpu("H200-141GB", 143771, 989.0, True, 700),
    _gpu("H100-80GB", 81559, 989.0, True, 700),
    _gpu("H100-PCIE-80GB", 81559, 756.0, False, 350),
    _gpu("H100-NVL-94GB", 95830, 835.0, True, 400),
    _gpu("A100-80GB", 81920, 312.0, True, 400),
    _gpu("A100-40GB", 40960, 312.0, True, 400),
    _gpu("L40S-48GB", 46068, 362.0, False, 350),
    _gpu("L40-48GB", 46068, 181.0, False, 300),
    _gpu("L4-24GB", 23034, 121.0, False, 72),
    _gpu("A10G-24GB", 23028, 70.0, False, 300),
    _gpu("A10-24GB", 23028, 125.0, False, 150),
    _gpu("V100-32GB", 32768, 125.0, True, 300),  # fp16; no bf16 on Volta
    _gpu("V100-16GB", 16384, 125.0, True, 300),
    _gpu("T4-16GB", 15360, 65.0, False, 70),  # fp16; no bf16 on Turing
]
_BY_NAME = {g.name: g for g in CANONICAL_TYPES}

# Values of `nvidia.com/gpu.product` as GFD writes them (the NVML device name, spaces as
# dashes) -> canonical type. Label values are case-sensitive: these are spelled exactly.
_GFD_PRODUCTS: dict[str, str] = {
    "NVIDIA-H200": "H200-141GB",
    "NVIDIA-H200-141GB-HBM3e": "H200-141GB",
    "NVIDIA-H200-SXM-141GB": "H200-141GB",
    "NVIDIA-H100-80GB-HBM3": "H100-80GB",
    "NVIDIA-H100-SXM5-80GB": "H100-80GB",
    "NVIDIA-H100-PCIe": "H100-PCIE-80GB",
    "NVIDIA-H100-80GB-PCIe": "H100-PCIE-80GB",
    "NVIDIA-H100-NVL": "H100-NVL-94GB",
    "NVIDIA-A100-SXM4-80GB": "A100-80GB",
    "NVIDIA-A100-80GB-PCIe": "A100-80GB",
    "NVIDIA-A100-SXM4-40GB": "A100-40GB",
    "NVIDIA-A100-PCIE-40GB": "A100-40GB",
    "NVIDIA-L40S": "L40S-48GB",
    "NVIDIA-L40": "L40-48GB",
    "NVIDIA-L4": "L4-24GB",
    "NVIDIA-A10G": "A10G-24GB",
    "NVIDIA-A10": "A10-24GB",
    "Tesla-V100-SXM2-32GB": "V100-32GB",
    "Tesla-V100-SXM2-16GB": "V100-16GB",
    "Tesla-T4": "T4-16GB",
}

# The names cloud providers put in their own accelerator label (GKE's, on nodes that may
# run no GFD at all) -> canonical type.
_CLOUD_ACCELERATORS: dict[str, str] = {
    "nvidia-h200-141gb": "H200-141GB",
    "nvidia-h100-80gb": "H100-80GB",
    "nvidia-h100-mega-80gb": "H100-80GB",
    "nvidia-a100-80gb": "A100-80GB",
    "nvidia-tesla-a100": "A100-40GB",
    "nvidia-l40s": "L40S-48GB",
    "nvidia-l4": "L4-24GB",
    "nvidia-tesla-t4": "T4-16GB",
}

# Which table holds the values of which node label.
_LABEL_VALUES: dict[str, dict[str, str]] = {GFD_PRODUCT: _GFD_PRODUCTS, GKE_ACCELERATOR: _CLOUD_ACCELERATORS}

# Lookup table: every spelling (and every canonical name), case-insensitive -> GpuType.
GPU_TYPES: dict[str, GpuType] = {name.lower(): gpu for name, gpu in _BY_NAME.items()}
for _table in _LABEL_VALUES.values():
    GPU_TYPES.update({spelling.lower(): _BY_NAME[canonical] for spelling, canonical in _table.items()})


def gpu_type_info(spelling: str) -> GpuType | None:
    """The GPU type a product label or canonical name denotes, or None when unknown."""
    return GPU_TYPES.get(spelling.strip().lower())


def canonical_gpu_name(spelling: str) -> str:
    """Canonical name of a spelling; unknown spellings are returned unchanged."""
    info = gpu_type_info(spelling)
    return info.name if info else spelling


def same_gpu_type(a: str, b: str) -> bool:
    """Whether two spellings name the same GPU type (`A100-80GB` == `NVIDIA-A100-SXM4-80GB`)."""
    return canonical_gpu_name(a).lower() == canonical_gpu_name(b).lower()


def label_values_for(key: str, gpu_type: str) -> list[str]:
    """The values node label `key` takes on nodes with GPU type `gpu_type`, as the table knows
    them (sorted); empty when the table does not know the label or the type."""
    canonical = canonical_gpu_name(gpu_type)
    table = _LABEL_VALUES.get(key, {})
    return sorted(value for value, name in table.items() if name == canonical)
