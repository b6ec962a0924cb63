// torch.autocast("dipu"): the same cast policies CUDA uses (lower-precision matmuls and convs,
// fp32 for numerically sensitive ops, promotion for mixed inputs). PyTorch ships these lists but
// registers them only for its in-tree backends, so an out-of-tree device must register them.
#include "device/TorchCompat.h"

#include <ATen/autocast_mode.h>
#include <torch/library.h>
#if !DITORCH_TORCH_AT_LEAST(2, 13)
#include <ATen/core/Dimname.h>  // 2.11 names DimnameList in its op lists (TorchCompat.h)
#endif

namespace ditorch {
namespace {
using at::Tensor;
using at::IntArrayRef;
using at::Scalar;
using at::ScalarType;
#if !DITORCH_TORCH_AT_LEAST(2, 13)
using at::DimnameList;  // torch 2.11's op lists name it unqualified; 2.13 has none (TorchCompat.h)
#endif
using namespace at::autocast;

// Ops without a policy run unchanged.
TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) { m.fallback(torch::CppFunction::makeFallthrough()); }

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
#define DITORCH_LOWER_PRECISION(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
  AT_FORALL_LOWER_PRECISION_FP(DITORCH_LOWER_PRECISION)
#define DITORCH_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
  AT_FORALL_FP32(DITORCH_FP32)
#define DITORCH_FP32_SET_OPT_DTYPE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32_set_opt_dtype)
  AT_FORALL_FP32_SET_OPT_DTYPE(DITORCH_FP32_SET_OPT_DTYPE)
  AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE(KERNEL_DIFFERENT_REDISPATCH_SIGNATURE_PRIVATEUSEONE)
#define DITORCH_PROMOTE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, promote)
  AT_FORALL_PROMOTE(DITORCH_PROMOTE)
}

}  // namespace
}  // namespace ditorch
