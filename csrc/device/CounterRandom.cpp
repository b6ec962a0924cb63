#include "device/CounterRandom.h"

#include "device/Generator.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/ones_like.h>
#include <ATen/ops/view_as_real.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <mutex>
#include <string>

namespace ditorch {

PhiloxBlock philox(uint64_t seed, uint64_t counter) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;  // Philox4x32 multipliers
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;  // key schedule increments
  uint32_t c0 = uint32_t(counter), c1 = uint32_t(counter >> 32), c2 = 0, c3 = 0;
  uint32_t k0 = uint32_t(seed), k1 = uint32_t(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = uint64_t(kMul0) * c0, p1 = uint64_t(kMul1) * c2;
    const uint32_t n0 = uint32_t(p1 >> 32) ^ c1 ^ k0, n2 = uint32_t(p0 >> 32) ^ c3 ^ k1;
    c1 = uint32_t(p1);
    c3 = uint32_t(p0);
    c0 = n0;
    c2 = n2;
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  return {{c0, c1, c2, c3}};
}

namespace {

enum class Draw { Uniform, Normal, Random, RandomFrom, RandomTo, BernoulliScalar, BernoulliTensor, BernoulliSelf,
                  BernoulliP, Exponential, Geometric, LogNormal, Cauchy, Dropout };

std::optional<Draw> drawOf(const c10::OperatorName& name) {
  const std::string& n = name.name;
  const std::string& o = name.overload_name;
  if (n == "aten::uniform_" && o.empty()) return Draw::Uniform;
  if (n == "aten::normal_" && o.empty()) return Draw::Normal;
  if (n == "aten::random_") {
    if (o.empty()) return Draw::Random;
    if (o == "from") return Draw::RandomFrom;
    if (o == "to") return Draw::RandomTo;
  }
  if (n == "aten::bernoulli_") {
    if (o == "float") return Draw::BernoulliScalar;
    if (o == "Tensor") return Draw::BernoulliTensor;
  }
  if (n == "aten::bernoulli") {
    if (o.empty()) return Draw::BernoulliSelf;
    if (o == "p") return Draw::BernoulliP;
  }
  if (n == "aten::exponential_" && o.empty()) return Draw::Exponential;
  if (n == "aten::geometric_" && o.empty()) return Draw::Geometric;
  if (n == "aten::log_normal_" && o.empty()) return Draw::LogNormal;
  if (n == "aten::cauchy_" && o.empty()) return Draw::Cauchy;
  if (n == "aten::native_dropout" && o.empty()) return Draw::Dropout;
  return std::nullopt;
}

// The op's generator argument: its slot on the stack, or -1 (native_dropout has none).
int generatorSlot(const c10::FunctionSchema& schema) {
  const auto& args = schema.arguments();
  for (size_t i = 0; i < args.size(); ++i)
    if (args[i].name() == "generator") return static_cast<int>(i);
  return -1;
}

constexpr double k2Pow53 = 9007199254740992.0;

uint64_t bits64(const PhiloxBlock& b, int half) { return uint64_t(b.w[2 * half]) << 32 | b.w[2 * half + 1]; }
// Uniform on [0, 1) with 53 random bits (half 0: words 0-1, half 1: words 2-3).
double unit53(const PhiloxBlock& b, int half) { return double(bits64(b, half) >> 11) / k2Pow53; }

// The mantissa bits (with the implicit one) of a floating dtype: a uniform value in [0, 1) drawn
// with that many bits is exact in the dtype and never rounds up to 1.
int digitsOf(c10::ScalarType t) {
  switch (t) {
    case at::kDouble: return 53;
    case at::kHalf: return 11;
    case at::kBFloat16: return 8;
    default: return 24;
  }
}

// Fills a contiguous double tensor of `numel` with f(block of counter first + i).
template <typename F>
at::Tensor fillDouble(int64_t numel, uint64_t seed, uint64_t first, F f) {
  at::Tensor out = at::empty({numel}, at::TensorOptions().dtype(at::kDouble));
  double* data = out.data_ptr<double>();
  at::parallel_for(0, numel, 2048, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) data[i] = f(philox(seed, first + uint64_t(i)), i);
  });
  return out;
}

template <typename F>
at::Tensor fillLong(int64_t numel, uint64_t seed, uint64_t first, F f) {
  at::Tensor out = at::empty({numel}, at::TensorOptions().dtype(at::kLong));
  int64_t* data = out.data_ptr<int64_t>();
  at::parallel_for(0, numel, 2048, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) data[i] = f(philox(seed, first + uint64_t(i)));
  });
  return out;
}

