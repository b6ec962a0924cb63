#include "device/KernelArguments.h"

#include "device/SparseOps.h"

#include "device/Allocator.h"
#include "device/Generator.h"
#include "device/ThreadSpares.h"
#include "device/vendor/Vendor.h"

#include <c10/core/StorageImpl.h>

namespace ditorch {
namespace {

constexpr c10::DeviceType kDipu = c10::DeviceType::PrivateUse1;

c10::Device dipuDevice(int index) { return c10::Device(kDipu, static_cast<c10::DeviceIndex>(index)); }

at::Tensor makeTensor(c10::Storage storage, c10::DispatchKey key, const at::Tensor& like_geometry) {
  c10::DispatchKeySet keys(key);
  if (like_geometry._is_zerotensor()) keys = keys.add(c10::DispatchKey::ZeroTensor);  // (settable only at birth)
  auto impl = c10::make_intrusive<c10::TensorImpl>(std::move(storage), keys, like_geometry.dtype());
  impl->set_sizes_and_strides(like_geometry.sizes(), like_geometry.strides(), like_geometry.storage_offset());
  // The lazy conjugate, negative and zero bits are part of the value: kernels that reach the shim
  // with them set (mm, copy_, clone, views...) resolve them, so the re-viewed tensor must carry them.
  impl->_set_conj(like_geometry.is_conj());
  impl->_set_neg(like_geometry.is_neg());
  return at::Tensor(std::move(impl));
}

// Non-owning, resizable storage over a dipu storage's bytes, as memory of the kernel device behind
// dipu:`device`. Resizable so that out= kernels may grow it: the new bytes are moved back after.
c10::Storage kernelStorageOver(c10::StorageImpl* s, int device) {
  static c10::Allocator* const kernel_allocator = c10::GetAllocator(kernelDeviceType());
  return c10::Storage(c10::Storage::use_byte_size_t(), s->nbytes(), c10::DataPtr(s->mutable_data(), kernelDevice(device)),
                      kernel_allocator, /*resizable=*/true);
}

// The bytes of `ks` (a kernel-side storage) as device memory of `device`, without a copy where
// they are device memory: a block of ours (born inside the kernel allocation scope) is taken from
// `ks`; on a vendor whose kernels allocate natively the kernel's own block is adopted (taken when
// `ks` is ours to empty (an alias storage) or nothing else holds it, else shared with it). Other
// memory of an emu kernel (a constant it keeps cached, say) is host memory the kernel owns: copied
// and left where it is.
c10::DataPtr takeAsDeviceBlock(c10::StorageImpl* ks, int device, bool ours) {
  if (DeviceAllocator::isBlock(ks->data_ptr())) {
    c10::DataPtr block = ks->set_data_ptr(c10::DataPtr(nullptr, ks->device()));
    block.unsafe_set_device(dipuDevice(device));
    return block;
  }
  if (kernelAllocationsRedirected())
    return deviceAllocator().copyToNewBlock(ks->data(), ks->nbytes(), ks->nbytes(), device, dipuDevice(device));
  if (ours || c10::raw::intrusive_ptr::use_count(ks) == 1)
    return deviceAllocator().adopt(ks->set_data_ptr(c10::DataPtr(nullptr, ks->device())), c10::Storage(), ks->nbytes(),
                                   device);
  return deviceAllocator().adopt(c10::DataPtr(), c10::Storage(c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(ks)),
                                 ks->nbytes(), device);
}

// Alias tensors and their storages are made and dropped by every op. A few per thread are kept
// for the next op instead: a malloc, a free and two constructors saved per argument (most of what
// re-viewing an argument costs). Only pairs nothing else holds come back. Each pointer owns one
// reference (the spare tensor also holds the storage).
struct SpareAlias {
  c10::TensorImpl* tensor;
  c10::StorageImpl* storage;
};
void releaseSpareAlias(const SpareAlias& spare) {
  c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>::reclaim(spare.tensor);
  c10::intrusive_ptr<c10::StorageImpl>::reclaim(spare.storage);
}
thread_local ThreadSpares<SpareAlias, 16, &releaseSpareAlias> t_spare_aliases;

// Whether `impl` has `t`'s sizes, strides and offset (compared inline: arguments have few dims).
bool sameGeometry(const c10::TensorImpl* impl, const at::Tensor& t) {
  const c10::IntArrayRef sizes = impl->sizes(), strides = impl->strides();
  const c10::IntArrayRef t_sizes = t.sizes(), t_strides = t.strides();
  if (sizes.size() != t_sizes.size() || impl->storage_offset() != t.storage_offset()) return false;
  for (size_t d = 0; d < sizes.size(); ++d)
    if (sizes[d] != t_sizes[d] || strides[d] != t_strides[d]) return false;
  return true;
}

// A kernel-device alias over dipu storage `s` (its bytes at `data`) shaped like `t`, from a spare
// pair when one is kept.
std::pair<c10::Storage, at::Tensor> newAlias(c10::StorageImpl* s, void* data, const at::Tensor& t) {
  const int device = t.device().index();
  SpareAlias spare;
  if (t._is_zerotensor() || !t_spare_aliases.pop(spare)) {
    c10::Storage storage = kernelStorageOver(s, device);
    at::Tensor k = makeTensor(storage, kernelDispatchKey(), t);
    return {std::move(storage), std::move(k)};
  }
  const c10::Device kernel_device = kernelDevice(device);
  spare.storage->set_data_ptr_noswap(c10::DataPtr(data, kernel_device));
  spare.storage->set_nbytes(s->nbytes());
  // The spare tensor still holds its storage, and keeps the dtype, device and geometry of its last
  // use: only what differs is set again (an op's arguments are mostly shaped like the last op's).
  c10::TensorImpl* impl = spare.tensor;
  auto storage = c10::intrusive_ptr<c10::StorageImpl>::reclaim(spare.storage);
  if (impl->dtype() != t.dtype() || impl->device() != kernel_device)
    impl->set_storage_and_dtype(c10::Storage(storage), t.dtype());
  if (!sameGeometry(impl, t)) impl->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
  if (impl->is_conj() != t.is_conj()) impl->_set_conj(t.is_conj());
  if (impl->is_neg() != t.is_neg()) impl->_set_neg(t.is_neg());
  return {c10::Storage(std::move(storage)),
          at::Tensor(c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>::reclaim(impl))};
}

bool isGeneratorArgument(const c10::Argument& arg) {
  return arg.type()->kind() == c10::TypeKind::OptionalType &&
         arg.type()->castRaw<c10::OptionalType>()->getElementType()->kind() == c10::TypeKind::GeneratorType;
}

}  // namespace

at::Tensor asKernelTensor(const at::Tensor& t) {
  return makeTensor(kernelStorageOver(t.storage().unsafeGetStorageImpl(), t.device().index()), kernelDispatchKey(), t);
}

KernelArguments::~KernelArguments() {
  auto& spares = t_spare_aliases;
  for (Alias& a : aliases_) {
    // Kept only when the alias and the tensor over it are the sole holders of the storage and
    // nothing holds the tensor (a kernel may have kept either).
    if (spares.full() || a.kernel_tensor.use_count() != 1 || a.kernel_storage.use_count() != 2 ||
        a.kernel_tensor.storage().unsafeGetStorageImpl() != a.kernel_storage.unsafeGetStorageImpl())
      continue;
    const SpareAlias spare{a.kernel_tensor.unsafeReleaseTensorImpl(), a.kernel_storage.unsafeReleaseStorageImpl()};
    if (!spares.push(spare)) releaseSpareAlias(spare);  // (the thread is exiting)
  }
}

at::Tensor& KernelArguments::alias(c10::MaybeOwned<at::Tensor> original, bool written) {
  any_written_ |= written;
  const at::Tensor& t = *original;
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  void* data = s->mutable_data();
  for (const Alias& a : aliases_) {
    if (a.original->storage().unsafeGetStorageImpl() == s) {
      // Two views of one storage share one alias storage, so kernels see them overlap.
      c10::Storage shared = a.kernel_storage;
      at::Tensor k = makeTensor(shared, kernelDispatchKey(), t);
      return aliases_.emplace_back(std::move(shared), std::move(k), std::move(original), data, written).kernel_tensor;
    }
  }
  auto [storage, k] = newAlias(s, data, t);
  window_.open(s);
  return aliases_.emplace_back(std::move(storage), std::move(k), std::move(original), data, written).kernel_tensor;
}

void KernelArguments::rewrite(const c10::OperatorHandle& op, torch::jit::Stack& stack, bool keep_generators) {
  const auto& args = op.schema().arguments();
  const size_t base = stack.size() - args.size();
  for (size_t i = 0; i < args.size(); ++i) {
    c10::IValue& v = stack[base + i];
    const bool written = args[i].alias_info() && args[i].alias_info()->isWrite();
    if (v.isTensor()) {
      // Moved off the stack (the slot is overwritten): no reference count taken.
      if (isDipu(v.toTensor())) v = alias(c10::MaybeOwned<at::Tensor>::owned(std::move(v).toTensor()), written);
    } else if (v.isList()) {
      // Tensor[] and Tensor?[] arguments (cat, index, the fused optimizers' parameter lists, ...).
      c10::List<c10::IValue> list = v.toList();
      bool any = false;
      for (const c10::IValue& e : list) any |= e.isTensor() && isDipu(e.toTensor());
      if (!any) continue;
      c10::impl::GenericList out(list.elementType());
      out.reserve(list.size());
      for (const c10::IValue& e : list)
        out.push_back(e.isTensor() && isDipu(e.toTensor())
                          ? c10::IValue(alias(c10::MaybeOwned<at::Tensor>::owned(at::Tensor(e.toTensor())), written))
                          : e);
      v = c10::IValue(std::move(out));
    } else if (v.isDevice() && v.toDevice().type() == kDipu) {
      v = kernelDevice(v.toDevice().has_index() ? v.toDevice().index() : device_);
    } else if (keep_generators) {
      continue;
    } else if (v.isGenerator() && v.toGenerator().device().type() == kDipu) {
      v = static_cast<DipuGenerator*>(v.toGenerator().unsafeGetGeneratorImpl())->kernelGenerator();
    } else if (v.isNone() && isGeneratorArgument(args[i])) {
      // Default randomness comes from the dipu device's generator, not the CPU one.
      v = static_cast<DipuGenerator*>(defaultGenerator(device_).unsafeGetGeneratorImpl())->kernelGenerator();
    }
  }
}

void KernelArguments::syncWritten() {
  if (!any_written_) return;
  for (const Alias& a : aliases_) {
    if (!a.written) continue;
    c10::StorageImpl* ks = a.kernel_storage.unsafeGetStorageImpl();
    c10::StorageImpl* orig = a.original->storage().unsafeGetStorageImpl();
    // (A storage shared by two arguments is moved once; the second sees it already empty.)
    if (ks->data() != a.original_data && ks->data() != nullptr && ks->nbytes() > 0) {
      orig->set_data_ptr_noswap(takeAsDeviceBlock(ks, device_, /*ours=*/true));
      orig->set_nbytes(ks->nbytes());
      window_.open(orig);
    }
    c10::TensorImpl* ot = a.original->unsafeGetTensorImpl();
    const c10::TensorImpl* kt = a.kernel_tensor.unsafeGetTensorImpl();
    if (ot->sizes() != kt->sizes() || ot->strides() != kt->strides() || ot->storage_offset() != kt->storage_offset())
      ot->set_sizes_and_strides(kt->sizes(), kt->strides(), kt->storage_offset());
  }
}

bool KernelArguments::becomeDipu(const at::Tensor& k) {
  // Only a result nobody else sees: the kernel's own tensor over a block it allocated (from us on
  // a redirecting vendor; from its own allocator, adopted in place, on the others).
  c10::StorageImpl* ks = k.storage().unsafeGetStorageImpl();
  if (k.use_count() != 1 || k.storage().use_count() != 1) return false;
  const c10::Device device = dipuDevice(device_);
  if (DeviceAllocator::isBlock(ks->data_ptr())) {
    ks->_mutable_data_ptr_no_checks().unsafe_set_device(device);
  } else if (!kernelAllocationsRedirected() && ks->data() != nullptr) {
    const size_t bytes = ks->nbytes();
    ks->set_data_ptr_noswap(
        deviceAllocator().adopt(ks->set_data_ptr(c10::DataPtr(nullptr, ks->device())), c10::Storage(), bytes, device_));
  } else {
    return false;
  }
  ks->set_allocator(&deviceAllocator());
  c10::TensorImpl* impl = k.unsafeGetTensorImpl();
  impl->set_storage_keep_dtype(k.storage());  // re-reads the device from the storage
  impl->_change_backend_component_keys(device);
  return true;
}

at::Tensor KernelArguments::toDipu(const at::Tensor& k, bool remember) {
  if (!k.defined() || k.device().type() != kernelDeviceType()) return k;
  if (k.layout() == c10::kSparse) return sparseOver(k, toDipu(k._indices()), toDipu(k._values()));  // to_sparse()
  TORCH_CHECK(k.layout() == c10::kStrided, "dipu holds strided and sparse COO tensors, but the '", vendor().name(),
              "' vendor's kernel returned a ", k.layout(), " tensor");
  c10::StorageImpl* ks = k.storage().unsafeGetStorageImpl();
  for (const Alias& a : aliases_) {
    if (a.kernel_storage.unsafeGetStorageImpl() != ks) continue;
    // In-place and out= results are the caller's own tensor; views share its storage.
    if (a.kernel_tensor.unsafeGetTensorImpl() == k.unsafeGetTensorImpl()) return *a.original;
    return makeTensor(a.original->storage(), c10::DispatchKey::PrivateUse1, k);
  }
  for (auto& [kernel_storage, storage] : adopted_)
    if (kernel_storage == ks) return makeTensor(storage, c10::DispatchKey::PrivateUse1, k);
  if (becomeDipu(k)) {
    if (remember) {
      adopted_.emplace_back(ks, k.storage());
      fresh_.push_back(k);
    }
    return k;
  }
  c10::DataPtr block;
  if (ks->mutable_data() == nullptr)
    // A ZeroTensor (its storage has a size but no bytes) or an empty result: nothing to move.
    block = c10::DataPtr(nullptr, dipuDevice(device_));
  else
    block = takeAsDeviceBlock(ks, device_, /*ours=*/false);
  window_.open(block.get());
  c10::Storage storage(c10::Storage::use_byte_size_t(), ks->nbytes(), std::move(block), &deviceAllocator(), true);
  at::Tensor t = makeTensor(storage, c10::DispatchKey::PrivateUse1, k);
  if (remember) {
    adopted_.emplace_back(ks, std::move(storage));
    fresh_.push_back(t);
  }
  return t;
}

void KernelArguments::adoptResults(size_t returns, torch::jit::Stack& stack) {
  for (size_t r = stack.size() - returns; r < stack.size(); ++r) {
    c10::IValue& v = stack[r];
    if (v.isTensor()) {
      v = toDipu(v.toTensor());
    } else if (v.isTensorList()) {
      c10::List<at::Tensor> list = v.toTensorList();
      c10::List<at::Tensor> out;
      out.reserve(list.size());
      for (const at::Tensor& t : list) out.push_back(toDipu(t));
      v = std::move(out);
    }
  }
}

}  // namespace ditorch
