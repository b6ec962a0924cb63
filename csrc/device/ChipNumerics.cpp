#include "device/ChipNumerics.h"

#include "device/vendor/Vendor.h"

#include <ATen/ATen.h>
#include <ATen/ExpandUtils.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <cfloat>
#include <unordered_map>
#include <unordered_set>

namespace ditorch {
namespace {

const std::unordered_set<std::string>& reproducedMatmuls() {
  static const std::unordered_set<std::string> ops = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"};
  return ops;
}

const std::unordered_set<std::string>& matmulFamily() {
  static const std::unordered_set<std::string> ops = {
      "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm",
      "aten::mv", "aten::addmv", "aten::dot", "aten::vdot", "aten::_addmm_activation",
  };
  return ops;
}

// Functions a chip evaluates with its own approximations (transcendentals and what is built on them).
const std::unordered_set<std::string>& specialFunctions() {
  static const std::unordered_set<std::string> ops = {
      "aten::exp", "aten::expm1", "aten::log", "aten::log1p", "aten::_softmax", "aten::_log_softmax",
      "aten::sigmoid", "aten::silu", "aten::tanh", "aten::rsqrt", "aten::gelu", "aten::erf",
  };
  return ops;
}

NumericsRole decideRole(const c10::FunctionSchema& schema) {
  const std::string& name = schema.name();
  const bool functional = schema.overload_name().empty();
  if (functional && reproducedMatmuls().count(name)) return NumericsRole::Matmul;
  if (matmulFamily().count(name)) return NumericsRole::MatmulInputs;
  if (functional && specialFunctions().count(name)) return NumericsRole::SpecialFunction;
  return NumericsRole::None;
}

bool isNarrow(at::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf; }

// fp32 `x` narrowed to `dtype` as the chip rounds: nearest-even (the host's conversion) or by
// truncation (the value truncated to the narrow mantissa first, which then converts exactly).
at::Tensor narrowTo(const at::Tensor& x, at::ScalarType dtype, bool toward_zero) {
  if (!isNarrow(dtype) || !toward_zero) return x.to(dtype);
  return roundMantissa(x, dtype == at::kBFloat16 ? 7 : 10, Rounding::TowardZero).to(dtype);
}

// `sum` truncated in place to `bits` mantissa bits, as a narrow accumulator keeps it.
void truncateInPlace(at::Tensor& sum, int bits) {
  if (bits >= 23) return;
  const uint32_t mask = ~((1u << (23 - bits)) - 1);
  if (bits >= 1) {
    // Every NaN an addition makes is quiet (its top mantissa bit set) and an infinity has no
    // mantissa, so with a bit or more kept the mask alone leaves both as they are: ATen's
    // vectorized and does it, several times faster than the loop below.
    sum.view(at::kInt).bitwise_and_(static_cast<int64_t>(static_cast<int32_t>(mask)));
    return;
  }
  uint32_t* data = reinterpret_cast<uint32_t*>(sum.mutable_data_ptr<float>());
  at::parallel_for(0, sum.numel(), 1 << 14, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const uint32_t u = data[i];
      data[i] = (u & 0x7f800000u) == 0x7f800000u ? u : u & mask;  // inf and nan pass through
    }
  });
}

// a @ b (batched or not) with the chip's K-reduction: each block of K-terms summed in fp32, the
// running sum truncated to the accumulator's mantissa after every block. The running sum stays
// one output's size (cache-resident) and each block is added to it by one GEMM: the
// emulation's host work is what the chip's accumulator does, not a copy of every partial sum.
at::Tensor accumulate(const at::Tensor& a, const at::Tensor& b, const Numerics& n) {
  const at::Tensor af = a.to(at::kFloat), bf = b.to(at::kFloat);
  const int64_t k = af.size(-1);
  if (k == 0) return at::matmul(af, bf);
  const int64_t block = n.accumulation_block > 0 ? std::min<int64_t>(n.accumulation_block, k) : k;
  const int64_t m = af.size(-2), cols = bf.size(-1);
  const at::Tensor a3 = af.reshape({-1, m, k}), b3 = bf.reshape({-1, k, cols});
  at::Tensor sum;  // the first block's sum, then the running one (no pass to zero it first)
  for (int64_t k0 = 0; k0 < k; k0 += block) {
    const int64_t width = std::min(block, k - k0);
    if (k0 == 0) sum = at::bmm(a3.narrow(2, 0, width), b3.narrow(1, 0, width));
    else sum.baddbmm_(a3.narrow(2, k0, width), b3.narrow(1, k0, width));
    truncateInPlace(sum, n.accumulator_bits);
  }
  std::vector<int64_t> shape(af.sizes().begin(), af.sizes().end() - 1);
  shape.push_back(cols);
  return sum.view(shape);
}

