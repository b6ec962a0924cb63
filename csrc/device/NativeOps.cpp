// Ops every backend must implement natively: allocation, views over storage, resize, copies
// between devices, scalar reads and the set_ overloads torch.load relies on. Everything else
// goes through the shim (Shim.cpp).
#include "device/Allocator.h"
#include "device/Guard.h"
#include "device/ChipNumerics.h"
#include "device/ChipProfile.h"
#include "device/KernelArguments.h"
#include "device/MemoryWindow.h"
#include "device/vendor/Vendor.h"

#include <ATen/EmptyTensor.h>
#include <ATen/ops/_local_scalar_dense.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/StorageImpl.h>
#include <torch/library.h>

namespace ditorch {
namespace {

constexpr c10::DeviceType kDipu = c10::DeviceType::PrivateUse1;


int deviceIndexOf(std::optional<c10::Device> device) {
  int index = device && device->has_index() ? device->index() : currentDevice();
  checkDevice(index);
  return index;
}

// Allocation routes to `device` for the duration (allocate() reads the current device).
struct AllocateOn {
  explicit AllocateOn(int device) : previous(currentDevice()) { setCurrentDevice(device); }
  ~AllocateOn() { setCurrentDevice(previous); }
  int previous;
};

void growStorage(c10::StorageImpl* storage, size_t nbytes) {
  if (nbytes > storage->nbytes()) resizeDeviceStorage(storage, nbytes);
}

size_t storageBytesNeeded(const at::Tensor& self) {
  if (self.numel() == 0) return 0;
  return at::detail::computeStorageNbytes(self.sizes(), self.strides(), self.dtype().itemsize(), self.storage_offset());
}

at::Tensor empty(c10::IntArrayRef size, std::optional<at::ScalarType> dtype, std::optional<at::Layout> layout,
                 std::optional<c10::Device> device, std::optional<bool> pin_memory,
                 std::optional<at::MemoryFormat> memory_format) {
  TORCH_CHECK(!pin_memory.value_or(false), "Only dense CPU tensors can be pinned; got pin_memory=True for a dipu tensor");
  TORCH_CHECK(layout.value_or(at::kStrided) == at::kStrided, "dipu supports only strided tensors, got layout ", *layout);
  AllocateOn on(deviceIndexOf(device));
  return at::detail::empty_generic(size, &deviceAllocator(), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   dtype.value_or(at::get_default_dtype_as_scalartype()), memory_format);
}

at::Tensor emptyStrided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<at::ScalarType> dtype,
                        std::optional<at::Layout> layout, std::optional<c10::Device> device,
                        std::optional<bool> pin_memory) {
  TORCH_CHECK(!pin_memory.value_or(false), "Only dense CPU tensors can be pinned; got pin_memory=True for a dipu tensor");
  TORCH_CHECK(layout.value_or(at::kStrided) == at::kStrided, "dipu supports only strided tensors, got layout ", *layout);
  AllocateOn on(deviceIndexOf(device));
  return at::detail::empty_strided_generic(size, stride, &deviceAllocator(),
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           dtype.value_or(at::get_default_dtype_as_scalartype()));
}

const at::Tensor& resize(const at::Tensor& self, c10::IntArrayRef size, std::optional<at::MemoryFormat> memory_format) {
  c10::TensorImpl* impl = self.unsafeGetTensorImpl();
  if (self.sizes() == size && !memory_format) return self;
  impl->set_sizes_contiguous(size);
  if (memory_format) impl->empty_tensor_restride(*memory_format);
  growStorage(self.storage().unsafeGetStorageImpl(), storageBytesNeeded(self));
  return self;
}

// Copies involving dipu: both sides are re-viewed on the kernel device and the kernel device's
// copy_ handles dtype conversion, strides and broadcasting (a kernel like any other: where device
// memory is protected from the host, it is open for the copy).
at::Tensor copyFrom(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  MemoryWindow window;
  if (isDipu(self)) window.open(self.storage().unsafeGetStorageImpl());
  if (isDipu(dst)) window.open(dst.storage().unsafeGetStorageImpl());
  at::Tensor src_k = isDipu(self) ? asKernelTensor(self) : self;
  at::Tensor dst_k = isDipu(dst) ? asKernelTensor(dst) : dst;
  const auto movable = [](const at::Tensor& k) { return k.device().is_cpu() || k.device().type() == kernelDeviceType(); };
  TORCH_CHECK(movable(src_k) && movable(dst_k), "copy between ", self.device(), " and ", dst.device(),
              " is not supported by the '", vendor().name(), "' vendor");
  // A conversion that lands on the chip is the chip's (autocast's weight casts are such copies).
  if (isDipu(dst) && chipProfile().numerics.round_toward_zero) copyOnChip(dst_k, src_k, chipProfile().numerics);
  else dst_k.copy_(src_k, non_blocking);
  return dst;
}

at::Tensor copyFromAndResize(const at::Tensor& self, const at::Tensor& dst) {
  if (isDipu(dst)) resize(dst, self.sizes(), std::nullopt);
  else dst.resize_(self.sizes());
  return copyFrom(self, dst, false);
}

at::Scalar localScalarDense(const at::Tensor& self) {
  MemoryWindow window;
  window.open(self.storage().unsafeGetStorageImpl());
  return at::_local_scalar_dense(asKernelTensor(self));
}

at::Tensor& setStorage(at::Tensor& self, c10::Storage source, int64_t offset, c10::IntArrayRef size,
                       c10::IntArrayRef stride) {
  TORCH_CHECK(!source || source.device().type() == kDipu, "set_: cannot give a dipu tensor the storage of a ",
              source.device(), " tensor");
  TORCH_CHECK(offset >= 0, "set_: storage offset must be non-negative, got ", offset);
  TORCH_CHECK(stride.empty() || stride.size() == size.size(), "set_: got ", size.size(), " sizes but ", stride.size(),
              " strides");
  c10::TensorImpl* impl = self.unsafeGetTensorImpl();
  impl->set_storage_keep_dtype(std::move(source));
  impl->set_storage_offset(offset);
  if (stride.empty()) impl->set_sizes_contiguous(size);
  else impl->set_sizes_and_strides(size, stride);
  growStorage(self.storage().unsafeGetStorageImpl(), storageBytesNeeded(self));
  return self;
}

at::Tensor& setSourceStorage(at::Tensor& self, c10::Storage source) {
  int64_t n = static_cast<int64_t>(source.nbytes() / self.dtype().itemsize());
  return setStorage(self, std::move(source), 0, {n}, {});
}

at::Tensor& setSourceTensor(at::Tensor& self, const at::Tensor& source) {
  if (self.is_same(source)) return self;
  return setStorage(self, source.storage(), source.storage_offset(), source.sizes(), source.strides());
}

at::Tensor& setEmpty(at::Tensor& self) {
  c10::Storage storage(c10::Storage::use_byte_size_t(), 0, deviceAllocator().allocateOn(0, self.device().index(), self.device()),
                       &deviceAllocator(), true);
  return setStorage(self, std::move(storage), 0, {0}, {});
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", TORCH_FN(empty));
  m.impl("empty_strided", TORCH_FN(emptyStrided));
  m.impl("as_strided", TORCH_FN(at::native::as_strided_tensorimpl));
  m.impl("view", TORCH_FN(at::native::view));
  m.impl("_reshape_alias", TORCH_FN(at::native::_reshape_alias));
  m.impl("resize_", TORCH_FN(resize));
  m.impl("_copy_from", TORCH_FN(copyFrom));
  m.impl("_copy_from_and_resize", TORCH_FN(copyFromAndResize));
  m.impl("_local_scalar_dense", TORCH_FN(localScalarDense));
  m.impl("set_.source_Storage_storage_offset", TORCH_FN(setStorage));
  m.impl("set_.source_Storage", TORCH_FN(setSourceStorage));
  m.impl("set_.source_Tensor", TORCH_FN(setSourceTensor));
  m.impl("set_", TORCH_FN(setEmpty));
}

// Copies resolve the conjugate and negative bits themselves (the kernel device's copy_ does, on
// the re-viewed tensors). Without these, the math-bit fallbacks would materialize the source with
// clone(), whose copy_ comes back here with the bit still set: endless recursion.
TORCH_LIBRARY_IMPL(aten, Conjugate, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
  m.impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(aten, Negative, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
  m.impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
}

}  // namespace
}  // namespace ditorch