double standardNormal(const PhiloxBlock& b) {
  // Box-Muller: 1 - u is in (0, 1], so the log is finite.
  const double u1 = 1.0 - unit53(b, 0), u2 = unit53(b, 1);
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
}

// The largest value random_() draws for `t` (inclusive): the integers a floating dtype holds
// exactly, the dtype's maximum for an integer one.
uint64_t randomCeiling(c10::ScalarType t) {
  switch (t) {
    case at::kBool: return 1;
    case at::kByte: return std::numeric_limits<uint8_t>::max();
    case at::kChar: return std::numeric_limits<int8_t>::max();
    case at::kShort: return std::numeric_limits<int16_t>::max();
    case at::kInt: return std::numeric_limits<int32_t>::max();
    case at::kLong: return std::numeric_limits<int64_t>::max();
    default:
      TORCH_CHECK(at::isFloatingType(t), "random_: dipu draws random integers into integer, bool and floating "
                  "tensors, not ", t);
      return uint64_t(1) << digitsOf(t);
  }
}

// Integers from + (r mod span) (span 0: the whole 64-bit range), in int64.
at::Tensor randomIntegers(int64_t numel, uint64_t seed, uint64_t first, int64_t from, uint64_t span) {
  return fillLong(numel, seed, first, [&](const PhiloxBlock& b) {
    const uint64_t r = bits64(b, 0);
    return static_cast<int64_t>(static_cast<uint64_t>(from) + (span ? r % span : r));
  });
}

void checkProbability(double p, const char* op) {
  TORCH_CHECK(p >= 0 && p <= 1, op, ": expects 0 <= p <= 1, got p=", p);
}

DipuGenerator& generatorFor(const c10::IValue& slot, int device) {
  const at::Generator& g = slot.isNone() ? defaultGenerator(device) : slot.toGenerator();
  return *static_cast<DipuGenerator*>(g.unsafeGetGeneratorImpl());
}

// Writes `values` (contiguous, row-major) into `self` in its dtype and layout.
void store(at::Tensor& self, const at::Tensor& values) { self.copy_(values.view(self.sizes())); }

}  // namespace

bool drawsCounterBased(const c10::OperatorHandle& op) { return drawOf(op.operator_name()).has_value(); }