void reproduceMatmul(const c10::FunctionSchema& schema, const std::vector<c10::IValue>& in, const at::Tensor& result,
                     const Numerics& n) {
  const bool with_bias = schema.name() == "aten::addmm" || schema.name() == "aten::baddbmm";
  at::Tensor y = accumulate(in[with_bias ? 1 : 0].toTensor(), in[with_bias ? 2 : 1].toTensor(), n);
  if (with_bias) {
    const at::Scalar beta = in[3].toScalar(), alpha = in[4].toScalar();
    if (!(alpha.isIntegral(false) && alpha.toLong() == 1) && alpha.toDouble() != 1.0) y = y * alpha;
    // beta == 0 ignores the bias, NaNs included, as the kernels do.
    if (beta.toDouble() != 0.0) y = y + in[0].toTensor().to(at::kFloat) * beta;
  }
  result.copy_(narrowTo(y, result.scalar_type(), n.round_toward_zero));
}

void reproduceSpecialFunction(const c10::OperatorHandle& op, const std::vector<c10::IValue>& in,
                              const at::Tensor& result, const Numerics& n) {
  if (!result.is_floating_point()) return;
  if (result.scalar_type() == at::kFloat || result.scalar_type() == at::kDouble) {
    if (result.scalar_type() == at::kFloat) result.copy_(roundMantissa(result, n.special_function_bits, Rounding::TowardZero));
    return;
  }
  // A narrow result: the chip's fp32 value is needed before narrowing, so the op runs again in fp32.
  torch::jit::Stack stack;
  stack.reserve(in.size());
  for (const c10::IValue& v : in)
    stack.push_back(v.isTensor() && v.toTensor().is_floating_point() ? c10::IValue(v.toTensor().to(at::kFloat)) : v);
  const std::string& name = op.schema().name();
  if (name == "aten::_softmax" || name == "aten::_log_softmax") stack[2] = false;  // half_to_float: input is fp32 now
  op.redispatchBoxed(c10::DispatchKeySet(kernelDispatchKey()),
                     &stack);
  at::Tensor exact = stack.back().toTensor();
  result.copy_(narrowTo(roundMantissa(exact, n.special_function_bits, Rounding::TowardZero), result.scalar_type(), n.round_toward_zero));
}

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

NumericsRole numericsRole(const c10::OperatorHandle& op) {
  // Keyed by the schema's address, stable for the operator's lifetime; per thread, so no lock.
  thread_local std::unordered_map<const void*, NumericsRole> roles;
  const c10::FunctionSchema& schema = op.schema();
  auto it = roles.find(&schema);
  if (it != roles.end()) return it->second;
  return roles.emplace(&schema, decideRole(schema)).first->second;
}

at::Tensor roundMantissa(const at::Tensor& t, int mantissa_bits, Rounding rounding) {
  if (t.scalar_type() != at::kFloat || mantissa_bits >= 23 || t.numel() == 0) return t;
  at::Tensor src = t.contiguous();
  at::Tensor out = at::empty_like(src);
  const uint32_t drop = 23 - mantissa_bits;
  const uint32_t half = (1u << (drop - 1)) - 1;
  const uint32_t mask = ~((1u << drop) - 1);
  const bool nearest = rounding == Rounding::NearestEven;
  const uint32_t* in = reinterpret_cast<const uint32_t*>(src.const_data_ptr<float>());
  uint32_t* res = reinterpret_cast<uint32_t*>(out.mutable_data_ptr<float>());
  at::parallel_for(0, src.numel(), 1 << 14, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const uint32_t bits = in[i];
      if ((bits & 0x7f800000u) == 0x7f800000u) {  // inf and nan pass through
        res[i] = bits;
        continue;
      }
      res[i] = nearest ? (bits + half + ((bits >> drop) & 1u)) & mask : bits & mask;
    }
  });
  return out;
}

