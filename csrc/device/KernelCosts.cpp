#include "device/KernelCosts.h"

#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <string_view>

namespace ditorch {
namespace {

Datasheet& active() {
  static Datasheet d;
  return d;
}

bool startsWith(std::string_view s, std::string_view prefix) { return s.substr(0, prefix.size()) == prefix; }
bool endsWith(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

// Ops that only touch a tensor's metadata: a real device launches no kernel for them.
bool metadataOnly(std::string_view op) {
  static constexpr std::string_view kOps[] = {
      "empty", "empty_strided", "as_strided", "view", "_reshape_alias", "_unsafe_view", "resize_", "set_",
      "alias", "detach", "unsqueeze", "squeeze", "permute", "transpose", "t", "expand", "slice", "select",
      "split", "unbind", "_local_scalar_dense", "lift_fresh", "record_stream"};
  for (const std::string_view m : kOps)
    if (op == m) return true;
  return startsWith(op, "empty.");
}

// Ops that reduce their input to far fewer elements: they read it and write little.
bool reduction(std::string_view op) {
  static constexpr std::string_view kOps[] = {
      "sum", "mean", "amax", "amin", "max", "min", "norm", "linalg_vector_norm", "var", "std", "var_mean",
      "std_mean", "prod", "any", "all", "argmax", "argmin", "logsumexp", "count_nonzero", "nansum", "aminmax",
      "_foreach_norm", "_fused_rms_norm"};
  for (const std::string_view r : kOps)
    if (op == r) return true;
  return false;
}

// In-place ops that write their first argument without reading it.
bool writeOnly(std::string_view op) {
  static constexpr std::string_view kOps[] = {"fill_", "zero_", "normal_", "uniform_", "random_", "bernoulli_",
                                              "exponential_", "geometric_", "cauchy_", "log_normal_", "copy_"};
  for (const std::string_view w : kOps)
    if (op == w) return true;
  return false;
}

Precision precisionOf(c10::ScalarType t, bool fp32_as_tf32) {
  switch (t) {
    case c10::ScalarType::BFloat16: return Precision::BF16;
    case c10::ScalarType::Half: return Precision::FP16;
    case c10::ScalarType::Float8_e4m3fn:
    case c10::ScalarType::Float8_e5m2:
    case c10::ScalarType::Float8_e4m3fnuz:
    case c10::ScalarType::Float8_e5m2fnuz: return Precision::FP8;
    case c10::ScalarType::Float: return fp32_as_tf32 ? Precision::TF32 : Precision::FP32;
    case c10::ScalarType::Char:
    case c10::ScalarType::Byte: return Precision::FP8;  // int8 units run at the FP8 rate on these parts
    default: return Precision::FP32;
  }
}

double product(const TensorShape& s, int from, int to) {
  double p = 1;
  for (int d = from; d < to; ++d) p *= double(s.sizes[d]);
  return p;
}

// A result of `elements` elements of `like`'s dtype, in bytes.
double resultBytes(double elements, const TensorShape& like) { return elements * double(c10::elementSize(like.dtype)); }

// mm(a[m,k], b[k,n]) and its relatives: the two operands at `a` and `a + 1`.
bool matmulWork(const KernelSignature& k, int a, KernelWork& w) {
  if (k.tensors() <= a + 1 || a + 1 >= KernelSignature::kMaxShapes) return false;
  const TensorShape &x = k.shape(a), &y = k.shape(a + 1);
  double m, kk, n, batch = 1;
  if (x.dims == 2 && y.dims == 2) {
    m = x.sizes[0], kk = x.sizes[1], n = y.sizes[1];
  } else if (x.dims == 3 && y.dims == 3) {
    batch = x.sizes[0], m = x.sizes[1], kk = x.sizes[2], n = y.sizes[2];
  } else if (x.dims == 2 && y.dims == 1) {  // mv
    m = x.sizes[0], kk = x.sizes[1], n = 1;
  } else if (x.dims == 1 && y.dims == 1) {  // dot
    m = 1, kk = x.sizes[0], n = 1;
  } else {
    return false;
  }
  w.flops = 2 * batch * m * kk * n;
  w.bytes = double(k.inputBytes()) + resultBytes(batch * m * n, x);
  return true;
}

// linear(input[..., k], weight[n, k], bias?)
bool linearWork(const KernelSignature& k, KernelWork& w) {
  if (k.tensors() < 2) return false;
  const TensorShape &x = k.shape(0), &weight = k.shape(1);
  if (x.dims < 1 || weight.dims != 2) return false;
  const double rows = double(x.numel) / double(std::max<int64_t>(1, x.size(-1)));
  w.flops = 2 * double(x.numel) * double(weight.sizes[0]);
  w.bytes = double(k.inputBytes()) + resultBytes(rows * double(weight.sizes[0]), x);
  return true;
}

// Scaled dot-product attention: q[b, h, sq, d], k[b, hkv, sk, d], v[b, hkv, sk, dv] from `q`.
// flop_counter's sdpa_flop_count (forward: q k^T and p v) and sdpa_backward_flop_count (the
// scores recomputed and four products: 5 bmm).
bool attentionWork(const KernelSignature& sig, int q_at, bool backward, KernelWork& w) {
  if (sig.tensors() < q_at + 3 || q_at + 2 >= KernelSignature::kMaxShapes) return false;
  const TensorShape &q = sig.shape(q_at), &k = sig.shape(q_at + 1), &v = sig.shape(q_at + 2);
  if (q.dims < 3 || k.dims != q.dims || v.dims != q.dims) return false;
  const double bh = product(q, 0, q.dims - 2), sq = q.size(-2), d = q.size(-1), sk = k.size(-2), dv = v.size(-1);
  if (backward) {
    w.flops = 2 * bh * (sq * d * sk + sq * dv * sk + sk * sq * dv + sq * sk * d + d * sq * sk);
    w.bytes = double(sig.inputBytes()) + double(q.bytes() + k.bytes() + v.bytes());  // reads, and the three grads
  } else {
    w.flops = 2 * bh * sq * sk * d + 2 * bh * sq * sk * dv;
    w.bytes = double(sig.inputBytes()) + resultBytes(bh * sq * dv, q);
  }
  return true;
}

// convolution(input, weight, bias?, stride, padding, dilation, transposed, output_padding, groups):
// flop_counter's conv_flop_count, 2 * batch * prod(spatial) * c_out * c_in/groups * prod(kernel),
// the spatial shape being the output's (the input's for a transposed convolution).
bool convolutionWork(const KernelSignature& k, bool backward, KernelWork& w) {
  const int x_at = backward ? 1 : 0;  // convolution_backward(grad_output, input, weight, ...)
  if (k.tensors() < x_at + 2) return false;
  const TensorShape &x = k.shape(x_at), &weight = k.shape(x_at + 1);
  const int spatial = weight.dims - 2;
  if (spatial < 1 || x.dims != weight.dims) return false;
  double conv_shape = 1;
  bool transposed;
  if (backward) {
    const TensorShape& grad_out = k.shape(0);
    transposed = grad_out.sizes[1] != weight.sizes[0];
    conv_shape = product(transposed ? x : grad_out, 2, x.dims);
  } else {
    if (k.ints() < 3 * spatial + 1 || 3 * spatial + 1 > KernelSignature::kMaxInts) return false;
    transposed = k.intAt(3 * spatial) != 0;
    for (int d = 0; d < spatial; ++d) {
      const double in = x.sizes[2 + d], kernel = weight.sizes[2 + d];
      const double stride = k.intAt(d), pad = k.intAt(spatial + d), dilation = k.intAt(2 * spatial + d);
      conv_shape *= transposed ? in : std::floor((in + 2 * pad - dilation * (kernel - 1) - 1) / stride) + 1;
    }
  }
  const double c_out = weight.sizes[0], c_in = weight.sizes[1];
  const double once = 2 * double(x.sizes[0]) * conv_shape * c_out * product(weight, 2, weight.dims) * c_in;
  w.flops = backward ? 2 * once : once;  // grad_input and grad_weight each cost the forward's FLOPs
  w.bytes = double(k.inputBytes()) + (backward ? double(x.bytes() + weight.bytes())
                                               : resultBytes(double(x.sizes[0]) * c_out * conv_shape, x));
  return true;
}

}  // namespace

const Datasheet& chipDatasheet() { return active(); }

void setChipDatasheet(const Datasheet& datasheet) { active() = datasheet; }

KernelWork kernelWork(const KernelSignature& k) {
  std::string_view op = k.name();
  if (startsWith(op, "aten::")) op.remove_prefix(6);
  KernelWork w;
  if (metadataOnly(op)) {
    w.launched = false;
    return w;
  }
  bool compute = false;
  int operand = 0;  // the tensor whose dtype sets the precision
  if (op == "mm" || op == "bmm" || op == "mv" || op == "dot") {
    compute = matmulWork(k, 0, w);
  } else if (op == "addmm" || op == "_addmm_activation" || op == "baddbmm" || op == "addmv") {
    compute = matmulWork(k, 1, w), operand = 1;
  } else if (op == "linear") {
    compute = linearWork(k, w);
  } else if (startsWith(op, "_scaled_dot_product") || op == "scaled_dot_product_attention") {
    const bool backward = endsWith(op, "_backward");
    compute = attentionWork(k, backward ? 1 : 0, backward, w), operand = backward ? 1 : 0;
  } else if (op == "convolution" || op == "_convolution" || op == "convolution_overrideable") {
    compute = convolutionWork(k, false, w);
  } else if (op == "convolution_backward" || op == "convolution_backward_overrideable") {
    compute = convolutionWork(k, true, w), operand = 1;
  }
  if (compute) {
    w.precision = precisionOf(k.shape(operand).dtype, active().fp32_matmul_as_tf32);
    return w;
  }
  // Memory-bound: every input is read once and a result the size of the largest input written
  // (broadcasting ops); in place, the first argument is also written; a reduction's result and
  // a write-only op's reads are negligible.
  const double in = double(k.inputBytes());
  const double first = k.tensors() > 0 ? double(k.shape(0).bytes()) : 0;
  if (reduction(op) || writeOnly(op)) {
    w.bytes = in;
  } else if (endsWith(op, "_")) {
    w.bytes = in + first;
  } else {
    w.bytes = in + double(k.largestBytes());
  }
  return w;
}

double peakFlops(const Datasheet& d, Precision p) {
  static constexpr Precision kFallback[][3] = {
      /*FP32*/ {Precision::FP32, Precision::FP32, Precision::FP32},
      /*TF32*/ {Precision::TF32, Precision::FP32, Precision::FP32},
      /*BF16*/ {Precision::BF16, Precision::FP16, Precision::FP32},
      /*FP16*/ {Precision::FP16, Precision::BF16, Precision::FP32},
      /*FP8*/ {Precision::FP8, Precision::FP16, Precision::BF16},
  };
  for (const Precision q : kFallback[int(p)])
    if (d.peak_flops[int(q)] > 0) return d.peak_flops[int(q)];
  return d.peak_flops[int(Precision::FP32)];
}

double chipSeconds(const KernelWork& w, const Datasheet& d) {
  if (!w.launched || !d.defined()) return 0;
  const double compute = w.flops > 0 ? w.flops / peakFlops(d, w.precision) : 0;
  return d.launch_s + std::max(compute, w.bytes / d.memory_bytes_per_s);
}

}  // namespace ditorch

// Set from Python as torch.ops.ditorch_emu.set_datasheet (ditorch_ext/chip.py).
TORCH_LIBRARY_FRAGMENT(ditorch_emu, m) {
  m.def("set_datasheet(float[] peak_flops, float memory_bytes_per_s, float launch_s, bool fp32_matmul_as_tf32) -> ()",
        [](std::vector<double> peaks, double bandwidth, double launch, bool tf32) {
          TORCH_CHECK(peaks.size() == size_t(ditorch::Precision::kCount), "set_datasheet: expected ",
                      int(ditorch::Precision::kCount), " peaks (fp32, tf32, bf16, fp16, fp8), got ", peaks.size());
          ditorch::Datasheet d;
          for (size_t i = 0; i < peaks.size(); ++i) {
            TORCH_CHECK(std::isfinite(peaks[i]) && peaks[i] >= 0, "set_datasheet: peak ", i, " is ", peaks[i],
                        "; expected a finite number >= 0");
            d.peak_flops[i] = peaks[i];
          }
          TORCH_CHECK(std::isfinite(bandwidth) && bandwidth >= 0, "set_datasheet: memory bandwidth ", bandwidth,
                      " must be a finite number >= 0");
          TORCH_CHECK(std::isfinite(launch) && launch >= 0, "set_datasheet: launch latency ", launch, " must be >= 0");
          TORCH_CHECK(bandwidth == 0 || peaks[0] > 0, "set_datasheet: a datasheet needs an fp32 peak");
          d.memory_bytes_per_s = bandwidth;
          d.launch_s = launch;
          d.fp32_matmul_as_tf32 = tf32;
          ditorch::setChipDatasheet(d);
        });
  m.def("kernel_work(str op, Tensor?[] tensors, int[] ints) -> float[]",
        [](std::string op, c10::List<std::optional<at::Tensor>> tensors, std::vector<int64_t> ints) {
          // An op's work as the emulated device counts it, without running it: [FLOPs, bytes,
          // precision (Precision's index), launched (1 or 0)]. The planner's datasheet layer times
          // (heteropp/roofline.py) trace a layer on meta tensors through it.
          const c10::FunctionSchema schema(op, "", {}, {});
          ditorch::KernelSignature k(schema);
          for (const std::optional<at::Tensor> t : tensors) k.addTensor(t.has_value() ? *t : at::Tensor());
          for (const int64_t v : ints) k.addInt(v);
          const ditorch::KernelWork w = ditorch::kernelWork(k);
          return std::vector<double>{w.flops, w.bytes, double(int(w.precision)), w.launched ? 1.0 : 0.0};
        });
}
