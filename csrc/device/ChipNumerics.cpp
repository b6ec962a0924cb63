#include "device/ChipNumerics.h"

#include "device/vendor/Vendor.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/ExpandUtils.h>
#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <torch/library.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cstdint>
#include <cstring>
#include <unordered_map>
#include <unordered_set>
#include <vector>

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

// `result` = fp32 `x` narrowed to result's dtype as the chip rounds: nearest-even (copy_'s own
// conversion) or by truncation (the value truncated to the narrow mantissa first, which then
// converts exactly).
void narrowInto(const at::Tensor& result, const at::Tensor& x, bool toward_zero) {
  const at::ScalarType dtype = result.scalar_type();
  result.copy_(toward_zero && isNarrow(dtype)
                   ? roundMantissa(x, dtype == at::kBFloat16 ? 7 : 10, Rounding::TowardZero)
                   : x);
}

// The chip's K-reduction as one fused kernel (accumulate(), below). Each output tile's running
// sum stays in registers across all of K: every block of K-terms is added into it by FMAs and
// the sum is truncated to the accumulator's bits after the block, so the emulation costs one
// pass over the inputs, as a GEMM does, instead of a GEMM per block re-reading and re-writing
// the whole output (output-bandwidth bound: 2 * block flops per element moved). Both operands
// are packed once per call into fp32 panels (the bf16/fp16 widening happens there, no separate
// conversion pass); columns of tiles are split over threads by at::parallel_for (serial unless
// the extension is built with OpenMP). ATen has no GEMM with a hook between K-blocks, hence a
// kernel of our own; its instruction set is chosen at run time as ATen chooses its own
// (ATEN_CPU_CAPABILITY included). It serves every host shape: benchmarks/chip_numerics.py found
// no llama-small matmul that one GEMM per block does faster on one thread, as chips' ranks run.
namespace accumulation {

// How the running sum is truncated after each block: `mask` keeps the accumulator's mantissa
// bits; with no bit kept, `keep_specials` lets inf and NaN pass (with a bit kept every NaN an
// FMA makes is quiet, its top mantissa bit set, so the mask alone leaves NaN and inf as they are).
struct Truncation {
  uint32_t mask;
  bool keep_specials;
};

Truncation truncationTo(int bits) {
  if (bits >= 23) return {~0u, false};
  return {~((1u << (23 - bits)) - 1), bits < 1};
}

constexpr uint32_t kExponent = 0x7f800000u;

// One tile: out[MR x NR] = the chip's sum over `k` of a_panel[k][0..MR) x b_panel[k][0..NR).
using TileKernel = void (*)(const float* a_panel, const float* b_panel, int64_t k, int64_t block, Truncation t,
                            float* out);

struct Kernel {
  int64_t mr, nr;
  TileKernel tile;
  const char* name;
};

template <int MR, int NR>
void tileScalar(const float* ap, const float* bp, int64_t k, int64_t block, Truncation t, float* out) {
  float acc[MR][NR] = {};
  for (int64_t k0 = 0; k0 < k; k0 += block) {
    const int64_t end = std::min(k, k0 + block);
    for (int64_t kk = k0; kk < end; ++kk) {
      const float* a = ap + kk * MR;
      const float* b = bp + kk * NR;
      for (int i = 0; i < MR; ++i)
        for (int j = 0; j < NR; ++j) acc[i][j] += a[i] * b[j];
    }
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) {
        uint32_t u;
        std::memcpy(&u, &acc[i][j], 4);
        if (!(t.keep_specials && (u & kExponent) == kExponent)) u &= t.mask;
        std::memcpy(&acc[i][j], &u, 4);
      }
  }
  std::memcpy(out, acc, sizeof(acc));
}

