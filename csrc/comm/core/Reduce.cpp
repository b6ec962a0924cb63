#include "comm/core/Reduce.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/maximum.h>
#include <ATen/ops/minimum.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>

#include <atomic>
#include <stdexcept>
#include <string>

// Weak: resolved from libgomp where ATen uses OpenMP, null where it does not.
extern "C" void omp_set_num_threads(int) __attribute__((weak));

namespace dicomm {

void reduceOnThisThreadOnly() {
  // ATen sizes a kernel's OpenMP team by omp_get_max_threads(), a per-thread setting: this
  // thread's kernels then run alone, the user's threads keep theirs.
  if (omp_set_num_threads) omp_set_num_threads(1);
}

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

const char* reduceName(ReduceKind op) {
  switch (op) {
    case ReduceKind::kSum: return "SUM";
    case ReduceKind::kAvg: return "AVG";
    case ReduceKind::kProduct: return "PRODUCT";
    case ReduceKind::kMin: return "MIN";
    case ReduceKind::kMax: return "MAX";
    case ReduceKind::kBand: return "BAND";
    case ReduceKind::kBor: return "BOR";
    case ReduceKind::kBxor: return "BXOR";
  }
  return "?";
}

void checkReducible(c10::ScalarType dtype, ReduceKind op) {
  // One bit per (op, dtype) already found to work: the check allocates, an op should not.
  static std::atomic<uint64_t> known[8] = {};
  const int o = static_cast<int>(op), d = static_cast<int>(dtype);
  const bool cacheable = o < 8 && d >= 0 && d < 64;
  if (cacheable && (known[o].load(std::memory_order_relaxed) >> d & 1)) return;
  try {
    at::Tensor a = at::zeros({1}, at::TensorOptions().dtype(dtype));
    at::Tensor b = at::ones({1}, at::TensorOptions().dtype(dtype));
    reduceInto(a.data_ptr(), b.data_ptr(), 1, dtype, op);
    if (op == ReduceKind::kAvg) finishAvg(a.data_ptr(), 1, dtype, 2);
  } catch (const c10::Error& e) {
    throw std::invalid_argument(std::string("dicomm: reduce op ") + reduceName(op) +
                                " is not defined for " + c10::toString(dtype) +
                                " tensors (ATen: " + e.what_without_backtrace() + ")");
  }
  if (cacheable) known[o].fetch_or(uint64_t(1) << d, std::memory_order_relaxed);
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