at::Tensor emptyMatmulResult(const c10::FunctionSchema& schema, const torch::jit::Stack& stack) {
  const bool with_bias = schema.name() == "aten::addmm" || schema.name() == "aten::baddbmm";
  const bool batched = schema.name() == "aten::bmm" || schema.name() == "aten::baddbmm";
  const auto args = stack.end() - schema.arguments().size();
  const c10::IValue& av = args[with_bias ? 1 : 0];
  const c10::IValue& bv = args[with_bias ? 2 : 1];
  if (!av.isTensor() || !bv.isTensor()) return {};
  const at::Tensor& a = av.toTensor();
  const at::Tensor& b = bv.toTensor();
  const int64_t dims = batched ? 3 : 2;
  if (a.dim() != dims || b.dim() != dims || a.scalar_type() != b.scalar_type() || !at::isFloatingType(a.scalar_type()) ||
      a.size(-1) != b.size(-2) || (batched && a.size(0) != b.size(0)))
    return {};
  std::vector<int64_t> shape(a.sizes().begin(), a.sizes().end() - 1);
  shape.push_back(b.size(-1));
  if (with_bias) {
    if (!args[0].isTensor()) return {};
    const at::Tensor& self = args[0].toTensor();
    if (self.scalar_type() != a.scalar_type() || !at::is_expandable_to(self.sizes(), shape)) return {};
  }
  return at::empty(shape, a.options());
}

void reproduceChipResult(NumericsRole role, const c10::OperatorHandle& op, const std::vector<c10::IValue>& inputs,
                         const at::Tensor& result, const Numerics& numerics) {
  switch (role) {
    case NumericsRole::Matmul: return reproduceMatmul(op.schema(), inputs, result, numerics);
    case NumericsRole::SpecialFunction: return reproduceSpecialFunction(op, inputs, result, numerics);
    default: return;
  }
}

void copyOnChip(const at::Tensor& dst, const at::Tensor& src, const Numerics& numerics) {
  const bool wide_source = src.scalar_type() == at::kFloat || src.scalar_type() == at::kDouble;
  if (!numerics.round_toward_zero || !isNarrow(dst.scalar_type()) || !wide_source) {
    dst.copy_(src);
    return;
  }
  dst.copy_(narrowTo(src.to(at::kFloat), dst.scalar_type(), true));
}

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

namespace {
std::atomic<bool> bf16_via_fp32{false};
}  // namespace

void setBf16MatmulViaFp32(bool on) { bf16_via_fp32.store(on, std::memory_order_relaxed); }

bool bf16MatmulViaFp32() { return bf16_via_fp32.load(std::memory_order_relaxed); }

bool bf16MatmulViaFp32Covers(const c10::OperatorHandle& op) {
  if (!bf16MatmulViaFp32()) return false;
  const c10::FunctionSchema& schema = op.schema();
  return schema.overload_name().empty() && reproducedMatmuls().count(schema.name()) > 0;
}

bool runBf16MatmulViaFp32(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  if (!bf16MatmulViaFp32Covers(op)) return false;
  const auto args = stack->end() - op.schema().arguments().size();
  for (auto it = args; it != stack->end(); ++it)
    if (it->isTensor() && it->toTensor().scalar_type() != at::kBFloat16) return false;
  for (auto it = args; it != stack->end(); ++it)
    if (it->isTensor()) *it = it->toTensor().to(at::kFloat);
  op.redispatchBoxed(c10::DispatchKeySet(kernelDispatchKey()), stack);
  stack->back() = stack->back().toTensor().to(at::kBFloat16);
  return true;
}

}  // namespace ditorch

// Set from Python as torch.ops.ditorch_emu.set_bf16_matmul_via_fp32 (ditorch_ext/chip.py).
TORCH_LIBRARY_FRAGMENT(ditorch_emu, m) {
  m.def("set_bf16_matmul_via_fp32(bool on) -> ()", [](bool on) { ditorch::setBf16MatmulViaFp32(on); });
  m.def("bf16_matmul_via_fp32() -> bool", [] { return ditorch::bf16MatmulViaFp32(); });
}
