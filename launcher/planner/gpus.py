"""GPU catalogue for the planner: memory, tensor-core peaks, HBM, NVLink and inter-node bandwidth.

Peaks are dense (no sparsity) vendor numbers for SXM parts. ``gemm_efficiency`` is the calibrated fraction of
the bf16 peak that large transformer GEMMs reach (see launcher/planner/calibration.md); parts without their
own published training rows inherit it from the nearest calibrated part and say so in ``calibration``.

List it: ``.venv/bin/python -c "from launcher.planner.gpus import GPUS; print(list(GPUS))"``.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.spec.errors import ConfigError, did_you_mean

GIB = 1024**3


@dataclass(frozen=True, kw_only=True)
class GpuSpec:
    """One accelerator type as the planner sees it."""

    name: str
    """Catalogue key, e.g. h100-80gb."""
    memory_gib: float
    """Device memory visible to CUDA, GiB."""
    bf16_tflops: float
    """Dense bf16 tensor-core peak, TFLOP/s."""
    fp8_tflops: float | None
    """Dense fp8 tensor-core peak, TFLOP/s; None where the part has no fp8."""
    hbm_tb_s: float
    """HBM bandwidth, TB/s."""
    nvlink_gb_s: float
    """NVLink bandwidth per GPU per direction, GB/s."""
    internode_gb_s: float
    """Network bandwidth per GPU (one NIC per GPU), GB/s."""
    gpus_per_node: int
    """GPUs sharing one NVLink domain (one node)."""
    host_link_gb_s: float
    """Host (CPU memory) link per GPU per direction, GB/s: PCIe Gen4 x16 = 32 (A100 SXM4), PCIe Gen5 x16 = 64
    (H100/H200/B200 SXM, NVIDIA's HGX specs: 128 GB/s both directions); what an optimizer offload crosses."""
    gemm_efficiency: float
    """Calibrated fraction of bf16 peak reached by large GEMMs (saturation value of the efficiency curve)."""
    calibration: str
    """Where gemm_efficiency comes from."""


GPUS: dict[str, GpuSpec] = {
    g.name: g
    for g in (
        GpuSpec(name="a100-40gb", memory_gib=40.0, bf16_tflops=312.0, fp8_tflops=None, hbm_tb_s=1.555,
                nvlink_gb_s=300.0, internode_gb_s=25.0, gpus_per_node=8, host_link_gb_s=32.0, gemm_efficiency=0.84,
                calibration="inherits a100-80gb (same SXM4 compute)"),
        GpuSpec(name="a100-80gb", memory_gib=80.0, bf16_tflops=312.0, fp8_tflops=None, hbm_tb_s=2.039,
                nvlink_gb_s=300.0, internode_gb_s=25.0, gpus_per_node=8, host_link_gb_s=32.0, gemm_efficiency=0.84,
                calibration="fitted on Korthikanti 2022 A100 rows (calibration.md)"),
        GpuSpec(name="h100-80gb", memory_gib=79.6, bf16_tflops=989.0, fp8_tflops=1979.0, hbm_tb_s=3.35,
                nvlink_gb_s=450.0, internode_gb_s=50.0, gpus_per_node=8, host_link_gb_s=64.0, gemm_efficiency=0.68,
                calibration="fitted on Megatron-Core H100 weak-scaling rows (calibration.md)"),
        GpuSpec(name="h200-141gb", memory_gib=140.4, bf16_tflops=989.0, fp8_tflops=1979.0, hbm_tb_s=4.8,
                nvlink_gb_s=450.0, internode_gb_s=50.0, gpus_per_node=8, host_link_gb_s=64.0, gemm_efficiency=0.68,
                calibration="inherits h100-80gb (same tensor cores, more and faster HBM)"),
        GpuSpec(name="b200-180gb", memory_gib=178.0, bf16_tflops=2250.0, fp8_tflops=4500.0, hbm_tb_s=8.0,
                nvlink_gb_s=900.0, internode_gb_s=50.0, gpus_per_node=8, host_link_gb_s=64.0, gemm_efficiency=0.68,
                calibration="UNCALIBRATED: inherits h100-80gb efficiency"),
    )
}


def get_gpu(name: str) -> GpuSpec:
    """Catalogue entry for `name` (case-insensitive); ConfigError naming the choices otherwise."""
    key = str(name).strip().lower()
    if key not in GPUS:
        raise ConfigError(f"--gpu-type '{name}' unknown{did_you_mean(key, GPUS, cutoff=0.5)}; "
                          f"choose one of {', '.join(GPUS)}")
    return GPUS[key]
