#include "comm/core/Reduce.h"

#include <ATen/ATen.h>

namespace dicomm {

namespace {
at::Tensor view(const void* p, size_t numel, c10::ScalarType dtype) {
  return at::from_blob(const_cast<void*>(p), {static_cast<int64_t>(numel)},
                       at::TensorOptions().dtype(dtype).device(at::kCPU));
}
}  // namespace

// ATen's CPU kernels are vectorized for every dtype (half and bfloat16 included); the views cost
// a few microseconds, small next to a chunk's transfer.
void reduceInto(void* dst, const void* src, size_t numel, c10::ScalarType dtype, ReduceKind op) {
  if (numel == 0) return;
  at::Tensor d = view(dst, numel, dtype), s = view(src, numel, dtype);
  switch (op) {
    case ReduceKind::kSum:
    case ReduceKind::kAvg:
      if (dtype == at::kBool) {
        d.logical_or_(s);
      } else {
        d.add_(s);
      }
      break;
    case ReduceKind::kProduct:
      if (dtype == at::kBool) {
        d.logical_and_(s);
      } else {
        d.mul_(s);
      }
      break;
    case ReduceKind::kMin:
      at::minimum_out(d, d, s);
      break;
    case ReduceKind::kMax:
      at::maximum_out(d, d, s);
      break;
    case ReduceKind::kBand:
      d.bitwise_and_(s);
      break;
    case ReduceKind::kBor:
      d.bitwise_or_(s);
      break;
    case ReduceKind::kBxor:
      d.bitwise_xor_(s);
      break;
  }
}

void finishAvg(void* dst, size_t numel, c10::ScalarType dtype, int divisor) {
  if (numel == 0 || divisor == 1) return;
  at::Tensor d = view(dst, numel, dtype);
  if (at::isIntegralType(dtype, /*includeBool=*/true)) {
    d.div_(divisor, "trunc");
  } else {
    d.div_(divisor);
  }
}

}  // namespace dicomm
