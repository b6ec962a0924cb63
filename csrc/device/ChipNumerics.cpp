#include "device/ChipNumerics.h"

#include <ATen/Parallel.h>
#include <ATen/ops/abs.h>
#include <ATen/ops/lt.h>
#include <ATen/ops/masked_fill.h>
#include <ATen/ops/empty_like.h>

#include <cfloat>
#include <cstring>
#include <unordered_set>

namespace ditorch {

bool isMatmulOp(const std::string& name) {
  static const std::unordered_set<std::string> ops = {
      "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm",
      "aten::mv", "aten::addmv", "aten::dot", "aten::vdot", "aten::_addmm_activation",
  };
  return ops.count(name) > 0;
}

at::Tensor roundMantissa(const at::Tensor& t, int mantissa_bits) {
  if (t.scalar_type() != at::kFloat || mantissa_bits >= 23 || t.numel() == 0) return t;
  at::Tensor src = t.contiguous();
  at::Tensor out = at::empty_like(src);
  const uint32_t drop = 23 - mantissa_bits;
  const uint32_t half = (1u << (drop - 1)) - 1;
  const uint32_t mask = ~((1u << drop) - 1);
  const uint32_t* in = reinterpret_cast<const uint32_t*>(src.const_data_ptr<float>());
  uint32_t* res = reinterpret_cast<uint32_t*>(out.mutable_data_ptr<float>());
  at::parallel_for(0, src.numel(), 1 << 14, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      uint32_t bits = in[i];
      if ((bits & 0x7f800000u) == 0x7f800000u) {  // inf and nan pass through
        res[i] = bits;
        continue;
      }
      res[i] = (bits + half + ((bits >> drop) & 1u)) & mask;  // round half to even
    }
  });
  return out;
}

namespace {
template <typename T>
void flushContiguous(T* data, int64_t n, float smallest_normal) {
  at::parallel_for(0, n, 1 << 14, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float v = static_cast<float>(data[i]);
      if (v != 0.0f && v > -smallest_normal && v < smallest_normal) data[i] = static_cast<T>(std::signbit(v) ? -0.0f : 0.0f);
    }
  });
}
}  // namespace

void flushDenormals(const at::Tensor& t) {
  if (!t.defined() || t.numel() == 0) return;
  float smallest;
  switch (t.scalar_type()) {
    case at::kFloat: smallest = FLT_MIN; break;
    case at::kBFloat16: smallest = FLT_MIN; break;
    case at::kHalf: smallest = 6.103515625e-05f; break;
    default: return;
  }
  if (!t.is_contiguous()) {
    t.masked_fill_(at::abs(t).lt(smallest), 0);
    return;
  }
  switch (t.scalar_type()) {
    case at::kFloat: flushContiguous(t.mutable_data_ptr<float>(), t.numel(), smallest); break;
    case at::kBFloat16: flushContiguous(t.mutable_data_ptr<at::BFloat16>(), t.numel(), smallest); break;
    default: flushContiguous(t.mutable_data_ptr<at::Half>(), t.numel(), smallest); break;
  }
}

}  // namespace ditorch