#if defined(__x86_64__) && defined(__GNUC__)
// 8 rows x 32 columns: 16 accumulators of the 32 zmm registers, 2 for B's row, the rows of A
// broadcast from memory.
__attribute__((target("avx512f"))) void tileAvx512(const float* ap, const float* bp, int64_t k, int64_t block,
                                                     Truncation t, float* out) {
  constexpr int MR = 8;
  __m512 c[MR][2];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) c[i][0] = c[i][1] = _mm512_setzero_ps();
  const __m512i mask = _mm512_set1_epi32(static_cast<int>(t.mask));
  const __m512i exponent = _mm512_set1_epi32(static_cast<int>(kExponent));
  for (int64_t k0 = 0; k0 < k; k0 += block) {
    const int64_t end = std::min(k, k0 + block);
    for (int64_t kk = k0; kk < end; ++kk) {
      const __m512 b0 = _mm512_loadu_ps(bp + kk * 32), b1 = _mm512_loadu_ps(bp + kk * 32 + 16);
      const float* a = ap + kk * MR;
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        const __m512 ai = _mm512_set1_ps(a[i]);
        c[i][0] = _mm512_fmadd_ps(ai, b0, c[i][0]);
        c[i][1] = _mm512_fmadd_ps(ai, b1, c[i][1]);
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 2
      for (int j = 0; j < 2; ++j) {
        const __m512i u = _mm512_castps_si512(c[i][j]);
        __m512i kept = _mm512_and_si512(u, mask);
        if (t.keep_specials)
          kept = _mm512_mask_blend_epi32(_mm512_cmpeq_epi32_mask(_mm512_and_si512(u, exponent), exponent), kept, u);
        c[i][j] = _mm512_castsi512_ps(kept);
      }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    _mm512_storeu_ps(out + i * 32, c[i][0]);
    _mm512_storeu_ps(out + i * 32 + 16, c[i][1]);
  }
}

// 6 rows x 16 columns: 12 accumulators of the 16 ymm registers, 2 for B's row, 1 for A's.
__attribute__((target("avx2,fma"))) void tileAvx2(const float* ap, const float* bp, int64_t k, int64_t block,
                                                   Truncation t, float* out) {
  constexpr int MR = 6;
  __m256 c[MR][2];
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i) c[i][0] = c[i][1] = _mm256_setzero_ps();
  const __m256i mask = _mm256_set1_epi32(static_cast<int>(t.mask));
  const __m256i exponent = _mm256_set1_epi32(static_cast<int>(kExponent));
  for (int64_t k0 = 0; k0 < k; k0 += block) {
    const int64_t end = std::min(k, k0 + block);
    for (int64_t kk = k0; kk < end; ++kk) {
      const __m256 b0 = _mm256_loadu_ps(bp + kk * 16), b1 = _mm256_loadu_ps(bp + kk * 16 + 8);
      const float* a = ap + kk * MR;
#pragma GCC unroll 6
      for (int i = 0; i < MR; ++i) {
        const __m256 ai = _mm256_broadcast_ss(a + i);
        c[i][0] = _mm256_fmadd_ps(ai, b0, c[i][0]);
        c[i][1] = _mm256_fmadd_ps(ai, b1, c[i][1]);
      }
    }
#pragma GCC unroll 6
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 2
      for (int j = 0; j < 2; ++j) {
        const __m256i u = _mm256_castps_si256(c[i][j]);
        __m256i kept = _mm256_and_si256(u, mask);
        if (t.keep_specials)
          kept = _mm256_blendv_epi8(kept, u, _mm256_cmpeq_epi32(_mm256_and_si256(u, exponent), exponent));
        c[i][j] = _mm256_castsi256_ps(kept);
      }
  }
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i) {
    _mm256_storeu_ps(out + i * 16, c[i][0]);
    _mm256_storeu_ps(out + i * 16 + 8, c[i][1]);
  }
}
#endif