void drawCounterBased(const c10::OperatorHandle& op, torch::jit::Stack* stack, int device) {
  const Draw draw = *drawOf(op.operator_name());
  const auto& schema = op.schema();
  const size_t nargs = schema.arguments().size();
  std::vector<c10::IValue> args(stack->end() - nargs, stack->end());
  torch::jit::drop(*stack, nargs);
  const int slot = generatorSlot(schema);
  DipuGenerator& gen = generatorFor(slot >= 0 ? args[slot] : c10::IValue(), device);

  at::Tensor self = args[0].toTensor();
  // The tensor the draws fill, and (native_dropout) the input it masks.
  at::Tensor target = self;
  if (draw == Draw::BernoulliSelf || draw == Draw::BernoulliP) target = at::empty_like(self, at::MemoryFormat::Contiguous);
  double p = 0;
  if (draw == Draw::Dropout) {
    p = args[1].toDouble();
    const bool train = args[2].isNone() || args[2].toBool();
    if (self.numel() == 0 || !train) {
      torch::jit::push(*stack, self.clone(), at::ones_like(self, self.options().dtype(at::kBool)));
      return;
    }
    checkProbability(p, "native_dropout");
    target = at::empty_like(self, self.options().dtype(at::kBool), at::MemoryFormat::Contiguous);
  }
  // A complex tensor draws its real and imaginary parts as two reals each (as ATen's CPU and
  // CUDA kernels do), the normal's spread divided by sqrt(2) per part.
  double part_spread = 1.0;
  if (target.is_complex() && (draw == Draw::Uniform || draw == Draw::Normal)) {
    target = at::view_as_real(target);
    if (draw == Draw::Normal) part_spread = M_SQRT1_2;
  }

  const int64_t n = target.numel();
  uint64_t seed, first;
  {
    std::lock_guard<std::mutex> lock(gen.mutex_);
    seed = gen.current_seed();
    first = gen.takeCounters(static_cast<uint64_t>(n));
  }
  const c10::ScalarType dtype = target.scalar_type();
  switch (draw) {
    case Draw::Uniform: {
      const double from = args[1].toDouble(), to = args[2].toDouble();
      TORCH_CHECK(from <= to, "uniform_ expects to return a [from, to) range, but found from=", from, " > to=", to);
      TORCH_CHECK(at::isFloatingType(dtype), "uniform_: expected a floating tensor, got ", dtype);
      const int digits = digitsOf(dtype);
      const double scale = std::ldexp(1.0, -digits);
      store(target, fillDouble(n, seed, first, [&](const PhiloxBlock& b, int64_t) {
              return from + double(bits64(b, 0) >> (64 - digits)) * scale * (to - from);
            }));
      break;
    }
    case Draw::Normal: {
      const double mean = args[1].toDouble(), std = args[2].toDouble() * part_spread;
      TORCH_CHECK(std >= 0.0, "normal expects std >= 0.0, but found std ", std);
      store(target, fillDouble(n, seed, first, [&](const PhiloxBlock& b, int64_t) { return mean + std * standardNormal(b); }));
      break;
    }
    case Draw::Random:
      store(target, randomIntegers(n, seed, first, 0, randomCeiling(dtype) + 1));
      break;
    case Draw::RandomTo:
    case Draw::RandomFrom: {
      const int64_t from = draw == Draw::RandomTo ? 0 : args[1].toInt();
      const c10::IValue& to_arg = draw == Draw::RandomTo ? args[1] : args[2];
      uint64_t span;
      if (to_arg.isNone()) {
        span = randomCeiling(dtype) - static_cast<uint64_t>(from) + 1;  // up to the ceiling, inclusive
      } else {
        const int64_t to = to_arg.toInt();
        TORCH_CHECK(from < to, "random_ expects 'from' to be less than 'to', but got from=", from, " >= to=", to);
        span = static_cast<uint64_t>(to) - static_cast<uint64_t>(from);
      }
      store(target, randomIntegers(n, seed, first, from, span));
      break;
    }
    case Draw::BernoulliScalar:
    case Draw::BernoulliP:
    case Draw::Dropout: {
      const double prob = draw == Draw::Dropout ? 1.0 - p : args[1].toDouble();
      checkProbability(prob, "bernoulli_");
      store(target, fillDouble(n, seed, first, [&](const PhiloxBlock& b, int64_t) { return unit53(b, 0) < prob ? 1.0 : 0.0; }));
      break;
    }
    case Draw::BernoulliTensor:
    case Draw::BernoulliSelf: {
      const at::Tensor probs = (draw == Draw::BernoulliSelf ? self : args[1].toTensor())
                                   .expand(target.sizes()).to(at::kDouble).contiguous();
      TORCH_CHECK(probs.numel() == 0 || (probs.min().item<double>() >= 0 && probs.max().item<double>() <= 1),
                  "bernoulli: expects every probability in [0, 1]");
      const double* pr = probs.data_ptr<double>();
      store(target, fillDouble(n, seed, first, [&](const PhiloxBlock& b, int64_t i) { return unit53(b, 0) < pr[i] ? 1.0 : 0.0; }));
      break;
    }
    case Draw::Exponential: {
      const double lambd = args[1].toDouble();
      TORCH_CHECK(lambd > 0.0, "exponential_ expects lambda > 0.0, but found lambda=", lambd);
      store(target, fillDouble(n, seed, first, [&](const PhiloxBlock& b, int64_t) { return -std::log1p(-unit53(b, 0)) / lambd; }));
      break;
    }
    case Draw::Geometric: {
      const double prob = args[1].toDouble();
      TORCH_CHECK(prob > 0 && prob < 1, "geometric_ expects p to be in (0, 1), but got p=", prob);
      store(target, fillDouble(n, seed, first, [&](const PhiloxBlock& b, int64_t) {
              const double u = (double(bits64(b, 0) >> 11) + 0.5) / k2Pow53;  // in (0, 1)
              return std::ceil(std::log(u) / std::log1p(-prob));
            }));
      break;
    }
    case Draw::LogNormal: {
      const double mean = args[1].toDouble(), std = args[2].toDouble();
      TORCH_CHECK(std > 0.0, "log_normal_ expects std > 0.0, but found std=", std);
      store(target, fillDouble(n, seed, first, [&](const PhiloxBlock& b, int64_t) { return std::exp(mean + std * standardNormal(b)); }));
      break;
    }
    case Draw::Cauchy: {
      const double median = args[1].toDouble(), sigma = args[2].toDouble();
      store(target, fillDouble(n, seed, first, [&](const PhiloxBlock& b, int64_t) {
              return median + sigma * std::tan(M_PI * (unit53(b, 0) - 0.5));
            }));
      break;
    }
  }
  switch (draw) {
    case Draw::BernoulliSelf:
    case Draw::BernoulliP:
      torch::jit::push(*stack, target);
      break;
    case Draw::Dropout: {
      const double scale = p == 1.0 ? 0.0 : 1.0 / (1.0 - p);
      torch::jit::push(*stack, self.mul(target).mul_(scale), target);
      break;
    }
    default:
      torch::jit::push(*stack, self);
  }
}

}  // namespace ditorch
