// Sparse COO tensors on dipu, and the refusal of quantized ones.
//
// A sparse dipu tensor is ATen's own SparseTensorImpl whose indices and values are dipu tensors:
// its constructor and accessors are ATen's layout-generic kernels, registered here for the
// SparsePrivateUse1 key as ATen registers them for SparseCPU and SparseCUDA. Every computation on
// it (coalesce, to_dense, indexing, arithmetic, ...) runs on the CPU with copies, through the
// same counted fallback as a dense op the vendor lacks: no vendor we emulate or wrap has sparse
// kernels of its own here, and the sparse ops are rare and host-bound on most accelerators.
//
// Quantized tensors have no such generic form (each quantizer is a backend's), nor do the
// compressed sparse layouts here, so every op that reaches QuantizedPrivateUse1 or
// SparseCsrPrivateUse1 is refused, naming the op and the layout.
#include "device/SparseOps.h"

#include "device/CpuFallback.h"
#include "device/vendor/Vendor.h"

#include <ATen/ops/_sparse_coo_tensor_with_dims_and_tensors.h>
#include <ATen/ops/_coalesced_native.h>
#include <ATen/ops/_indices_native.h>
#include <ATen/ops/_nnz_native.h>
#include <ATen/ops/_sparse_coo_tensor_with_dims_and_tensors_native.h>
#include <ATen/ops/_values_native.h>
#include <ATen/ops/dense_dim_native.h>
#include <ATen/ops/indices_native.h>
#include <ATen/ops/is_coalesced_native.h>
#include <ATen/ops/sparse_dim_native.h>
#include <ATen/ops/values_native.h>
#include <ATen/SparseTensorImpl.h>
#include <torch/library.h>

#include <optional>
#include <vector>