// The widest kernel both this CPU and ATen's chosen capability allow (ATEN_CPU_CAPABILITY=avx2
// makes a host without AVX-512 of one with it, for ATen and for this kernel alike).
Kernel chooseKernel() {
#if defined(__x86_64__) && defined(__GNUC__)
  const std::string ability = at::get_cpu_capability();
  if (ability == "AVX512" && __builtin_cpu_supports("avx512f")) return {8, 32, tileAvx512, "avx512"};
  if ((ability == "AVX512" || ability == "AVX2") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    return {6, 16, tileAvx2, "avx2"};
#endif
  return {4, 16, tileScalar<4, 16>, "scalar"};
}

const Kernel& kernel() {
  static const Kernel chosen = chooseKernel();
  return chosen;
}

// One element widened to fp32 (bf16 by its bits: c10's conversion is not inlined into a loop the
// compiler can vectorize).
inline float widen(float v) { return v; }
inline float widen(double v) { return static_cast<float>(v); }
inline float widen(at::Half v) { return static_cast<float>(v); }
inline float widen(at::BFloat16 v) {
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// One panel: to[k][0..R) = from[r * s_row + k * s_k] for the first `live` rows, zeros after. R
// is a constant so that the loops over a full panel's rows unroll and vectorize.
template <int64_t R, typename T>
void packPanel(const T* from, int64_t live, int64_t k, int64_t s_row, int64_t s_k, float* to) {
  constexpr int64_t kChunk = 16;
  if (live < R) {  // the last panel: element by element
    for (int64_t kk = 0; kk < k; ++kk)
      for (int64_t r = 0; r < R; ++r) to[kk * R + r] = r < live ? widen(from[r * s_row + kk * s_k]) : 0.0f;
  } else if (s_row == 1) {  // rows contiguous: copied in the order they are written
    for (int64_t kk = 0; kk < k; ++kk)
      for (int64_t r = 0; r < R; ++r) to[kk * R + r] = widen(from[kk * s_k + r]);
  } else if (s_k == 1) {  // k contiguous (a row-major A, a transposed weight): a chunk of k at a time, transposed
    float chunk[R][kChunk];
    int64_t k0 = 0;
    for (; k0 + kChunk <= k; k0 += kChunk) {
      for (int64_t r = 0; r < R; ++r)
        for (int64_t j = 0; j < kChunk; ++j) chunk[r][j] = widen(from[r * s_row + k0 + j]);
      for (int64_t j = 0; j < kChunk; ++j)
        for (int64_t r = 0; r < R; ++r) to[(k0 + j) * R + r] = chunk[r][j];
    }
    for (; k0 < k; ++k0)
      for (int64_t r = 0; r < R; ++r) to[k0 * R + r] = widen(from[r * s_row + k0]);
  } else {
    for (int64_t kk = 0; kk < k; ++kk)
      for (int64_t r = 0; r < R; ++r) to[kk * R + r] = widen(from[r * s_row + kk * s_k]);
  }
}

// dst[batch][panel][k][0..R) = src[batch, panel * R + r, k] widened to fp32 (0 past `rows`): an
// operand in the layout its tile reads, whatever its strides and dtype.
template <int64_t R, typename T>
void packPanels(const T* src, int64_t batch, int64_t rows, int64_t k, int64_t s_batch, int64_t s_row, int64_t s_k,
                float* dst) {
  const int64_t panels = (rows + R - 1) / R;
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, k * R));
  at::parallel_for(0, batch * panels, grain, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t bi = p / panels, first = (p % panels) * R;
      packPanel<R>(src + bi * s_batch + first * s_row, std::min(R, rows - first), k, s_row, s_k, dst + p * k * R);
    }
  });
}

// packPanels for the panel widths the kernels use.
template <typename T>
void pack(const T* src, int64_t batch, int64_t rows, int64_t k, int64_t s_batch, int64_t s_row, int64_t s_k,
          int64_t R, float* dst) {
  switch (R) {
    case 4: return packPanels<4>(src, batch, rows, k, s_batch, s_row, s_k, dst);
    case 6: return packPanels<6>(src, batch, rows, k, s_batch, s_row, s_k, dst);
    case 8: return packPanels<8>(src, batch, rows, k, s_batch, s_row, s_k, dst);
    case 16: return packPanels<16>(src, batch, rows, k, s_batch, s_row, s_k, dst);
    case 32: return packPanels<32>(src, batch, rows, k, s_batch, s_row, s_k, dst);
    default: TORCH_INTERNAL_ASSERT(false, "chip matmul: no packing for panels of ", R);
  }
}

