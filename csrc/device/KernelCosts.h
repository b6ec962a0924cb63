#pragma once
// What a kernel costs an emulated chip: its work (FLOPs and bytes moved, counted from the op's
// shapes and dtypes) on the chip's datasheet (peak throughput per precision, memory bandwidth,
// launch latency), by the roofline model:
//
//   seconds = launch latency + max(FLOPs / peak FLOP/s of the kernel's precision,
//                                   bytes moved / memory bandwidth)
//
// The matmul family (mm, addmm, bmm, baddbmm, linear, mv, addmv, dot), scaled dot-product
// attention (forward and backward) and convolution (forward and backward) are counted in FLOPs
// with torch.utils.flop_counter's formulas; every other op is memory-bound on the bytes it
// reads and writes. Nothing here reads a clock: a chip's time for a kernel is the same on every
// host. ditorch_ext/roofline.py is the same model in Python (the planner's datasheet layer
// times); tests/device/test_kernel_costs.py holds the two to hand-computed kernels.
#include "device/SpeedEmulation.h"

namespace ditorch {

// The precisions a datasheet gives a peak for, in the order Python hands them over.
enum class Precision : int { FP32 = 0, TF32, BF16, FP16, FP8, kCount };

struct Datasheet {
  double peak_flops[int(Precision::kCount)] = {};  // FLOP/s; 0: the part has no such unit
  double memory_bytes_per_s = 0;
  double launch_s = 0;
  // fp32 matmuls run on TF32 units (a chip whose numerics round fp32 matmul inputs to 10 bits)
  bool fp32_matmul_as_tf32 = false;
  bool defined() const { return memory_bytes_per_s > 0 && peak_flops[int(Precision::FP32)] > 0; }
};

// The active chip's datasheet (all zeros when the chip's speed is not emulated).
const Datasheet& chipDatasheet();
void setChipDatasheet(const Datasheet& datasheet);

struct KernelWork {
  double flops = 0;   // counted only for the compute-bound families
  double bytes = 0;   // read and written
  Precision precision = Precision::FP32;  // the units the FLOPs run on
  bool launched = true;  // false: metadata only, no kernel on a real device
};

// The work of the kernel `signature` describes (its arguments as the op received them).
KernelWork kernelWork(const KernelSignature& signature);
// The peak FLOP/s `datasheet` offers `precision`: a part without that unit runs it on the next
// wider one (FP8 on FP16, FP16/BF16 on each other, then FP32; TF32 on FP32).
double peakFlops(const Datasheet& datasheet, Precision precision);
// The roofline time of `work` on `datasheet`, launch latency included, in seconds.
double chipSeconds(const KernelWork& work, const Datasheet& datasheet);

}  // namespace ditorch
