#pragma once
// How an emulated chip's arithmetic differs from IEEE fp32 on the host. Real accelerators round
// matmul inputs (TF32 keeps 10 mantissa bits, others keep fewer or more) while accumulating in
// fp32, and many flush denormals to zero; the emu vendor reproduces both so that one training
// run gives close-but-different losses per chip, as in the H2 paper's Table 1.
#include <ATen/core/Tensor.h>

#include <string>

namespace ditorch {

// Matrix-multiply family whose fp32 inputs a chip rounds (mm, addmm, bmm, baddbmm, ...).
bool isMatmulOp(const std::string& name);
// A copy of `t` (a kernel-device tensor) with fp32 values rounded to nearest-even at
// `mantissa_bits` mantissa bits; other dtypes are returned unchanged.
at::Tensor roundMantissa(const at::Tensor& t, int mantissa_bits);
// In place: floating values below the dtype's smallest normal become (signed) zero.
void flushDenormals(const at::Tensor& t);

}  // namespace ditorch