// a [batch, m, k] @ b [batch, k, n] into a new fp32 [batch, m, n], summed as the chip sums. A is
// packed whole; each of B's panels is packed by the thread that runs its column of tiles, just
// before it runs them, so the panel goes through memory once and its tiles read it from cache.
at::Tensor blockedMatmul(const at::Tensor& a, const at::Tensor& b, int64_t block, Truncation t) {
  const Kernel& kern = kernel();
  const int64_t batch = a.size(0), m = a.size(1), k = a.size(2), n = b.size(2);
  const int64_t mp = (m + kern.mr - 1) / kern.mr, np = (n + kern.nr - 1) / kern.nr;
  at::Tensor a_packed = at::empty({batch * mp * k * kern.mr}, a.options().dtype(at::kFloat));
  at::Tensor out = at::empty({batch, m, n}, a.options().dtype(at::kFloat));
  if (out.numel() == 0) return out;
  float* cp = out.mutable_data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, a.scalar_type(), "chip_accumulate", [&] {
    float* ap = a_packed.mutable_data_ptr<float>();
    pack(a.const_data_ptr<scalar_t>(), batch, m, k, a.stride(0), a.stride(1), a.stride(2), kern.mr, ap);
    const scalar_t* bsrc = b.const_data_ptr<scalar_t>();
    const int64_t sb = b.stride(0), s_col = b.stride(2), s_k = b.stride(1);
    // Work units (batch, B's panel): a panel's column of tiles.
    const int64_t grain = std::max<int64_t>(1, (1 << 18) / (mp * k * kern.mr * kern.nr));
    at::parallel_for(0, batch * np, grain, [&](int64_t begin, int64_t end) {
      thread_local std::vector<float> panel;  // kept between calls: one panel, K x NR
      panel.resize(std::max<size_t>(panel.size(), k * kern.nr));
      std::vector<float> tile(kern.mr * kern.nr);
      for (int64_t u = begin; u < end; ++u) {
        const int64_t bi = u / np, jp = u % np, cols = std::min(kern.nr, n - jp * kern.nr);
        pack(bsrc + bi * sb + jp * kern.nr * s_col, 1, cols, k, 0, s_col, s_k, kern.nr, panel.data());
        for (int64_t ip = 0; ip < mp; ++ip) {
          kern.tile(ap + (bi * mp + ip) * k * kern.mr, panel.data(), k, block, t, tile.data());
          const int64_t rows = std::min(kern.mr, m - ip * kern.mr);
          float* to = cp + bi * m * n + ip * kern.mr * n + jp * kern.nr;
          for (int64_t i = 0; i < rows; ++i) std::memcpy(to + i * n, tile.data() + i * kern.nr, cols * sizeof(float));
        }
      }
    });
  });
  return out;
}

}  // namespace accumulation

// `sum` truncated in place to `bits` mantissa bits, as a narrow accumulator keeps it, by the
// device's own kernels.
void truncateInPlace(at::Tensor& sum, int bits) {
  if (bits >= 23) return;
  const int64_t mask = static_cast<int32_t>(~((1u << (23 - bits)) - 1));
  at::Tensor u = sum.view(at::kInt);
  // Every NaN an addition makes is quiet (its top mantissa bit set) and an infinity has no
  // mantissa, so with a bit or more kept the mask alone leaves both as they are.
  if (bits >= 1) u.bitwise_and_(mask);
  else u.copy_(at::where(sum.isfinite(), u.bitwise_and(mask), u));
}