namespace ditorch {

at::Tensor sparseOver(const at::Tensor& like, const at::Tensor& indices, const at::Tensor& values) {
  return at::_sparse_coo_tensor_with_dims_and_tensors(like.sparse_dim(), like.dense_dim(), like.sizes(), indices, values,
                                                      like.options().device(values.device()), like.is_coalesced());
}

namespace {

at::Tensor toCpu(const at::Tensor& t) {
  if (!t.defined() || t.device().type() != c10::DeviceType::PrivateUse1) return t;
  if (t.layout() == c10::kSparse) return sparseOver(t, t._indices().cpu(), t._values().cpu());
  return t.cpu();
}

at::Tensor toDevice(const at::Tensor& t, c10::Device device) {
  if (!t.defined() || t.device() == device) return t;
  if (t.layout() == c10::kSparse) return sparseOver(t, t._indices().to(device), t._values().to(device));
  return t.to(device);
}

// `original` (dipu) takes the value its CPU copy `result` has after an in-place or out= op.
void writeBack(const at::Tensor& original, const at::Tensor& result) {
  if (original.layout() == c10::kSparse) {
    auto* impl = static_cast<at::SparseTensorImpl*>(original.unsafeGetTensorImpl());
    impl->resize_(result.sparse_dim(), result.dense_dim(), result.sizes());
    impl->set_indices_and_values_unsafe(result._indices().to(original.device()), result._values().to(original.device()));
    impl->set_coalesced(result.is_coalesced());
    return;
  }
  if (original.sizes() != result.sizes()) original.resize_(result.sizes());
  original.copy_(result);
}

// Every sparse op beyond the accessors: the arguments moved to the CPU (sparse ones as CPU
// sparse tensors), the op run there, the results moved back, and what it wrote in place written
// into the caller's tensors. Counted and warned with the dense fallbacks when the vendor's kernels
// are not the CPU's (on emu, the CPU is where every kernel runs anyway).
void sparseKernel(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  if (kernelDeviceType() != c10::DeviceType::CPU) countCpuFallback(op);
  const c10::FunctionSchema& schema = op.schema();
  const size_t n = schema.arguments().size();
  std::optional<c10::Device> device;
  std::vector<std::optional<at::Tensor>> written(n);  // the caller's tensor of each argument an op writes
  for (size_t i = 0; i < n; ++i) {
    c10::IValue& v = (*stack)[stack->size() - n + i];
    const c10::AliasInfo* alias = schema.arguments()[i].alias_info();
    if (v.isTensor()) {
      const at::Tensor t = v.toTensor();
      if (t.defined() && t.device().type() == c10::DeviceType::PrivateUse1) device = t.device();
      if (alias != nullptr && alias->isWrite()) written[i] = t;
      v = toCpu(t);
    } else if (v.isDevice() && v.toDevice().type() == c10::DeviceType::PrivateUse1) {  // a factory's device=
      device = v.toDevice();
      v = c10::Device(c10::kCPU);
    } else if (v.isTensorList()) {
      c10::List<at::Tensor> cpu;
      for (const at::Tensor& t : v.toTensorList()) {
        if (t.defined() && t.device().type() == c10::DeviceType::PrivateUse1) device = t.device();
        cpu.push_back(toCpu(t));
      }
      v = std::move(cpu);
    }
  }
  TORCH_INTERNAL_ASSERT(device.has_value(), schema.name(), " reached dipu's sparse kernel without a dipu tensor or device");
  std::vector<at::Tensor> cpu_args(n);
  for (size_t i = 0; i < n; ++i)
    if (written[i]) cpu_args[i] = (*stack)[stack->size() - n + i].toTensor();
  op.callBoxed(stack);
  const size_t r = schema.returns().size();
  for (size_t i = 0; i < n; ++i)
    if (written[i]) writeBack(*written[i], cpu_args[i]);
  for (size_t j = 0; j < r; ++j) {
    c10::IValue& v = (*stack)[stack->size() - r + j];
    if (!v.isTensor()) continue;
    const at::Tensor t = v.toTensor();
    bool returned_in_place = false;
    for (size_t i = 0; i < n && !returned_in_place; ++i)
      if (written[i] && cpu_args[i].defined() && t.is_same(cpu_args[i])) {
        v = *written[i];
        returned_in_place = true;
      }
    if (!returned_in_place) v = toDevice(t, *device);
  }
}

[[noreturn]] void refuseQuantized(const c10::OperatorHandle& op, torch::jit::Stack*) {
  TORCH_CHECK_NOT_IMPLEMENTED(false, op.schema().name(), ": quantized tensors (affine per-tensor or per-channel, "
                              "dtypes quint8, qint8, qint32, ...) are not supported on dipu; dequantize() them first "
                              "or keep them on the CPU");
}

[[noreturn]] void refuseCompressed(const c10::OperatorHandle& op, torch::jit::Stack*) {
  TORCH_CHECK_NOT_IMPLEMENTED(false, op.schema().name(), ": compressed sparse layouts (torch.sparse_csr, sparse_csc, "
                              "sparse_bsr, sparse_bsc) are not supported on dipu; use torch.sparse_coo or dense "
                              "tensors, or keep them on the CPU");
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, SparsePrivateUse1, m) {
  m.impl("_sparse_coo_tensor_with_dims_and_tensors", TORCH_FN(at::native::new_with_dims_and_tensor_sparse_symint));
  m.impl("_indices", TORCH_FN(at::native::_indices_sparse));
  m.impl("_values", TORCH_FN(at::native::_values_sparse));
  m.impl("indices", TORCH_FN(at::native::indices_sparse));
  m.impl("values", TORCH_FN(at::native::values_sparse));
  m.impl("_nnz", TORCH_FN(at::native::_nnz_sparse));
  m.impl("sparse_dim", TORCH_FN(at::native::sparse_dim_sparse));
  m.impl("dense_dim", TORCH_FN(at::native::dense_dim_sparse));
  m.impl("is_coalesced", TORCH_FN(at::native::is_coalesced_sparse));
  m.impl("_coalesced_", TORCH_FN(at::native::_coalesced_sparse_));
  // ATen gives these a composite kernel (for strided tensors) beside the sparse kernels of
  // SparseCPU and SparseCUDA; the composite would outrank the fallback below.
  for (const char* name : {"clone", "copy_", "zero_"})
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&sparseKernel>());
}

TORCH_LIBRARY_IMPL(_, SparsePrivateUse1, m) { m.fallback(torch::CppFunction::makeFromBoxedFunction<&sparseKernel>()); }

TORCH_LIBRARY_IMPL(_, SparseCsrPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&refuseCompressed>());
}

TORCH_LIBRARY_IMPL(_, QuantizedPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&refuseQuantized>());
}

}  // namespace ditorch
