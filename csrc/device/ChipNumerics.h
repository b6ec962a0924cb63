#pragma once
// How an emulated chip's arithmetic differs from the host's, op by op. Real accelerators differ
// where the H2 paper's Table 1 sees them differ, in bf16 mixed-precision training too:
//   - fp32 matmul inputs rounded to fewer mantissa bits (TF32 keeps 10);
//   - the K-reduction of a matmul: summed in blocks, the running sum truncated to fewer mantissa
//     bits than fp32 between blocks (a narrow accumulator: FP8 GEMMs on H800 keep ~14 bits,
//     DeepSeek-V3 section 3.3.2);
//   - results narrowed to bf16/fp16 by truncation instead of round-to-nearest-even;
//   - special functions (exp, softmax, rsqrt, silu, ...) computed to fewer bits, truncated (a
//     fast approximation's error has a sign);
//   - denormal results flushed to zero.
// The vendor kernel runs as usual (the chip's speed is charged for it, from its arguments); the
// chip's result is then recomputed from the same inputs and written over the kernel's. A matmul
// the chip accumulates its own way skips the kernel: the host computes only the chip's result.
#include "device/ChipProfile.h"

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>

namespace ditorch {

enum class Rounding { NearestEven, TowardZero };

// What part of a chip's numerics an op is subject to.
enum class NumericsRole {
  None,
  Matmul,           // functional mm, addmm, bmm, baddbmm: accumulation and narrowing reproduced
  MatmulInputs,     // the rest of the matmul family: only fp32 inputs rounded
  SpecialFunction,  // functional exp, softmax, rsqrt, silu, ...: reduced-precision results
};

// The role of `op` (decided once per op and thread).
NumericsRole numericsRole(const c10::OperatorHandle& op);

// A copy of fp32 `t` with its values rounded to `mantissa_bits` mantissa bits; other dtypes
// are returned unchanged.
at::Tensor roundMantissa(const at::Tensor& t, int mantissa_bits, Rounding rounding = Rounding::NearestEven);

// For a functional matmul (NumericsRole::Matmul) whose result the chip recomputes: the empty tensor
// the kernel would return for the arguments on `stack` (its shape and dtype), to be filled by
// reproduceChipResult instead of running the kernel first; undefined where the arguments are not a
// valid call, so that the kernel runs and reports what is wrong.
at::Tensor emptyMatmulResult(const c10::FunctionSchema& schema, const torch::jit::Stack& stack);

// Overwrites `result` (the vendor kernel's output of `op` on the kernel-device `inputs`) with what
// the chip computes. Inputs must be the op's arguments as the kernel saw them.
void reproduceChipResult(NumericsRole role, const c10::OperatorHandle& op, const std::vector<c10::IValue>& inputs,
                         const at::Tensor& result, const Numerics& numerics);

// a @ b (two matrices or two batches of them, host tensors of any floating dtype and strides) as
// a chip with `accumulator_bits` and `accumulation_block` sums it: the fp32 result before any
// narrowing. What the chip's matmuls run; exposed as torch.ops.ditorch_emu.chip_matmul.
at::Tensor chipMatmul(const at::Tensor& a, const at::Tensor& b, int64_t accumulator_bits, int64_t accumulation_block);

// The instruction set chipMatmul's kernel uses here: "avx512", "avx2" or "scalar".
const char* chipMatmulKernel();

// dst.copy_(src) for `dst` on the chip (both kernel-device tensors): a narrowing conversion to
// bf16/fp16 is rounded as the chip rounds.
void copyOnChip(const at::Tensor& dst, const at::Tensor& src, const Numerics& numerics);

// In place: floating values below the dtype's smallest normal become (signed) zero.
void flushDenormals(const at::Tensor& t);

// bf16 matmuls on a host without bf16 units (no AVX512-BF16, no AMX), where ATen's bf16 kernel
// is several times slower than fp32's: the functional mm, addmm, bmm and baddbmm run as fp32
// kernels on their bf16 inputs widened (exactly: a bf16 value is an fp32 one) and the result is
// rounded to bf16 once, nearest-even: fp32 accumulation, as the accelerators do. The chip's own
// numerics are reproduced afterwards from the bf16 inputs, as for any kernel. Set per process
// (ditorch_ext/chip.py: from the host's CPU flags, or DITORCH_BF16_VIA_FP32).
void setBf16MatmulViaFp32(bool on);
bool bf16MatmulViaFp32();
// Whether the switch is on and covers `op` (the unboxed shim hands such ops to the boxed one).
bool bf16MatmulViaFp32Covers(const c10::OperatorHandle& op);
// Runs `op` on `stack` (kernel-device tensors) in fp32 with its result rounded to bf16 when the
// switch covers it and every tensor argument is bf16; returns false, the stack untouched, otherwise.
bool runBf16MatmulViaFp32(const c10::OperatorHandle& op, torch::jit::Stack* stack);

}  // namespace ditorch