// accumulate() on another device's tensors (a GPU's, with the native vendor), from the device's
// own kernels: each block added to the running sum by one GEMM, then the sum truncated. The
// fused kernel below reads host memory only.
at::Tensor accumulateByBlockGemms(const at::Tensor& a, const at::Tensor& b, const Numerics& n) {
  const at::Tensor af = a.to(at::kFloat), bf = b.to(at::kFloat);
  const int64_t k = af.size(-1);
  if (k == 0) return at::matmul(af, bf);
  const int64_t block = n.accumulation_block > 0 ? std::min<int64_t>(n.accumulation_block, k) : k;
  const int64_t cols = bf.size(-1);
  const at::Tensor a3 = af.dim() == 2 ? af.unsqueeze(0) : af, b3 = bf.dim() == 2 ? bf.unsqueeze(0) : bf;
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

// a @ b (batched or not) with the chip's K-reduction: each block of K-terms summed in fp32, the
// running sum truncated to the accumulator's mantissa after every block (the fused kernel above,
// for host tensors).
at::Tensor accumulate(const at::Tensor& a, const at::Tensor& b, const Numerics& n) {
  TORCH_CHECK((a.dim() == 2 && b.dim() == 2) || (a.dim() == 3 && b.dim() == 3 && a.size(0) == b.size(0)),
              "chip matmul: operands of shapes ", a.sizes(), " and ", b.sizes(),
              "; expected two matrices or two batches of as many matrices");
  TORCH_CHECK(a.size(-1) == b.size(-2), "chip matmul: operands of shapes ", a.sizes(), " and ", b.sizes(),
              "; expected the first's columns to equal the second's rows");
  TORCH_CHECK(at::isFloatingType(a.scalar_type()) && at::isFloatingType(b.scalar_type()), "chip matmul: operands of ",
              a.scalar_type(), " and ", b.scalar_type(), "; expected floating types");
  if (!a.device().is_cpu() || !b.device().is_cpu()) return accumulateByBlockGemms(a, b, n);
  std::vector<int64_t> shape(a.sizes().begin(), a.sizes().end() - 1);
  shape.push_back(b.size(-1));
  const int64_t k = a.size(-1);
  if (k == 0) return at::zeros(shape, a.options().dtype(at::kFloat));
  // Mixed dtypes are widened to one (each converts exactly to fp32 in the packing).
  const bool same = a.scalar_type() == b.scalar_type();
  const at::Tensor a3 = same ? a : a.to(at::kFloat), b3 = same ? b : b.to(at::kFloat);
  const int64_t block = n.accumulation_block > 0 ? std::min<int64_t>(n.accumulation_block, k) : k;
  return accumulation::blockedMatmul(a3.dim() == 2 ? a3.unsqueeze(0) : a3, b3.dim() == 2 ? b3.unsqueeze(0) : b3, block,
                                     accumulation::truncationTo(n.accumulator_bits))
      .view(shape);
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
  narrowInto(result, y, n.round_toward_zero);
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
  narrowInto(result, roundMantissa(exact, n.special_function_bits, Rounding::TowardZero), n.round_toward_zero);
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

at::Tensor chipMatmul(const at::Tensor& a, const at::Tensor& b, int64_t accumulator_bits, int64_t accumulation_block) {
  TORCH_CHECK(accumulator_bits >= 0 && accumulator_bits <= 23, "chip_matmul: accumulator_bits=", accumulator_bits,
              "; expected 0 to 23 mantissa bits");
  TORCH_CHECK(accumulation_block >= 0, "chip_matmul: accumulation_block=", accumulation_block,
              "; expected a block of K-terms >= 0 (0: all of K)");
  TORCH_CHECK(a.device().is_cpu() && b.device().is_cpu(), "chip_matmul: operands on ", a.device(), " and ",
              b.device(), "; expected host (cpu) tensors");
  Numerics n;
  n.accumulator_bits = static_cast<int>(accumulator_bits);
  n.accumulation_block = static_cast<int>(std::min<int64_t>(accumulation_block, INT32_MAX));
  return accumulate(a, b, n);
}

const char* chipMatmulKernel() { return accumulation::kernel().name; }

void copyOnChip(const at::Tensor& dst, const at::Tensor& src, const Numerics& numerics) {
  const bool wide_source = src.scalar_type() == at::kFloat || src.scalar_type() == at::kDouble;
  if (!numerics.round_toward_zero || !isNarrow(dst.scalar_type()) || !wide_source) {
    dst.copy_(src);
    return;
  }
  narrowInto(dst, src.to(at::kFloat), true);
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
  // The chip's K-reduction on host tensors, for tests and benchmarks/chip_numerics.py.
  m.def("chip_matmul(Tensor a, Tensor b, int accumulator_bits, int accumulation_block) -> Tensor",
        [](const at::Tensor& a, const at::Tensor& b, int64_t accumulator_bits, int64_t accumulation_block) {
          return ditorch::chipMatmul(a, b, accumulator_bits, accumulation_block);
        });
  m.def("chip_matmul_kernel() -> str", [] { return std::string(ditorch::chipMatmulKernel()); });
}
