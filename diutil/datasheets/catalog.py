"""Real accelerators by their public datasheets, beside H2's chips A-D.

Every figure is the vendor's published peak for one chip (dense: sparsity's 2x left out), per
precision in TFLOP/s, memory in GiB as sold (GB) and bandwidths in GB/s, one direction. Where a
vendor publishes no figure the entry says what stands in for it (``assumed``). Kernel launch
latency is on no datasheet: every part takes ``chips.LAUNCH_US``. docs/device.md
("Catalog") lists the same table with its sources; ``ditorch plan`` plans a fleet of these by
name with no profiling (heteropp/profile.py), and ``DITORCH_CHIP=H100`` emulates one.
"""
from __future__ import annotations

from diutil.datasheets.chips import A100_MEMORY_GBPS, A100_TFLOPS, ChipProfile

NVIDIA_A100 = ("NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB), "
               "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
               "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf; NICs: DGX A100 (8x 200 Gb/s HDR)")
NVIDIA_H100 = ("NVIDIA H100 Tensor Core GPU datasheet (SXM5), https://www.nvidia.com/en-us/data-center/h100/; "
               "NICs: DGX H100 (8x 400 Gb/s ConnectX-7)")
NVIDIA_H200 = ("NVIDIA H200 Tensor Core GPU datasheet (SXM), https://www.nvidia.com/en-us/data-center/h200/; "
               "NICs: as DGX H100")
NVIDIA_B200 = ("NVIDIA HGX B200 specifications (8 GPUs: FP32 600 TFLOPS, TF32/BF16/FP8 18/36/72 PFLOPS sparse, "
               "1440 GB, 64 TB/s; per GPU here), https://www.nvidia.com/en-us/data-center/hgx/; NVLink 5 "
               "1.8 TB/s per GPU; NICs: DGX B200 (8x 400 Gb/s ConnectX-7)")
AMD_MI300X = ("AMD Instinct MI300X data sheet, https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html "
              "(Infinity Fabric: 7 links of 64 GB/s per direction); NICs: 8x 400 Gb/s per 8-GPU platform (assumed)")
INTEL_GAUDI2 = ("Habana Gaudi2 white paper (May 2022) and Intel Gaudi 2 product brief: BF16 432 TFLOPS, FP8 865 "
                "TFLOPS (MME), 96 GB HBM2e at 2.45 TB/s, 24x 100 GbE RoCE (21 scale-up, 3 scale-out); "
                "fp32: TPC vector rate, assumed (no matrix FP32 figure published)")
INTEL_GAUDI3 = ("Intel Gaudi 3 AI Accelerator white paper (2024): BF16/FP8 1835 TFLOPS (MME), 28.7 TFLOPS BF16 "
                "vector, 128 GB HBM2e at 3.7 TB/s, 24x 200 GbE RoCE (21 scale-up, 3 scale-out); fp32: the vector "
                "rate, assumed (no matrix FP32 figure published)")
HUAWEI_910B = ("Huawei publishes no Ascend 910B datasheet; figures as commonly reported for the Atlas 800T A2 "
               "(FP16 ~320 TFLOPS, 64 GB HBM2e at 1.6 TB/s, HCCS 392 GB/s, 8x 200 GE RoCE); fp32 assumed a "
               "quarter of fp16; bf16 taken equal to fp16")
NVIDIA_L40S = ("NVIDIA L40S datasheet, https://www.nvidia.com/en-us/data-center/l40s/ (48 GB GDDR6 at 864 GB/s; "
               "no NVLink: PCIe Gen4 x16, 32 GB/s per direction); NICs: one 200 Gb/s per GPU (assumed)")

CATALOG: dict[str, ChipProfile] = {
    p.name: p
    for p in (
        # The reference of Table 1 and of H2's relative speeds. Its arithmetic is the host's (fp32
        # accumulation, round-to-nearest-even, IEEE special functions).
        ChipProfile("A100", 80, None, 8, 8, fp32_tflops=A100_TFLOPS["fp32"], tf32_tflops=A100_TFLOPS["tf32"],
                    bf16_tflops=A100_TFLOPS["bf16"], fp16_tflops=A100_TFLOPS["fp16"], memory_gbps=A100_MEMORY_GBPS,
                    intra_node_gbps=300, nic_gbps=25, source=NVIDIA_A100,
                    description="NVIDIA A100 SXM4 80 GB: the reference accelerator"),
        ChipProfile("H100", 80, None, 8, 8, fp32_tflops=67, tf32_tflops=494.5, bf16_tflops=989.5, fp16_tflops=989.5,
                    fp8_tflops=1979, memory_gbps=3350, intra_node_gbps=450, nic_gbps=50, source=NVIDIA_H100,
                    description="NVIDIA H100 SXM5 80 GB"),
        ChipProfile("H200", 141, None, 8, 8, fp32_tflops=67, tf32_tflops=494.5, bf16_tflops=989.5, fp16_tflops=989.5,
                    fp8_tflops=1979, memory_gbps=4800, intra_node_gbps=450, nic_gbps=50, source=NVIDIA_H200,
                    description="NVIDIA H200 SXM 141 GB"),
        ChipProfile("B200", 180, None, 8, 8, fp32_tflops=75, tf32_tflops=1125, bf16_tflops=2250, fp16_tflops=2250,
                    fp8_tflops=4500, memory_gbps=8000, intra_node_gbps=900, nic_gbps=50, source=NVIDIA_B200,
                    description="NVIDIA B200 (HGX B200) 180 GB"),
        ChipProfile("MI300X", 192, None, 8, 8, fp32_tflops=163.4, tf32_tflops=653.7, bf16_tflops=1307.4,
                    fp16_tflops=1307.4, fp8_tflops=2614.9, memory_gbps=5300, intra_node_gbps=448, nic_gbps=50,
                    source=AMD_MI300X, description="AMD Instinct MI300X 192 GB"),
        ChipProfile("Gaudi2", 96, None, 8, 8, fp32_tflops=11, bf16_tflops=432, fp8_tflops=865, memory_gbps=2450,
                    intra_node_gbps=262.5, nic_gbps=37.5, source=INTEL_GAUDI2, description="Intel Gaudi 2 96 GB"),
        ChipProfile("Gaudi3", 128, None, 8, 8, fp32_tflops=28.7, bf16_tflops=1835, fp8_tflops=1835, memory_gbps=3700,
                    intra_node_gbps=525, nic_gbps=75, source=INTEL_GAUDI3, description="Intel Gaudi 3 128 GB"),
        ChipProfile("Ascend910B", 64, None, 8, 8, fp32_tflops=80, bf16_tflops=320, fp16_tflops=320, memory_gbps=1600,
                    intra_node_gbps=196, nic_gbps=25, source=HUAWEI_910B, description="Huawei Ascend 910B 64 GB"),
        ChipProfile("L40S", 48, None, 8, 8, fp32_tflops=91.6, tf32_tflops=183, bf16_tflops=362.05, fp16_tflops=362.05,
                    fp8_tflops=733, memory_gbps=864, intra_node_gbps=32, nic_gbps=25, source=NVIDIA_L40S,
                    description="NVIDIA L40S 48 GB (PCIe)"),
    )
}
